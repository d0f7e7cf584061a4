"""Time and cost to train Stable Diffusion 2 base (or Flux.1-schnell, MLPerf's model since v5.1), from measured throughput.

    python cost.py results/*.json --plot cost.png
    python cost.py --gpus 8 16 32 64 128 --images_per_sec 128.2 254.0 485.7 912.2 1618.4 \
        --num_gpus 8 16 32 64 128 256 --plot cost.png --csv cost.csv --markdown cost.md

Turns images/s on some GPU counts into days, GPU-hours and dollars for the whole training run, as
the 2023 MosaicML table did, and predicts the counts not measured. The arithmetic, the scaling
model and which results may be mixed are in docs/cost.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field

from t2ibench import errors
from t2ibench.buckets import DEFAULT as DEFAULT_BUCKETS
from t2ibench.buckets import parse_bucket, synthetic_weights
from t2ibench.cli import GPU_COUNT, MAX_GPUS, MAX_IMAGE_SIZE, POSITIVE_FLOAT, Parser
from t2ibench.cost_table import Row, format_table, plot, write_csv, write_markdown
from t2ibench.errors import fail
from t2ibench.files import write_error
from t2ibench.locations import check_output, check_outputs_apart, normalise
from t2ibench.scale import (MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU, MLPERF_FLUX_TRAIN_SAMPLES, PRICED_MODELS,
                            SAMPLES,  # 2023: 1.4M x 2048
                            USD_PER_GPU_HOUR)  # $2 per A100-hour
SECONDS_PER_DAY = 86_400
# The default table runs at least to this count, the largest one in the 2023 table.
DEFAULT_MAX_GPUS = 256
# The one-time pass of a run on precomputed latents (cost.py --precompute): latents.py encodes each
# distinct image once. Its default speed comes from the encoders' FLOPs (the family's count, per
# 512x512 image: VAE encoder 1,117 GFLOP; the text encoder's 45 only with --store_text_states) on an
# A100 (312 dense bf16 TFLOP/s) at an assumed 40% MFU: 312e12 x 0.4 / 1.117e12 = 111.7 images/s per GPU.
# For SDXL at 1024 (VAE encoder 4,879 GFLOP, PRICED_MODELS) the same rule gives 25.6.
PRECOMPUTE_IMAGES = 2_000_000_000  # distinct images behind the 2.9B samples (about LAION-2B)
VAE_ENCODER_FLOPS = PRICED_MODELS["sd2-base"][2]
PRECOMPUTE_PEAK_FLOPS, PRECOMPUTE_MFU = 312e12, 0.40
PRECOMPUTE_IMAGES_PER_SEC = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / VAE_ENCODER_FLOPS  # per GPU
# Flux.1-schnell at 256x256 (families/flux.py's count): VAE encoder 272.9, CLIP-L 13.3, T5-XXL
# (256 tokens) 2,396.6 GFLOP per image; its pass encodes MLPerf's training set once. Only the VAE's
# part grows with an image's pixels (a bucketed run's mix), the text encoders' is per caption.
FLUX_VAE_ENCODER_FLOPS, FLUX_TEXT_ENCODER_FLOPS = 272.9e9, (13.3 + 2_396.6) * 1e9
FLUX_PRECOMPUTE_FLOPS = FLUX_VAE_ENCODER_FLOPS + FLUX_TEXT_ENCODER_FLOPS
FLUX_PRECOMPUTE_IMAGES_PER_SEC = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / FLUX_PRECOMPUTE_FLOPS
# Configurations with a table of their own: (name in titles, resolution MLPerf / the 2023 table use).
NAMED_MODELS = {"sd2-base": ("SD2 base", 512), "flux1-schnell": ("Flux.1-schnell (MLPerf Training v5.1's model)", 256)}
# What --model_config may name for --gpus/--images_per_sec pairs: (name, the size they are taken at).
PAIR_MODELS = {**{config: (name, size) for config, (name, size, _) in PRICED_MODELS.items()}, **NAMED_MODELS}


@dataclass(frozen=True)
class BucketList:
    """The aspect-ratio buckets a result trained on (benchmark.py --aspect_buckets), or none: square images.

    Two results are of one list when they name the same buckets (`bucket_list`), whatever file held them;
    a result that records only the flag (`aspect_buckets`, written before the list was) is compared by the
    flag as given. `repr` is how the refusals and the table name it."""
    identity: tuple[str, ...] = ()  # the "HxW" names; ("--aspect_buckets", spec) when only the flag is known
    spec: str | None = field(default=None, compare=False)  # --aspect_buckets as given: "default" or a file
    image_size: int | None = field(default=None, compare=False)  # the size the default list is scaled to
    count: int | None = field(default=None, compare=False)  # buckets in the list, when it is recorded

    @property
    def bucketed(self) -> bool:
        return self.spec is not None

    def __repr__(self) -> str:
        if not self.bucketed:
            return "square"
        listed = f"the default list at {self.image_size}" if self.spec == DEFAULT_BUCKETS else f"the list {self.spec}"
        return listed + (f" ({self.count} buckets)" if self.count else " (its buckets not recorded)")

    def label(self, image_size: int) -> str:
        """How titles and captions name a bucketed run's images: '41 aspect-ratio buckets around
        1024x1024 (the default list)'."""
        listed = "the default list" if self.spec == DEFAULT_BUCKETS else f"the list {self.spec}"
        return (f"{self.count} " if self.count else "") + f"aspect-ratio buckets around {image_size}x{image_size} ({listed})"


SQUARE = BucketList()


@dataclass(frozen=True)
class BucketWeights:
    """--synthetic_bucket_weights as a run recorded it, compared by the shares it gives each bucket of the
    list (`40x96=3,64x64=1` and `64x64=2,40x96=6` are one mix); its repr is the flag's value."""
    identity: tuple  # each bucket's share of the list (to 1e-9); (the value as written,) without the list
    spec: str = field(compare=False)

    def __repr__(self) -> str:
        return repr(self.spec)


@dataclass
class Measurement:
    """One throughput measurement: `images_per_sec` is global (all `num_gpus` GPUs together)."""
    num_gpus: int
    images_per_sec: float
    source: str = "--images_per_sec"  # the results file it came from, or the flag
    device: str | None = None
    image_size: int | None = None
    model_config: str | None = None
    precomputed: bool | None = None  # trained from precomputed latents (no VAE/text encoder in the step)
    # A results file without 'aspect_buckets' was written before buckets existed (or by hand): square.
    aspect_buckets: BucketList = SQUARE
    # How often synthetic batches came from each bucket (--synthetic_bucket_weights); None for real data.
    synthetic_bucket_weights: BucketWeights | None = None
    images_per_bucket: dict[str, int] = field(default_factory=dict)  # the mix trained: {"HxW": images}
    largest_bucket: str | None = None  # the bucket the memory model sized the microbatch for


@dataclass
class ScalingModel:
    """Per-GPU throughput model. `measured` maps GPU count -> global images/s (averaged);
    `per_doubling` is the factor applied to per-GPU images/s for each doubling of the GPU count
    outside the measured range (already clamped to [0.5, 1])."""
    measured: dict[int, float]
    per_doubling: float
    fitted_per_doubling: float  # before clamping, for the report


# -----------------------------------------------------------------------------
# arithmetic

def days_to_train(samples: float, images_per_sec: float) -> float:
    """Wall-clock days to push `samples` images through at `images_per_sec` (global)."""
    return samples / images_per_sec / SECONDS_PER_DAY


def make_row(num_gpus: int, images_per_sec: float, samples: float, usd_per_gpu_hour: float,
             source: str) -> Row:
    """Days, GPU-hours (days * 24 * num_gpus) and dollars (GPU-hours * price) for one GPU count."""
    days = days_to_train(samples, images_per_sec)
    gpu_hours = days * 24 * num_gpus
    return Row(num_gpus, images_per_sec, days, gpu_hours, gpu_hours * usd_per_gpu_hour, source)


def add_precompute(rows: list[Row], images: float, images_per_sec_per_gpu: float, usd_per_gpu_hour: float) -> list[Row]:
    """The rows with the one-time latents.py pass added, run on the same GPUs before training:
    GPU-hours = images / (images/s per GPU) / 3600, whatever the GPU count (it scales linearly:
    every GPU encodes its own chunks), so days grow by GPU-hours / 24 / GPUs."""
    gpu_hours = images / images_per_sec_per_gpu / 3600
    return [Row(r.num_gpus, r.images_per_sec, r.days + gpu_hours / 24 / r.num_gpus, r.gpu_hours + gpu_hours,
                r.cost_usd + gpu_hours * usd_per_gpu_hour, r.source) for r in rows]


# -----------------------------------------------------------------------------
# inputs

def load_results(path: str) -> Measurement:
    """Read one results JSON file. Raises ValueError with a message that names the file."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'images_per_sec' and 'world_size'")
    if data.get("already_complete"):
        raise ValueError(f"{path}: written by a retried run that was already complete, so nothing was measured; "
                         "use the results of the run that trained")
    for key in ("images_per_sec", "world_size"):
        if key not in data:
            raise ValueError(f"{path}: missing '{key}' (need 'images_per_sec' and 'world_size')")
    ips, n = data["images_per_sec"], data["world_size"]
    # bool is an int in Python, and a JSON true is never a GPU count
    if isinstance(ips, bool) or not isinstance(ips, (int, float)) or not math.isfinite(ips) or ips <= 0:
        raise ValueError(f"{path}: 'images_per_sec' must be a positive number, got {ips!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_GPUS:
        shown = repr(n) if len(repr(n)) <= 40 else f"a number of {len(str(n))} digits"
        raise ValueError(f"{path}: 'world_size' must be a positive integer (GPUs, at most {MAX_GPUS:,}), got {shown}")
    for key, kind, what in (("device", str, "a device name"), ("model_config", str, "a model configuration name"),
                            ("image_size", int, "a size in pixels"), ("precomputed", bool, "true or false")):
        value = data.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is int and (
                isinstance(value, bool) or not 0 < value <= MAX_IMAGE_SIZE))):
            raise ValueError(f"{path}: '{key}' must be {what}, got {str(value)[:40]!r}")
    return Measurement(n, float(ips), path, data.get("device"), data.get("image_size"), data.get("model_config"),
                       data.get("precomputed"), *load_buckets(path, data))


def load_buckets(path: str, data: dict) -> tuple[BucketList, BucketWeights | None, dict[str, int], str | None]:
    """A results file's buckets: (the list, --synthetic_bucket_weights, the images trained per bucket, the
    largest bucket); square when it has no 'aspect_buckets'. Raises ValueError naming the file."""
    spec = data.get("aspect_buckets")
    if spec is None:
        return SQUARE, None, {}, None
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{path}: 'aspect_buckets' must be \"default\", a file name or null, got {str(spec)[:40]!r}")
    names = data.get("bucket_list")
    if names is not None and (not isinstance(names, list) or not names or not all(
            isinstance(name, str) and parse_bucket(name) for name in names)):
        raise ValueError(f"{path}: 'bucket_list' must be a list of \"HxW\" buckets, got {str(names)[:40]!r}")
    images = data.get("images_per_bucket") or {}
    if not isinstance(images, dict) or not all(
            isinstance(name, str) and parse_bucket(name) and isinstance(count, int) and not isinstance(count, bool)
            and count >= 0 for name, count in images.items()):
        raise ValueError(f"{path}: 'images_per_bucket' must map \"HxW\" buckets to image counts, "
                         f"got {str(images)[:40]!r}")
    strays = sorted(set(images) - set(names or images))
    if strays:
        raise ValueError(f"{path}: 'images_per_bucket' names {', '.join(strays)}, not in its 'bucket_list'")
    weights, largest = data.get("synthetic_bucket_weights"), data.get("largest_bucket")
    if weights is not None and not isinstance(weights, str):
        raise ValueError(f"{path}: 'synthetic_bucket_weights' must be \"uniform\", HxW=WEIGHT,... or null, "
                         f"got {str(weights)[:40]!r}")
    largest = largest.get("bucket") if isinstance(largest, dict) else None
    identity = tuple(names) if names else ("--aspect_buckets", spec)
    listed = BucketList(identity, spec, data.get("image_size"), len(names) if names else None)
    if weights is not None:  # benchmark.py's own rule reads them (a bad value: one line naming the file)
        shares = synthetic_weights(weights, tuple(parse_bucket(name) for name in names),
                                   f"{path}: 'synthetic_bucket_weights'") if names else None
        weights = BucketWeights(tuple(round(share, 9) for share in shares) if shares else (weights,), weights)
    return listed, weights, images, largest if isinstance(largest, str) and parse_bucket(largest) else None


# What results must share to be fitted into one curve: the GPU, the model at its size, the latents mode,
# and the aspect-ratio buckets with the shares synthetic batches drew them in (the mix is the throughput's
# condition, as the size is a square run's).
CONSISTENT_KEYS = ("device", "image_size", "model_config", "precomputed", "aspect_buckets", "synthetic_bucket_weights")


def check_consistent(measurements: list[Measurement], keys: tuple[str, ...] = CONSISTENT_KEYS) -> None:
    """Refuse to fit one scaling curve through different GPUs, image sizes, models, latents modes or buckets."""
    for key in keys:
        seen = {}
        for m in measurements:
            value = getattr(m, key)
            if value is not None:
                seen.setdefault(value, m.source)
        if len(seen) > 1:
            detail = ", ".join(f"{v!r} in {src}" for v, src in seen.items())
            raise ValueError(f"results mix different '{key}' values ({detail}); give one at a time")


def bucket_mix(measurements: list[Measurement]) -> dict[str, int]:
    """The images the results trained in each bucket, all of them together (one list: check_consistent)."""
    mix: dict[str, int] = {}
    for m in measurements:
        for name, images in m.images_per_bucket.items():
            mix[name] = mix.get(name, 0) + images
    return mix


def pixel_fraction(mix: dict[str, int], image_size: int) -> float | None:
    """An image's pixels in the mix, on average, as a fraction of image_size^2 (the square run's); None
    without a mix. What an image costs the VAE encoder scales with it (a convolutional network)."""
    total = sum(mix.values())
    if not total:
        return None
    return sum(parse_bucket(name).pixels * images for name, images in mix.items()) / total / image_size ** 2


def describe_mix(measurements: list[Measurement], image_size: int) -> tuple[str, float | None]:
    """(a line on the buckets a bucketed run trained, the share of its largest bucket): the mix is the
    condition of the images/s measured, as the image size is a square run's."""
    listed, mix = measurements[0].aspect_buckets, bucket_mix(measurements)
    weights = next((m.synthetic_bucket_weights for m in measurements if m.synthetic_bucket_weights), None)
    drawn = f", synthetic batches drawn by --synthetic_bucket_weights {weights.spec}" if weights else ""
    total = sum(mix.values())
    if not total:
        return f"aspect-ratio buckets: {listed!r}{drawn}; the results do not record the mix trained", None
    largest = next((m.largest_bucket for m in measurements if m.largest_bucket), None)
    share = mix.get(largest, 0) / total if largest else None
    line = (f"aspect-ratio buckets: {listed!r}{drawn}; the mix trained: {total:,} images in {len(mix)}"
            + (f" of the {listed.count}" if listed.count else "") + " buckets"
            + (f", {share:.0%} in the largest ({largest})" if largest else "")
            + f", {pixel_fraction(mix, image_size):.1%} of {image_size}x{image_size}'s pixels an image on average; "
            "images/s is this mix's (another mix, from other data or weights, trains at another speed)")
    return line, share


def average_by_gpus(measurements: list[Measurement]) -> tuple[dict[int, float], list[str]]:
    """Average global images/s per GPU count. Returns {num_gpus: images/s} and notes on averaging."""
    groups: dict[int, list[float]] = {}
    for m in measurements:
        groups.setdefault(m.num_gpus, []).append(m.images_per_sec)
    notes = []
    for n, values in sorted(groups.items()):
        if len(values) > 1:
            listed = ", ".join(f"{v:,.1f}" for v in values)
            notes.append(f"averaged {len(values)} measurements at {n} GPUs "
                         f"({listed}) -> {sum(values) / len(values):,.1f} images/s")
    return {n: sum(v) / len(v) for n, v in sorted(groups.items())}, notes


# -----------------------------------------------------------------------------
# scaling model

def fit_scaling(measured: dict[int, float]) -> ScalingModel:
    """Least-squares fit of ln(per-GPU images/s) against log2(num_gpus) over the measured counts.
    With a single count the slope is 0, i.e. linear scaling."""
    xs = [math.log2(n) for n in measured]
    ys = [math.log(ips / n) for n, ips in measured.items()]
    slope = 0.0
    if len(xs) > 1:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fitted = math.exp(slope)
    return ScalingModel(dict(sorted(measured.items())), min(max(fitted, 0.5), 1.0), fitted)


def predict_images_per_sec(model: ScalingModel, num_gpus: int) -> float:
    """Global images/s predicted at `num_gpus` (equal to the measurement at a measured count)."""
    if num_gpus in model.measured:
        return model.measured[num_gpus]
    counts = list(model.measured)
    per_gpu = {n: ips / n for n, ips in model.measured.items()}
    x = math.log2(num_gpus)
    below = [n for n in counts if n < num_gpus]
    above = [n for n in counts if n > num_gpus]
    if below and above:  # interpolate between the two measured neighbours
        lo, hi = below[-1], above[0]
        w = (x - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        log_t = (1 - w) * math.log(per_gpu[lo]) + w * math.log(per_gpu[hi])
    else:  # extrapolate from the nearest measured count by the fitted factor per doubling
        anchor = below[-1] if below else above[0]
        log_t = math.log(per_gpu[anchor]) + math.log(model.per_doubling) * (x - math.log2(anchor))
    t = math.exp(log_t)
    if below:
        # never beat linear scaling from the nearest measured count below (noisy data can
        # make the interpolation rise)...
        t = min(t, per_gpu[below[-1]])
        # ...and never let extra GPUs make the whole job slower than a smaller measured count
        t = max(t, max(model.measured[n] for n in below) / num_gpus)
    return t * num_gpus


def cost_table(measured: dict[int, float], num_gpus: list[int], samples: float = SAMPLES,
               usd_per_gpu_hour: float = USD_PER_GPU_HOUR) -> list[Row]:
    """Rows for each requested GPU count: measured ones from `measured` ({gpus: images/s}),
    the rest predicted by `fit_scaling`. samples in images, price in USD per GPU-hour."""
    model = fit_scaling(measured)
    rows = []
    for n in sorted(set(num_gpus)):
        source = "measured" if n in measured else "predicted"
        rows.append(make_row(n, predict_images_per_sec(model, n), samples, usd_per_gpu_hour, source))
    return rows


def default_num_gpus(measured: dict[int, float]) -> list[int]:
    """The measured counts, plus powers of two from the smallest measured count up to twice the
    largest one (and at least to 256, to line up with the 2023 table)."""
    top = max(2 * max(measured), DEFAULT_MAX_GPUS)
    n = 1 << (min(measured) - 1).bit_length()  # smallest power of two >= the smallest count
    counts = set(measured)
    while n <= top:
        counts.add(n)
        n *= 2
    return sorted(counts)


def model_notes(model: ScalingModel) -> list[str]:
    """Human-readable lines about what the prediction assumes."""
    counts = list(model.measured)
    if len(counts) == 1:
        return [f"only one measured GPU count ({counts[0]}): predictions assume linear scaling "
                f"(constant images/s per GPU), an upper bound on real throughput"]
    line = (f"scaling fit over {len(counts)} measured counts ({counts[0]}..{counts[-1]} GPUs): "
            f"per-GPU images/s x{model.fitted_per_doubling:.3f} per doubling")
    if model.per_doubling != model.fitted_per_doubling:
        line += f", clamped to x{model.per_doubling:.3f}"
    doublings = [(a, b) for a, b in zip(counts, counts[1:]) if b == 2 * a]
    if doublings:
        per_gpu = {n: ips / n for n, ips in model.measured.items()}
        kept = ", ".join(f"{b}: {per_gpu[b] / per_gpu[a]:.3f}" for a, b in doublings)
        line += f" (measured doublings -> {kept})"
    return [line]


# -----------------------------------------------------------------------------
# command line

def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        "cost.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Time and cost to train SD2 base (or SDXL base, or what the results measured) from "
                    "measured images/sec, as in the 2023 "
                    "MosaicML table. days = samples / images_per_sec / 86400; GPU-hours = "
                    "days * 24 * GPUs; cost = GPU-hours * price.",
        epilog="Prediction for unmeasured GPU counts: per-GPU images/s is fitted as ln(t) linear "
               "in log2(GPUs) by least squares over the measured counts, giving a factor per "
               "doubling (clamped to [0.5, 1]). Between measured counts t is interpolated; "
               "beyond them it starts from the nearest measurement and changes by that factor "
               "per doubling. Never better than linear scaling from the nearest smaller measured "
               "count, never slower in total than a smaller measured count. "
               "With one measured count: linear scaling. Several measurements at one count are "
               "averaged.")
    p.add_argument("files", nargs="*", metavar="RESULTS.json",
                   help="results JSON files with images_per_sec (global) and world_size (GPUs)")
    p.add_argument("--results", nargs="+", action="extend", default=[], metavar="FILE",
                   help="more results JSON files")
    p.add_argument("--gpus", nargs="+", action="extend", type=GPU_COUNT, default=[],
                   metavar="N", help="measured GPU counts, paired with --images_per_sec")
    p.add_argument("--images_per_sec", nargs="+", action="extend", type=POSITIVE_FLOAT,
                   default=[], metavar="X", help="measured global images/s, one per --gpus")
    p.add_argument("--num_gpus", nargs="+", type=GPU_COUNT, metavar="N",
                   help="GPU counts for the table (default: the measured counts plus powers of "
                        "two up to 2x the largest measured, at least to 256)")
    p.add_argument("--samples", type=POSITIVE_FLOAT, default=None,
                   help=f"images seen in the whole run (default {SAMPLES:,} = 1.4M steps x 2048 for SD2; for "
                        f"Flux {MLPERF_FLUX_TRAIN_SAMPLES:,}, one pass over MLPerf's training set)")
    p.add_argument("--model_config", default=None, choices=sorted(PAIR_MODELS),
                   help="the model of --gpus/--images_per_sec pairs, measured at its training size ("
                        + ", ".join(f"{size} for {config}" for config, (_, size) in PAIR_MODELS.items())
                        + "); default: sd2-base, the 2023 table's. Results files of another model or size are not "
                        "fitted with the pairs")
    p.add_argument("--usd_per_gpu_hour", type=POSITIVE_FLOAT, default=USD_PER_GPU_HOUR,
                   help=f"price of one GPU-hour in US dollars (default {USD_PER_GPU_HOUR})")
    p.add_argument("--plot", metavar="PATH.png",
                   help="save a plot of days and cost vs GPUs; the suffix picks the format (.png, .pdf, .svg...), "
                        "none writes PATH.png")
    p.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    p.add_argument("--title", help="plot title (default: describes samples, price and device)")
    # A run on precomputed latents: its one-time latents.py pass, so the table's cost is the total.
    p.add_argument("--precompute", action="store_true",
                   help="add the one-time latents.py pass to every row (for --precomputed throughputs)")
    p.add_argument("--precompute_images", type=POSITIVE_FLOAT, default=None,
                   help=f"distinct images the pass encodes (default {PRECOMPUTE_IMAGES:,}; Flux: "
                        f"{MLPERF_FLUX_TRAIN_SAMPLES:,})")
    p.add_argument("--precompute_images_per_sec", type=POSITIVE_FLOAT, default=None,
                   help="images/s of the pass per GPU (latents.py's images_per_sec / world_size; default: an A100 at "
                        f"40%% MFU on the measured model's encoders, {PRECOMPUTE_IMAGES_PER_SEC:.1f} for SD2 base "
                        f"at 512 (VAE encoder, 1,117 GFLOP/image), "
                        f"{PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / PRICED_MODELS['sdxl-base'][2]:.1f} for SDXL base "
                        f"at 1024 (4,879), {FLUX_PRECOMPUTE_IMAGES_PER_SEC:.1f} for Flux (T5-XXL, CLIP and the VAE, "
                        "2,683 GFLOP/image)")
    return p


def mlperf_rows(num_gpus: list[int], samples: float, usd_per_gpu_hour: float) -> list[Row]:
    """Reference rows at each GPU count: MLPerf v5.1's per-GPU Flux.1 throughputs, scaled linearly."""
    return [make_row(n, per_gpu * n, samples, usd_per_gpu_hour, f"MLPerf v5.1 {gpu} (published elsewhere)")
            for n in num_gpus for gpu, per_gpu in MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU.items()]


# The model the 2023 table is for: results of anything else are labeled as such.
SD2_BASE = ("sd2-base", 512)


def plot_file(path: str) -> str:
    """The file --plot writes: PATH as given when its suffix is a format matplotlib saves, PATH.png
    when it has none (what savefig does); a folder or an unknown suffix is refused, before any work."""
    if os.path.isdir(path):
        fail(f"--plot {path} is a folder; give the plot's file name, such as {os.path.join(path, 'cost.png')}")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if not suffix:
        return path + ".png"
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        fail(f"--plot {path}: matplotlib cannot write .{suffix} files; use one of "
             + ", ".join(f".{f}" for f in sorted(formats)))
    return path


def measured_model(measurements: list[Measurement]) -> tuple[str, int]:
    """(--model_config, image size) of the measurements; what a result lacks (and --gpus /
    --images_per_sec values) is taken to be the 2023 benchmark's: SD2 base at 512x512."""
    model = next((m.model_config for m in measurements if m.model_config), SD2_BASE[0])
    return model, next((m.image_size for m in measurements if m.image_size), SD2_BASE[1])


def describe(measurements: list[Measurement]) -> tuple[str, str | None]:
    """(what was measured, a note when it is not SD2 base at 512x512 trained from images).

    The first part names the model in titles and captions: a priced model (SD2 base, SDXL base 1.0)
    by its name, anything else by its config name. SDXL base at its 1024x1024 is priced as itself,
    with a note that the sample count is the 2023 SD2 run's unless --samples says otherwise.
    """
    model = next((m.model_config for m in measurements if m.model_config), SD2_BASE[0])
    size = next((m.image_size for m in measurements if m.image_size), NAMED_MODELS.get(model, SD2_BASE)[1])
    precomputed = any(m.precomputed for m in measurements)
    name = (PRICED_MODELS[model][0] if model in PRICED_MODELS else NAMED_MODELS[model][0] if model in NAMED_MODELS
            else f"model '{model}'")
    listed = measurements[0].aspect_buckets  # one list for all (check_consistent)
    what = (f"{name} in {listed.label(size)}" if listed.bucketed else f"{name} at {size}x{size}") + (
        " from precomputed latents" if precomputed else "")
    if model == "flux1-schnell":
        return what, None if not any(m.precomputed is False for m in measurements) else (
            "these results encode images and captions in the training step (T5-XXL, CLIP, VAE); MLPerf's set-up "
            "trains from precomputed latents and text states")
    if model in PRICED_MODELS and model != SD2_BASE[0] and size == PRICED_MODELS[model][1]:
        return what, (f"the table prices {what}, trained from scratch on --samples images (by default the 2023 SD2 "
                      "run's 2.87 billion; SDXL's own schedule was not published in samples): not Stable Diffusion 2 "
                      "base")
    if (model, size) != SD2_BASE:
        return what, (f"these results are for {what}, not SD2 base at 512x512: the table is the time and cost "
                      "of training that model, not Stable Diffusion 2 base")
    if precomputed:
        return what, ("these results train from precomputed latents: encoding the images and captions "
                      "(VAE and text encoder, once per image) is not included in the table")
    return what, None


def main(argv: list[str] | None = None) -> list[Row]:
    parsed = build_parser().parse_intermixed_args(argv)  # files may come before or after the flags
    with errors.command("cost.py"):
        return table(validate(parsed))


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """Check the inputs (one line naming the flag or file) and read the results files. Returns the flags
    with paths normalised and defaults resolved, plus what the table derives from them (measurements,
    flux), in a new namespace: the parsed one is left as it was parsed."""
    if len(parsed.gpus) != len(parsed.images_per_sec):
        fail(f"--gpus has {len(parsed.gpus)} value(s) but --images_per_sec has "
             f"{len(parsed.images_per_sec)}; give one --images_per_sec per --gpus")
    # file:///path is the path /path (locations.normalise); inputs and outputs are local files.
    files, results = ([normalise("RESULTS", f, ()) for f in names] for names in (parsed.files, parsed.results))
    paths = {flag: normalise(f"--{flag}", getattr(parsed, flag), ()) if getattr(parsed, flag) is not None else None
             for flag in ("plot", "csv", "markdown")}
    if paths["plot"] is not None:
        paths["plot"] = plot_file(paths["plot"])
    # Every output probed before any work (the table is cheap, but a results file overwritten by
    # --csv is lost): an existing folder, writable, not a results file, and not another output.
    outputs = [(f"--{flag}", path, "file") for flag, path in paths.items()]
    inputs = [("RESULTS", f) for f in files + results]
    for flag, path, _ in outputs:
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            fail(f"{flag}: directory of {path} does not exist")
        problem = check_output(flag, path, folder=False, inputs=inputs)
        if problem:
            fail(problem)
    problem = check_outputs_apart(outputs)
    if problem:
        fail(problem)
    try:
        measurements = [load_results(path) for path in files + results]
        check_consistent(measurements)
    except ValueError as e:
        fail(str(e))
    configs = {m.model_config for m in measurements if m.model_config}
    if parsed.model_config and configs and configs != {parsed.model_config}:
        fail(f"--model_config {parsed.model_config}: the results files are for {sorted(configs)}")
    # Figures given as flags are taken as --model_config's model at its training size (by default the
    # 2023 table's SD2 base at 512x512), so results of another model or size are refused rather than
    # fitted with them into one curve.
    pairs_model = parsed.model_config or SD2_BASE[0]
    pairs_name, pairs_size = PAIR_MODELS[pairs_model]
    flagged = [Measurement(n, x, f"--gpus/--images_per_sec (taken as {pairs_name} at {pairs_size}x{pairs_size})",
                           model_config=pairs_model, image_size=pairs_size)
               for n, x in zip(parsed.gpus, parsed.images_per_sec)]
    try:
        check_consistent(measurements + flagged, ("image_size", "model_config"))
    except ValueError as e:  # the pairs differ in model or size: say how to name theirs
        fail(f"{e} (--model_config sets the model of --gpus/--images_per_sec: {', '.join(sorted(PAIR_MODELS))})")
    try:
        check_consistent(measurements + flagged)
    except ValueError as e:  # ...or in the buckets: the pairs are taken as square runs' figures
        fail(f"{e}; --gpus/--images_per_sec pairs are taken as square images, so price a bucketed run from its "
             "results files alone")
    measurements += flagged
    if not measurements:
        fail("no measurements: give results JSON files or --gpus N --images_per_sec X")
    flux = measured_model(measurements)[0] == "flux1-schnell"  # the first result that names its model
    model, size = measured_model(measurements)
    # A bucketed run's images are its mix's sizes, not size x size: the VAE encoder's part of the pass
    # scales with their pixels (the default list's hold 90% to 100% of the square's).
    fraction = pixel_fraction(bucket_mix(measurements), size) if measurements[0].aspect_buckets.bucketed else None
    precompute_images_per_sec = parsed.precompute_images_per_sec
    if precompute_images_per_sec is None and flux:
        precompute_images_per_sec = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / (
            FLUX_VAE_ENCODER_FLOPS * (fraction or 1.0) + FLUX_TEXT_ENCODER_FLOPS)
    if precompute_images_per_sec is None:  # a priced model's VAE encoder at its size; else SD2's at 512
        priced = PRICED_MODELS.get(model)
        vae_flops = priced[2] if priced and priced[1] == size else VAE_ENCODER_FLOPS
        precompute_images_per_sec = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / (vae_flops * (fraction or 1.0))
    resolved = {
        "files": files, "results": results, **paths,
        "samples": (MLPERF_FLUX_TRAIN_SAMPLES if flux else SAMPLES) if parsed.samples is None else parsed.samples,
        "precompute_images": ((MLPERF_FLUX_TRAIN_SAMPLES if flux else PRECOMPUTE_IMAGES)
                              if parsed.precompute_images is None else parsed.precompute_images),
        "precompute_images_per_sec": precompute_images_per_sec,
        "measurements": measurements, "flux": flux,
        # The mix's pixels the pass's default speed counts (None: square images, or the speed was given).
        "precompute_pixel_fraction": fraction if parsed.precompute_images_per_sec is None else None,
    }
    return argparse.Namespace(**{**vars(parsed), **resolved})


def table(args: argparse.Namespace) -> list[Row]:
    """Print the table of `validate`'s settings and write the files asked for."""
    measurements, flux = args.measurements, args.flux
    what, warning = describe(measurements)
    measured, notes = average_by_gpus(measurements)
    model = fit_scaling(measured)
    notes += model_notes(model)
    listed = measurements[0].aspect_buckets
    mix, largest_share = describe_mix(measurements, measured_model(measurements)[1]) if listed.bucketed else (None, None)
    if mix:
        notes.append(mix)
    num_gpus = args.num_gpus or default_num_gpus(measured)
    rows = cost_table(measured, num_gpus, args.samples, args.usd_per_gpu_hour)
    if args.precompute:
        rows = add_precompute(rows, args.precompute_images, args.precompute_images_per_sec, args.usd_per_gpu_hour)
        pass_hours = args.precompute_images / args.precompute_images_per_sec / 3600
        notes.append(f"includes the one-time latents.py pass: {args.precompute_images:,.0f} images at "
                     f"{args.precompute_images_per_sec:,.1f} images/s per GPU = {pass_hours:,.0f} GPU-hours "
                     f"(${pass_hours * args.usd_per_gpu_hour:,.0f})")
        if args.precompute_pixel_fraction is not None:
            notes.append(f"the pass's images/s counts the VAE encoder at the mix's {args.precompute_pixel_fraction:.1%} "
                         "of the square's pixels an image, each image encoded in its bucket")
    if flux:
        if args.samples == MLPERF_FLUX_TRAIN_SAMPLES:
            notes.append(f"{args.samples:,.0f} samples: one pass over MLPerf's training set; a run to its quality "
                         "target takes more (pass --samples)")
        rows = rows + mlperf_rows(sorted(measured), args.samples, args.usd_per_gpu_hour)
        notes.append("MLPerf v5.1 rows: per-GPU samples/s of the published Flux.1 results times the GPU count "
                     "(MXFP8, CUDA graphs; published elsewhere, not measured here)"
                     + ("; they train square 256x256 images, these results aspect-ratio buckets" if mix else ""))

    device = next((m.device for m in measurements if m.device), None)
    caption = (f"{what}: {args.samples:,.0f} images at ${args.usd_per_gpu_hour:,.2f} per GPU-hour"
               + (f" ({device})" if device else "")
               + "; days = samples / images/s / 86400, GPU-hours = days x 24 x GPUs.")
    title = args.title or (f"Time and cost to train {what}: {args.samples / 1e9:.2f}B images, "
                           f"${args.usd_per_gpu_hour:,.2f}/GPU-hour" + (f", {device}" if device else ""))
    print(caption)
    if warning:
        print(f"WARNING: {warning}")
    for note in notes:
        print(f"note: {note}")
    print()
    print(format_table(rows))

    # Each file is replaced whole or left as it was (files.atomic_file); a full disk is one line.
    writes = [("--csv", args.csv, lambda: write_csv(rows, args.csv, repr(listed), largest_share)),
              ("--markdown", args.markdown, lambda: write_markdown(
                  rows, args.markdown, caption + (f" {mix[0].upper()}{mix[1:]}." if mix else ""))),
              ("--plot", args.plot, lambda: plot([r for r in rows if r.source in ("measured", "predicted")],
                                                  args.plot, title))]  # not the references
    for flag, path, write in writes:
        if path:
            try:
                write()
            except OSError as error:
                fail(write_error(f"{flag} {path}", error))
            print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
