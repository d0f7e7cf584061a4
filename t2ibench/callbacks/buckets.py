"""Images per aspect-ratio bucket and each bucket's images/s (`--aspect_buckets`): what a bucketed run
trained, shape by shape; the FLOPs of one image in each bucket, which the throughput window adds up
(`BucketFlops`). The keys and their units: docs/metrics.md.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.buckets import Bucket
from t2ibench.compiling import compile_seconds
from t2ibench.errors import fail


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


class BucketFlops:
    """FLOPs of one training image in each bucket a run may train, of the whole step and of the
    trained network alone, and those of a batch by its bucket.

    `count(bucket)` is the run's count of one image at the bucket's (height, width) (benchmark.py: the
    family's `flops_per_image` on the meta device, 5 to 7 s a bucket for SDXL base or Flux.1 schnell on
    one CPU core, minutes for a default list of 41). `count_shared()`, called once before the first
    batch (`Throughput.fit_start`, when the ranks can gather), has each rank count its share of the
    buckets and gathers them all, so a node of 8 counts a list in an eighth of the time.
    """

    def __init__(self, buckets: tuple[Bucket, ...], count: Callable[[Bucket], tuple[float, float]],
                 latent_downsample: int):
        self.buckets, self.count, self.latent_downsample = buckets, count, latent_downsample
        self.step: dict[str, float] = {}  # "HxW": FLOPs of one image's step (the results' flops_per_image)
        self.trained_network: dict[str, float] = {}  # "HxW": the denoiser's forward and backward alone

    def count_shared(self) -> None:
        if self.step:
            return  # counted already (a second fit of the same Trainer)
        rank, ranks = dist.get_global_rank(), dist.get_world_size()
        mine = {bucket.name: self.count(bucket) for bucket in self.buckets[rank::ranks]}
        for counted in (dist.all_gather_object(mine) if ranks > 1 else [mine]):
            for name, (step, trained) in counted.items():
                self.step[name], self.trained_network[name] = step, trained

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
    throughput window leaves them out too). Under DDP a batch also waits for the slowest rank's: a
    bucket's figure is that of the steps it was in.

    `summary()`, after fit (every rank has gathered at FIT_END): `images_per_bucket` (all ranks) and
    `images_per_sec_per_device_by_bucket` (images of the bucket's measured batches over their seconds,
    summed over the ranks).
    """

    def __init__(self, warmup_batches: int, latent_downsample: int, order_depends_on: dict[str, int] | None = None):
        self.warmup_batches, self.latent_downsample = warmup_batches, latent_downsample
        # What the bucketed order of the samples depends on besides the seed (the ranks, and for real
        # data the loader workers of each): saved in every checkpoint, and a resume with other counts
        # refused, since it would repeat some samples and skip others without a word.
        self.order_depends_on = dict(order_depends_on or {})
        self.images: Counter[str] = Counter()  # every trained batch of this run, this rank
        self.measured_images: Counter[str] = Counter()
        self.measured_seconds: Counter[str] = Counter()
        self.current: tuple[str, int] | None = None
        self.started = 0.0
        self.compiled_at_start: float | None = None  # compile seconds at the batch's start (None: no timers)
        self.gathered: dict | None = None

    def state_dict(self) -> dict:
        return {"order_depends_on": dict(self.order_depends_on)}

    def load_state_dict(self, state: dict) -> None:
        # Composer loads a checkpoint's callback state while the Trainer is built, before any batch.
        saved = state.get("order_depends_on") or {}
        differ = [f"{name} {saved[name]} then, {self.order_depends_on[name]} now" for name in sorted(saved)
                  if name in self.order_depends_on and saved[name] != self.order_depends_on[name]]
        if differ:
            fail(f"--aspect_buckets: the checkpoint resumed was trained with other counts ({'; '.join(differ)}): "
                 "the bucketed order of the samples depends on them, so resume with the same ranks and "
                 "--num_workers, or start a new run in another --save_folder")

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
        seconds = time.perf_counter() - self.started
        compiled = compile_seconds()
        if compiled is not None and self.compiled_at_start is not None:
            seconds -= compiled - self.compiled_at_start
        self.measured_seconds[bucket] += seconds

    def fit_end(self, state: State, logger: Logger) -> None:
        ranks = dist.all_gather_object((dict(self.images), dict(self.measured_images), dict(self.measured_seconds)))
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


def by_shape(name: str) -> tuple[float, int]:
    """Sort key of an "HxW" name: from the tallest bucket to the widest, as the lists are ordered."""
    height, width = (int(side) for side in name.split("x"))
    return width / height, -height * width
