"""Stable Diffusion 2 base: everything specific to it, behind `ModelFamily`.

    python benchmark.py --model_config sd2-base ...   # the 2023 benchmark's model (the default)
    python benchmark.py --model_config tiny ...       # the same structure at a few million parameters

The architecture is plain config dicts (`sd2-base` mirrors the diffusers / transformers configs of
stabilityai/stable-diffusion-2-base; `tiny` keeps its structure at a few million parameters for
CPUs and tests), so the model builds offline. The UNet always starts from random weights (that is
the benchmark); the VAE, the OpenCLIP ViT-H/14 text encoder and the tokenizer come from
`--model_name` when that folder or cached hub id is available (never for `tiny`: there are no
pretrained weights of its shapes), and the CLIP tokenizer is otherwise built from the vocabulary
the `open-clip-torch` package ships. A caption becomes 77 CLIP token ids (`captions`), the text
encoder's last hidden states (`text_states`, 77 x 1024) are what the UNet attends to, and the UNet
learns the noise (`epsilon`) on SD2's DDPM schedule.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import (AutoencoderKL, DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline,
                       UNet2DConditionModel)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from t2ibench.families.family import ModelFamily, Parts, denoiser_flops, latent_scale_of, load_pretrained, seeded
from t2ibench.flops import count_flops
from t2ibench.objectives import DDPMObjective
from t2ibench.tokenizer import MAX_LENGTH, VOCAB_SIZE, bundled_tokenizer, tokenize

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
        norm_num_groups=32, act_fn="silu", sample_size=512, scaling_factor=0.18215,
    ),
    "text_encoder": dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
        hidden_act="gelu", vocab_size=49408, max_position_embeddings=77, projection_dim=512,
    ),
}

# The tiny VAE is random, but must behave like a trained one in the two ways that matter for
# learning: a trained VAE's posterior is nearly deterministic (its std is tiny against the latent
# means), while a random one's log-variance is ~0, a std of ~1 that buries the means (RMS ~0.27) in
# noise. So the quant_conv bias of the log-variance channels starts strongly negative (std e^-6),
# and latents are scaled by 1/RMS of the means (3.3-4.1 over seeds 0, 1, 17, 42 on shape and uniform
# images, mean 3.6), found the way SD's 0.18215 was.
TINY_VAE_LOGVAR_BIAS = -12.0
TINY_SCALING_FACTOR = 3.6

TINY = {
    "unet": dict(
        SD2_BASE["unet"], sample_size=8, block_out_channels=(32, 64, 64, 64), layers_per_block=1,
        attention_head_dim=(2, 4, 4, 4), cross_attention_dim=64, norm_num_groups=16,
    ),
    # scaling_factor: 1 / RMS of this VAE's latent means (measured the way SD's 0.18215 was; see
    # TINY_VAE_LOGVAR_BIAS), stored in the VAE config so that exported pipelines carry it.
    "vae": dict(SD2_BASE["vae"], block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
                sample_size=64, scaling_factor=TINY_SCALING_FACTOR),
    "text_encoder": dict(
        SD2_BASE["text_encoder"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        projection_dim=64,
    ),
}

CONFIGS = {"sd2-base": SD2_BASE, "tiny": TINY}

# The DDPM training schedule of SD2 base (1000 steps, scaled_linear betas 0.00085..0.012).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    prediction_type="epsilon", clip_sample=False, steps_offset=1,
)
LATENT_SCALE = 0.18215  # SD2's VAE scaling_factor: latents * 0.18215 have roughly unit variance


def build_vae(config: str) -> AutoencoderKL:
    """A randomly initialized VAE of `config`; the tiny one as a miniature of a trained one."""
    vae = AutoencoderKL(**CONFIGS[config]["vae"])
    if config == "tiny":
        with torch.no_grad():
            vae.quant_conv.bias[vae.config.latent_channels:] = TINY_VAE_LOGVAR_BIAS
    return vae


class SD2(ModelFamily):
    name = "sd2"
    configs = tuple(CONFIGS)
    pretrained_configs = ("sd2-base",)  # no pretrained weights have the tiny shapes
    default_model_name = "stabilityai/stable-diffusion-2-base"
    denoiser_name = "unet"
    pipeline_class = "StableDiffusionPipeline"
    pipeline_parts = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
    parallelism = "ddp"
    text_input_keys = ("captions",)
    conditioning_keys = ("text_states",)
    samplers = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}
    token_columns = {"captions": "token_ids"}  # the column name of the format's first release

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
        tokenizer = {}
        if tokenizers:
            tokenizer["tokenizer"] = part("tokenizer", CLIPTokenizer, bundled_tokenizer)
            if "tokenizer" in random:  # the bundled tokenizer is SD2's own: not a random part
                random.remove("tokenizer")
        scheduler = load_pretrained(DDPMScheduler, lookup, "scheduler") or DDPMScheduler(**SCHEDULER_CONFIG)
        unet = UNet2DConditionModel(**cfg["unet"]) if denoiser else None  # always from scratch: the benchmark
        latent_scale = latent_scale_of(built_vae, cfg["vae"]["scaling_factor"], lookup)
        return Parts(unet, built_vae, encoders, tokenizer, scheduler, latent_scale,
                     pretrained=pretrained, random=random)

    def meta_parts(self, config: str) -> Parts:
        cfg = CONFIGS[config]
        with torch.device("meta"):
            unet, vae = UNet2DConditionModel(**cfg["unet"]), AutoencoderKL(**cfg["vae"])
            text_encoder = CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))
        # The schedule's tensors are real: they are tiny, and a model built on these parts trains.
        return Parts(unet, vae, {"text_encoder": text_encoder}, {}, DDPMScheduler(**SCHEDULER_CONFIG),
                     float(cfg["vae"]["scaling_factor"]))

    def latent_channels(self, config: str) -> int:
        return CONFIGS[config]["vae"]["latent_channels"]

    def conditioning_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {"text_states": (MAX_LENGTH, CONFIGS[config]["unet"]["cross_attention_dim"])}

    def text_input_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {"captions": (MAX_LENGTH,)}

    def vocabulary_sizes(self, config: str) -> dict[str, int]:
        return {"captions": VOCAB_SIZE}

    def random_text_inputs(self, generator: torch.Generator, config: str) -> dict[str, torch.Tensor]:
        return {"captions": torch.randint(0, VOCAB_SIZE, (MAX_LENGTH,), generator=generator)}

    def tokenize(self, tokenizers: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        return {"captions": tokenize(tokenizers["tokenizer"], captions)}

    def encode_text(self, text_encoders: dict[str, torch.nn.Module],
                    text_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The last hidden states (SD2 does not use the pooled output).
        return {"text_states": text_encoders["text_encoder"](text_inputs["captions"])[0]}

    def objective(self, noise_scheduler: Any, timestep_sampling: str = "uniform") -> DDPMObjective:
        return DDPMObjective(noise_scheduler)  # uniform over the schedule's integer timesteps

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        return denoiser(noisy, timesteps, conditioning["text_states"]).sample

    def flops_per_image(self, config: str, image_size: int, *, vae: bool = True,
                        text_encoders: bool = True) -> dict[str, float]:
        parts = self.meta_parts(config)
        unet, latent_size = parts.denoiser, image_size // self.latent_downsample
        latents = torch.randn(1, unet.config.in_channels, latent_size, latent_size, device="meta")
        timesteps = torch.tensor([500], device="meta")
        text_states = torch.randn(1, MAX_LENGTH, unet.config.cross_attention_dim, device="meta")
        forward, forward_backward = denoiser_flops(unet, lambda: unet(latents, timesteps, text_states).sample)
        flops = {"unet_fwd": forward, "unet_fwd_bwd": forward_backward, "vae_encoder": 0.0, "text_encoder": 0.0}
        with torch.no_grad():
            if vae:
                images = torch.randn(1, 3, image_size, image_size, device="meta")
                flops["vae_encoder"] = count_flops(lambda: parts.vae.encode(images))
            if text_encoders:
                ids = torch.zeros(1, MAX_LENGTH, dtype=torch.long, device="meta")
                flops["text_encoder"] = count_flops(lambda: parts.text_encoder(ids))
        flops["total"] = flops["unet_fwd_bwd"] + flops["vae_encoder"] + flops["text_encoder"]
        return flops

    def make_pipeline(self, parts: Parts, sampler: Any) -> StableDiffusionPipeline:
        return StableDiffusionPipeline(
            vae=parts.vae, text_encoder=parts.text_encoder, tokenizer=parts.tokenizer, unet=parts.denoiser,
            scheduler=sampler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
