"""Draw sample grids while training (`--sample_prompts`), left out of the measured time.
What it writes and logs: docs/metrics.md.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, ContextManager, Protocol

import numpy as np
import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.callbacks.throughput import Pauses
from t2ibench.families import ModelFamily, Parts
from t2ibench.train.model import unwrap_model
from t2ibench.eval.sampling import decode, image_grid, make_sampler, sample_latents


class WeightAverage(Protocol):
    """An average of the trained weights that can stand in for them (ema.EMA is one)."""

    initialized: bool  # False until averaging has started (--ema_start)

    def averaged_weights(self, model: torch.nn.Module, prefix: str = "") -> ContextManager[Any]:
        """Swap the averaged weights of `model`'s parameters named `prefix`* in, and back on exit."""


class SampleImages(Callback):
    """Every `interval` (and at the end of training), draw a grid of the prompts and save it.

    The prompts are split over the ranks (prompt i on rank i % world size, each with seed + i), so
    each rank samples its share and no rank waits for more than one share, in denoiser batches no
    larger than the training microbatch (an image does not depend on its batch); rank 0 gathers the
    images, writes `<folder>/<batch>.png` and logs the grid to the loggers (W&B's `samples`).
    With `average` (the run's EMA), once it has started its weights are swapped in while sampling.
    A denoiser sharded by FSDP2 (`--fsdp`) is sampled too (`_draw_sharded_or_not`).

    Args:
        family: the model family (how prompts become conditioning, one denoiser call).
        prompts: the captions to draw.
        folder: where the PNGs go (created by rank 0).
        interval: Composer time string in batches or epochs; None: no grid, only `draw` when asked
            (t2ibench.eval.image_metrics draws the held-out captions with it at each evaluation).
        encoders: the parts used to encode prompts and decode latents (tokenizers, text encoders,
            VAE, latent scale and shift): the model's own, or separately built copies when the
            model trains without them (precomputed).
        height, width: the samples' size in pixels (`--sample_size`; by default --image_size square).
        pauses: where the seconds spent sampling are recorded (the Throughput callback's).
        average: the weight average to sample with once it has started, or None.
        sampler: "ddim" or "euler". num_steps, guidance_scale, seed: as for diffusers pipelines.
    """

    def __init__(self, family: ModelFamily, prompts: list[str], folder: str, interval: str | None, *, encoders: Parts,
                 height: int, width: int, pauses: Pauses, average: WeightAverage | None = None, sampler: str = "ddim",
                 num_steps: int = 50, guidance_scale: float = 7.5, seed: int = 0):
        self.family, self.prompts, self.folder = family, prompts, Path(folder)
        self.interval = Time.from_timestring(interval) if interval else None
        self.encoders, self.pauses, self.average = encoders, pauses, average
        self.height, self.width = height, width
        self.sampler_name, self.num_steps, self.guidance_scale, self.seed = sampler, num_steps, guidance_scale, seed
        self.written: list[Path] = []
        self._last_batch = -1

    def _due(self, state: State, event_unit: TimeUnit) -> bool:
        if self.interval is None or self.interval.unit != event_unit:
            return False
        count = int(state.timestamp.get(event_unit).value)
        return count > 0 and count % int(self.interval.value) == 0

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._due(state, TimeUnit.BATCH):
            self.sample(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._due(state, TimeUnit.EPOCH):
            self.sample(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.interval is not None:
            self.sample(state, logger)  # the final weights, unless just drawn

    def sample(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if batch == self._last_batch:
            return
        self._last_batch = batch
        start = time.perf_counter()
        mine = list(range(dist.get_global_rank(), len(self.prompts), dist.get_world_size()))
        images = self.draw(state, mine)
        gathered = dist.all_gather_object((mine, images)) if dist.get_world_size() > 1 else [(mine, images)]
        if dist.get_global_rank() == 0:
            ordered = [None] * len(self.prompts)
            for indices, arrays in gathered:
                for i, array in zip(indices, arrays):
                    ordered[i] = array
            grid = image_grid(np.stack(ordered))
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{batch}.png"
            grid.save(path)
            self.written.append(path)
            logger.log_images(np.asarray(grid), name="samples", channels_last=True, step=batch)
        self.pauses.record(start, time.perf_counter() - start)

    def draw(self, state: State, mine: list[int]) -> list[np.ndarray]:
        """This rank's images (H, W, 3 uint8) of prompts `mine`, from the model as it is now (the
        average's weights once it has started); every rank calls it at once (a sharded denoiser)."""
        model = unwrap_model(state.model)
        denoiser = model.denoiser
        averaged = (self.average.averaged_weights(model, prefix=f"{model.denoiser_name}.")
                    if self.average is not None and self.average.initialized else contextlib.nullcontext())
        was_training = denoiser.training
        denoiser.eval()
        # The denoiser sees at most the training microbatch at once (guidance doubles each prompt), so
        # sampling fits wherever training did, however many prompts there are. The same number on
        # every rank (a sharded denoiser needs as many batches on each): without a microbatch size,
        # the largest share in one batch.
        micro = int(state.device_train_microbatch_size or -(-len(self.prompts) // dist.get_world_size()))
        per_call = max(1, micro // 2 if self.guidance_scale > 1.0 else micro)
        try:
            with averaged:
                images = self._draw_sharded_or_not(denoiser, model.noise_scheduler, mine, per_call)
        finally:
            denoiser.train(was_training)
        return images

    def _draw_sharded_or_not(self, denoiser: torch.nn.Module, noise_scheduler: Any, indices: list[int],
                             per_call: int) -> list[np.ndarray]:
        """`_draw`, also on a denoiser sharded by FSDP2 (`benchmark.py --fsdp`).

        Sampling needs whole weights, and FSDP2's forward hooks gather each unit's weights from the
        ranks' shards (the average's, when it is swapped into the shards). Two things make that safe.
        Every rank runs as many denoiser forwards as the others, since each gather is a collective:
        a rank whose share is short of the largest (prompts not divisible by the ranks) draws prompt
        0 in its place and drops it, so every rank has as many prompts, hence as many batches of
        `per_call`. And the gathered weights are freed afterwards (`reshard`), because FSDP2 keeps
        the root's, and with reshard_after_forward=False every unit's, until a backward that
        sampling never runs: the next training step would otherwise compute with the weights
        gathered here (the average's).
        """
        from torch.distributed.fsdp import FSDPModule

        sharded = [module for module in denoiser.modules() if isinstance(module, FSDPModule)]
        if not sharded:
            return self._draw(denoiser, noise_scheduler, indices, per_call)
        largest_share = -(-len(self.prompts) // dist.get_world_size())
        try:
            padded = indices + [0] * (largest_share - len(indices))
            return self._draw(denoiser, noise_scheduler, padded, per_call)[:len(indices)]
        finally:
            for module in sharded:
                module.reshard()

    def _draw(self, denoiser: torch.nn.Module, noise_scheduler: Any, indices: list[int],
              per_call: int) -> list[np.ndarray]:
        """The images of prompts `indices`, `per_call` prompts per denoiser batch."""
        if not indices:
            return []
        device = next(denoiser.parameters()).device
        vae = self.encoders.vae
        decoder_device = next(vae.decoder.parameters()).device  # benchmark.py parks it on the host on GPU
        for encoder in self.encoders.text_encoders.values():
            encoder.to(device)
        vae.to(device)
        latent_shape = (vae.config.latent_channels, self.height // self.family.latent_downsample,
                        self.width // self.family.latent_downsample)
        images: list[np.ndarray] = []
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            empty = self._encode([""], device)  # guidance's "no caption", once for every batch
            unconditional = self.family.as_unconditional(empty)
            for start in range(0, len(indices), per_call):
                chunk = indices[start:start + per_call]
                sampler = make_sampler(self.sampler_name, noise_scheduler.config, self.family)  # fresh state per batch
                latents = sample_latents(self.family, denoiser, self._encode([self.prompts[i] for i in chunk], device),
                                         unconditional, sampler, self.num_steps, self.guidance_scale,
                                         [self.seed + i for i in chunk], latent_shape)
                images += [image.numpy() for image in
                           decode(vae, latents, self.encoders.latent_scale, self.encoders.latent_shift)]
        vae.decoder.to(decoder_device)
        if vae.post_quant_conv is not None:  # Flux's VAE has none
            vae.post_quant_conv.to(decoder_device)
        return images

    def _encode(self, captions: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The family's text conditioning of `captions`, on `device`."""
        inputs = self.family.tokenize(self.encoders.tokenizers, captions)
        return self.family.encode_text(self.encoders.text_encoders,
                                       {key: value.to(device) for key, value in inputs.items()})
