"""Images per aspect-ratio bucket and each bucket's images/s (`--aspect_buckets`): what a bucketed run
trained, shape by shape; the FLOPs of one image in each bucket, which the throughput window adds up
(`BucketFlops`). The keys and their units: docs/metrics.md.
"""
from __future__ import annotations

import time
from collections import Counter
from fractions import Fraction
from typing import Callable

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.datasets.buckets import Bucket
from t2ibench.callbacks.progress import format_seconds
from t2ibench.train.compiling import compile_seconds


def batch_bucket(batch: dict[str, torch.Tensor], latent_downsample: int) -> str:
    """"HxW" of a batch's images, in pixels (precomputed latents: their size times the VAE's downsampling)."""
    if "image" in batch:
        height, width = batch["image"].shape[-2:]
    else:
        height, width = (side * latent_downsample for side in batch["latent_mean"].shape[-2:])
    return f"{height}x{width}"


def batch_images(batch: dict[str, torch.Tensor]) -> int:
    """Images in a batch (this rank's)."""
    return int(batch["sample_index"].shape[0])


# How close the counted check bucket must come to the quadratic through the other three for the fit to
# stand for the rest of the list: the quadratic is exact (only the floats' last bits differ), and one
# rounded side anywhere in the network is off by far more than this.
FIT_RELATIVE_TOLERANCE = 1e-9
FIT_COUNTS = 4  # buckets counted when the list can be fitted: three fix the quadratic, the fourth checks it
COUNT_PROGRESS_SECONDS = 30.0  # a count of many buckets says how far it is this often


def quadratic_through(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """The quadratic a + b P + c P^2 through three (P, value) points, evaluated in exact fractions."""
    exact = [(Fraction(pixels), Fraction(value)) for pixels, value in points]

    def at(pixels: int) -> float:
        total = Fraction(0)
        for i, (p_i, value) in enumerate(exact):  # Lagrange's form: no matrix to solve
            term = value
            for j, (p_j, _) in enumerate(exact):
                if j != i:
                    term *= (pixels - p_j) / (p_i - p_j)
            total += term
        return float(total)

    return at


def fit_counts(buckets: tuple[Bucket, ...], exact_multiple: int) -> tuple[Bucket, ...] | None:
    """The few buckets to count when the rest can come from a quadratic in the pixel count: the smallest,
    the largest and the middle pixel count fit it, the one a quarter of the way checks it. None when the
    list cannot be fitted: a side that is not a multiple of `exact_multiple` (some level rounds it) or
    fewer than FIT_COUNTS distinct pixel counts."""
    if any(bucket.height % exact_multiple or bucket.width % exact_multiple for bucket in buckets):
        return None
    first: dict[int, Bucket] = {}  # pixel count -> the list's first bucket of it
    for bucket in buckets:
        first.setdefault(bucket.pixels, bucket)
    pixels = sorted(first)
    if len(pixels) < FIT_COUNTS:
        return None
    return tuple(first[pixels[i]] for i in (0, -1, len(pixels) // 2, len(pixels) // 4))


class BucketFlops:
    """FLOPs of one training image in each bucket a run may train, of the whole step and of the
    trained network alone, and those of a batch by its bucket.

    `count(bucket)` is the run's count of one image at the bucket's (height, width) (benchmark.py: the
    family's `flops_per_image` on the meta device, 5 to 7 s a bucket for SDXL base or Flux.1 schnell on
    one CPU core). `count_shared()`, called once before the first batch (`Throughput.fit_start`, when the
    ranks can gather), counts only four buckets of a list whose sides are all multiples of
    `exact_multiple` (the family's `flops_exact_multiple`): at such sides every level's size is the
    image's pixel count P over a fixed factor, so convolutions and linears scale with P, self-attention's
    scores with P^2 and attention to a fixed text with both, and each count is exactly a + b P + c P^2.
    Three counts fix the quadratic, the fourth must agree with it to FIT_RELATIVE_TOLERANCE, and then every other
    bucket's counts (step and trained network, each its own quadratic) come from it: SDXL base's default
    list at 1024 in 30 s instead of 256 s, Flux.1 schnell's at 256 in 35 s instead of 214 s,
    on one core of a shared 2-core VM (docs/data.md). A list that cannot be fitted, or whose check
    disagrees, has every bucket counted. The ranks share the counts, each counting its part.
    """

    def __init__(self, buckets: tuple[Bucket, ...], count: Callable[[Bucket], tuple[float, float]],
                 latent_downsample: int, exact_multiple: int):
        self.buckets, self.count, self.latent_downsample = buckets, count, latent_downsample
        self.exact_multiple = exact_multiple
        self.step: dict[str, float] = {}  # "HxW": FLOPs of one image's step (the results' flops_per_image)
        self.trained_network: dict[str, float] = {}  # "HxW": the denoiser's forward and backward alone

    def count_shared(self) -> None:
        if self.step:
            return  # counted already (a second fit of the same Trainer)
        few = fit_counts(self.buckets, self.exact_multiple)
        if few is None:
            say(f"counting the FLOPs per image of the {len(self.buckets)} buckets on the meta device")
            self._count(self.buckets)
            return
        say(f"counting the FLOPs per image of {len(few)} of the {len(self.buckets)} buckets on the meta device; "
            f"the other {len(self.buckets) - len(few)} come from the quadratic in the pixel count that they fit")
        self._count(few)
        if not self._fit(few):
            rest = tuple(bucket for bucket in self.buckets if bucket.name not in self.step)
            say(f"the FLOPs of {few[-1].name} are not on the quadratic through {', '.join(b.name for b in few[:-1])}: "
                f"counting the other {len(rest)} buckets too")
            self._count(rest)

    def _count(self, buckets: tuple[Bucket, ...]) -> None:
        """Counts `buckets`, each rank its share, and gathers every count on every rank. A long count
        (buckets off the fitted grid are counted one by one, 5 to 7 s each for SDXL base) says how far
        it is every COUNT_PROGRESS_SECONDS, and after the first bucket how long the rest will take."""
        rank, ranks = dist.get_global_rank(), dist.get_world_size()
        share = buckets[rank::ranks]
        mine: dict[str, tuple[float, float]] = {}
        start = said = time.perf_counter()
        for done, bucket in enumerate(share, 1):
            mine[bucket.name] = self.count(bucket)
            now = time.perf_counter()
            each_seconds = (now - start) / done
            left_seconds = each_seconds * (len(share) - done)
            if done < len(share) and (now - said >= COUNT_PROGRESS_SECONDS or (
                    done == 1 and left_seconds >= COUNT_PROGRESS_SECONDS)):
                say(f"  counted {done} of {len(share)} buckets" + (f" (rank 0's share of {len(buckets)})" if ranks > 1
                                                                 else "")
                    + f", {each_seconds:.1f} s each: about {format_seconds(left_seconds)} left")
                said = now
        for counted in (dist.all_gather_object(mine) if ranks > 1 else [mine]):
            for name, (step, trained) in counted.items():
                self.step[name], self.trained_network[name] = step, trained

    def _fit(self, few: tuple[Bucket, ...]) -> bool:
        """Fills in every other bucket from the quadratics through `few[:3]` when `few[3]` lies on both."""
        fitted = []
        for counts in (self.step, self.trained_network):
            quadratic = quadratic_through([(bucket.pixels, counts[bucket.name]) for bucket in few[:3]])
            check = few[3]
            if abs(quadratic(check.pixels) - counts[check.name]) > FIT_RELATIVE_TOLERANCE * abs(counts[check.name]):
                return False
            fitted.append((counts, quadratic))
        for counts, quadratic in fitted:
            # A bucket of a counted one's pixel count takes that count (the same P, the same quadratic).
            counted = {bucket.pixels: counts[bucket.name] for bucket in few}
            for bucket in self.buckets:
                if bucket.name in counts:
                    continue
                counts[bucket.name] = counted[bucket.pixels] if bucket.pixels in counted else quadratic(bucket.pixels)
        return True

    def of_batch(self, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(step, trained network) FLOPs of this rank's batch: its images times their bucket's."""
        name, images = batch_bucket(batch, self.latent_downsample), batch_images(batch)
        return images * self.step[name], images * self.trained_network[name]

    def by_bucket(self) -> dict[str, float]:
        """`{"HxW": FLOPs}` of one image's step, from the tallest bucket to the widest."""
        return {name: self.step[name] for name in sorted(self.step, key=by_shape)}


class BucketThroughput(Callback):
    """Counts every trained image by its bucket and times each bucket's batches after `warmup_batches`
    (the throughput window's start), from the start of the batch to its end (CUDA synchronized at both,
    which a bucketed run's per-batch clock needs; the optimizer step and every callback's BATCH_END
    listed before this one are inside, checkpoints and sample grids after it are not), less the seconds
    torch spent compiling inside it (`--compile`: a bucket's first batch may compile graphs; the
    throughput window leaves them out too), the most any rank compiled in that batch, since every rank
    waits for that one. Under DDP a batch also waits for the slowest rank's: a bucket's figure is that
    of the steps it was in.

    `summary()`, after fit (every rank has gathered at FIT_END): `images_per_bucket` (all ranks) and
    `images_per_sec_per_device_by_bucket` (images of the bucket's measured batches over their seconds,
    summed over the ranks).
    """

    def __init__(self, warmup_batches: int, latent_downsample: int):
        # What the bucketed order depends on is recorded and compared on resume by RunRecord
        # (t2ibench.train.data_order); checkpoints before issue 45 kept the ranks and workers here too.
        self.warmup_batches, self.latent_downsample = warmup_batches, latent_downsample
        self.images: Counter[str] = Counter()  # every trained batch of this run, this rank
        self.measured_images: Counter[str] = Counter()
        self.measured_seconds: Counter[str] = Counter()  # this rank's, compiling still in (see seconds_less_compiling)
        # The bucket of each measured batch, in order (every rank measures the same batches), and the
        # seconds this rank compiled in those that compiled, by their place in that list.
        self.measured_buckets: list[str] = []
        self.compiling: dict[int, float] = {}
        self.current: tuple[str, int] | None = None
        self.started = 0.0
        self.compiled_at_start: float | None = None  # compile seconds at the batch's start (None: no timers)
        self.gathered: dict | None = None

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        bucket = batch_bucket(state.batch, self.latent_downsample)
        count = batch_images(state.batch)
        self.images[bucket] += count
        self.current = (bucket, count)

    def batch_start(self, state: State, logger: Logger) -> None:
        self._sync()
        self.started = time.perf_counter()
        self.compiled_at_start = compile_seconds()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.current is None or int(state.timestamp.batch) <= self.warmup_batches:
            return
        self._sync()
        bucket, count = self.current
        self.measured_images[bucket] += count
        self.measured_seconds[bucket] += time.perf_counter() - self.started
        compiled = compile_seconds()
        if compiled is not None and self.compiled_at_start is not None and compiled > self.compiled_at_start:
            self.compiling[len(self.measured_buckets)] = compiled - self.compiled_at_start
        self.measured_buckets.append(bucket)

    def seconds_less_compiling(self) -> Counter[str]:
        """This rank's seconds by bucket, less in each batch the most any rank compiled in it (every rank
        waits for that one at the step's collectives; its own seconds alone would leave the wait in).

        One gather at FIT_END, once per run, of the few batches that compiled: no collective or host
        sync per step, compiled or not. It cannot ride with the gather of the figures that follows: which
        bucket a batch another rank compiled in was on this rank is known here alone, and sending every
        batch's bucket instead would gather a list as long as the run from every rank."""
        by_rank = dist.all_gather_object(self.compiling)
        most: dict[int, float] = {}
        for compiling in by_rank:
            for batch, seconds in compiling.items():
                most[batch] = max(most.get(batch, 0.0), seconds)
        left = Counter(self.measured_seconds)
        for batch, seconds in most.items():
            left[self.measured_buckets[batch]] -= seconds
        return left

    def fit_end(self, state: State, logger: Logger) -> None:
        seconds_less_compiling = dict(self.seconds_less_compiling())
        ranks = dist.all_gather_object((dict(self.images), dict(self.measured_images), seconds_less_compiling))
        images, measured, seconds = Counter(), Counter(), Counter()
        for rank_images, rank_measured, rank_seconds in ranks:
            images.update(rank_images)
            measured.update(rank_measured)
            seconds.update(rank_seconds)
        self.gathered = {
            "images_per_bucket": dict(sorted(images.items(), key=lambda kv: by_shape(kv[0]))),
            "images_per_sec_per_device_by_bucket": {
                name: measured[name] / seconds[name] for name in sorted(measured, key=by_shape) if seconds[name] > 0},
        }

    def summary(self) -> dict:
        return self.gathered or {"images_per_bucket": {}, "images_per_sec_per_device_by_bucket": {}}


def say(message: str) -> None:
    """A set-up line on rank 0's stdout, as the run's others."""
    if dist.get_global_rank() == 0:
        print(message, flush=True)


def by_shape(name: str) -> tuple[float, int]:
    """Sort key of an "HxW" name: from the tallest bucket to the widest, as the lists are ordered."""
    height, width = (int(side) for side in name.split("x"))
    return width / height, -height * width
