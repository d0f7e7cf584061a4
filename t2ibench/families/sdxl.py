"""Stable Diffusion XL base 1.0 as a model family: its configs (`sdxl-base`, and `sdxl-tiny`, its
structure at 2.1M UNet parameters), its two CLIP encoders on one set of token ids, its size-and-crop
micro-conditioning and its pipeline; the rest is `ModelFamily`'s. What differs from SD2, and why, is in
docs/sdxl.md.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import (DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                       UNet2DConditionModel)
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from t2ibench.families.family import TEXT_STATES_KEY, TOKEN_IDS_COLUMN, TOKENS_KEY, ModelFamily, Parts, load_pretrained
from t2ibench.families.sd2 import SCHEDULER_CONFIG, TINY
from t2ibench.core.images import CROP_KEY, ORIGINAL_SIZE_KEY
from t2ibench.families.objectives import DDPMObjective
from t2ibench.core.tokenizer import MAX_LENGTH, VOCAB_SIZE, bundled_tokenizer, tokenize

MODEL_NAME = "stabilityai/stable-diffusion-xl-base-1.0"
VAE_SCALING_FACTOR = 0.13025  # SDXL VAE's: latents x 0.13025 have roughly unit variance
END_TOKEN_ID = 49407  # <|endoftext|> of CLIP's BPE vocabulary: ViT-L's padding
TIME_IDS = ("original_height", "original_width", "crop_top", "crop_left", "target_height", "target_width")
# TOKENS_KEY: bigG's padding of the token ids, as SD2's; TEXT_STATES_KEY: (B, 77, 2048), what the UNet attends to.
POOLED_KEY = "pooled_text_states"  # (B, 1280): bigG's projected end-of-text embedding

_TEXT_ENCODER_IDS = dict(bos_token_id=0, eos_token_id=2, pad_token_id=1)  # as the hub configs (transformers
# then pools at the argmax of the ids: the first end token, the largest id)

SDXL_BASE = {
    "unet": dict(
        sample_size=128, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816, norm_num_groups=32, act_fn="silu", flip_sin_to_cos=True,
        freq_shift=0,
    ),
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=VAE_SCALING_FACTOR, force_upcast=True,
    ),
    "text_encoder": dict(  # OpenAI CLIP ViT-L/14 text tower
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        hidden_act="quick_gelu", vocab_size=49408, max_position_embeddings=MAX_LENGTH, projection_dim=768,
        **_TEXT_ENCODER_IDS,
    ),
    "text_encoder_2": dict(  # OpenCLIP ViT-bigG/14 text tower, with its text projection
        hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
        hidden_act="gelu", vocab_size=49408, max_position_embeddings=MAX_LENGTH, projection_dim=1280,
        **_TEXT_ENCODER_IDS,
    ),
}

# Tiny: text widths 32 + 64 = 96 attended to, pooled 64, time ids 6 x 16: 96 + 64 = 160 added inputs.
# 64 px images: latents of 8, levels 8 / 4 / 2 (attention at 4 and 2, as SDXL's at 64 and 32).
SDXL_TINY = {
    "unet": dict(
        SDXL_BASE["unet"], sample_size=8, block_out_channels=(32, 64, 64), layers_per_block=1,
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), cross_attention_dim=96,
        addition_time_embed_dim=16, projection_class_embeddings_input_dim=6 * 16 + 64, norm_num_groups=16,
    ),
    # SD2's tiny VAE (sd2.TINY): the same architecture, measured scaling factor and near-deterministic
    # posterior; SDXL's VAE is SD's architecture too.
    "vae": dict(TINY["vae"], force_upcast=False),
    "vae_logvar_bias": TINY["vae_logvar_bias"],
    "text_encoder": dict(SDXL_BASE["text_encoder"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, projection_dim=32),
    "text_encoder_2": dict(SDXL_BASE["text_encoder_2"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, projection_dim=64),
}

CONFIGS = {"sdxl-base": SDXL_BASE, "sdxl-tiny": SDXL_TINY}


def text_widths(config: str) -> tuple[int, int]:
    """(width the UNet attends to, width of the pooled embedding): (2048, 1280) for sdxl-base."""
    cfg = CONFIGS[config]
    return (cfg["text_encoder"]["hidden_size"] + cfg["text_encoder_2"]["hidden_size"],
            cfg["text_encoder_2"]["projection_dim"])


def check_config(config: str) -> None:
    """The UNet's widths agree with the text encoders' (cross-attention and added embedding)."""
    cfg = CONFIGS[config]
    width, pooled = text_widths(config)
    unet = cfg["unet"]
    assert unet["cross_attention_dim"] == width, (config, unet["cross_attention_dim"], width)
    added = len(TIME_IDS) * unet["addition_time_embed_dim"] + pooled
    assert unet["projection_class_embeddings_input_dim"] == added, (config, added)


def bundled_tokenizers() -> dict[str, CLIPTokenizer]:
    """SDXL's two tokenizers built offline: ViT-L's (pads with <|endoftext|>) and bigG's (pads with "!")."""
    tokenizer_2 = bundled_tokenizer()  # SD2's OpenCLIP padding, "!", is bigG's too
    tokenizer = bundled_tokenizer()
    tokenizer.pad_token = "<|endoftext|>"  # saved with the tokenizer (special_tokens_map.json)
    return {"tokenizer": tokenizer, "tokenizer_2": tokenizer_2}


def repad(token_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Token ids (B, 77) with every position after the first end token set to `pad_token_id`.

    The data is tokenized once with bigG's padding; ViT-L was trained with its own (the end token),
    and its hidden states at padded positions, which the UNet attends to, depend on it. Keyed on the
    end token, not on the pad id: "!" inside a caption is token 0 too.
    """
    position = torch.arange(token_ids.shape[-1], device=token_ids.device)
    is_end = token_ids == END_TOKEN_ID
    first_end = torch.where(is_end.any(-1), is_end.int().argmax(-1), token_ids.shape[-1])
    return torch.where(position > first_end.unsqueeze(-1), torch.full_like(token_ids, pad_token_id), token_ids)


def size_rows(size: tuple[int, int], rows: int, device: torch.device) -> torch.Tensor:
    """(rows, 2) float32 copies of `size`, filled on `device` from scalars: torch.tensor(size, device=...)
    would copy from the host (and, to a GPU, wait for it) on every microbatch."""
    filled = torch.empty(rows, 2, dtype=torch.float32, device=device)
    filled[:, 0], filled[:, 1] = size
    return filled


def time_ids(original_size: torch.Tensor, crop_top_left: torch.Tensor, target_size: tuple[int, int]) -> torch.Tensor:
    """(B, 6) float time ids (TIME_IDS) from (B, 2) original (height, width) and (B, 2) crop (top, left), pixels."""
    target = size_rows(target_size, original_size.shape[0], original_size.device)
    return torch.cat([original_size.float(), crop_top_left.float(), target], dim=-1)


class SDXL(ModelFamily):
    name = "sdxl"
    architectures = CONFIGS
    pretrained_configs = ("sdxl-base",)
    default_model_name = MODEL_NAME
    denoiser_name = "unet"
    denoiser_class = UNet2DConditionModel
    text_encoder_classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
    # SDXL base trains on SD2's DDPM schedule (1000 steps, scaled_linear 0.00085..0.012, epsilon); its
    # hub scheduler/ is the Euler sampler of inference, so the training schedule is always this one.
    scheduler_class = DDPMScheduler
    scheduler_config = SCHEDULER_CONFIG
    scheduler_from_pretrained = False
    pipeline_class = "StableDiffusionXLPipeline"
    pipeline_parts = ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
    parallelism = "ddp"
    text_input_keys = (TOKENS_KEY,)
    conditioning_keys = (TEXT_STATES_KEY, POOLED_KEY)
    token_columns = {TOKENS_KEY: TOKEN_IDS_COLUMN}  # stored as SD2's, so the tokens format reads alike
    micro_conditioning = True
    # Euler first: the scheduler of SDXL's own pipeline (model_index.json of sdxl-base-1.0).
    samplers = {"euler": EulerDiscreteScheduler, "ddim": DDIMScheduler}
    unconditional = "zeros"

    # -- building --------------------------------------------------------------------------------
    def default_image_size(self, config: str) -> int:
        return self.architectures[config]["unet"]["sample_size"] * self.latent_downsample  # 1024; sdxl-tiny 64

    def flops_exact_multiple(self, config: str) -> int:
        # The UNet halves the latent between its levels: 4 latent pixels a side for SDXL's 3 (32 px).
        return self.latent_downsample * 2 ** (len(self.architectures[config]["unet"]["block_out_channels"]) - 1)

    def build_tokenizers(self, config: str, model_name: str | None) -> tuple[dict[str, Any], list[str]]:
        found = {name: load_pretrained(CLIPTokenizer, model_name, name) for name in ("tokenizer", "tokenizer_2")}
        if all(found.values()):
            return found, list(found)
        # Both or neither: the bundled pair is SDXL's own (same vocabulary and padding).
        return bundled_tokenizers(), []

    def conditioning_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        width, pooled = text_widths(config)
        return {TEXT_STATES_KEY: (MAX_LENGTH, width), POOLED_KEY: (pooled,)}

    def text_input_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {TOKENS_KEY: (MAX_LENGTH,)}

    def vocabulary_sizes(self, config: str) -> dict[str, int]:
        return {TOKENS_KEY: VOCAB_SIZE}

    # -- conditioning ------------------------------------------------------------------------------
    def tokenize(self, tokenizers: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        # One set of ids, bigG's (padded with "!"); ViT-L's padding is restored in encode_text.
        return {TOKENS_KEY: tokenize(tokenizers["tokenizer_2"], captions)}

    def encode_text(self, text_encoders: dict[str, torch.nn.Module],
                    text_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # As diffusers' StableDiffusionXLPipeline.encode_prompt: each encoder's hidden_states[-2]
        # (the next-to-last layer's output, no final layer norm), and text_encoder_2's text_embeds.
        ids = text_inputs[TOKENS_KEY]
        first = text_encoders["text_encoder"](repad(ids, END_TOKEN_ID), output_hidden_states=True).hidden_states[-2]
        second = text_encoders["text_encoder_2"](ids, output_hidden_states=True)
        return {TEXT_STATES_KEY: torch.cat([first, second.hidden_states[-2]], dim=-1), POOLED_KEY: second.text_embeds}

    # -- training ----------------------------------------------------------------------------------
    def objective(self, noise_scheduler: Any, timestep_sampling: str = "uniform") -> DDPMObjective:
        return DDPMObjective(noise_scheduler)

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        states = conditioning[TEXT_STATES_KEY]
        target = (noisy.shape[-2] * self.latent_downsample, noisy.shape[-1] * self.latent_downsample)
        if ORIGINAL_SIZE_KEY in conditioning:  # training: each image's own size and crop
            ids = time_ids(conditioning[ORIGINAL_SIZE_KEY], conditioning[CROP_KEY], target)
        else:  # sampling (and FLOPs): an uncropped image of the target size (the pipeline's default)
            size = size_rows(target, noisy.shape[0], noisy.device)
            ids = time_ids(size, torch.zeros_like(size), target)
        added = {"text_embeds": conditioning[POOLED_KEY].to(states.dtype), "time_ids": ids.to(states.dtype)}
        return denoiser(noisy, timesteps, states, added_cond_kwargs=added).sample

    # -- use ---------------------------------------------------------------------------------------
    def make_pipeline(self, parts: Parts, sampler: Any) -> StableDiffusionXLPipeline:
        # Zeros as the unconditional branch (what caption dropout trained); no invisible watermark.
        return StableDiffusionXLPipeline(
            vae=parts.vae, text_encoder=parts.text_encoders["text_encoder"],
            text_encoder_2=parts.text_encoders["text_encoder_2"], tokenizer=parts.tokenizers["tokenizer"],
            tokenizer_2=parts.tokenizers["tokenizer_2"], unet=parts.denoiser, scheduler=sampler,
            force_zeros_for_empty_prompt=True, add_watermarker=False)
