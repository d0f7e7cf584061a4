"""Stable Diffusion 2 base, the 2023 benchmark's model, as a model family: its configs (`sd2-base`, and
`tiny`, its structure at a few million parameters for CPUs and tests), its CLIP conditioning, its
epsilon objective and its pipeline. The rest is `ModelFamily`'s (families/family.py).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import (DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline,
                       UNet2DConditionModel)
from transformers import CLIPTextModel, CLIPTokenizer

from t2ibench.families.family import (TEXT_STATES_KEY, TINY_VAE_LOGVAR_BIAS, TOKEN_IDS_COLUMN, TOKENS_KEY, ModelFamily,
                                      Parts, load_pretrained)
from t2ibench.families.objectives import DDPMObjective
from t2ibench.core.tokenizer import MAX_LENGTH, VOCAB_SIZE, bundled_tokenizer, tokenize

LATENT_SCALE = 0.18215  # SD2's VAE scaling_factor: latents * 0.18215 have roughly unit variance
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
        norm_num_groups=32, act_fn="silu", sample_size=512, scaling_factor=LATENT_SCALE,
    ),
    "text_encoder": dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
        hidden_act="gelu", vocab_size=49408, max_position_embeddings=77, projection_dim=512,
    ),
}

# 1 / RMS of the tiny VAE's latent means (3.3-4.1 over seeds 0, 1, 17, 42 on shape and uniform images,
# mean 3.6), measured the way SD's 0.18215 was; in the VAE config, so that exported pipelines carry it.
TINY_SCALING_FACTOR = 3.6

TINY = {
    "unet": dict(
        SD2_BASE["unet"], sample_size=8, block_out_channels=(32, 64, 64, 64), layers_per_block=1,
        attention_head_dim=(2, 4, 4, 4), cross_attention_dim=64, norm_num_groups=16,
    ),
    "vae": dict(SD2_BASE["vae"], block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
                sample_size=64, scaling_factor=TINY_SCALING_FACTOR),
    "text_encoder": dict(
        SD2_BASE["text_encoder"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        projection_dim=64,
    ),
    "vae_logvar_bias": TINY_VAE_LOGVAR_BIAS,  # a miniature of a trained VAE (family.TINY_VAE_LOGVAR_BIAS)
}

CONFIGS = {"sd2-base": SD2_BASE, "tiny": TINY}

# The DDPM training schedule of SD2 base (1000 steps, scaled_linear betas 0.00085..0.012).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    prediction_type="epsilon", clip_sample=False, steps_offset=1,
)


class SD2(ModelFamily):
    name = "sd2"
    architectures = CONFIGS
    pretrained_configs = ("sd2-base",)
    default_model_name = "stabilityai/stable-diffusion-2-base"
    denoiser_name = "unet"
    denoiser_class = UNet2DConditionModel
    text_encoder_classes = {"text_encoder": CLIPTextModel}  # OpenCLIP ViT-H/14's text tower
    scheduler_class = DDPMScheduler
    scheduler_config = SCHEDULER_CONFIG
    pipeline_class = "StableDiffusionPipeline"
    pipeline_parts = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
    parallelism = "ddp"
    text_input_keys = (TOKENS_KEY,)
    conditioning_keys = (TEXT_STATES_KEY,)
    samplers = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}
    token_columns = {TOKENS_KEY: TOKEN_IDS_COLUMN}  # the column name of the format's first release
    refused_flags = {"aspect_buckets": "SD2 trains on squares, as its 2023 recipe did; buckets are for the families "
                                       "with size conditioning or patch tokens (SDXL, Flux.1)"}

    # -- building --------------------------------------------------------------------------------
    def build_tokenizers(self, config: str, model_name: str | None) -> tuple[dict[str, Any], list[str]]:
        # Offline, the CLIP tokenizer from the vocabulary open-clip-torch ships: SD2's own.
        tokenizer = load_pretrained(CLIPTokenizer, model_name, "tokenizer")
        if tokenizer is None:
            return {"tokenizer": bundled_tokenizer()}, []
        return {"tokenizer": tokenizer}, ["tokenizer"]

    def conditioning_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {TEXT_STATES_KEY: (MAX_LENGTH, self.architectures[config]["text_encoder"]["hidden_size"])}

    def text_input_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {TOKENS_KEY: (MAX_LENGTH,)}

    def vocabulary_sizes(self, config: str) -> dict[str, int]:
        return {TOKENS_KEY: VOCAB_SIZE}

    # -- conditioning ------------------------------------------------------------------------------
    def tokenize(self, tokenizers: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        return {TOKENS_KEY: tokenize(tokenizers["tokenizer"], captions)}

    def encode_text(self, text_encoders: dict[str, torch.nn.Module],
                    text_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The last hidden states (SD2 does not use the pooled output).
        return {TEXT_STATES_KEY: text_encoders["text_encoder"](text_inputs[TOKENS_KEY])[0]}

    # -- training ----------------------------------------------------------------------------------
    def objective(self, noise_scheduler: Any, timestep_sampling: str = "uniform") -> DDPMObjective:
        return DDPMObjective(noise_scheduler)  # uniform over the schedule's integer timesteps

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        return denoiser(noisy, timesteps, conditioning[TEXT_STATES_KEY]).sample

    # -- use ---------------------------------------------------------------------------------------
    def make_pipeline(self, parts: Parts, sampler: Any) -> StableDiffusionPipeline:
        return StableDiffusionPipeline(
            vae=parts.vae, text_encoder=parts.text_encoder, tokenizer=parts.tokenizer, unet=parts.denoiser,
            scheduler=sampler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
