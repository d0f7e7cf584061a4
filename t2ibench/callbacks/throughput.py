"""The benchmark's measurement over the whole run after the warm-up: images/s, MFU, data wait,
peak memory, checkpoint time (`Throughput`), with deliberate pauses left out (`Pauses`).
What it logs, in which units: docs/metrics.md.
"""
from __future__ import annotations

import resource
import time
from typing import Any

import torch
from composer.callbacks import CheckpointSaver
from composer.callbacks.speed_monitor import get_gpu_flops_available
from composer.core import Callback, State, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.callbacks.buckets import BucketFlops
from t2ibench.train.compiling import compile_seconds, graphs_compiled, recompile_limit_hits, watch_recompile_limits


class Pauses:
    """Intervals a run spends outside training on purpose (drawing sample grids), in seconds.

    The callback that pauses records them; `Throughput` leaves those inside its window out of the
    measured time. One object shared by both, passed to each by benchmark.py.
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []  # (perf_counter at the start, seconds)

    def record(self, start: float, seconds: float) -> None:
        self.intervals.append((start, seconds))

    def seconds_within(self, start: float, end: float) -> float:
        """Seconds of the pauses that fall between `start` and `end` (perf_counter readings).

        Only the part inside the window counts: an evaluation that Composer runs after the window's
        last batch (at the end of training) must not shorten the window, or images/s comes out too
        high, or negative when the pause is longer than the window.
        """
        return sum(max(0.0, min(began + seconds, end) - max(began, start)) for began, seconds in self.intervals)


def peak_memory_bytes() -> dict[str, Any]:
    """Peak memory of this process since the last reset: on CUDA both the bytes the tensors held
    (`max_memory_allocated`) and what the caching allocator took from the device
    (`max_memory_reserved`, what an OOM is about); else the host's resident set size, which cannot
    be reset, so it covers the whole process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(),
                "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
                "peak_memory_kind": "cuda_max_memory_allocated"}
    return {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
            "peak_memory_reserved_bytes": None, "peak_memory_kind": "host_max_rss"}


def _timed_subclass(cls: type) -> type:
    """A subclass of the loader's class whose iterator times every `next()`, and nothing else.

    Composer's BEFORE/AFTER_DATALOADER events also enclose an all-reduce of an end-of-data flag and
    its `.item()`, so a rank waiting there for a slower rank (one saving a checkpoint, say) would be
    counted as waiting for data. Only the loader's own `next()` is timed here. (A subclass with no
    new base: Python only lets an instance change class between classes of the same layout.)
    """

    def __iter__(self):
        iterator = cls.__iter__(self)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.next_wait_seconds += time.perf_counter() - start
            self.next_calls += 1
            yield batch

    return type(f"Timed{cls.__name__}", (cls,), {
        "__iter__": __iter__, "__module__": cls.__module__, "times_next": True,
        "next_wait_seconds": 0.0,  # cumulative over the life of the loader (per instance once it counts)
        "next_calls": 0,
    })


_TIMED_CLASSES: dict[type, type] = {}


def time_loader_next(loader: Any) -> bool:
    """Make `loader` time its `next()` calls (see `_timed_subclass`); True if it could.

    The loader keeps its class, as a subclass: Composer checks `isinstance(loader, DataLoader)` to
    set the distributed sampler's epoch and to checkpoint a StreamingDataLoader's position, so a
    wrapper object would silently break shuffling and mid-epoch resumption.
    """
    cls = type(loader)
    if getattr(cls, "times_next", False):
        return True
    if cls not in _TIMED_CLASSES:
        _TIMED_CLASSES[cls] = _timed_subclass(cls)
    try:
        object.__setattr__(loader, "__class__", _TIMED_CLASSES[cls])  # DataLoader's __setattr__ guards some names
    except TypeError:  # built-in or __slots__ layouts cannot change class: data wait is then not reported
        return False
    return True


class Throughput(Callback):
    """Whole-run throughput after `warmup_batches`, plus MFU, peak memory, data wait and save time.

    The clock starts at the end of batch `warmup_batches` (compilation, cuDNN autotuning and
    allocator growth happen in the first batches) and stops at the end of the last batch, so the
    final checkpoint, the EMA export and whatever else runs at the end of fit are not in it. The
    seconds torch spends compiling (`--compile`) are reported, and any that fall inside a training
    batch of the window (a graph compiled late: a new shape) are left out of it, as pauses are: in each
    batch the most any rank compiled, since every rank waits for that one. CUDA
    is synchronized at those two batch ends only, so the measurement does not slow the steps it
    measures. Peak device memory is reset at the start of the window: it is the steady state's.
    If the run is shorter than the warm-up, only the first batch is excluded (and `warmup_batches`
    in the summary says so).

    Checkpoint saves (Composer's CheckpointSaver at BATCH/EPOCH_CHECKPOINT) inside the window are
    part of the measured time, as they are of a real run; their seconds are reported, and so are
    those of saves after the window. Data wait is the time in the loader's `next()` (see
    `time_loader_next`, applied at fit start), reported as the max and the mean over ranks.

    Args:
        warmup_batches: batches excluded from the measurement.
        flops_per_image: model FLOPs of one training step per image (0: MFU not reported).
        peak_flops_per_device: peak FLOP/s of one device at the run's precision; None asks
            Composer's table (`SpeedMonitor`'s), which knows A100/H100/H200 but not CPUs.
        pauses: time other callbacks spend outside training (sampling), left out of the window.
        trained_flops_per_image: FLOPs of the trained network alone (the denoiser's forward and
            backward) per image, for `mfu_trained_network`: the MFU MLPerf and MosaicML report,
            which leaves out the frozen encoders' forward passes that `mfu` counts.
        bucket_flops: a bucketed run's FLOPs per image of each bucket (`--aspect_buckets`), counted
            at fit start; the window's FLOPs are then those of the images it trained, bucket by
            bucket, and `flops_per_image` (and the trained network's) their mean over those images,
            instead of the two figures above (the square's).
    """

    def __init__(self, warmup_batches: int = 5, flops_per_image: float = 0.0, peak_flops_per_device: float | None = None,
                 pauses: Pauses | None = None, trained_flops_per_image: float = 0.0,
                 bucket_flops: BucketFlops | None = None):
        self.pauses = pauses if pauses is not None else Pauses()
        self.warmup_batches = warmup_batches
        self.flops_per_image = flops_per_image
        self.trained_flops_per_image = trained_flops_per_image
        self.bucket_flops = bucket_flops
        # A bucketed run: (step, trained network) FLOPs of this rank's images, cumulative at every batch end.
        self._flops_done: list[tuple[float, float]] = []
        self.peak_flops_per_device = peak_flops_per_device
        self.summary: dict[str, Any] = {}
        self._batch_times: list[float] = []  # wall clock at the end of every batch, seconds
        self._data_wait: list[float] = []  # cumulative loader next() seconds at the end of every batch
        self._save_seconds: list[float] = []  # cumulative checkpoint-save seconds at the end of every batch
        self._samples_seen: list[int] = []  # global samples trained at the end of every batch
        self._compiling: list[float] = []  # seconds this rank compiled inside each training batch
        self._compile_at_start: tuple[float | None, int, int] = (None, 0, 0)  # (compile seconds, graphs, limit hits)
        self._compile_at_batch_start: float | None = None
        self._loader: Any = None
        self._fit_start = 0.0
        self._fit_start_samples = 0
        self._saves = 0.0  # cumulative seconds spent in checkpoint saves
        self._save_pending: tuple[float, Any] | None = None  # (start, saver's last batch) at a *_CHECKPOINT event
        self.window_end = 0.0  # perf_counter() at the end of the last batch (benchmark.py times what follows)

    # -- checkpoint saves: our *_checkpoint handler runs just before Composer's CheckpointSaver (the
    # Trainer appends the saver after the user's callbacks), and the next event we see just after it.
    def _saver(self, state: State) -> CheckpointSaver | None:
        return next((cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)), None)

    def _checkpoint_event(self, state: State) -> None:
        saver = self._saver(state)
        if saver is not None:
            self._save_pending = (time.perf_counter(), saver.last_checkpoint_batch)

    def _after_checkpoint_event(self, state: State) -> None:
        if self._save_pending is None:
            return
        start, before = self._save_pending
        self._save_pending = None
        saver = self._saver(state)
        if saver is not None and saver.last_checkpoint_batch != before:  # it saved (on every rank)
            self._saves += time.perf_counter() - start

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._checkpoint_event(state)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._after_checkpoint_event(state)  # a batch checkpoint just before (the epoch's last batch)
        self._checkpoint_event(state)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._after_checkpoint_event(state)

    def epoch_start(self, state: State, logger: Logger) -> None:
        self._after_checkpoint_event(state)

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = float(get_gpu_flops_available(state))
        if self.bucket_flops is not None:
            self.bucket_flops.count_shared()  # before the clock: seconds on one rank, none in the window
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        self._loader = state.dataloader if time_loader_next(state.dataloader) else None
        self._fit_start = time.perf_counter()
        self._fit_start_samples = int(state.timestamp.sample.value)  # nonzero after a resume
        watch_recompile_limits()  # whatever compiled it: a function gone eager is said in the summary
        self._compile_at_start = (compile_seconds(), graphs_compiled(), len(recompile_limit_hits()))

    def batch_start(self, state: State, logger: Logger) -> None:
        self._compile_at_batch_start = compile_seconds()

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._after_checkpoint_event(state)

    def _is_last_batch(self, state: State) -> bool:
        """At BATCH_END: will training stop after this batch? (Composer's own end-of-training test,
        plus the last batch of the last epoch, whose epoch count is only incremented after it.)"""
        if state.max_duration is None:
            return False
        if state.timestamp >= state.max_duration:
            return True
        return (state.max_duration.unit == TimeUnit.EPOCH and state.dataloader_len is not None
                and int(state.timestamp.batch_in_epoch) >= int(state.dataloader_len)
                and int(state.timestamp.epoch) + 1 >= state.max_duration.value)

    def batch_end(self, state: State, logger: Logger) -> None:
        at_warmup_end = len(self._batch_times) == self.warmup_batches - 1
        last = self._is_last_batch(state)
        if (at_warmup_end or last) and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the clock starts and stops with no work queued
        now = time.perf_counter()
        if at_warmup_end and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()  # the steady state's peak, not the warm-up's
        self._batch_times.append(now)
        self._samples_seen.append(int(state.timestamp.sample.value))
        self._data_wait.append(self._loader.next_wait_seconds if self._loader is not None else 0.0)
        self._save_seconds.append(self._saves)
        compiled = compile_seconds()
        self._compiling.append(compiled - self._compile_at_batch_start if compiled is not None else 0.0)
        if self.bucket_flops is not None:  # state.batch is the whole batch again here (Composer 0.32.1)
            step, trained = self._flops_done[-1] if self._flops_done else (0.0, 0.0)
            batch_step, batch_trained = self.bucket_flops.of_batch(state.batch)
            self._flops_done.append((step + batch_step, trained + batch_trained))
        self.window_end = now

    def fit_end(self, state: State, logger: Logger) -> None:
        self._after_checkpoint_event(state)
        if not self._batch_times:
            return
        num_batches = len(self._batch_times)
        warmup = self.warmup_batches if num_batches > self.warmup_batches else min(1, num_batches - 1)
        start = self._batch_times[warmup - 1] if warmup > 0 else self._fit_start
        seconds = self._batch_times[-1] - start
        seconds -= self.pauses.seconds_within(start, self._batch_times[-1])  # pauses in it are not training
        samples = self._samples_seen[-1] - (self._samples_seen[warmup - 1] if warmup > 0 else self._fit_start_samples)
        world_size = dist.get_world_size()
        wait = self._data_wait[-1] - (self._data_wait[warmup - 1] if warmup > 0 else 0.0)
        saves_in = self._save_seconds[-1] - (self._save_seconds[warmup - 1] if warmup > 0 else 0.0)
        saves_after = self._saves - self._save_seconds[-1]  # so far: FIT_END work is timed by the caller
        memory = peak_memory_bytes()
        # A bucketed run: the FLOPs of the images this rank trained in the window (bucket by bucket).
        window_flops = [0.0, 0.0]
        if self.bucket_flops is not None:
            before = self._flops_done[warmup - 1] if warmup > 0 else (0.0, 0.0)
            window_flops = [self._flops_done[-1][i] - before[i] for i in range(2)]
        # Every rank waits for data on its own: the slowest loader sets the pace (max), the mean
        # says whether that is one rank or all. Peak memory: the fullest device. FLOPs: summed.
        # Compiling: a batch in which any rank compiles a graph (a new shape) lasts, on every rank, as
        # long as the slowest rank's compiling, since the others wait for it at the step's collectives;
        # so each batch of the window loses the most any rank compiled in it (rank 0's own seconds would
        # leave in the wait for another's). Those seconds are known only here, once per run, in the
        # reduction the figures above need anyway: one entry a batch of the window, and no collective or
        # host sync per step, compiled or not (a per-batch reduction would cost every step a collective).
        values = torch.tensor([wait, wait, float(memory["peak_memory_bytes"]),
                               float(memory["peak_memory_reserved_bytes"] or 0), *window_flops,
                               *self._compiling[warmup:]], dtype=torch.float64)
        if world_size > 1:
            values = state.device.tensor_to_device(values)
            summed = values.clone()
            dist.all_reduce(values, reduce_operation="MAX")
            dist.all_reduce(summed, reduce_operation="SUM")
            values[1] = summed[1] / world_size
            values[4:6] = summed[4:6]
            values = values.cpu()
        compiling_in = float(values[6:].sum())  # the window's batches, each the most any rank compiled in it
        seconds -= compiling_in  # compiling a graph first needed inside the window (a new shape) is not training
        images_per_sec = samples / seconds
        flops_per_image, trained_flops_per_image = self.flops_per_image, self.trained_flops_per_image
        if self.bucket_flops is not None and samples > 0:
            # The mean over the window's images, all ranks: each bucket weighs as the images it trained.
            flops_per_image, trained_flops_per_image = float(values[4]) / samples, float(values[5]) / samples
        per_device = images_per_sec / world_size
        peak_flops = self.peak_flops_per_device or 0.0
        mfu = per_device * flops_per_image / peak_flops if peak_flops and flops_per_image else None
        mfu_trained = (per_device * trained_flops_per_image / peak_flops
                       if peak_flops and trained_flops_per_image else None)
        timed = self._loader is not None
        self.summary = {
            "images_per_sec": images_per_sec,
            "images_per_sec_per_device": per_device,
            "measured_batches": num_batches - warmup,
            "measured_seconds": seconds,
            "warmup_batches": warmup,
            "data_wait_fraction": float(values[0]) / seconds if timed else None,
            "data_wait_fraction_mean": float(values[1]) / seconds if timed else None,
            "checkpoint_seconds_in_window": saves_in,
            "checkpoint_seconds_after_window": saves_after,
            **self._compile_summary(compiling_in),
            "peak_memory_bytes": int(values[2]),
            "peak_memory_reserved_bytes": int(values[3]) if memory["peak_memory_reserved_bytes"] is not None else None,
            "peak_memory_kind": memory["peak_memory_kind"],
            "flops_per_image": flops_per_image,
            "peak_flops_per_device": peak_flops or None,
            "mfu": mfu,
            "flops_per_image_trained_network": trained_flops_per_image,
            "mfu_trained_network": mfu_trained,
            "flops_per_image_by_bucket": self.bucket_flops.by_bucket() if self.bucket_flops is not None else None,
        }
        logger.log_metrics({f"benchmark/{k}": v for k, v in self.summary.items()
                            if isinstance(v, (int, float)) and v is not None})

    def _compile_summary(self, in_window: float) -> dict[str, Any]:
        """Seconds compiling from the start of fit to its end (evaluations' graphs included), those left
        out of the window, the graphs compiled, and the functions that reached one of dynamo's recompile
        limits during fit (they ran eagerly for shapes they had no graph for); seconds None where torch
        keeps no compile timers."""
        seconds_at_start, graphs_at_start, hits_at_start = self._compile_at_start
        now = compile_seconds()
        return {"compile_seconds": now - seconds_at_start if now is not None and seconds_at_start is not None else None,
                "compile_seconds_in_window": in_window if now is not None else None,
                "compiled_graphs": graphs_compiled() - graphs_at_start,
                "recompile_limit_hits": recompile_limit_hits()[hits_at_start:]}
