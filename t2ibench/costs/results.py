"""What cost.py reads: benchmark.py results JSON files (or hand-written ones with images/s and a GPU count)
as `Measurement`s, with the aspect-ratio buckets a run trained and the mix of images it trained in them;
the rule that keeps one curve to one GPU, model, size, latents mode and bucket mix; and the measurements
averaged per GPU count. A bad file is a ValueError naming it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from t2ibench.datasets.buckets import DEFAULT as DEFAULT_BUCKETS
from t2ibench.datasets.buckets import parse_bucket, synthetic_weights
from t2ibench.core.cli import MAX_BATCH_SIZE, MAX_GPUS, MAX_IMAGE_SIZE, read_text
from t2ibench.core.errors import UserError


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
class Targets:
    """Every target a run stopped at (benchmark.py --eval_target, --fid_target, --clip_target: it stops at the
    first evaluation that meets all of them), compared whole: a run to a loss and one to FID and CLIP score, or
    to FID 90 and FID 80, took their samples to different things. Its repr is how tables and notes name it."""
    loss: float | None = None  # validation loss at or under
    fid: float | None = None  # FID at or under
    clip_score: float | None = None  # CLIP score (100 x cosine) at or over

    def __bool__(self) -> bool:
        return any(value is not None for value in (self.loss, self.fid, self.clip_score))

    def __repr__(self) -> str:
        parts = [f"{name} {sign} {value:g}" for name, sign, value in (
            ("validation loss", "<=", self.loss), ("FID", "<=", self.fid), ("CLIP score", ">=", self.clip_score))
            if value is not None]
        return " and ".join(parts) if parts else "no target"


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
    # A run to a validation loss (benchmark.py --eval_target), as MLPerf times it; None where not recorded.
    global_batch_size: int | None = None  # images per optimizer step, all GPUs together
    eval_target: float | None = None  # the validation loss the run trained to
    converged: bool | None = None  # reached its targets; None: the run had no target
    samples_to_target: int | None = None  # training samples over all ranks at the first evaluation at the target
    time_to_target_s: float | None = None  # seconds from run start to that evaluation, set-up out, evaluation in
    # Every target it had (the loss, FID, CLIP score): runs are compared, averaged and labelled by all of them.
    targets: Targets | None = None
    # A bucketed run's data, "synthetic" or "real" (the mix real images give differs from any synthetic
    # weights'): a curve keeps to one; None for square runs and files without 'data'.
    bucket_data: str | None = None


def load_results(path: str) -> Measurement:
    """Read one results JSON file. Raises ValueError with a message that names the file."""
    try:  # a regular file, bounded, a byte-order mark skipped (cli.read_text): a results file is a few kilobytes
        data = json.loads(read_text(path, path, "give a results JSON file benchmark.py wrote"))
    except UserError as e:
        raise ValueError(e.message) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # json's decoder recurses per level: '[' x 100,000 was a traceback
        raise ValueError(f"{path}: JSON nested too deeply to be a results file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'images_per_sec' and 'world_size'")
    if data.get("already_complete"):
        raise ValueError(f"{path}: written by a retried run that was already complete, so nothing was measured; "
                         "use the results of the run that trained")
    diverged = diverged_because(data)
    if diverged:
        raise ValueError(f"{path}: the run diverged ({diverged}), so its figures measure no training; price a run "
                         "that trained (docs/metrics.md, 'diverged')")
    for key in ("images_per_sec", "world_size"):
        if key not in data:
            raise ValueError(f"{path}: missing '{key}' (need 'images_per_sec' and 'world_size')")
    ips, n = data["images_per_sec"], data["world_size"]
    # bool is an int in Python, and a JSON true is never a GPU count
    if isinstance(ips, bool) or not isinstance(ips, (int, float)) or not positive_number(ips):
        raise ValueError(f"{path}: 'images_per_sec' must be a positive number, got {str(ips)[:40]!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_GPUS:
        shown = repr(n) if len(repr(n)) <= 40 else f"a number of {len(str(n))} digits"
        raise ValueError(f"{path}: 'world_size' must be a positive integer (GPUs, at most {MAX_GPUS:,}), got {shown}")
    rate = implausible_rate(ips, n)
    if rate:
        raise ValueError(f"{path}: 'images_per_sec' {str(ips)[:40]} on {n} GPU(s): {rate}")
    for key, kind, what in (("device", str, "a device name"), ("model_config", str, "a model configuration name"),
                            ("image_size", int, "a size in pixels"), ("precomputed", bool, "true or false")):
        value = data.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is int and (
                isinstance(value, bool) or not 0 < value <= MAX_IMAGE_SIZE))):
            raise ValueError(f"{path}: '{key}' must be {what}, got {str(value)[:40]!r}")
    source = data.get("data")
    bucket_data = None if data.get("aspect_buckets") is None or not isinstance(source, str) or not source else (
        "synthetic" if source == "synthetic" else "real")
    return Measurement(n, float(ips), path, data.get("device"), data.get("image_size"), data.get("model_config"),
                       data.get("precomputed"), *load_buckets(path, data), *load_target(path, data),
                       targets=load_targets(path, data), bucket_data=bucket_data)


def diverged_because(data: dict) -> str | None:
    """Why a results file records a run that diverged, or None: benchmark.py's record of a run it stopped
    (`diverged`), or a non-finite `final_loss` or `grad_norm` (files written before runs stopped on one)."""
    if data.get("diverged"):
        return str(data["diverged"]).split(";")[0][:200]
    for key in ("final_loss", "grad_norm"):
        if isinstance(data.get(key), float) and not math.isfinite(data[key]):  # JSON's NaN and Infinity
            return f"'{key}' is {data[key]}"
    return None


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
    if names and len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"{path}: 'bucket_list' names {', '.join(twice)} more than once")
    strays = sorted(set(images) - set(names or images))
    if strays:
        raise ValueError(f"{path}: 'images_per_bucket' names {', '.join(strays)}, not in its 'bucket_list'")
    weights, largest = data.get("synthetic_bucket_weights"), data.get("largest_bucket")
    if weights is not None and not isinstance(weights, str):
        raise ValueError(f"{path}: 'synthetic_bucket_weights' must be \"uniform\", HxW=WEIGHT,... or null, "
                         f"got {str(weights)[:40]!r}")
    if largest is not None:
        named = largest.get("bucket") if isinstance(largest, dict) else None
        if not isinstance(named, str) or not parse_bucket(named) or (names and named not in names):
            raise ValueError(f"{path}: 'largest_bucket' must be {{\"bucket\": \"HxW\", ...}} naming a bucket of its "
                             f"'bucket_list', got {str(largest)[:40]!r}")
    largest = largest.get("bucket") if isinstance(largest, dict) else None
    identity = tuple(names) if names else ("--aspect_buckets", spec)
    listed = BucketList(identity, spec, data.get("image_size"), len(names) if names else None)
    if weights is not None:  # benchmark.py's own rule reads them (a bad value: one line naming the file)
        shares = synthetic_weights(weights, tuple(parse_bucket(name) for name in names),
                                   f"{path}: 'synthetic_bucket_weights'") if names else None
        weights = BucketWeights(tuple(round(share, 9) for share in shares) if shares else (weights,), weights)
    return listed, weights, images, largest if isinstance(largest, str) and parse_bucket(largest) else None


# Samples in one run to a target: 10**15 is 350,000 times the 2023 run's 2.9 billion; a larger count is no run
# (and 10**400 would overflow the float arithmetic of the table).
MAX_SAMPLES_TO_TARGET = 10**15


def load_target(path: str, data: dict) -> tuple[int | None, float | None, bool | None, int | None, float | None]:
    """A results file's run to a target: (global batch, eval_target, converged, samples_to_target,
    time_to_target_s). A run that did not converge has no time to target (its figures are left out); one
    that did must give both. Raises ValueError naming the file."""
    batch, target, converged = data.get("global_batch_size"), data.get("eval_target"), data.get("converged")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or not 0 < batch <= MAX_BATCH_SIZE):
        raise ValueError(f"{path}: 'global_batch_size' must be a positive integer (images per step), "
                         f"got {str(batch)[:40]!r}")
    if target is not None and not positive_number(target):
        raise ValueError(f"{path}: 'eval_target' must be a positive validation loss, got {str(target)[:40]!r}")
    if converged is not None and not isinstance(converged, bool):
        raise ValueError(f"{path}: 'converged' must be true, false or null, got {str(converged)[:40]!r}")
    samples, seconds = data.get("samples_to_target"), data.get("time_to_target_s")
    if converged is None and (samples is not None or seconds is not None):
        raise ValueError(f"{path}: 'samples_to_target' and 'time_to_target_s' without 'converged': give a results "
                         "file benchmark.py --eval_target wrote")
    if not converged:
        return batch, target, converged, None, None  # not reached: what it trained is no sample count to target
    if isinstance(samples, bool) or not isinstance(samples, int) or not 0 < samples <= MAX_SAMPLES_TO_TARGET:
        raise ValueError(f"{path}: 'converged' is true, so 'samples_to_target' must be a positive number of samples "
                         f"(at most {MAX_SAMPLES_TO_TARGET:.0e}), got {str(samples)[:40]!r}")
    if not positive_number(seconds):
        raise ValueError(f"{path}: 'converged' is true, so 'time_to_target_s' must be a positive number of seconds, "
                         f"got {str(seconds)[:40]!r}")
    return batch, target, converged, samples, float(seconds)


def load_targets(path: str, data: dict) -> Targets | None:
    """Every target a results file's run had ('eval_target', 'fid_target', 'clip_target'), or None for a run
    to none. Raises ValueError naming the file."""
    values = {}
    for key, field_name, what in (("eval_target", "loss", "a positive validation loss"),
                                  ("fid_target", "fid", "a positive FID"),
                                  ("clip_target", "clip_score", "a positive CLIP score")):
        value = data.get(key)
        if value is not None and not positive_number(value):
            raise ValueError(f"{path}: '{key}' must be {what} or null, got {str(value)[:40]!r}")
        values[field_name] = None if value is None else float(value)
    targets = Targets(**values)
    return targets if targets else None


# What a measured rate can be, per GPU: 1e6 images/s is beyond any model here on any GPU (the tiny UNet at 32 px
# runs thousands on an H100), 1e-4 is one image in about three hours, which no benchmark window measures. A
# rate outside (1e308, 5e-324, 0 or negative) priced a run at nothing or forever, and gave ratios of 0 or inf.
IMAGES_PER_SEC_PER_GPU_RANGE = (1e-4, 1e6)


def implausible_rate(images_per_sec: object, gpus: int = 1) -> str | None:
    """Why `images_per_sec` (on `gpus` GPUs together) is no measurement, or None: the one rule cost.py,
    blocks.py and the GPU report read results by."""
    if not positive_number(images_per_sec):
        return f"{str(images_per_sec)[:40]} is not a finite positive number"
    low, high = IMAGES_PER_SEC_PER_GPU_RANGE
    per_gpu = float(images_per_sec) / max(1, gpus)
    if not low <= per_gpu <= high:
        return f"{per_gpu:.3g} images/s per GPU is outside what a run measures ({low:g} to {high:g})"
    return None


def positive_number(value: object) -> bool:
    """A JSON number above zero and finite (a JSON true is no number, an integer of 400 digits no float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and number > 0


# What results must share to be fitted into one curve: the GPU, the model at its size, the latents mode,
# and the aspect-ratio buckets with the shares synthetic batches drew them in (the mix is the throughput's
# condition, as the size is a square run's).
CONSISTENT_KEYS = ("device", "image_size", "model_config", "precomputed", "aspect_buckets", "synthetic_bucket_weights",
                   "bucket_data")


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
