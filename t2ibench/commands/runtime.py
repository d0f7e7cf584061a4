"""Where a training run runs: ranks, device, precision and microbatch, decided once (`Runtime.start`)
from the run's settings before anything is built, and read by the rest of the run.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from composer.utils import dist, reproducibility

from t2ibench.train import allocator, cpu_threads
from t2ibench.core import devices
from t2ibench import memory
from t2ibench.train.allocator import AllocatorSetting
from t2ibench.datasets.buckets import largest_bucket
from t2ibench.train.cpu_threads import CpuThreads
from t2ibench.families import ModelFamily
from t2ibench.commands.gpu_setup import choose_setup, from_flag
from t2ibench.train.parallel import resolve_mode
from t2ibench.train.precision import resolve_precision
from t2ibench.train.settings import Settings
from t2ibench.train.weight_casts import resolve_weight_casts


@dataclass(frozen=True)
class Runtime:
    world_size: int
    on_gpu: bool
    precision: str  # what runs: fp32, amp_bf16 or amp_fp16 ("auto" resolved)
    trainer_precision: str  # what Composer is told: it refuses AMP on CPU, where the model autocasts itself
    batch_size_per_device: int
    microbatch: int | str  # images per device per forward/backward, or Composer's "auto" search
    weight_casts: str  # "step": bf16 weight copies once per optimizer step (t2ibench.train.weight_casts); "microbatch"
    activation_checkpointing: bool  # the denoiser's blocks recomputed in backward (`auto` resolved on a GPU
    # by `with_counted_setup`, once the data says what precomputed batches carry)
    activation_checkpointing_reason: str  # which rule chose it: the flag, or `auto` and its figures
    cpu_threads: CpuThreads | None = None  # a CPU run's intra-op threads and why (None on a GPU)
    allocator: AllocatorSetting | None = None  # the CUDA caching allocator's setting (None on a CPU)

    @property
    def is_rank_zero(self) -> bool:
        return dist.get_global_rank() == 0

    @classmethod
    def start(cls, settings: Settings) -> Runtime:
        """Set the process up (CUDA device per rank, intra-op threads per CPU rank, Composer's node signal
        files, seeds) and decide the precision and the microbatch (`auto` on several GPUs, and activation
        checkpointing `auto` on a GPU: see `with_counted_setup`)."""
        world_size = dist.get_world_size()
        # Before the first CUDA allocation: expandable segments unless the user set the allocator's variable.
        setting = allocator.configure()
        on_gpu = torch.cuda.is_available()
        # Composer's launcher leaves every CPU rank using all cores, and torch's default ignores the
        # loader workers: see cpu_threads.choose (a rule of the machine, not of its load).
        threads = None if on_gpu else cpu_threads.choose(settings.num_workers, dist.get_local_world_size(),
                                                           settings.cpu_threads)
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
        # `with_counted_setup` replaces it with the memory model's count.
        if settings.channels_last and not settings.compile and dist.get_global_rank() == 0:
            warnings.warn("--channels_last without --compile: eager GroupNorm returns contiguous tensors, so every "
                          "convolution after a norm converts its input back to channels-last; add --compile "
                          "(inductor keeps one layout), or measure before keeping the flag.", stacklevel=1)
        per_node_signal_files()
        reproducibility.seed_all(settings.seed)
        weight_casts = resolve_weight_casts(settings.weight_casts, on_gpu=on_gpu, precision=precision,
                                            world_size=world_size)
        # On a GPU `auto` is decided with the microbatch (`with_counted_setup`); off until then.
        checkpointing, reason = from_flag(settings.activation_checkpointing)
        return cls(world_size, on_gpu, precision, precision if on_gpu else "fp32", per_device, microbatch,
                   weight_casts, checkpointing, reason, threads, setting)

    def with_counted_setup(self, settings: Settings, text_format: str | None) -> Runtime:
        """This runtime with activation checkpointing `auto` on a GPU decided (`gpu_setup.choose_setup`,
        with the microbatch it chose where the microbatch is `auto`), and the microbatch `auto` on
        several GPUs replaced by `safe_auto_microbatch`'s count; call it once the data is built
        (`text_format`: what precomputed shards carry, None online). Anything else is returned as it is.
        With checkpointing on or off and one GPU, `auto` stays Composer's OOM search (on for the warm-up
        batches: t2ibench.callbacks.oom_fallback)."""
        if not self.on_gpu:
            return self
        gpu = devices.visible()  # recognised by name (its FLOP/s and link), its memory as CUDA reports it
        memory_bytes = gpu.cuda_memory_bytes
        counted, at = counted_image_size(settings)
        if settings.activation_checkpointing == "auto":
            setup = choose_setup(
                settings.model_config, counted, memory_bytes, self.batch_size_per_device, device=gpu,
                microbatch=None if self.microbatch == "auto" else self.microbatch, **counted_settings(
                    settings, self.world_size, self.precision, text_format, self.weight_casts))
            if self.is_rank_zero:
                print(f"--activation_checkpointing auto: {'on' if setup.activation_checkpointing else 'off'}, "
                      f"microbatch {setup.microbatch} ({setup.reason}; counted by t2ibench.memory, t2ibench.memory.kernels "
                      f"and, on several GPUs, t2ibench.train.parallel's collectives for this GPU's memory and these "
                      f"settings{at}, docs/speed.md)", flush=True)
            return replace(self, microbatch=setup.microbatch, activation_checkpointing=setup.activation_checkpointing,
                           activation_checkpointing_reason=setup.reason)
        if self.microbatch != "auto" or self.world_size == 1:
            return self
        microbatch = safe_auto_microbatch(settings.family, settings, memory_bytes, self.world_size, self.precision,
                                          text_format)
        if self.is_rank_zero:
            print(f"--device_train_microbatch_size auto with {self.world_size} ranks: using {microbatch} "
                  f"(counted by t2ibench.memory for this GPU's memory and these settings{at}; see docs/gpu-runs.md), "
                  "not Composer's OOM search", flush=True)
        return replace(self, microbatch=microbatch)


def counted_image_size(settings: Settings) -> tuple[int | tuple[int, int], str]:
    """The image the memory model sizes the microbatch for: --image_size's square, or a bucketed run's
    largest bucket (tokens for Flux.1, pixels for SDXL: `buckets.largest_bucket`), and the words saying so."""
    if not settings.buckets:
        return settings.image_size, ""
    family = settings.family
    bucket, measure = largest_bucket(settings.buckets, family.latent_downsample, family.patch_size)
    unit, count = next((key, value) for key, value in measure.items() if key != "bucket")
    return (bucket.height, bucket.width), f", at the largest bucket {bucket.name} ({count:,} {unit})"


def counted_settings(settings: Settings, world_size: int, precision: str, text_format: str | None,
                     weight_casts: str) -> dict:
    """The run's settings the memory model and the kernel count take, as the run resolved them."""
    return dict(precision=precision, norm_precision=settings.norm_precision, precomputed=settings.precomputed,
                precomputed_format=text_format if settings.precomputed else None, use_ema=settings.use_ema,
                fsdp=resolve_mode(settings.fsdp, settings.family.parallelism, world_size), num_gpus=world_size,
                weight_casts=weight_casts, fp8=settings.fp8)


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
        settings.model_config, counted_image_size(settings)[0], total_memory_bytes, settings.batch_size // world_size,
        precision=precision, norm_precision=settings.norm_precision, precomputed=settings.precomputed,
        precomputed_format=text_format if settings.precomputed else None, use_ema=settings.use_ema,
        fsdp=resolve_mode(settings.fsdp, family.parallelism, world_size), num_gpus=world_size,
        # Several ranks: weights cast per microbatch; checkpointing `auto` never comes here (choose_setup).
        activation_checkpointing=settings.activation_checkpointing == "on", fp8=settings.fp8)


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
