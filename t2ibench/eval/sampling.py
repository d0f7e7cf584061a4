"""Sampling from the model being trained: diffusers' samplers on the denoiser inside the Composer model
(EMA weights swapped in), prompt sets, image grids, and pipeline folders diffusers loads.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler
from PIL import Image

from t2ibench.datasets.buckets import EXPORT_FILE, Bucket, buckets_text
from t2ibench.core.cli import read_text
from t2ibench.families import ModelFamily, Parts
from t2ibench.core.files import write_text

SAMPLERS = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}  # SD2's (families.sd2.SD2.samplers)
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
    """The prompts of a built-in set name or of a text file (one per line, blank lines skipped; read by
    `cli.read_text`, so bounded and a byte-order mark skipped)."""
    if spec in PROMPT_SETS:
        return list(PROMPT_SETS[spec])
    path = Path(spec)
    if not path.exists():  # anything else there is read_text's to refuse, as what it is
        raise ValueError(f"'{spec}' is neither a file nor a built-in prompt set ({', '.join(PROMPT_SETS)})")
    text = read_text(spec, f"--sample_prompts {spec}", "give a text file of prompts, one a line")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{spec} holds no prompts (one per line)")
    return prompts


def make_sampler(name: str, noise_scheduler_config, family: ModelFamily | None = None):
    """The family's sampler `name` (SD2's by default: DDIM or Euler) for the training noise schedule
    (betas and prediction type; for Flux the flow-matching schedule)."""
    samplers = family.samplers if family is not None else SAMPLERS
    if name not in samplers:
        raise ValueError(f"--sampler {name} does not sample this model; choose from {sorted(samplers)}")
    return samplers[name].from_config(noise_scheduler_config)


def _guided(conditioning: dict[str, torch.Tensor], empty: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The empty caption's conditioning stacked before every caption's (one denoiser call for both)."""
    return {key: torch.cat([empty[key].expand_as(value), value]) for key, value in conditioning.items()}


@torch.no_grad()
def sample_latents(family: ModelFamily, denoiser: torch.nn.Module, conditioning: dict[str, torch.Tensor],
                   empty_conditioning: dict[str, torch.Tensor] | None, sampler, num_steps: int,
                   guidance_scale: float, seeds: list[int], latent_shape: tuple[int, int, int]) -> torch.Tensor:
    """Scaled latents (B, C, h, w), one per row of the conditioning, with classifier-free guidance.

    Each image's starting noise is drawn on the CPU from its own generator seeded by `seeds[i]`,
    so an image does not depend on the device, the batch it is in, or the number of ranks.
    `empty_conditioning` (rows of 1) encodes the empty caption; with guidance_scale <= 1 it is unused.
    """
    first = next(iter(conditioning.values()))
    device = first.device
    dtype = next(denoiser.parameters()).dtype
    noise = torch.stack([torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    # Flow matching starts from plain noise and scales no model input (no init_noise_sigma,
    # no scale_model_input); it runs FluxPipeline's schedule, sigma from 1 to 1/steps.
    flow = isinstance(sampler, FlowMatchEulerDiscreteScheduler)
    latents = noise.to(device) * (1.0 if flow else sampler.init_noise_sigma)
    guided = guidance_scale > 1.0 and empty_conditioning is not None
    states = _guided(conditioning, empty_conditioning) if guided else conditioning
    states = {key: value.to(dtype) if value.is_floating_point() else value for key, value in states.items()}
    if flow:
        sampler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps).tolist(), device=device)
    else:
        sampler.set_timesteps(num_steps, device=device)
    for t in sampler.timesteps:
        model_input = torch.cat([latents, latents]) if guided else latents
        if not flow:
            model_input = sampler.scale_model_input(model_input, t)
        output = family.predict(denoiser, model_input.to(dtype), t, states).float()
        if guided:
            uncond, cond = output.chunk(2)
            output = uncond + guidance_scale * (cond - uncond)
        latents = sampler.step(output, t, latents).prev_sample
    return latents


@torch.no_grad()
def decode(vae: torch.nn.Module, latents: torch.Tensor, latent_scale: float, latent_shift: float = 0.0) -> torch.Tensor:
    """uint8 images (B, H, W, 3) on the CPU from latents in the denoiser's space (scaled and shifted)."""
    dtype = next(vae.parameters()).dtype
    images = vae.decode((latents / latent_scale + latent_shift).to(dtype)).sample.float()
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


def write_pipeline(out: str | os.PathLike, family: ModelFamily, parts: Parts, sampler: str | None = None,
                   buckets: tuple[Bucket, ...] = ()) -> None:
    """Save a complete diffusers pipeline folder of `parts` (the family's pipeline class); its
    scheduler is `sampler` (default: the family's first) on the training schedule. With `buckets` (the
    run's --aspect_buckets list), the sizes it trained at go beside it in `EXPORT_FILE`: the pipeline
    itself generates at any height and width on the latent grid (none of its configs pins a size;
    the UNet's sample_size is only the default one), so the file says which ones the model has seen."""
    sampler = sampler or next(iter(family.samplers))
    pipeline = family.make_pipeline(parts, make_sampler(sampler, parts.noise_scheduler.config, family))
    pipeline.save_pretrained(out, safe_serialization=True)
    if buckets:
        write_text(Path(out, EXPORT_FILE), buckets_text(buckets, (
            f"The sizes (height x width, pixels) this {family.pipeline_class} trained at (benchmark.py "
            "--aspect_buckets).\nGenerate at one: pipeline(prompt, height=H, width=W). Read back by "
            "--aspect_buckets FILE.")))
