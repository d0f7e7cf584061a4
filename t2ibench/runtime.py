"""Where a training run runs: ranks, device, precision and microbatch, decided once (`Runtime.start`)
from the run's settings before anything is built, and read by the rest of the run.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from composer.utils import dist, reproducibility

from t2ibench import cpu_threads, memory
from t2ibench.cpu_threads import CpuThreads
from t2ibench.families import ModelFamily
from t2ibench.parallel import resolve_mode
from t2ibench.precision import resolve_precision
from t2ibench.settings import Settings
from t2ibench.weight_casts import resolve_weight_casts


@dataclass(frozen=True)
class Runtime:
    world_size: int
    on_gpu: bool
    precision: str  # what runs: fp32, amp_bf16 or amp_fp16 ("auto" resolved)
    trainer_precision: str  # what Composer is told: it refuses AMP on CPU, where the model autocasts itself
    batch_size_per_device: int
    microbatch: int | str  # images per device per forward/backward, or Composer's "auto" search
    weight_casts: str  # "step": bf16 weight copies once per optimizer step (t2ibench.weight_casts); "microbatch"
    cpu_threads: CpuThreads | None = None  # a CPU run's intra-op threads and why (None on a GPU)

    @property
    def is_rank_zero(self) -> bool:
        return dist.get_global_rank() == 0

    @classmethod
    def start(cls, settings: Settings) -> Runtime:
        """Set the process up (CUDA device per rank, intra-op threads per CPU rank, Composer's node signal files,
        seeds) and decide the precision and the microbatch (`auto` on several GPUs: see
        `with_counted_microbatch`)."""
        world_size = dist.get_world_size()
        on_gpu = torch.cuda.is_available()
        # Composer's launcher leaves every CPU rank using all cores, and torch's default ignores the
        # loader workers and other programs' load: see cpu_threads.choose.
        threads = None if on_gpu else cpu_threads.choose(settings.num_workers, dist.get_local_world_size())
        if on_gpu:
            # Before anything touches CUDA: otherwise every rank creates a context on GPU 0.
            torch.cuda.set_device(dist.get_local_rank())
            # Fixed shapes every step: let cuDNN time its convolution algorithms once and keep the fastest.
            torch.backends.cudnn.benchmark = True
        precision = resolve_precision(settings.precision, on_gpu)
        per_device = settings.batch_size // world_size
        microbatch = settings.device_train_microbatch_size
        if microbatch == "auto" and not on_gpu:
            microbatch = per_device  # Composer's auto microbatching needs a GPU
        # "auto" on several GPUs stays until the data says what precomputed batches carry:
        # `with_counted_microbatch` replaces it with the memory model's count.
        if settings.channels_last and not settings.compile and dist.get_global_rank() == 0:
            warnings.warn("--channels_last without --compile: eager GroupNorm returns contiguous tensors, so every "
                          "convolution after a norm converts its input back to channels-last; add --compile "
                          "(inductor keeps one layout), or measure before keeping the flag.", stacklevel=1)
        per_node_signal_files()
        reproducibility.seed_all(settings.seed)
        weight_casts = resolve_weight_casts(settings.weight_casts, on_gpu=on_gpu, precision=precision,
                                            world_size=world_size)
        return cls(world_size, on_gpu, precision, precision if on_gpu else "fp32", per_device, microbatch,
                   weight_casts, threads)

    def with_counted_microbatch(self, settings: Settings, text_format: str | None) -> Runtime:
        """This runtime with `auto` on several GPUs replaced by `safe_auto_microbatch`'s count; call it
        once the data is built (`text_format`: what precomputed shards carry, None online). Any
        other microbatch is returned as it is."""
        if self.microbatch != "auto" or self.world_size == 1 or not self.on_gpu:
            return self
        microbatch = safe_auto_microbatch(settings.family, settings, torch.cuda.get_device_properties(0).total_memory,
                                          self.world_size, self.precision, text_format)
        if self.is_rank_zero:
            print(f"--device_train_microbatch_size auto with {self.world_size} ranks: using {microbatch} "
                  "(counted by t2ibench.memory for this GPU's memory and these settings; see docs/gpu-runs.md), "
                  "not Composer's OOM search", flush=True)
        return replace(self, microbatch=microbatch)


def safe_auto_microbatch(family: ModelFamily, settings: Settings, total_memory_bytes: int, world_size: int,
                         precision: str, text_format: str | None) -> int:
    """`auto` for several ranks: the microbatch the memory model counts for this GPU and this run's
    settings (`t2ibench.memory.auto_microbatch`), not an OOM search.

    Composer's auto microbatching catches an OOM and retries the batch with half the microbatch.
    Under DDP an OOM in the backward pass leaves the gradient reducer mid-reduction (buckets marked
    ready on one rank and not on another), and the size found on batch 1 ignores the AdamW and EMA
    state that is only allocated after it; so with several ranks `auto` takes the largest power of
    two that divides the per-device batch and that `memory.plan` counts as fitting
    `total_memory_bytes` with the run's family, resolution, precision, norm precision, data path
    (`text_format`: what precomputed shards carry, None online), EMA, FSDP mode and activation
    checkpointing; 1 when nothing fits (the run's own OOM then says so).
    """
    return memory.auto_microbatch(
        settings.model_config, settings.image_size, total_memory_bytes, settings.batch_size // world_size,
        precision=precision, norm_precision=settings.norm_precision, precomputed=settings.precomputed,
        precomputed_format=text_format if settings.precomputed else None, use_ema=settings.use_ema,
        fsdp=resolve_mode(settings.fsdp, family.parallelism, world_size), num_gpus=world_size,
        activation_checkpointing=settings.activation_checkpointing, fp8=settings.fp8)  # several ranks: casts per microbatch


def per_node_signal_files() -> None:
    """Make Composer's node signal files per node, so --autoresume works when nodes share --save_folder.

    Composer 0.32.1 (autoresume, checkpoint loading) names the file by which each node's local rank 0
    tells the node's other ranks it is done after node 0 plus a random suffix broadcast from rank 0,
    so every node uses the same name in the same folder, and every node's local rank 0 deletes it:
    on a file system shared by the nodes the second delete fails (FileNotFoundError) and the run
    dies before training. Adding this node's rank keeps the name equal within a node only.
    """
    original = dist.get_node_signal_file_name
    if getattr(original, "per_node", False):
        return

    def per_node(rng=None) -> str:
        return f"{original(rng)}_n{dist.get_node_rank()}"

    per_node.per_node = True
    dist.get_node_signal_file_name = per_node
