"""Planning the microbatch: the bytes per image and per microbatch from two counted steps, the fixed
bytes per GPU (weights, gradients, optimizer, EMA, DDP or FSDP, encoders), and the largest
power-of-two microbatch that fits a GPU (`plan`, `auto_microbatch`). The derivations are in
docs/gpu-runs.md, "The memory model"."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from t2ibench.train import allocator
from t2ibench.core import devices
from t2ibench.families import family_of
from t2ibench.memory.autocast import CUDA_AUTOCAST, autocast_dtype, probe_cpu_autocast
from t2ibench.memory.step import COUNTED_MICROBATCHES, build_meta_step, count_step
from t2ibench.train.parallel import FSDP_MODES
from t2ibench.datasets.precomputed import TEXT_STATES, batch_text_format
from t2ibench.train.weight_casts import WEIGHT_CASTS

GIB = 2**30
# Device memory the PyTorch allocator never sees: the CUDA context with its kernels (about 0.5-0.6
# GiB on A100/H100 under torch 2.7), cuBLAS/cuDNN handles, and NCCL's communicator buffers (a few
# hundred MiB for 8 ranks on NVLink).
CUDA_CONTEXT_BYTES = int(1.5 * GIB)
# The caching allocator's reserve over what tensors hold (max_memory_reserved / max_memory_allocated
# - 1), by its setting (t2ibench.train.allocator). torch's default: blocks rounded up and split, and whole
# segments cached for sizes no later request fits, which cannot go back to the device while one block
# in them lives. 10% is a margin for a step with fixed shapes (H100, 2026-11-25/26: 1.4-2.3% for
# SD2 precomputed and SDXL without checkpointing, 6.1-6.5% for SDXL with it; SD2 online, whose VAE
# allocates other sizes than the UNet, 11-16%).
ALLOCATOR_RESERVE_FRACTION = 0.10
# With expandable segments (the default on CUDA, t2ibench.train.allocator): one segment per stream grows in
# 20 MiB pages (2 MiB for allocations under 1 MiB), and before it reports out of memory the allocator
# unmaps every free page and retries, so a free hole costs no device memory at the limit. What stays
# is blocks rounded and split and part-used pages: measured on an H100 (results/h100-2026-11-27),
# SDXL 1024 with checkpointing at microbatch 32 reserved 78.12 GiB over 74.63 allocated (4.7%, with 4
# allocation retries: at the device's limit) and SD2 512 precomputed at 32, 0.6%. 5% is the larger.
EXPANDABLE_SEGMENTS_RESERVE_FRACTION = 0.05
# What a plan leaves free of the device beyond its prediction: the count's own error (SDXL's step
# allocated 0.5% more than counted on 2026-11-27, 1.3% before) and how the allocator's reserve varies
# with the set-up and the run. A microbatch fits when its prediction is within the rest
# (`usable_bytes`); a run whose first batches still run out of memory halves its microbatch
# (t2ibench.callbacks.oom_fallback).
HEADROOM_FRACTION = 0.03
# torch.cuda.get_device_properties(0).total_memory of common GPUs, GiB, by label: what `auto` compares
# with where no GPU is visible (t2ibench.core.devices' table).
GPU_MEMORY_GIB = devices.GPU_MEMORY_GIB
MAX_MICROBATCH = 1024


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """Bytes of a microbatch of `b` images: `per_image * b + per_microbatch`, from counts at b = 2, 4."""

    saved_per_image: float  # activation_bytes_per_image: saved for backward
    saved_per_microbatch: float  # saved whatever the size (weight casts)
    peak_per_image: float  # peak of the step above the fixed bytes (backward transients, gradients aside)
    peak_per_microbatch: float
    weight_cast_bytes: int

    def saved_bytes(self, microbatch: int) -> float:
        return self.saved_per_image * microbatch + self.saved_per_microbatch

    def peak_bytes(self, microbatch: int) -> float:
        return self.peak_per_image * microbatch + self.peak_per_microbatch


# Cached: a count runs two meta-device steps (seconds to a minute), and a matrix of plans (gpu_report.py,
# --table) asks for the same count under several GPU sizes, FSDP modes and EMA settings.
@functools.lru_cache(maxsize=None)
def activation_model(model_config: str, image_size: int, *, precision: str = "amp_bf16",
                     norm_precision: str = "autocast", precomputed: bool = False,
                     precomputed_format: str | None = None, activation_checkpointing: bool = False,
                     sharded: bool = False, device_type: str = "cuda", weight_casts: str = "microbatch",
                     fp8: str = "off") -> ActivationModel:
    """Count the step at microbatch 2 and 4 under `precision` ("fp32", "amp_bf16", "amp_fp16").

    `sharded`: under FSDP (the denoiser's parameters reach the forward in the autocast dtype);
    `weight_casts` "step" (t2ibench.train.weight_casts): the forward computes with bf16 copies of the
    weights, so, as under FSDP, autocast casts none of them. `fp8`: `--fp8`'s recipe (t2ibench.train.fp8),
    "off" for none.
    Counted once per process and setting (seconds on a CPU: about 10 s for SD2, 30 s for SDXL at
    1024, longer for Flux.1's 11.9B parameters)."""
    text_format = batch_text_format(family_of(model_config), precomputed, precomputed_format)
    if weight_casts not in WEIGHT_CASTS:
        raise ValueError(f"weight_casts must be one of {WEIGHT_CASTS}, not {weight_casts!r}")
    low_precision_weights = (sharded or weight_casts == "step") and precision != "fp32"
    return _activation_model(model_config, image_size, precision, norm_precision, text_format,
                             activation_checkpointing, low_precision_weights, device_type, fp8)


@functools.lru_cache(maxsize=None)
def _activation_model(model_config: str, image_size: int, precision: str, norm_precision: str,
                      text_format: str | None, activation_checkpointing: bool, sharded: bool,
                      device_type: str, fp8: str = "off") -> ActivationModel:
    with torch.random.fork_rng(devices=[]):  # the run that asks (benchmark.py's auto) draws the same numbers after
        return _count_activations(model_config, image_size, precision, norm_precision, text_format,
                                  activation_checkpointing, sharded, device_type, fp8)


def _count_activations(model_config: str, image_size: int, precision: str, norm_precision: str,
                       text_format: str | None, activation_checkpointing: bool, sharded: bool,
                       device_type: str, fp8: str = "off") -> ActivationModel:
    step = build_meta_step(model_config, image_size, precision=precision, norm_precision=norm_precision,
                           text_format=text_format, activation_checkpointing=activation_checkpointing,
                           low_precision_weights=sharded, device_type=device_type, fp8=fp8,
                           policy=CUDA_AUTOCAST if device_type == "cuda" else probe_cpu_autocast())
    # Counted at 2 and 4 images, not 1 and 2: with one image some reshapes are views (a dimension of
    # size 1 keeps them contiguous) that copy from two on (Flux.1's transformer saves 1.3% less per
    # image at 1 than the slope from 2 on). The line through 2 and 4 is exact from 2 on (counted
    # at 1, 2, 3, 4 for SD2, SDXL and Flux.1) and over-counts a microbatch of 1 a little.
    two, four = (count_step(step.model, step.batch(microbatch), step.policy, step.dtype, device_type)
                 for microbatch in COUNTED_MICROBATCHES)
    return ActivationModel(
        saved_per_image=(four.saved_bytes - two.saved_bytes) / 2,
        saved_per_microbatch=2 * two.saved_bytes - four.saved_bytes,
        peak_per_image=(four.backward_peak_bytes - two.backward_peak_bytes) / 2,
        peak_per_microbatch=2 * two.backward_peak_bytes - four.backward_peak_bytes,
        weight_cast_bytes=two.weight_cast_bytes)


def _nbytes(module: torch.nn.Module | None, dtype: torch.dtype | None = None) -> int:
    """Bytes of a module's parameters and buffers, in `dtype` when given (else their own)."""
    if module is None:
        return 0
    itemsize = torch.empty(0, dtype=dtype).element_size() if dtype is not None else None
    return sum(t.numel() * (itemsize if itemsize and t.is_floating_point() else t.element_size())
               for t in [*module.parameters(), *module.buffers()])


@functools.lru_cache(maxsize=None)
def _meta_parts(model_config: str):
    """The family's parts on the meta device, built once per config (read only: parameter counts)."""
    return family_of(model_config).meta_parts(model_config)


def fsdp_unit_params(model_config: str) -> dict[str, int]:
    """Parameters of the denoiser's FSDP units as the run wraps them (`ModelFamily.fsdp_blocks`, which
    `DiffusionModel.mark_fsdp_units` hands Composer): the largest block, the root unit (what no
    block holds: embeddings, input and output layers), which FSDP2 keeps gathered from the root's
    forward to the end of its backward, and the whole denoiser (what DDP reduces and FSDP gathers)."""
    denoiser = _meta_parts(model_config).denoiser
    blocks = family_of(model_config).fsdp_blocks(denoiser)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    return {"largest_block": max(sum(p.numel() for p in block.parameters()) for block in blocks),
            "root": sum(p.numel() for p in denoiser.parameters() if id(p) not in in_blocks),
            "denoiser": sum(p.numel() for p in denoiser.parameters())}


def fixed_bytes(model_config: str, *, precision: str = "amp_bf16", precomputed: bool = False,
                precomputed_format: str | None = None, use_ema: bool = True, fsdp: str = "none", num_gpus: int = 8,
                bucket_view: bool = False, weight_cast_bytes: int = 0, weight_casts: str = "microbatch"
                ) -> dict[str, int]:
    """Bytes per GPU that do not depend on the microbatch, by what holds them (see `plan`).

    `weight_casts` "step": the bf16 copies of the weights live all run (in place of autocast's cached
    casts); the step's gradients are summed in fp32, as autocast's, from the first microbatch's
    upcast on (t2ibench.train.weight_casts). That upcast holds the first backward's bf16 gradients beside
    the fp32 ones once the activations are gone (`plan` checks that moment apart: "step_end_bytes")."""
    if fsdp not in FSDP_MODES:
        raise ValueError(f"fsdp must be one of {FSDP_MODES}, not {fsdp!r}")
    if weight_casts not in WEIGHT_CASTS:
        raise ValueError(f"weight_casts must be one of {WEIGHT_CASTS}, not {weight_casts!r}")
    family = family_of(model_config)
    text_format = batch_text_format(family, precomputed, precomputed_format)
    parts = _meta_parts(model_config)
    num_params = sum(p.numel() for p in parts.denoiser.parameters())
    dtype = autocast_dtype(precision)
    compute_bytes = 4 if dtype is None else 2
    shards = num_gpus if fsdp != "none" else 1
    copies = fsdp == "none" and weight_casts == "step" and dtype is not None
    if copies:
        gathered = compute_bytes * num_params  # t2ibench.train.weight_casts' bf16 copies
    elif fsdp == "none":
        # Autocast's cached weight casts, kept by autograd until backward (counted in the step).
        gathered = weight_cast_bytes
    elif fsdp == "shard_grad_op":
        # Every unit gathered in the autocast dtype, kept from its forward to the end of the backward.
        gathered = compute_bytes * num_params
    else:
        # Each block freed after its forward and gathered again for its backward: two at once (one
        # computing, the next prefetched), beside the root unit, gathered throughout.
        units = fsdp_unit_params(model_config)
        gathered = compute_bytes * (2 * units["largest_block"] + units["root"])
    if fsdp == "none":
        reduce_scatter = 0
    else:
        # FSDP2's reduce-scatter of a unit's gradient (torch 2.7, foreach_reduce): the unsharded
        # gradients in the compute dtype, copied into an fp32 reduce-scatter input (Composer reduces
        # in fp32) of the unit's full size, for the largest unit.
        units = fsdp_unit_params(model_config)
        reduce_scatter = (compute_bytes + 4) * max(units["largest_block"], units["root"])
    vae_encoder = 0
    if not precomputed and parts.vae is not None:
        # Only the VAE's encoder is on the GPU: benchmark.py keeps the decoder on the host.
        vae_encoder = _nbytes(parts.vae.encoder, dtype) + _nbytes(getattr(parts.vae, "quant_conv", None), dtype)
    text_encoders = 0 if text_format == TEXT_STATES else sum(
        _nbytes(encoder, dtype) for encoder in parts.text_encoders.values())
    return {
        # fp32 master weights: replicated under DDP; sharded at rest under both FSDP strategies (what
        # computes is the gathered copy: `weight_casts_or_gathered`).
        "weights": 4 * num_params // shards,
        "gradients": 4 * num_params // shards,
        # DDP's reducer buckets: a second copy of the gradients unless they are views into the buckets
        # (`gradient_as_bucket_view`, which Composer 0.32.1's prepare_ddp_module does not pass on).
        "ddp_buckets": 4 * num_params if fsdp == "none" and num_gpus > 1 and not bucket_view else 0,
        "adamw_moments": 8 * num_params // shards,
        "ema": 4 * num_params // shards if use_ema else 0,
        "weight_casts_or_gathered": int(gathered),
        "fsdp_reduce_scatter": int(reduce_scatter),
        # Frozen encoders in their stored dtype (the autocast dtype under AMP), replicated on every
        # GPU under FSDP too (mark_fsdp_units leaves them out of the sharding).
        "frozen_encoders": vae_encoder + text_encoders,
    }


def reserve_fraction(expandable_segments: bool) -> float:
    """The allocator reserve the plan counts for the allocator's setting."""
    return EXPANDABLE_SEGMENTS_RESERVE_FRACTION if expandable_segments else ALLOCATOR_RESERVE_FRACTION


def usable_bytes(gpu_memory_bytes: float) -> float:
    """The device memory a plan may fill: all but HEADROOM_FRACTION of it."""
    return gpu_memory_bytes * (1 - HEADROOM_FRACTION)


def largest_microbatch(fixed_total_bytes: float, activations: ActivationModel, gpu_memory_bytes: float,
                       per_device_batch: int | None = None, reserve: float = ALLOCATOR_RESERVE_FRACTION) -> int:
    """Largest power of two b (dividing `per_device_batch` when given) with
    (fixed + peak(b)) * (1 + reserve) + CUDA_CONTEXT_BYTES <= the usable part of gpu memory; 0 if none."""
    best, size = 0, 1
    limit = per_device_batch or MAX_MICROBATCH
    while size <= limit:
        tensors = fixed_total_bytes + activations.peak_bytes(size)
        need = tensors * (1 + reserve) + CUDA_CONTEXT_BYTES
        if need > usable_bytes(gpu_memory_bytes):
            break
        if per_device_batch is None or per_device_batch % size == 0:
            best = size
        size *= 2
    return best


@functools.lru_cache(maxsize=None)
def train_flops_per_image(model_config: str, image_size: int | tuple[int, int]) -> float:
    """FLOPs of the trained network alone (the denoiser's forward and backward) per image (`image_size`
    a square's side or a bucket's (height, width)), the family's count with the encoders left out
    (recomputation under checkpointing not included)."""
    return family_of(model_config).flops_per_image(model_config, image_size, vae=False, text_encoders=False)["total"]


def plan(model_config: str = "sd2-base", image_size: int | tuple[int, int] | None = None,
         gpu_memory_bytes: float = 80 * GIB, *,
         precision: str = "amp_bf16", norm_precision: str = "autocast", precomputed: bool = False,
         precomputed_format: str | None = None, use_ema: bool = True, fsdp: str = "none", num_gpus: int = 8,
         bucket_view: bool = False, per_device_batch: int | None = None,
         activation_checkpointing: bool = False, weight_casts: str = "microbatch", fp8: str = "off",
         expandable_segments: bool | None = None) -> dict[str, Any]:
    """The memory of a training step per GPU and the largest microbatch that fits, as a JSON-able dict.

    `image_size` None: the family's training resolution (`ModelFamily.default_image_size`); (height,
    width): an aspect-ratio bucket (a bucketed run counts its largest, `buckets.largest_bucket`);
    `precomputed_format` None: the family's (`precomputed.default_format`); `expandable_segments`
    None: the allocator setting a run started from this environment uses (`allocator.planned`)."""
    if expandable_segments is None:
        expandable_segments = allocator.planned().expandable_segments
    reserve = reserve_fraction(expandable_segments)
    if fsdp not in FSDP_MODES:
        raise ValueError(f"fsdp must be one of {FSDP_MODES}, not {fsdp!r}")
    family = family_of(model_config)
    image_size = image_size or family.default_image_size(model_config)
    text_format = batch_text_format(family, precomputed, precomputed_format)
    activations = activation_model(model_config, image_size, precision=precision, norm_precision=norm_precision,
                                   precomputed=precomputed, precomputed_format=text_format,
                                   activation_checkpointing=activation_checkpointing, sharded=fsdp != "none",
                                   weight_casts=weight_casts, fp8=fp8)
    parts = fixed_bytes(model_config, precision=precision, precomputed=precomputed, precomputed_format=text_format,
                        use_ema=use_ema, fsdp=fsdp, num_gpus=num_gpus, bucket_view=bucket_view,
                        weight_cast_bytes=activations.weight_cast_bytes, weight_casts=weight_casts)
    tensors = sum(parts.values())
    # With bf16 weight copies, the fp32 gradients are made from the first backward's bf16 ones after
    # it: both exist then, the activations no longer (2 more bytes per parameter, whatever the
    # microbatch). Later microbatches' bf16 gradients are added into the fp32 ones one by one as
    # backward makes them (the step's count holds them as autocast's).
    step_end = tensors + (2 * sum(p.numel() for p in _meta_parts(model_config).denoiser.parameters())
                          if weight_casts == "step" and fsdp == "none" and precision != "fp32" else 0)
    # Weight casts are per microbatch in the activation model too: counted once, in the fixed part.
    activations_without_casts = dataclasses.replace(
        activations, saved_per_microbatch=activations.saved_per_microbatch - activations.weight_cast_bytes,
        peak_per_microbatch=activations.peak_per_microbatch - activations.weight_cast_bytes)
    microbatch = largest_microbatch(tensors, activations_without_casts, gpu_memory_bytes, per_device_batch, reserve)
    if step_end * (1 + reserve) + CUDA_CONTEXT_BYTES > usable_bytes(gpu_memory_bytes):
        microbatch = 0
    fixed = tensors * (1 + reserve) + CUDA_CONTEXT_BYTES
    result = {
        "model_config": model_config, "family": family.name, "image_size": image_size, "precision": precision,
        "norm_precision": norm_precision, "precomputed": precomputed, "precomputed_format": text_format,
        "use_ema": use_ema, "fsdp": fsdp, "num_gpus": num_gpus, "ddp_bucket_view": bucket_view,
        "activation_checkpointing": activation_checkpointing, "weight_casts": weight_casts, "fp8": fp8,
        "gpu_memory_bytes": int(gpu_memory_bytes),
        "headroom_fraction": HEADROOM_FRACTION,
        "usable_bytes": int(usable_bytes(gpu_memory_bytes)),
        "activation_bytes_per_image": int(activations.saved_per_image),
        "activation_bytes_per_microbatch": int(activations_without_casts.saved_per_microbatch),
        "peak_bytes_per_image": int(activations.peak_per_image),
        "peak_bytes_per_microbatch": int(activations_without_casts.peak_per_microbatch),
        "fixed_tensor_bytes": int(tensors),
        "fixed_bytes_breakdown": {k: int(v) for k, v in parts.items()},
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "expandable_segments": expandable_segments,
        "allocator_reserve_fraction": reserve,
        "fixed_bytes": int(fixed),
        "step_end_bytes": int(step_end),
        "microbatch": microbatch,
        "train_flops_per_image": train_flops_per_image(model_config, image_size),
    }
    result["predicted_bytes_at_microbatch"] = predicted_bytes(result, microbatch) if microbatch else None
    return result


def predicted_bytes(plan_result: dict[str, Any], microbatch: int) -> int:
    """GPU memory a step at `microbatch` needs by `plan`'s figures, context and reserve included."""
    tensors = (plan_result["fixed_tensor_bytes"] + plan_result["peak_bytes_per_image"] * microbatch
               + plan_result["peak_bytes_per_microbatch"])
    return int(tensors * (1 + plan_result["allocator_reserve_fraction"]) + plan_result["cuda_context_bytes"])


def auto_microbatch(model_config: str, image_size: int | None, gpu_memory_bytes: float, per_device_batch: int,
                    **options: Any) -> int:
    """benchmark.py's `auto` with several ranks: the plan's microbatch for this per-device batch (at
    least 1: when nothing fits, the run's own OOM says so rather than a refusal here)."""
    return max(1, plan(model_config, image_size, gpu_memory_bytes, per_device_batch=per_device_batch,
                       **options)["microbatch"])


def gib(nbytes: float) -> float:
    """Bytes in GiB, for printing."""
    return nbytes / GIB
