"""Sampling from the model being trained: diffusers samplers, prompt sets, image grids, and the
callback that writes `samples/<batch>.png` while training (`benchmark.py --sample_prompts ...`).

The sampler is diffusers' own (DDIM or Euler, built from the training noise schedule's config);
only the loop around it is written here, because it must run on the UNet inside the Composer model
(with the EMA weights swapped in) rather than through a pipeline that would own copies of the parts.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from diffusers import DDIMScheduler, EulerDiscreteScheduler
from PIL import Image

from tokenizer import tokenize

SAMPLERS = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}
# Classifier-free guidance scales in use are 1-20; far above, the guided prediction leaves the range
# the sampler can follow and the images saturate to black or white (inf: all black).
MAX_GUIDANCE_SCALE = 100.0

# Built-in prompt sets (`--sample_prompts NAME`); a path to a text file gives one prompt per line.
PROMPT_SETS = {
    "default": [
        "a photograph of an astronaut riding a horse",
        "a red apple on a wooden table",
        "a mountain lake at sunrise, oil painting",
        "a city street at night in the rain",
        "a portrait of a cat wearing a hat",
        "a bowl of fruit, still life",
        "a lighthouse on a cliff during a storm",
        "an empty beach with palm trees",
    ],
    "shapes": ["a red square", "a blue circle", "a green triangle", "a yellow square",
               "a red circle", "a blue triangle", "a green square", "a yellow circle"],
}


def load_prompts(spec: str) -> list[str]:
    """The prompts of a built-in set name or of a text file (one per line, blank lines skipped)."""
    if spec in PROMPT_SETS:
        return list(PROMPT_SETS[spec])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"'{spec}' is neither a file nor a built-in prompt set ({', '.join(PROMPT_SETS)})")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{spec} holds no prompts (one per line)")
    return prompts


def make_sampler(name: str, noise_scheduler_config) -> DDIMScheduler | EulerDiscreteScheduler:
    """diffusers' DDIM or Euler sampler for the training noise schedule (betas, prediction type)."""
    return SAMPLERS[name].from_config(noise_scheduler_config)


@torch.no_grad()
def sample_latents(unet: torch.nn.Module, text_states: torch.Tensor, empty_states: torch.Tensor | None,
                   sampler, num_steps: int, guidance_scale: float, seeds: list[int],
                   latent_shape: tuple[int, int, int]) -> torch.Tensor:
    """Scaled latents (B, C, h, w) for each row of `text_states`, with classifier-free guidance.

    Each image's starting noise is drawn on the CPU from its own generator seeded by `seeds[i]`,
    so an image does not depend on the device, the batch it is in, or the number of ranks.
    `empty_states` (1, 77, D) is the empty caption's encoding; with guidance_scale <= 1 it is unused.
    """
    device = text_states.device
    dtype = next(unet.parameters()).dtype
    noise = torch.stack([torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    latents = noise.to(device) * sampler.init_noise_sigma
    guided = guidance_scale > 1.0 and empty_states is not None
    states = text_states
    if guided:
        states = torch.cat([empty_states.expand_as(text_states), text_states])
    sampler.set_timesteps(num_steps, device=device)
    for t in sampler.timesteps:
        model_input = torch.cat([latents, latents]) if guided else latents
        model_input = sampler.scale_model_input(model_input, t)
        output = unet(model_input.to(dtype), t, states.to(dtype)).sample.float()
        if guided:
            uncond, cond = output.chunk(2)
            output = uncond + guidance_scale * (cond - uncond)
        latents = sampler.step(output, t, latents).prev_sample
    return latents


@torch.no_grad()
def decode(vae: torch.nn.Module, latents: torch.Tensor, latent_scale: float) -> torch.Tensor:
    """uint8 images (B, H, W, 3) on the CPU from scaled latents."""
    dtype = next(vae.parameters()).dtype
    images = vae.decode((latents / latent_scale).to(dtype)).sample.float()
    return ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def image_grid(images: np.ndarray, columns: int | None = None) -> Image.Image:
    """One PIL image of (N, H, W, 3) uint8 images, in rows of `columns` (default: about square)."""
    n, h, w, _ = images.shape
    columns = columns or int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / columns))
    grid = np.full((rows * h, columns * w, 3), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = image
    return Image.fromarray(grid)


class SampleImages(Callback):
    """Every `interval` (and at the end of training), draw a grid of the prompts and save it.

    The prompts are split over the ranks (prompt i on rank i % world size, each with seed + i), so
    each rank samples its share and no rank waits for more than one share, in UNet batches no larger
    than the training microbatch (an image does not depend on its batch); rank 0 gathers the
    images, writes `<folder>/<batch>.png` and logs the grid to the loggers (W&B's `samples`).
    With an EMA algorithm in the run, its averaged weights are swapped in while sampling.

    Sampling time is recorded in `pauses` as (perf_counter at start, seconds): the Throughput
    callback subtracts the pauses that fall inside its measured window.

    Args:
        prompts: the captions to draw.
        folder: where the PNGs go (created by rank 0).
        interval: Composer time string in batches or epochs.
        tokenizer, text_encoder, vae: the parts used to encode prompts and decode latents; pass the
            model's own, or separately built copies when the model trains without them (precomputed).
        latent_scale: the VAE's scaling factor. image_size: pixels.
        sampler: "ddim" or "euler". num_steps, guidance_scale, seed: as for diffusers pipelines.
    """

    def __init__(self, prompts: list[str], folder: str, interval: str, *, tokenizer, text_encoder: torch.nn.Module,
                 vae: torch.nn.Module, latent_scale: float, image_size: int, sampler: str = "ddim",
                 num_steps: int = 50, guidance_scale: float = 7.5, seed: int = 0):
        self.prompts, self.folder = prompts, Path(folder)
        self.interval = Time.from_timestring(interval)
        self.tokenizer, self.text_encoder, self.vae = tokenizer, text_encoder, vae
        self.latent_scale, self.image_size = latent_scale, image_size
        self.sampler_name, self.num_steps, self.guidance_scale, self.seed = sampler, num_steps, guidance_scale, seed
        self.pauses: list[tuple[float, float]] = []
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
        model = state.model.module if isinstance(state.model, torch.nn.parallel.DistributedDataParallel) else state.model
        ema = next((a for a in state.algorithms if hasattr(a, "averaged_weights") and getattr(a, "initialized", False)),
                   None)
        mine = list(range(dist.get_global_rank(), len(self.prompts), dist.get_world_size()))
        was_training = model.unet.training
        model.unet.eval()
        try:
            if ema is not None:
                with ema.averaged_weights(model, prefix="unet."):
                    images = self._draw_sharded_or_not(model.unet, mine, state)
            else:
                images = self._draw_sharded_or_not(model.unet, mine, state)
        finally:
            model.unet.train(was_training)
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
        self.pauses.append((start, time.perf_counter() - start))

    def _draw_sharded_or_not(self, unet: torch.nn.Module, indices: list[int], state: State) -> list[np.ndarray]:
        """`_draw`, also on a UNet sharded by FSDP2 (`benchmark.py --fsdp`).

        Sampling needs whole weights, and FSDP2's forward hooks gather each block's weights from
        the ranks' shards (the EMA's, when it is swapped into the shards). Two things make that
        safe: every rank runs as many UNet forwards as the others (a rank without a prompt of its
        own draws prompt 0, and drops it), since each gather is a collective; and the gathered
        weights are freed afterwards (`reshard`), because FSDP2 keeps the root's, and with
        reshard_after_forward=False every block's, until a backward that sampling never runs: the
        next training step would otherwise compute with the weights gathered here (the EMA's).
        """
        from torch.distributed.fsdp import FSDPModule
        sharded = [m for m in unet.modules() if isinstance(m, FSDPModule)]
        if not sharded:
            return self._draw(unet, indices, state)
        try:
            return self._draw(unet, indices or [0], state)[:len(indices)]
        finally:
            for module in sharded:
                module.reshard()

    def _draw(self, unet: torch.nn.Module, indices: list[int], state: State) -> list[np.ndarray]:
        if not indices:
            return []
        device = next(unet.parameters()).device
        decoder_device = next(self.vae.decoder.parameters()).device  # benchmark.py parks it on the host on GPU
        self.text_encoder.to(device)
        self.vae.to(device)
        # The UNet sees at most the training microbatch at once (guidance doubles each prompt), so
        # sampling fits wherever training did, however many prompts there are.
        micro = int(state.device_train_microbatch_size or len(indices))
        per_call = max(1, micro // 2 if self.guidance_scale > 1.0 else micro)
        images = []
        size = self.image_size // 8
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for start in range(0, len(indices), per_call):
                chunk = indices[start:start + per_call]
                ids = tokenize(self.tokenizer, [self.prompts[i] for i in chunk] + [""]).to(device)
                states = self.text_encoder(ids)[0]
                sampler = make_sampler(self.sampler_name, _unwrap_scheduler(state).config)
                latents = sample_latents(unet, states[:-1], states[-1:], sampler, self.num_steps, self.guidance_scale,
                                         [self.seed + i for i in chunk], (unet.config.in_channels, size, size))
                images += [image.numpy() for image in decode(self.vae, latents, self.latent_scale)]
        self.vae.decoder.to(decoder_device)
        self.vae.post_quant_conv.to(decoder_device)
        return images


def _unwrap_scheduler(state: State):
    model = state.model.module if isinstance(state.model, torch.nn.parallel.DistributedDataParallel) else state.model
    return model.noise_scheduler
