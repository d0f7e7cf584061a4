"""The arithmetic of cost.py's table: days, GPU-hours and dollars from global images/s, the one-time
latents.py pass added to a row, and the scaling model that predicts the GPU counts not measured (a
least-squares fit of per-GPU images/s against log2 of the count, docs/cost.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from t2ibench.costs.table import Row
from t2ibench.costs.scale import (MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU,
                            SAMPLES,  # 2023: 1.4M x 2048
                            USD_PER_GPU_HOUR)  # $2 per A100-hour

SECONDS_PER_DAY = 86_400
# The default table runs at least to this count, the largest one in the 2023 table.
DEFAULT_MAX_GPUS = 256


@dataclass
class ScalingModel:
    """Per-GPU throughput model. `measured` maps GPU count -> global images/s (averaged);
    `per_doubling` is the factor applied to per-GPU images/s for each doubling of the GPU count
    outside the measured range (already clamped to [0.5, 1])."""
    measured: dict[int, float]
    per_doubling: float
    fitted_per_doubling: float  # before clamping, for the report


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


def mlperf_rows(num_gpus: list[int], samples: float, usd_per_gpu_hour: float) -> list[Row]:
    """Reference rows at each GPU count: MLPerf v5.1's per-GPU Flux.1 throughputs, scaled linearly."""
    return [make_row(n, per_gpu * n, samples, usd_per_gpu_hour, f"MLPerf v5.1 {gpu} (published elsewhere)")
            for n in num_gpus for gpu, per_gpu in MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU.items()]


def nearest_reference_batch(global_batch: int, references: dict[int, int]) -> int:
    """The global batch of MLPerf's reference convergence points (`references`: {batch: samples},
    t2ibench.costs.mlperf.reference_samples_to_target) nearest `global_batch`, by ratio (log2); halfway between
    two, the larger, whose figure is the more samples: a price that errs high."""
    return min(references, key=lambda batch: (abs(math.log2(batch / global_batch)), -batch))


def samples_to_target(batch: int, references: dict[int, int]) -> int:
    """Training samples MLPerf's Flux.1 reference takes to its target at the reference batch nearest `batch`."""
    return references[nearest_reference_batch(batch, references)]
