"""Stable Diffusion 2 base as a Composer model: UNet trained from scratch, VAE and text encoder frozen.

The architecture is defined here as plain config dicts (`sd2-base` mirrors the diffusers /
transformers configs of stabilityai/stable-diffusion-2-base; `tiny` keeps its structure at a few
million parameters for CPUs and tests), so the model builds offline. Pretrained VAE, text encoder
and tokenizer come from `--model_name` when that folder or cached hub id is available.
"""
from __future__ import annotations

import copy
import os
import zlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from tokenizer import bundled_tokenizer

_CROSS_DOWN = ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"]
_CROSS_UP = ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3

SD2_BASE = {
    "unet": dict(
        sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280),
        layers_per_block=2, attention_head_dim=(5, 10, 20, 20), cross_attention_dim=1024,
        use_linear_projection=True, down_block_types=_CROSS_DOWN, up_block_types=_CROSS_UP,
        norm_num_groups=32, act_fn="silu", flip_sin_to_cos=True, freq_shift=0,
    ),
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        norm_num_groups=32, act_fn="silu", sample_size=512,
    ),
    "text_encoder": dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
        hidden_act="gelu", vocab_size=49408, max_position_embeddings=77, projection_dim=512,
    ),
}

TINY = {
    "unet": dict(
        SD2_BASE["unet"], sample_size=8, block_out_channels=(32, 64, 64, 64), layers_per_block=1,
        attention_head_dim=(2, 4, 4, 4), cross_attention_dim=64, norm_num_groups=16,
    ),
    "vae": dict(SD2_BASE["vae"], block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=64),
    "text_encoder": dict(
        SD2_BASE["text_encoder"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        projection_dim=64,
    ),
}

MODEL_CONFIGS = {"sd2-base": SD2_BASE, "tiny": TINY}

# The DDPM training schedule of SD2 base (1000 steps, scaled_linear betas 0.00085..0.012).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    prediction_type="epsilon", clip_sample=False, steps_offset=1,
)
LATENT_SCALE = 0.18215  # SD2's VAE scaling_factor: latents * 0.18215 have roughly unit variance


def scale_images(images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pixels (as the loaders yield them) -> `dtype` in [-1, 1]; float input is taken as already scaled.

    Done on the device, after the transfer, so loader workers, pinned memory and the host-to-device
    copy carry one byte per pixel instead of four.
    """
    if images.dtype == torch.uint8:
        return images.to(dtype).div_(127.5).sub_(1.0)
    return images.to(dtype)


@dataclass
class Components:
    """The parts of Stable Diffusion, plus what was loaded pretrained and what was not."""

    unet: UNet2DConditionModel | None
    vae: AutoencoderKL | None
    text_encoder: CLIPTextModel | None
    tokenizer: CLIPTokenizer | None
    noise_scheduler: DDPMScheduler
    pretrained: list[str] = field(default_factory=list)
    random: list[str] = field(default_factory=list)


def _load_pretrained(cls, model_name: str | None, subfolder: str):
    """`cls.from_pretrained(model_name, subfolder)`, or None when unavailable offline.

    A local folder is read directly. A hub id is looked up in the local hub cache first and only
    downloaded when HF_HUB_OFFLINE is not set, so that runs on air-gapped clusters do not hang.
    """
    if not model_name:
        return None
    attempts = [dict(local_files_only=True)]
    if not Path(model_name).is_dir() and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        attempts.append(dict(local_files_only=False))
    for kwargs in attempts:
        try:
            return cls.from_pretrained(model_name, subfolder=subfolder, **kwargs)
        except Exception:  # noqa: BLE001 - missing files, no network, bad repo: all mean "not available"
            continue
    return None


def build_components(model_config: str, model_name: str | None = None, *, with_unet: bool = True,
                     with_encoders: bool = True, with_vae: bool | None = None,
                     with_text_encoder: bool | None = None, with_tokenizer: bool | None = None) -> Components:
    """Build SD2's parts: a random UNet from `model_config`, frozen VAE/text encoder (pretrained if found).

    `model_name` (hub id or local diffusers folder) is only consulted for `sd2-base`: there are no
    pretrained weights of the `tiny` shapes. `with_encoders=False` (training on precomputed
    latents) skips the VAE, text encoder and tokenizer; `with_vae`, `with_text_encoder` and
    `with_tokenizer` override it part by part (latents stored with token ids: the text encoder runs
    in training, the VAE does not). Each randomly initialized part is drawn from its own generator,
    seeded from the global seed and the part's name, so a part is the same whatever else is built
    (the text encoder of `latents.py` and of a training run on its tokens, for one).
    """
    if model_config not in MODEL_CONFIGS:
        raise ValueError(f"--model_config: unknown '{model_config}', choose from {sorted(MODEL_CONFIGS)}")
    cfg = MODEL_CONFIGS[model_config]
    lookup = model_name if model_config == "sd2-base" else None
    pretrained, random = [], []

    def part(name: str, cls, build):
        module = _load_pretrained(cls, lookup, name)
        (pretrained if module is not None else random).append(name)
        if module is not None:
            return module
        with torch.random.fork_rng(devices=[]):  # leaves the global generator as it was
            torch.manual_seed((torch.initial_seed() + zlib.crc32(name.encode())) % 2**63)
            return build()

    vae = text_encoder = tokenizer = unet = None
    if with_encoders if with_vae is None else with_vae:
        vae = part("vae", AutoencoderKL, lambda: AutoencoderKL(**cfg["vae"]))
    if with_encoders if with_text_encoder is None else with_text_encoder:
        text_encoder = part("text_encoder", CLIPTextModel, lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])))
    if with_encoders if with_tokenizer is None else with_tokenizer:
        tokenizer = part("tokenizer", CLIPTokenizer, bundled_tokenizer)
        if "tokenizer" in random:  # the bundled tokenizer is SD2's own: not a random part
            random.remove("tokenizer")
    scheduler = _load_pretrained(DDPMScheduler, lookup, "scheduler") or DDPMScheduler(**SCHEDULER_CONFIG)
    if with_unet:
        unet = UNet2DConditionModel(**cfg["unet"])  # always from scratch: that is the benchmark
    return Components(unet, vae, text_encoder, tokenizer, scheduler, pretrained, random)


def sd2_meta_components(model_config: str = "sd2-base") -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """UNet, VAE and text encoder on the meta device: shapes and parameter counts without memory."""
    cfg = MODEL_CONFIGS[model_config]
    with torch.device("meta"):
        return (
            UNet2DConditionModel(**cfg["unet"]),
            AutoencoderKL(**cfg["vae"]),
            CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])),
        )


class StableDiffusion(ComposerModel):
    """Noise-prediction training of the UNet on VAE latents conditioned on text-encoder outputs.

    Batches are dicts: `image` (B, 3, H, W) uint8 pixels (or float already in [-1, 1]) and
    `captions` (B, 77) token ids, or,
    with encoder outputs precomputed (`latents.py`), `latent_mean` and `latent_logvar` (B, 4, H/8, W/8,
    the VAE posterior before scaling) and either `captions` (the text encoder runs, frozen, in the
    autocast dtype) or `text_states` (B, 77, D) (neither encoder runs).
    The loss is the MSE between the UNet output and the scheduler's target: the noise for
    `prediction_type="epsilon"`, the velocity for `"v_prediction"`.
    """

    def __init__(self, unet: torch.nn.Module, vae: torch.nn.Module | None, text_encoder: torch.nn.Module | None,
                 noise_scheduler: DDPMScheduler, latent_scale: float = LATENT_SCALE):
        super().__init__()
        self.unet, self.vae, self.text_encoder = unet, vae, text_encoder
        self.noise_scheduler = copy.deepcopy(noise_scheduler)
        self.latent_scale = latent_scale
        self.vae_channels_last = False  # set with --channels_last: feed the VAE channels-last images
        self.cpu_autocast_dtype: torch.dtype | None = None  # set for --precision amp_bf16 on CPU
        self.flops_per_image = 0.0  # set by the benchmark from throughput.count_flops_per_image
        self.num_timesteps = self.noise_scheduler.config.num_train_timesteps
        self.prediction_type = self.noise_scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"scheduler prediction_type '{self.prediction_type}' is not supported for training")
        for frozen in self._frozen():
            frozen.requires_grad_(False)
            frozen.eval()

    def train(self, mode: bool = True) -> "StableDiffusion":
        # Composer calls model.train() every epoch: the frozen encoders must stay in eval mode.
        super().train(mode)
        for frozen in self._frozen():
            frozen.eval()
        return self

    def _frozen(self) -> list[torch.nn.Module]:
        """The encoders; absent when training on precomputed latents."""
        return [m for m in (self.vae, self.text_encoder) if m is not None]

    @torch.no_grad()
    def encode(self, images: torch.Tensor, captions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled VAE latents (sampled from the posterior) and text-encoder hidden states.

        `images` are uint8 pixels or floats in [-1, 1]; they are scaled here, on their device, into
        the VAE's dtype (the autocast dtype when the encoders are stored in it).
        """
        images = scale_images(images, next(self.vae.parameters()).dtype)
        if self.vae_channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        latents = self.vae.encode(images).latent_dist.sample() * self.latent_scale
        return latents, self.encode_text(captions)

    @torch.no_grad()
    def encode_text(self, captions: torch.Tensor) -> torch.Tensor:
        """Text-encoder last hidden states of token ids (B, 77): what the UNet attends to."""
        return self.text_encoder(captions)[0]

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cpu_autocast_dtype is not None:
            # Composer autocasts on CUDA only (and refuses AMP on CPU): on CPU the model does it itself.
            with torch.autocast("cpu", dtype=self.cpu_autocast_dtype):
                return self._forward(batch)
        return self._forward(batch)

    def _forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "latent_mean" in batch:
            # Sample the stored posterior as the VAE would: mean + std * eps, then scale.
            mean, logvar = batch["latent_mean"].float(), batch["latent_logvar"].float()
            eps = torch.randn(mean.shape, device=mean.device)
            latents = (mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps) * self.latent_scale
            if "text_states" in batch:
                text_states = batch["text_states"].to(latents.dtype)
            elif self.text_encoder is None:
                raise ValueError("this model was built without a text encoder but got token ids (latents "
                                 "precomputed without --store_text_states)")
            else:
                text_states = self.encode_text(batch["captions"])
        elif self.vae is None or self.text_encoder is None:
            raise ValueError("this model was built without encoders (--precomputed) but got an image batch")
        else:
            latents, text_states = self.encode(batch["image"], batch["captions"])
        # Noise is added in fp32 whatever the autocast dtype of the VAE output, and drawn with
        # torch.randn, not randn_like, so the draws do not depend on dtype or memory format.
        latents = latents.float()
        noise = torch.randn(latents.shape, device=latents.device)
        timesteps = torch.randint(0, self.num_timesteps, (latents.shape[0],), device=latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        else:
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, text_states).sample
        return prediction, target

    def flops_per_batch(self, batch: dict) -> float:
        """Model FLOPs of one training step on `batch` (read by Composer's SpeedMonitor for MFU)."""
        key = "latent_mean" if "latent_mean" in batch else "image"
        return self.flops_per_image * batch[key].shape[0]

    def loss(self, outputs: tuple[torch.Tensor, torch.Tensor], batch: dict) -> torch.Tensor:
        prediction, target = outputs
        return F.mse_loss(prediction.float(), target.float())


def count_parameters(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def warn_about_random_parts(components: Components) -> None:
    if components.random:
        warnings.warn(
            f"Pretrained {' and '.join(components.random)} not found; using randomly initialized ones "
            "(throughput does not depend on the weights).", stacklevel=2,
        )
