"""The step the memory model measures, on the meta device: the training model built as benchmark.py
builds it, a batch of the loaders' shapes, and one counted forward, loss and backward (`count_step`)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from t2ibench.train import fp8 as float8
from t2ibench.families import family_of
from t2ibench.core.images import GEOMETRY_KEYS, image_shape
from t2ibench.memory.autocast import CUDA_AUTOCAST, AutocastPolicy, AutocastRules, autocast_dtype
from t2ibench.memory.saved import LiveBytes, SavedForBackward, storage_key
from t2ibench.train.model import DiffusionModel
from t2ibench.datasets.precomputed import TEXT_STATES, batch_text_format

COUNTED_MICROBATCHES = (2, 4)  # the step is counted at these sizes; bytes are linear in the size from 2 on


@dataclasses.dataclass
class StepCount:
    """One forward and backward at one microbatch size, in bytes above the weights, buffers and
    gradients that exist before it (meta device, nothing allocated)."""

    microbatch: int
    saved_bytes: int  # everything saved for backward (parameters' own storages excluded)
    weight_cast_bytes: int  # of which: autocast's cached weight casts
    forward_peak_bytes: int  # peak of storages created during forward and loss (encoders' transients included)
    after_forward_bytes: int  # alive when backward starts: saved tensors, outputs, loss
    backward_peak_bytes: int  # peak from the start of forward to the end of backward (existing gradients aside)


def build_meta_model(model_config: str, *, precomputed: bool = False, precomputed_format: str | None = None,
                     frozen_dtype: torch.dtype | None = None,
                     denoiser_dtype: torch.dtype | None = None) -> DiffusionModel:
    """The training model with every part on the meta device, built as benchmark.py builds it: no VAE
    on precomputed latents, no text encoders on stored text states, the frozen parts in
    `frozen_dtype` (the autocast dtype under AMP). `denoiser_dtype`: the trained parameters' dtype
    as the forward sees them (FSDP's mixed precision gathers them in the autocast dtype)."""
    family = family_of(model_config)
    text_format = batch_text_format(family, precomputed, precomputed_format)
    parts = family.meta_parts(model_config)
    if precomputed:
        parts.vae = None
        if text_format == TEXT_STATES:
            parts.text_encoders = {}
    model = DiffusionModel(family, parts, num_loss_bins=0)
    if frozen_dtype is not None:
        for frozen in model.frozen():
            frozen.to(frozen_dtype)
    if denoiser_dtype is not None:
        model.denoiser.to(denoiser_dtype)
    return model


def meta_batch(model: DiffusionModel, model_config: str, image_size: int | tuple[int, int], microbatch: int,
               device: str = "meta") -> dict[str, torch.Tensor]:
    """A batch of the shapes and dtypes the loaders yield for this model (data.py): uint8 images and
    int64 token ids online; fp16 latent moments with the token ids or the fp16 stored conditioning
    on precomputed latents; with micro-conditioning (SDXL) each image's int64 size and crop.
    `image_size`: a square's side, or (height, width) of an aspect-ratio bucket."""
    family = model.family
    height, width = image_shape(image_size)
    batch: dict[str, torch.Tensor] = {}
    if model.vae is not None:
        batch["image"] = torch.zeros(microbatch, 3, height, width, dtype=torch.uint8, device=device)
    else:
        shape = (microbatch, family.latent_channels(model_config), height // family.latent_downsample,
                 width // family.latent_downsample)
        batch["latent_mean"] = torch.zeros(shape, dtype=torch.float16, device=device)
        batch["latent_logvar"] = torch.zeros(shape, dtype=torch.float16, device=device)
    if model.text_encoder_names:
        for key, shape in family.text_input_shapes(model_config).items():
            batch[key] = torch.zeros(microbatch, *shape, dtype=torch.long, device=device)
    else:
        for key, shape in family.conditioning_shapes(model_config).items():
            batch[key] = torch.zeros(microbatch, *shape, dtype=torch.float16, device=device)
    if family.micro_conditioning:
        for key in GEOMETRY_KEYS:
            batch[key] = torch.full((microbatch, 2), height, dtype=torch.long, device=device)
    return batch


@functools.lru_cache(maxsize=None)
def linear_rows_per_sample(model_config: str, image_size: int, text_format: str | None) -> dict[str, int]:
    """Rows of input each Linear layer of the denoiser sees per sample in the training step (its
    tokens; 1 for a layer applied once per sample), by module name, read off one forward on the meta
    device (`text_format`: None online, else the precomputed format). t2ibench.train.fp8 converts by them."""
    model = build_meta_model(model_config, precomputed=text_format is not None, precomputed_format=text_format)
    microbatch, rows = COUNTED_MICROBATCHES[0], {}

    def record(name: str) -> Callable[..., None]:
        return lambda module, inputs, output: rows.__setitem__(name, inputs[0].numel() // inputs[0].shape[-1]
                                                               // microbatch)

    handles = [module.register_forward_hook(record(name)) for name, module in model.denoiser.named_modules()
               if isinstance(module, torch.nn.Linear)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(meta_batch(model, model_config, image_size, microbatch))
    finally:
        for handle in handles:
            handle.remove()
    return rows


def use_float8(model: DiffusionModel, mode: str, rows_per_sample: dict[str, int], dtype: torch.dtype | None,
               device_type: str = "cuda") -> float8.Conversion:
    """Convert the denoiser's Linear layers as benchmark.py's --fp8 does (`fp8.convert`; emulated for a
    CPU count, `torch._scaled_mm`'s meta kernel for CUDA), each converted layer's input cast to the
    autocast dtype as its forward does under real autocast (which the meta device does not enter)."""
    conversion = float8.convert(model.denoiser, mode, rows_per_sample, emulate=device_type != "cuda")
    if dtype is not None:
        modules = dict(model.denoiser.named_modules())
        for name in conversion.converted:
            modules[name].register_forward_pre_hook(
                lambda module, args: tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                                           else a for a in args))
    return conversion


@dataclasses.dataclass
class MetaStep:
    """A training step ready to run on the meta device: the model as the run builds it, and the
    autocast rules it computes under (the policy with the run's norm precision, the dtype)."""

    model: DiffusionModel
    model_config: str
    image_size: int
    policy: AutocastPolicy
    dtype: torch.dtype | None
    device_type: str

    def batch(self, microbatch: int) -> dict[str, torch.Tensor]:
        """A meta batch of `microbatch` images of this step's shapes and dtypes."""
        return meta_batch(self.model, self.model_config, self.image_size, microbatch)

    def rules(self) -> AutocastRules:
        """Fresh autocast rules for one step (a new context: an empty weight-cast cache)."""
        return AutocastRules(self.policy, self.dtype, self.device_type)


def build_meta_step(model_config: str, image_size: int, *, precision: str, norm_precision: str,
                    text_format: str | None, activation_checkpointing: bool = False,
                    low_precision_weights: bool = False, policy: AutocastPolicy = CUDA_AUTOCAST,
                    device_type: str = "cuda", fp8: str = "off") -> MetaStep:
    """The step a run with these settings takes, on the meta device, in training mode: the frozen
    parts in the autocast dtype; `low_precision_weights`: the denoiser's too, as the forward sees
    them under FSDP's mixed precision or t2ibench.train.weight_casts' copies; `fp8` and
    `activation_checkpointing` applied as benchmark.py applies them. `text_format`: None online,
    else the precomputed format. The memory count and the kernel count (t2ibench.memory.kernels) share it."""
    dtype = autocast_dtype(precision)
    policy = policy.with_norms(norm_precision)
    model = build_meta_model(model_config, precomputed=text_format is not None, precomputed_format=text_format,
                             frozen_dtype=dtype, denoiser_dtype=dtype if low_precision_weights else None)
    if fp8 != "off":
        use_float8(model, fp8, linear_rows_per_sample(model_config, image_size, text_format), dtype, device_type)
    if activation_checkpointing:
        use_checkpointing(model, policy, dtype, device_type)
    model.train()
    return MetaStep(model, model_config, image_size, policy, dtype, device_type)


def use_checkpointing(model: DiffusionModel, policy: AutocastPolicy, dtype: torch.dtype | None,
                      device_type: str = "cuda") -> None:
    """Turn on the denoiser's gradient checkpointing as benchmark.py's --activation_checkpointing does
    (diffusers' `enable_gradient_checkpointing`: non-reentrant `torch.utils.checkpoint` per block),
    with the recomputation under a fresh `AutocastRules`: torch re-enters real autocast there, which
    the meta device ignores, and a fresh context starts with an empty weight-cast cache. What the
    checkpoint also keeps per block, the RNG states it replays dropout with, are host tensors (CPU
    and CUDA generator states alike) and not counted."""

    def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), AutocastRules(policy, dtype, device_type)

    def checkpoint_block(block: Callable[..., Any], *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False,
                                                 context_fn=recompute_contexts)

    model.denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_block)


def count_step(model: DiffusionModel, batch: dict[str, torch.Tensor], policy: AutocastPolicy | None,
               dtype: torch.dtype | None, device_type: str = "cuda") -> StepCount:
    """Count one forward, loss and backward of `model` on `batch` (the method: docs/gpu-runs.md)."""
    params = [p for p in model.parameters()]
    # Gradient accumulation's steady state: the gradients exist before backward (they are fixed
    # bytes) and backward adds into them. The first microbatch of a step, which creates them while
    # the activations are being freed, peaks lower.
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    exclude = {storage_key(t) for t in [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None)]}
    rules = AutocastRules(policy or CUDA_AUTOCAST, dtype, device_type)
    live = LiveBytes()
    with live:
        with SavedForBackward(exclude) as saved, rules:
            loss = model.loss(model(batch), batch)
        forward_peak = live.peak_bytes
        saved_bytes, cast_bytes = saved.bytes(), saved.bytes(rules.weight_cast_keys())
        # Autocast empties its cast cache when its context exits (casts of biases, not saved, go),
        # and the counter's own references must not keep saved tensors alive through backward.
        rules.weight_casts.clear()
        saved.storages.clear()
        after_forward = live.live_bytes
        loss.backward()
        del loss
        backward_peak = live.peak_bytes
    for p in params:
        p.grad = None
    return StepCount(_batch_size(batch), saved_bytes, cast_bytes, forward_peak, after_forward, backward_peak)


def _batch_size(batch: dict[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])
