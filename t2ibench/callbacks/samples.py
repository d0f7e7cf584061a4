"""Sample grids while training (`benchmark.py --sample_prompts ...`).

Every `--sample_interval` and at the end, `<folder>/<batch>.png` (one image per prompt, uint8 RGB
at the training resolution, in a grid) and, to the loggers, the image `samples` at step `batch`.
The seconds spent sampling are recorded in the run's `Pauses`, so images/s leaves them out.
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
from t2ibench.model import unwrap_model
from t2ibench.sampling import decode, image_grid, make_sampler, sample_latents


class WeightAverage(Protocol):
    """An average of the trained weights that can stand in for them (ema.EMA is one)."""

    initialized: bool  # False until averaging has started (--ema_start)

    def averaged_weights(self, model: torch.nn.Module, prefix: str = "") -> ContextManager[Any]:
        """Swap the averaged weights of `model`'s parameters named `prefix`* in, and back on exit."""


class SampleImages(Callback):
    """Every `interval` (and at the end of training), draw a grid of the prompts and save it.

    The prompts are split over the ranks (prompt i on rank i % world size, each with seed + i), so
    each rank samples its share and no rank waits for more than one share; rank 0 gathers the
    images, writes `<folder>/<batch>.png` and logs the grid to the loggers (W&B's `samples`).
    With `average` (the run's EMA), once it has started its weights are swapped in while sampling.

    Args:
        family: the model family (how prompts become conditioning, one denoiser call).
        prompts: the captions to draw.
        folder: where the PNGs go (created by rank 0).
        interval: Composer time string in batches or epochs.
        encoders: the parts used to encode prompts and decode latents (tokenizers, text encoders,
            VAE, latent scale and shift): the model's own, or separately built copies when the
            model trains without them (precomputed).
        image_size: pixels.
        pauses: where the seconds spent sampling are recorded (the Throughput callback's).
        average: the weight average to sample with once it has started, or None.
        sampler: "ddim" or "euler". num_steps, guidance_scale, seed: as for diffusers pipelines.
    """

    def __init__(self, family: ModelFamily, prompts: list[str], folder: str, interval: str, *, encoders: Parts,
                 image_size: int, pauses: Pauses, average: WeightAverage | None = None, sampler: str = "ddim",
                 num_steps: int = 50, guidance_scale: float = 7.5, seed: int = 0):
        self.family, self.prompts, self.folder = family, prompts, Path(folder)
        self.interval = Time.from_timestring(interval)
        self.encoders, self.image_size, self.pauses, self.average = encoders, image_size, pauses, average
        self.sampler_name, self.num_steps, self.guidance_scale, self.seed = sampler, num_steps, guidance_scale, seed
        self.written: list[Path] = []
        self._last_batch = -1

    def _due(self, state: State, event_unit: TimeUnit) -> bool:
        if self.interval.unit != event_unit:
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
        self.sample(state, logger)  # the final weights, unless just drawn

    def sample(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if batch == self._last_batch:
            return
        self._last_batch = batch
        start = time.perf_counter()
        model = unwrap_model(state.model)
        denoiser = model.denoiser
        mine = list(range(dist.get_global_rank(), len(self.prompts), dist.get_world_size()))
        averaged = (self.average.averaged_weights(model, prefix=f"{model.denoiser_name}.")
                    if self.average is not None and self.average.initialized else contextlib.nullcontext())
        was_training = denoiser.training
        denoiser.eval()
        try:
            with averaged:
                images = self._draw(denoiser, model.noise_scheduler, mine)
        finally:
            denoiser.train(was_training)
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

    def _draw(self, denoiser: torch.nn.Module, noise_scheduler: Any, indices: list[int]) -> list[np.ndarray]:
        if not indices:
            return []
        device = next(denoiser.parameters()).device
        vae = self.encoders.vae
        decoder_device = next(vae.decoder.parameters()).device  # benchmark.py parks it on the host on GPU
        for encoder in self.encoders.text_encoders.values():
            encoder.to(device)
        vae.to(device)
        inputs = self.family.tokenize(self.encoders.tokenizers, [self.prompts[i] for i in indices] + [""])
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            states = self.family.encode_text(self.encoders.text_encoders,
                                             {key: value.to(device) for key, value in inputs.items()})
            sampler = make_sampler(self.sampler_name, noise_scheduler.config, self.family)
            size = self.image_size // self.family.latent_downsample
            latents = sample_latents(self.family, denoiser, {k: v[:-1] for k, v in states.items()},
                                     self.family.as_unconditional({k: v[-1:] for k, v in states.items()}),
                                     sampler, self.num_steps,
                                     self.guidance_scale, [self.seed + i for i in indices],
                                     (vae.config.latent_channels, size, size))
            images = decode(vae, latents, self.encoders.latent_scale, self.encoders.latent_shift)
        vae.decoder.to(decoder_device)
        if vae.post_quant_conv is not None:  # Flux's VAE has none
            vae.post_quant_conv.to(decoder_device)
        return [image.numpy() for image in images]
