"""Throughput math: FLOPs per training image, and a callback that measures what SpeedMonitor does not.

Composer's `SpeedMonitor` logs rolling images/sec, FLOPs/sec and MFU from the model's
`flops_per_batch`. `Throughput` adds the figures a benchmark needs over the whole run after
warm-up: images/sec (global and per device), MFU, peak device memory and the share of step time
spent waiting for data. Its `summary` is what `benchmark.py` prints and writes to JSON.
"""
from __future__ import annotations

import resource
import time
from typing import Any

import torch
from composer.callbacks.speed_monitor import get_gpu_flops_available
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist
from torch.utils.flop_counter import FlopCounterMode


def count_flops_per_image(unet: torch.nn.Module, vae: torch.nn.Module | None, text_encoder: torch.nn.Module | None,
                          image_size: int, seq_len: int = 77) -> dict[str, float]:
    """FLOPs of one training image, counted by `torch.utils.flop_counter` on meta tensors.

    Pass modules built on the meta device (`model.sd2_meta_components`): nothing is computed or
    allocated. `vae`/`text_encoder` None means their outputs are precomputed and cost nothing.
    Returns FLOPs (not GFLOP) for `unet_fwd`, `unet_fwd_bwd`, `vae_encoder`, `text_encoder`, `total`.
    """
    latent_size = image_size // 8
    channels = unet.config.in_channels
    device = next(unet.parameters()).device

    def counted(fn) -> float:
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    latents = torch.randn(1, channels, latent_size, latent_size, device=device)
    timesteps = torch.tensor([500], device=device)
    text_states = torch.randn(1, seq_len, unet.config.cross_attention_dim, device=device)
    unet_fwd = counted(lambda: unet(latents, timesteps, text_states))
    unet_fwd_bwd = counted(lambda: unet(latents, timesteps, text_states).sample.sum().backward())
    unet.zero_grad(set_to_none=True)
    flops = {"unet_fwd": unet_fwd, "unet_fwd_bwd": unet_fwd_bwd, "vae_encoder": 0.0, "text_encoder": 0.0}
    with torch.no_grad():
        if vae is not None:
            images = torch.randn(1, 3, image_size, image_size, device=device)
            flops["vae_encoder"] = counted(lambda: vae.encode(images))
        if text_encoder is not None:
            ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
            flops["text_encoder"] = counted(lambda: text_encoder(ids))
    flops["total"] = flops["unet_fwd_bwd"] + flops["vae_encoder"] + flops["text_encoder"]
    return flops


def peak_memory_bytes() -> tuple[int, str]:
    """Peak memory of this process: device memory allocated on CUDA, else host resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated(), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_max_rss"  # ru_maxrss is KiB on Linux


class Throughput(Callback):
    """Whole-run throughput after `warmup_batches`, plus MFU, peak memory and data-wait share.

    The clock starts at the end of batch `warmup_batches` (compilation, cuDNN autotuning and
    allocator growth happen in the first batches) and stops at the end of training; CUDA is
    synchronized at both ends only, so the measurement does not slow the steps it measures.
    If the run is shorter than the warm-up, only the first batch is excluded (and
    `warmup_batches` in the summary says so).

    Args:
        warmup_batches: batches excluded from the measurement.
        flops_per_image: model FLOPs of one training step per image (0: MFU not reported).
        peak_flops_per_device: peak FLOP/s of one device at the run's precision; None asks
            Composer's table (`SpeedMonitor`'s), which knows A100/H100/H200 but not CPUs.
    """

    def __init__(self, warmup_batches: int = 5, flops_per_image: float = 0.0, peak_flops_per_device: float | None = None):
        self.warmup_batches = warmup_batches
        self.flops_per_image = flops_per_image
        self.peak_flops_per_device = peak_flops_per_device
        self.summary: dict[str, Any] = {}
        self._batch_times: list[float] = []  # wall clock at the end of every batch, seconds
        self._data_wait: list[float] = []  # seconds spent in the dataloader, per batch
        self._samples_seen: list[int] = []  # global samples trained at the end of every batch
        self._data_start = 0.0
        self._fit_start = 0.0
        self._fit_start_samples = 0

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = float(get_gpu_flops_available(state))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        self._fit_start = time.perf_counter()
        self._fit_start_samples = int(state.timestamp.sample.value)  # nonzero after a resume

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._data_start = time.perf_counter()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._data_wait.append(time.perf_counter() - self._data_start)

    def batch_end(self, state: State, logger: Logger) -> None:
        if len(self._batch_times) == self.warmup_batches - 1 and torch.cuda.is_available():
            torch.cuda.synchronize()  # the clock starts with no work queued
        self._batch_times.append(time.perf_counter())
        self._samples_seen.append(int(state.timestamp.sample.value))

    def fit_end(self, state: State, logger: Logger) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        end = time.perf_counter()
        if not self._batch_times:
            return
        self._batch_times[-1] = end
        num_batches = len(self._batch_times)
        warmup = self.warmup_batches if num_batches > self.warmup_batches else min(1, num_batches - 1)
        start = self._batch_times[warmup - 1] if warmup > 0 else self._fit_start
        seconds = self._batch_times[-1] - start
        # Time other callbacks spent outside training (sample.SampleImages: `pauses` of (start, seconds))
        # inside the measured window is not training time.
        seconds -= sum(s for cb in state.callbacks for t, s in getattr(cb, "pauses", ()) if t >= start)
        samples = self._samples_seen[-1] - (self._samples_seen[warmup - 1] if warmup > 0 else self._fit_start_samples)
        world_size = dist.get_world_size()
        images_per_sec = samples / seconds
        # Every rank waits for data on its own; the slowest loader sets the pace, so report the max.
        local_wait = torch.tensor([sum(self._data_wait[warmup:num_batches])], dtype=torch.float64)
        peak_bytes, memory_kind = peak_memory_bytes()
        local_peak = torch.tensor([float(peak_bytes)], dtype=torch.float64)
        if world_size > 1:
            local_wait = state.device.tensor_to_device(local_wait)
            local_peak = state.device.tensor_to_device(local_peak)
            dist.all_reduce(local_wait, reduce_operation="MAX")
            dist.all_reduce(local_peak, reduce_operation="MAX")
        per_device = images_per_sec / world_size
        peak_flops = self.peak_flops_per_device or 0.0
        mfu = per_device * self.flops_per_image / peak_flops if peak_flops and self.flops_per_image else None
        self.summary = {
            "images_per_sec": images_per_sec,
            "images_per_sec_per_device": per_device,
            "measured_batches": num_batches - warmup,
            "measured_seconds": seconds,
            "warmup_batches": warmup,
            "data_wait_fraction": float(local_wait.item()) / seconds,
            "peak_memory_bytes": int(local_peak.item()),
            "peak_memory_kind": memory_kind,
            "flops_per_image": self.flops_per_image,
            "peak_flops_per_device": peak_flops or None,
            "mfu": mfu,
        }
        logger.log_metrics({f"benchmark/{k}": v for k, v in self.summary.items()
                            if isinstance(v, (int, float)) and v is not None})
