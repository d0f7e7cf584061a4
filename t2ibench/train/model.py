"""The training model: a Composer model that trains a family's denoiser on VAE latents, conditioned on
its frozen text encoders' outputs, with the family's objective.

What is specific to a model (the parts, how captions become conditioning, the target) comes from its
family (`families/`); what is here is the step every family shares: images or precomputed latent
distributions to scaled latents, noise drawn in fp32, the caption dropout of classifier-free guidance,
the loss with optional min-SNR-gamma weighting, and its sums by timestep (`LossBins`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from composer.models import ComposerModel

from t2ibench.families import ModelFamily, Parts
from t2ibench.core.images import GEOMETRY_KEYS
from t2ibench.families.objectives import Objective
from t2ibench.eval.validation import NUM_VALIDATION_TIMESTEPS, ValidationLoss, validation_noise, validation_timestep_index


def scale_images(images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pixels (as the loaders yield them) -> `dtype` in [-1, 1]; float input is taken as already scaled.

    Done on the device, after the transfer, so loader workers, pinned memory and the host-to-device
    copy carry one byte per pixel instead of four.
    """
    if images.dtype == torch.uint8:
        return images.to(dtype).div_(127.5).sub_(1.0)
    return images.to(dtype)


def vae_overflows_in(vae: torch.nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether `vae` must run in fp32 rather than `dtype`: SDXL's own VAE overflows in fp16 (inf/NaN
    activations) and its config says so (`force_upcast`, which diffusers' pipelines obey when they
    decode); bf16 has fp32's range. The fp16-fix VAE (madebyollin/sdxl-vae-fp16-fix) says false."""
    return dtype == torch.float16 and bool(getattr(vae.config, "force_upcast", False))


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The training model inside Composer's DDP wrapper (state.model under several ranks)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def count_parameters(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


class DiffusionModel(ComposerModel):
    """Training of `parts.denoiser` (from scratch) with the VAE and text encoders frozen.

    The parts are attributes under their diffusers names (SD2: `unet`, `vae`, `text_encoder`), so
    checkpoint keys are `unet.*`, `vae.*`, `text_encoder.*`. Batches are dicts: `image` (B, 3, H, W)
    uint8 pixels (or float already in [-1, 1]) and the family's token ids (SD2: `captions` (B, 77)),
    or, with encoder outputs precomputed (`latents.py`), `latent_mean` and `latent_logvar` (the VAE
    posterior, before scaling) and either the token ids (the frozen text encoders run in the
    autocast dtype) or the family's conditioning (SD2: `text_states` (B, 77, D); no encoder runs).
    The loss is the MSE between the denoiser's output and the objective's target.

    Training-recipe options (all off by default, and then the step is exactly the plain one):
    `snr_gamma` (min-SNR-gamma loss weighting), `offset_noise` (a per-channel constant added to the
    noise) and caption dropout (`set_caption_dropout`; for a family whose "no caption" is zeros, the
    dropped rows' text conditioning is zeroed after encoding instead). A family with
    micro-conditioning (SDXL) also gets each image's `original_size` and `crop_top_left` from the
    batch in its conditioning. Every step also adds its per-sample errors
    to `loss_bins` sums by timestep (a few element-wise ops on the latents, no host sync).
    """

    def __init__(self, family: ModelFamily, parts: Parts, *, snr_gamma: float | None = None,
                 offset_noise: float = 0.0, num_loss_bins: int = 10, timestep_sampling: str = "uniform",
                 validation_seed: int = 0):
        super().__init__()
        self.family = family
        self.denoiser_name = family.denoiser_name
        self.add_module(family.denoiser_name, parts.denoiser)
        self.vae = parts.vae
        self.text_encoder_names = list(parts.text_encoders)
        for name, encoder in parts.text_encoders.items():
            self.add_module(name, encoder)
        self.objective = family.objective(parts.noise_scheduler, timestep_sampling)
        self.noise_scheduler = self.objective.noise_scheduler
        self.latent_scale, self.latent_shift = parts.latent_scale, parts.latent_shift
        self.vae_channels_last = False  # set with --channels_last: feed the VAE channels-last images
        self.vae_in_fp32 = False  # set under fp16 autocast for a VAE that overflows in fp16 (vae_overflows_in)
        self.cpu_autocast_dtype: torch.dtype | None = None  # set for --precision amp_bf16 on CPU
        self.flops_per_image = 0.0  # set by the benchmark from the family's count
        # A bucketed run's FLOPs of a batch by its bucket (set by the benchmark; None: flops_per_image's).
        self.flops_of_batch: Callable[[dict], float] | None = None
        self.snr_gamma, self.offset_noise = snr_gamma, offset_noise
        self.loss_bins = LossBins(self.objective, num_loss_bins)
        self.validation_seed = validation_seed  # fixes the noise of every held-out sample (t2ibench.eval.validation)
        self.caption_drop_prob = 0.0
        self.empty_text_inputs: dict[str, torch.Tensor] = {}
        self.empty_conditioning: dict[str, torch.Tensor] = {}
        for frozen in self.frozen():
            frozen.requires_grad_(False)
            frozen.eval()

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self, self.denoiser_name)

    @property
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        return {name: getattr(self, name) for name in self.text_encoder_names}

    def parts(self) -> Parts:
        """The model's own parts (for samples and export); tokenizers are not the model's."""
        return Parts(self.denoiser, self.vae, self.text_encoders, {}, self.noise_scheduler, self.latent_scale,
                     self.latent_shift)

    def set_caption_dropout(self, prob: float, empty_text_inputs: dict[str, torch.Tensor] | None = None,
                            empty_conditioning: dict[str, torch.Tensor] | None = None) -> None:
        """Replace each caption by the empty one with probability `prob` (for classifier-free guidance).

        Rows of token-id batches become `empty_text_inputs` (each (1, ...)); rows of stored
        conditioning become `empty_conditioning`, the text encoders' output for the empty caption.
        One draw per sample decides for all of a sample's tensors. The draw uses the global RNG,
        which Composer seeds and checkpoints, so a resumed run drops the same rows.
        """
        self.caption_drop_prob = prob
        # Own dicts: `_drop_captions` replaces their tensors by device copies, not the caller's.
        self.empty_text_inputs, self.empty_conditioning = dict(empty_text_inputs or {}), dict(empty_conditioning or {})

    def train(self, mode: bool = True) -> "DiffusionModel":
        # Composer calls model.train() every epoch: the frozen encoders must stay in eval mode.
        super().train(mode)
        for frozen in self.frozen():
            frozen.eval()
        return self

    def frozen(self) -> list[torch.nn.Module]:
        """The encoders; absent when training on precomputed latents."""
        return [m for m in (self.vae, *self.text_encoders.values()) if m is not None]

    def mark_fsdp_units(self) -> None:
        """Tell Composer's FSDP2 wrapping (its policy for a ComposerModel) to shard the denoiser only,
        one unit per block of the family's `fsdp_blocks`.

        Composer 0.32.1 (`generate_composer_model_policy`) wraps every direct child of the model
        (here the denoiser under `denoiser_name`, the VAE and each text encoder) with `fully_shard`
        unless the child says `_fsdp_wrap = False`; inside a child it asks the child's own
        `fsdp_wrap_fn`. The frozen encoders are therefore marked off: sharded, they would be
        all-gathered on every forward for nothing (they hold no gradients or optimizer state), and
        they stay in the dtype the benchmark stored them in. In the denoiser each block is a unit
        (the rest, embeddings and output layers, is the root unit), so that full_shard gathers one
        block's weights at a time instead of the whole network's.
        """
        for frozen in self.frozen():
            frozen._fsdp_wrap = False
        blocks = set(self.family.fsdp_blocks(self.denoiser))  # modules hash by identity
        self.denoiser.fsdp_wrap_fn = lambda module: module in blocks

    def to_latent_space(self, vae_latents: torch.Tensor) -> torch.Tensor:
        """VAE latents as the denoiser sees them: shifted and scaled to about unit variance."""
        return (vae_latents - self.latent_shift) * self.latent_scale

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Scaled latents sampled from the VAE posterior of uint8 pixels or floats in [-1, 1].

        The images are scaled here, on their device, into the VAE's dtype (the autocast dtype when
        the encoders are stored in it).
        """
        images = scale_images(images, next(self.vae.parameters()).dtype)
        if self.vae_channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        # Autocast would run the convolutions in fp16 whatever the weights' dtype: leave it for the VAE.
        with torch.autocast(images.device.type, enabled=False) if self.vae_in_fp32 else contextlib.nullcontext():
            return self.to_latent_space(self.vae.encode(images).latent_dist.sample())

    @torch.no_grad()
    def encode_text(self, text_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The frozen text encoders' outputs for token ids: what the denoiser is conditioned on."""
        return self.family.encode_text(self.text_encoders, text_inputs)

    def _drop_captions(self, batch: dict) -> dict:
        """The batch with a random subset of its captions replaced by the empty caption."""
        stored = all(key in batch for key in self.family.conditioning_keys)
        keys, empty = ((self.family.conditioning_keys, self.empty_conditioning) if stored
                       else (self.family.text_input_keys, self.empty_text_inputs))
        if not all(key in empty for key in keys):
            raise ValueError(f"caption dropout on {keys} batches needs the empty caption's {keys} (set_caption_dropout)")
        first = batch[keys[0]]
        drop = torch.rand(first.shape[0], device=first.device) < self.caption_drop_prob
        dropped = dict(batch)
        for key in keys:
            rows = batch[key]
            if empty[key].device != rows.device or empty[key].dtype != rows.dtype:
                # Moved (and cast) once and kept there: not a host-to-device copy on every microbatch.
                empty[key] = empty[key].to(device=rows.device, dtype=rows.dtype)
            mask = drop.view(-1, *([1] * (rows.dim() - 1)))
            dropped[key] = torch.where(mask, empty[key], rows)
        return dropped

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cpu_autocast_dtype is not None:
            # Composer autocasts on CUDA only (and refuses AMP on CPU): on CPU the model does it itself.
            with torch.autocast("cpu", dtype=self.cpu_autocast_dtype):
                return self._forward(batch)
        return self._forward(batch)

    def _drop_rows(self, batch: dict) -> torch.Tensor:
        """Which samples lose their caption (B,) bool: one draw per sample from the global RNG."""
        first = next(batch[key] for key in (*self.family.conditioning_keys, *self.family.text_input_keys)
                     if key in batch)
        return torch.rand(first.shape[0], device=first.device) < self.caption_drop_prob

    def _zero_dropped(self, conditioning: dict[str, torch.Tensor], drop: torch.Tensor) -> dict[str, torch.Tensor]:
        """The dropped rows of the text conditioning zeroed (families whose "no caption" is zeros).

        Nothing is copied from the host: the mask is drawn on the batch's device and the fill value
        is a scalar (`drop.to` is a no-op where conditioning and batch share the device, as they do).
        """
        dropped = dict(conditioning)
        for key in self.family.conditioning_keys:
            rows = conditioning[key]
            dropped[key] = rows.masked_fill(drop.to(rows.device).view(-1, *([1] * (rows.dim() - 1))), 0)
        return dropped

    def _forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        drop_to_zeros = None
        if self.caption_drop_prob > 0:
            if self.family.unconditional == "zeros":
                drop_to_zeros = self._drop_rows(batch)  # drawn where the other families draw theirs
            else:
                batch = self._drop_captions(batch)
        latents, conditioning = self.latents_and_conditioning(batch)
        if drop_to_zeros is not None:
            conditioning = self._zero_dropped(conditioning, drop_to_zeros)
        noise = torch.randn(latents.shape, device=latents.device)
        if self.offset_noise:
            # Offset noise: a per-image, per-channel constant lets the model shift mean brightness.
            noise = noise + self.offset_noise * torch.randn(*latents.shape[:2], 1, 1, device=latents.device)
        timesteps = self.objective.sample_timesteps(latents.shape[0], latents.device)
        noisy, target = self.objective.noisy_and_target(latents, noise, timesteps)
        prediction = self.family.predict(self.denoiser, noisy, timesteps, conditioning)
        return prediction, target, timesteps

    def latents_and_conditioning(self, batch: dict, sample_posterior: bool = True
                                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Latents in the denoiser's space (fp32) and the conditioning, from a batch of any form.

        `sample_posterior=False` takes the posterior's mean instead of a draw (the validation loss,
        whose problems must not change between evaluations).
        """
        if "latent_mean" in batch:
            # Sample the stored posterior as the VAE would: mean + std * eps, then shift and scale.
            mean, logvar = batch["latent_mean"].float(), batch["latent_logvar"].float()
            if sample_posterior:
                eps = torch.randn(mean.shape, device=mean.device)
                mean = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps
            latents = self.to_latent_space(mean)
        elif self.vae is None:
            raise ValueError("this model was built without a VAE (--precomputed) but got an image batch")
        elif sample_posterior:
            latents = self.encode_images(batch["image"])
        else:
            with torch.no_grad():
                images = scale_images(batch["image"], next(self.vae.parameters()).dtype)
                latents = self.to_latent_space(self.vae.encode(images).latent_dist.mean)
        if all(key in batch for key in self.family.conditioning_keys):
            conditioning = {key: batch[key].to(latents.dtype) for key in self.family.conditioning_keys}
        elif not self.text_encoder_names:
            raise ValueError("this model was built without text encoders but got token ids (latents "
                             "precomputed without --store_text_states)")
        else:
            conditioning = self.encode_text({key: batch[key] for key in self.family.text_input_keys})
        if self.family.micro_conditioning:  # each image's original size and crop, from the data
            missing = [key for key in GEOMETRY_KEYS if key not in batch]
            if missing:
                raise ValueError(f"this model is conditioned on each image's original size and crop, but the batch "
                                 f"has no {' or '.join(missing)}: build the loader with this model's family")
            conditioning.update({key: batch[key] for key in GEOMETRY_KEYS})
        # Noise is added in fp32 whatever the autocast dtype of the VAE output, and drawn with
        # torch.randn, not randn_like, so the draws do not depend on dtype or memory format.
        return latents.float(), conditioning

    # -- the validation loss (t2ibench.eval.validation): Composer's evaluation calls these ----------------
    def get_metrics(self, is_train: bool = False) -> dict:
        return {} if is_train else {"ValidationLoss": ValidationLoss()}

    def eval_forward(self, batch: dict, outputs: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per held-out sample, the loss at fixed timestep k/8 of the schedule, k = its `sample_index`
        mod 8, with noise fixed by that index: (per-sample errors, k)."""
        if self.cpu_autocast_dtype is not None:
            with torch.autocast("cpu", dtype=self.cpu_autocast_dtype):
                return self._validation_errors(batch)
        return self._validation_errors(batch)

    @torch.no_grad()
    def _validation_errors(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        latents, conditioning = self.latents_and_conditioning(batch, sample_posterior=False)
        index = batch["sample_index"]
        k = validation_timestep_index(index).to(latents.device)
        timesteps = self.objective.fixed_timesteps(k, NUM_VALIDATION_TIMESTEPS)
        noise = validation_noise(index, latents.shape[1:], self.validation_seed).to(latents.device)
        noisy, target = self.objective.noisy_and_target(latents, noise, timesteps)
        prediction = self.family.predict(self.denoiser, noisy, timesteps, conditioning)
        return (prediction.float() - target.float()).pow(2).flatten(1).mean(1), k

    def update_metric(self, batch: dict, outputs: tuple[torch.Tensor, torch.Tensor], metric) -> None:
        metric.update(*outputs)

    def flops_per_batch(self, batch: dict) -> float:
        """Model FLOPs of one training step on `batch` (read by Composer's SpeedMonitor for MFU)."""
        if self.flops_of_batch is not None:
            return self.flops_of_batch(batch)
        key = "latent_mean" if "latent_mean" in batch else "image"
        return self.flops_per_image * batch[key].shape[0]

    def loss(self, outputs: tuple[torch.Tensor, ...], batch: dict) -> torch.Tensor:
        prediction, target, timesteps = outputs
        # Per-sample squared error, computed once: the loss, and (detached) the loss-by-timestep bins.
        errors = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
        self.loss_bins.add(errors.detach(), timesteps)
        if self.snr_gamma is None:
            return errors.mean()  # every sample has the same size: the plain MSE
        return (errors * self.objective.loss_weights(timesteps, self.snr_gamma)).mean()


class LossBins:
    """Running sums of the training loss per bin of timesteps (which noise levels lag).

    Kept on the loss's device and never synchronized during the step; `take()` reads and resets
    the sums of one logging window (`callbacks.loss_by_timestep.LossByTimestep` logs them and keeps
    the run's total).
    """

    def __init__(self, objective: Objective, num_bins: int):
        if num_bins > objective.num_timesteps:  # benchmark.py refuses --loss_bins above the timesteps first
            raise ValueError(f"{num_bins} loss bins for {objective.num_timesteps} timesteps: "
                             "some bins would stay empty")
        self.objective, self.num_timesteps, self.num_bins = objective, objective.num_timesteps, num_bins
        self.window: torch.Tensor | None = None  # (2, bins): loss sums, counts

    def edges(self) -> list[tuple[int, int]]:
        """[first, last] timestep of each bin: exactly the timesteps `add` puts there.

        Every objective bins a timestep t by its integer part n = floor(t) (the DDPM's t is one already)
        into bin floor(n * bins / timesteps) (`Objective.bin_index`), so bin i starts at
        ceil(i * timesteps / bins), computed in integers; a continuous t (rectified flow) is in bin i
        when first <= t < last + 1.
        """
        first = [-(-i * self.num_timesteps // self.num_bins) for i in range(self.num_bins + 1)]
        return [(first[i], first[i + 1] - 1) for i in range(self.num_bins)]

    def add(self, per_sample_loss: torch.Tensor, timesteps: torch.Tensor) -> None:
        if self.num_bins <= 0:
            return
        if self.window is None or self.window.device != per_sample_loss.device:
            self.window = torch.zeros(2, self.num_bins, dtype=torch.float64, device=per_sample_loss.device)
        index = self.objective.bin_index(timesteps, self.num_bins)
        self.window[0].index_add_(0, index, per_sample_loss.double())
        self.window[1].index_add_(0, index, torch.ones_like(per_sample_loss, dtype=torch.float64))

    def take(self) -> torch.Tensor | None:
        """The window's (2, bins) sums (None if nothing was added), and a fresh window."""
        window, self.window = self.window, None
        return window

    def kept(self) -> torch.Tensor | None:
        """A copy of the window's sums (None if nothing was added), to `restore` if a batch runs again."""
        return None if self.window is None else self.window.clone()

    def restore(self, kept: torch.Tensor | None) -> None:
        """The window as `kept` held it: a batch run again adds its samples once."""
        self.window = None if kept is None else kept.clone()

