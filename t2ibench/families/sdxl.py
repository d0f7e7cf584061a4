"""Stable Diffusion XL base 1.0 as a model family: its configs, its parts built offline, how a caption
and an image's size and crop become its conditioning, its FLOPs, and its diffusers pipeline.

    python benchmark.py --model_config sdxl-base --use_synth_data ...   # 1024 px by default
    python benchmark.py --model_config sdxl-tiny --use_synth_data --batch_size 4 --max_duration 4ba

What differs from SD2 (families/sd2.py), all of it here:

- The UNet (`UNet2DConditionModel`, 2,567,463,684 parameters): three levels (320, 640, 1280
  channels), the first without attention, transformer depths 1 / 2 / 10 (10 again in the middle
  block), 64-wide heads (diffusers' `attention_head_dim` (5, 10, 20) is the number of heads),
  cross-attention width 2048, and an "added" embedding (`addition_embed_type="text_time"`): six
  size/crop numbers, each embedded sinusoidally in 256 channels, next to the pooled 1280-wide
  text embedding: 6 x 256 + 1280 = 2816 inputs, summed into the timestep embedding.
- Two frozen text encoders on the same CLIP BPE tokens: OpenAI CLIP ViT-L/14 (`CLIPTextModel`,
  768 wide, 12 layers, quick-GELU) and OpenCLIP ViT-bigG/14 (`CLIPTextModelWithProjection`, 1280
  wide, 32 layers, GELU). The UNet attends to both encoders' penultimate hidden states (the
  output of the next-to-last layer, before the final layer norm) concatenated: 768 + 1280 = 2048.
  The pooled embedding is bigG's projected end-of-text state (`text_embeds`, 1280).
- Micro-conditioning: the six time ids are (original height, original width, crop top, crop left,
  target height, target width) in pixels, the image's size before it was resized and where the
  crop that made it square began in the resized image (as diffusers' SDXL training script and
  pipeline use them). They come from the data (data.decode_image_with_geometry, or latents.py's
  stored columns) as the batch keys `original_size` and `crop_top_left`; samples drawn while
  training use the uncropped training size.
- The VAE is SD's architecture with SDXL's weights and scaling factor 0.13025, at 1024 px. SDXL's
  own VAE overflows in fp16 (its config says `force_upcast`: the pipelines decode in fp32); the
  community's fp16-fix VAE (madebyollin/sdxl-vae-fp16-fix, same architecture and scaling, config
  `force_upcast: false`) runs in fp16: put it in the `vae/` folder of the `--model_name` pipeline.
  Under fp16 autocast the training model keeps a VAE that asks for the upcast in fp32
  (t2ibench.model.vae_overflows_in).
- Caption dropout zeroes both encoders' conditioning (the states and the pooled embedding), as
  the reference SDXL trainer (generative-models) drops it and as the exported pipeline's unconditional branch
  (`force_zeros_for_empty_prompt`) samples it; the size/crop ids are kept.

The two tokenizers are the same CLIP BPE and differ only in padding: ViT-L's pads with the end
token `<|endoftext|>` (49407), bigG's with `!` (0), as the hub's `tokenizer/` and `tokenizer_2/`
configs of stabilityai/stable-diffusion-xl-base-1.0 say. Data is tokenized once, with bigG's
padding (t2ibench.tokenizer.bundled_tokenizer, SD2's tokenizer, pads with "!" too), so the batch
and the precomputed `token_ids` column hold one set of ids; `repad` rewrites the padding after the
first end token for ViT-L. Offline, both are built from open-clip-torch's BPE vocabulary.

`sdxl-tiny` keeps every structural feature (three levels, the first without attention, deeper
transformers below, two text encoders whose penultimate states are concatenated, pooled
projection, six time ids, the added embedding) with a 2.1M-parameter UNet at 64 px, for CPUs and tests.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import (AutoencoderKL, DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                       UNet2DConditionModel)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from t2ibench.families.family import ModelFamily, Parts, latent_scale_of, load_pretrained, seeded
from t2ibench.families.sd2 import SCHEDULER_CONFIG, TINY, TINY_VAE_LOGVAR_BIAS
from t2ibench.flops import count_flops
from t2ibench.images import CROP_KEY, ORIGINAL_SIZE_KEY
from t2ibench.objectives import DDPMObjective
from t2ibench.tokenizer import MAX_LENGTH, VOCAB_SIZE, bundled_tokenizer, tokenize

MODEL_NAME = "stabilityai/stable-diffusion-xl-base-1.0"
DEFAULT_IMAGE_SIZE = 1024  # pixels: SDXL base's training resolution (its UNet sample_size 128 x 8)
VAE_SCALING_FACTOR = 0.13025  # SDXL VAE's: latents x 0.13025 have roughly unit variance
END_TOKEN_ID = 49407  # <|endoftext|> of CLIP's BPE vocabulary: ViT-L's padding
TIME_IDS = ("original_height", "original_width", "crop_top", "crop_left", "target_height", "target_width")
TOKENS_KEY = "captions"  # batch key of the token ids (bigG's padding), as SD2's
TEXT_STATES_KEY = "text_states"  # (B, 77, 2048): what the UNet attends to
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


def build_vae(config: str) -> AutoencoderKL:
    """A randomly initialized VAE of `config`; the tiny one as a miniature of a trained one (sd2.build_vae)."""
    vae = AutoencoderKL(**CONFIGS[config]["vae"])
    if config == "sdxl-tiny":
        with torch.no_grad():
            vae.quant_conv.bias[vae.config.latent_channels:] = TINY_VAE_LOGVAR_BIAS
    return vae


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
    configs = tuple(CONFIGS)
    pretrained_configs = ("sdxl-base",)  # no pretrained weights have the tiny shapes
    default_model_name = MODEL_NAME
    denoiser_name = "unet"
    pipeline_class = "StableDiffusionXLPipeline"
    pipeline_parts = ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
    parallelism = "ddp"
    text_input_keys = (TOKENS_KEY,)
    conditioning_keys = (TEXT_STATES_KEY, POOLED_KEY)
    token_columns = {TOKENS_KEY: "token_ids"}  # stored as SD2's, so the tokens format reads alike
    micro_conditioning = True
    # Euler first: the scheduler of SDXL's own pipeline (model_index.json of sdxl-base-1.0).
    samplers = {"euler": EulerDiscreteScheduler, "ddim": DDIMScheduler}
    unconditional = "zeros"

    def default_image_size(self, config: str) -> int:
        return CONFIGS[config]["unet"]["sample_size"] * self.latent_downsample  # 1024; sdxl-tiny 64

    def build(self, config: str, model_name: str | None = None, *, denoiser: bool = True, vae: bool = True,
              text_encoders: bool = True, tokenizers: bool = True) -> Parts:
        cfg = CONFIGS[config]
        lookup = model_name if config in self.pretrained_configs else None
        pretrained, random = [], []

        def part(name: str, cls: Any, build: Any) -> Any:
            module = load_pretrained(cls, lookup, name)
            (pretrained if module is not None else random).append(name)
            return module if module is not None else seeded(name, build)

        built_vae = part("vae", AutoencoderKL, lambda: build_vae(config)) if vae else None
        encoders = {}
        if text_encoders:
            encoders["text_encoder"] = part("text_encoder", CLIPTextModel,
                                            lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])))
            encoders["text_encoder_2"] = part(
                "text_encoder_2", CLIPTextModelWithProjection,
                lambda: CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"])))
        found = {}
        if tokenizers:
            found = {name: load_pretrained(CLIPTokenizer, lookup, name) for name in ("tokenizer", "tokenizer_2")}
            if all(found.values()):
                pretrained += list(found)
            else:  # the bundled ones are SDXL's own (same vocabulary and padding): not random parts
                found = bundled_tokenizers()
        # SDXL base trains on SD2's DDPM schedule (1000 steps, scaled_linear 0.00085..0.012, epsilon);
        # its hub scheduler/ is the Euler sampler of inference, so the training schedule is built here.
        scheduler = DDPMScheduler(**SCHEDULER_CONFIG)
        unet = UNet2DConditionModel(**cfg["unet"]) if denoiser else None  # always from scratch: the benchmark
        latent_scale = latent_scale_of(built_vae, cfg["vae"]["scaling_factor"], lookup)
        return Parts(unet, built_vae, encoders, found, scheduler, latent_scale,
                     pretrained=pretrained, random=random)

    def meta_parts(self, config: str) -> Parts:
        cfg = CONFIGS[config]
        with torch.device("meta"):
            unet, vae = UNet2DConditionModel(**cfg["unet"]), AutoencoderKL(**cfg["vae"])
            encoders = {"text_encoder": CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])),
                        "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"]))}
        # The schedule's tensors are real: they are tiny, and a model built on these parts trains.
        return Parts(unet, vae, encoders, {}, DDPMScheduler(**SCHEDULER_CONFIG), float(cfg["vae"]["scaling_factor"]))

    def latent_channels(self, config: str) -> int:
        return CONFIGS[config]["vae"]["latent_channels"]

    def conditioning_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        width, pooled = text_widths(config)
        return {TEXT_STATES_KEY: (MAX_LENGTH, width), POOLED_KEY: (pooled,)}

    def text_input_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {TOKENS_KEY: (MAX_LENGTH,)}

    def vocabulary_sizes(self, config: str) -> dict[str, int]:
        return {TOKENS_KEY: VOCAB_SIZE}

    def random_text_inputs(self, generator: torch.Generator, config: str) -> dict[str, torch.Tensor]:
        return {TOKENS_KEY: torch.randint(0, VOCAB_SIZE, (MAX_LENGTH,), generator=generator)}

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

    def objective(self, noise_scheduler: Any, timestep_sampling: str = "uniform") -> DDPMObjective:
        return DDPMObjective(noise_scheduler)

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        states = conditioning[TEXT_STATES_KEY]
        target = (noisy.shape[-2] * self.latent_downsample, noisy.shape[-1] * self.latent_downsample)
        if ORIGINAL_SIZE_KEY in conditioning:  # training: each image's own size and crop
            ids = time_ids(conditioning[ORIGINAL_SIZE_KEY], conditioning[CROP_KEY], target)
        else:  # sampling: an uncropped image of the target size (the pipeline's default)
            size = size_rows(target, noisy.shape[0], noisy.device)
            ids = time_ids(size, torch.zeros_like(size), target)
        added = {"text_embeds": conditioning[POOLED_KEY].to(states.dtype), "time_ids": ids.to(states.dtype)}
        return denoiser(noisy, timesteps, states, added_cond_kwargs=added).sample

    def flops_per_image(self, config: str, image_size: int, *, vae: bool = True,
                        text_encoders: bool = True) -> dict[str, float]:
        parts = self.meta_parts(config)
        unet, latent_size = parts.denoiser, image_size // self.latent_downsample
        latents = torch.randn(1, unet.config.in_channels, latent_size, latent_size, device="meta")
        timesteps = torch.tensor([500], device="meta")
        conditioning = {key: torch.randn(1, *shape, device="meta")
                        for key, shape in self.conditioning_shapes(config).items()}
        # One pass: the forward's count is read before the backward runs (half the time of counting
        # a forward and a forward+backward apart: tracing SDXL's ~2,000 modules is what takes long).
        from torch.utils.flop_counter import FlopCounterMode
        with FlopCounterMode(display=False) as counter:
            output = self.predict(unet, latents, timesteps, conditioning)
            forward = float(counter.get_total_flops())
            output.sum().backward()
            forward_backward = float(counter.get_total_flops())
        unet.zero_grad(set_to_none=True)
        flops = {"unet_fwd": forward, "unet_fwd_bwd": forward_backward, "vae_encoder": 0.0, "text_encoder": 0.0}
        with torch.no_grad():
            if vae:
                images = torch.randn(1, 3, image_size, image_size, device="meta")
                flops["vae_encoder"] = count_flops(lambda: parts.vae.encode(images))
            if text_encoders:
                ids = torch.zeros(1, MAX_LENGTH, dtype=torch.long, device="meta")
                flops["text_encoder"] = count_flops(lambda: self.encode_text(parts.text_encoders, {TOKENS_KEY: ids}))
        flops["total"] = flops["unet_fwd_bwd"] + flops["vae_encoder"] + flops["text_encoder"]
        return flops

    def make_pipeline(self, parts: Parts, sampler: Any) -> StableDiffusionXLPipeline:
        # Zeros as the unconditional branch (what caption dropout trained); no invisible watermark.
        return StableDiffusionXLPipeline(
            vae=parts.vae, text_encoder=parts.text_encoders["text_encoder"],
            text_encoder_2=parts.text_encoders["text_encoder_2"], tokenizer=parts.tokenizers["tokenizer"],
            tokenizer_2=parts.tokenizers["tokenizer_2"], unet=parts.denoiser, scheduler=sampler,
            force_zeros_for_empty_prompt=True, add_watermarker=False)
