"""Stable Diffusion XL base 1.0 as a model family: its configs, its parts built offline, how a caption
and an image's size and crop become its conditioning, its FLOPs, and its diffusers pipeline.

    python -c "import sdxl; print(sdxl.parameter_counts('sdxl-base'))"      # built on the meta device

What differs from SD2 (model.py), all of it here:

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
  pipeline use them). They come from the data (data.decode_image), not from a guess.
- The VAE is SD's architecture with SDXL's weights and scaling factor 0.13025, at 1024 px. SDXL's
  own VAE overflows in fp16 (its config says `force_upcast`: the pipelines decode in fp32); the
  community's fp16-fix VAE (madebyollin/sdxl-vae-fp16-fix, same architecture and scaling, config
  `force_upcast: false`) runs in fp16. `vae_dtype` follows the config.
- Caption dropout zeroes both encoders' conditioning (the states and the pooled embedding), as
  the reference SDXL trainer (generative-models) drops it and as the exported pipeline's unconditional branch
  (`force_zeros_for_empty_prompt`) samples it; the size/crop ids are kept.

The two tokenizers are the same CLIP BPE and differ only in padding: ViT-L's pads with the end
token `<|endoftext|>` (49407), bigG's with `!` (0), as the hub's `tokenizer/` and `tokenizer_2/`
configs of stabilityai/stable-diffusion-xl-base-1.0 say. Data is tokenized once, with bigG's
padding (tokenizer.bundled_tokenizer, SD2's tokenizer, pads with "!" too); `repad` rewrites the
padding after the first end token for ViT-L. Offline, both are built from open-clip-torch's BPE
vocabulary (tokenizer.py).

`sdxl-tiny` keeps every structural feature (three levels, the first without attention, deeper
transformers below, two text encoders whose penultimate states are concatenated, pooled
projection, six time ids, the added embedding) at about 3 million parameters, for CPUs and tests.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from t2ibench.families.family import load_pretrained as _load_pretrained
from t2ibench.families.sd2 import SCHEDULER_CONFIG, TINY, TINY_VAE_LOGVAR_BIAS
from t2ibench.tokenizer import MAX_LENGTH, bundled_tokenizer

MODEL_NAME = "stabilityai/stable-diffusion-xl-base-1.0"
FP16_FIX_VAE_NAME = "madebyollin/sdxl-vae-fp16-fix"  # same architecture and scaling, runs in fp16
DEFAULT_IMAGE_SIZE = 1024  # pixels: SDXL base's training resolution (its UNet sample_size 128 x 8)
VAE_SCALING_FACTOR = 0.13025  # SDXL VAE's: latents x 0.13025 have roughly unit variance
END_TOKEN_ID = 49407  # <|endoftext|> of CLIP's BPE vocabulary
TIME_IDS = ("original_height", "original_width", "crop_top", "crop_left", "target_height", "target_width")

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
    # SD2's tiny VAE (model.TINY): the same architecture, measured scaling factor and near-deterministic
    # posterior; SDXL's VAE is SD's architecture too.
    "vae": dict(TINY["vae"], force_upcast=False),
    "text_encoder": dict(SDXL_BASE["text_encoder"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, projection_dim=32),
    "text_encoder_2": dict(SDXL_BASE["text_encoder_2"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, projection_dim=64),
}

CONFIGS = {"sdxl-base": SDXL_BASE, "sdxl-tiny": SDXL_TINY}
TINY_IMAGE_SIZE = 64  # pixels: sdxl-tiny's UNet sample_size 8 x 8


def text_widths(model_config: str) -> tuple[int, int]:
    """(width the UNet attends to, width of the pooled embedding): (2048, 1280) for sdxl-base."""
    cfg = CONFIGS[model_config]
    return (cfg["text_encoder"]["hidden_size"] + cfg["text_encoder_2"]["hidden_size"],
            cfg["text_encoder_2"]["projection_dim"])


def check_config(model_config: str) -> None:
    """The UNet's widths agree with the text encoders' (cross-attention and added embedding)."""
    cfg = CONFIGS[model_config]
    width, pooled = text_widths(model_config)
    unet = cfg["unet"]
    assert unet["cross_attention_dim"] == width, (model_config, unet["cross_attention_dim"], width)
    added = len(TIME_IDS) * unet["addition_time_embed_dim"] + pooled
    assert unet["projection_class_embeddings_input_dim"] == added, (model_config, added)


# -----------------------------------------------------------------------------------------------
# Building the parts.
# -----------------------------------------------------------------------------------------------

@dataclass
class Components:
    """SDXL's parts, plus what was loaded pretrained and what was not (names as the pipeline's folders)."""

    unet: UNet2DConditionModel | None
    vae: AutoencoderKL | None
    text_encoder: CLIPTextModel | None
    text_encoder_2: CLIPTextModelWithProjection | None
    tokenizer: CLIPTokenizer | None
    tokenizer_2: CLIPTokenizer | None
    noise_scheduler: DDPMScheduler
    pretrained: list[str] = field(default_factory=list)
    random: list[str] = field(default_factory=list)
    latent_scale: float = VAE_SCALING_FACTOR


def bundled_tokenizers() -> tuple[CLIPTokenizer, CLIPTokenizer]:
    """SDXL's two tokenizers built offline: ViT-L's (pads with <|endoftext|>) and bigG's (pads with "!")."""
    tokenizer_2 = bundled_tokenizer()  # SD2's OpenCLIP padding, "!", is bigG's too
    tokenizer = bundled_tokenizer()
    tokenizer.pad_token = "<|endoftext|>"  # saved with the tokenizer (special_tokens_map.json)
    return tokenizer, tokenizer_2


def build_vae(model_config: str) -> AutoencoderKL:
    """A randomly initialized VAE of `model_config`; the tiny one as a miniature of a trained one (model.py)."""
    vae = AutoencoderKL(**CONFIGS[model_config]["vae"])
    if model_config == "sdxl-tiny":
        with torch.no_grad():
            vae.quant_conv.bias[vae.config.latent_channels:] = TINY_VAE_LOGVAR_BIAS
    return vae


def build_components(model_config: str, model_name: str | None = None, *, vae_name: str | None = None,
                     with_unet: bool = True, with_vae: bool = True, with_text_encoders: bool = True,
                     with_tokenizers: bool = True) -> Components:
    """SDXL's parts: a random UNet from `model_config`, frozen VAE and text encoders pretrained if found.

    `model_name` (hub id or local diffusers folder of an SDXL pipeline) is only consulted for
    `sdxl-base`; `vae_name` (e.g. FP16_FIX_VAE_NAME, a folder or hub id holding the VAE at its
    root or in vae/) replaces its VAE. Each random part is drawn from its own generator, seeded
    from the global seed and the part's name (as model.build_components does), so a part is the
    same whatever else is built.
    """
    if model_config not in CONFIGS:
        raise ValueError(f"--model_config: unknown '{model_config}', choose from {sorted(CONFIGS)}")
    cfg = CONFIGS[model_config]
    base = model_config == "sdxl-base"
    lookup = model_name if base else None
    pretrained, random = [], []

    def part(name: str, cls, build: Callable[[], torch.nn.Module], sources: list[tuple[str | None, str]]):
        for source, subfolder in sources:
            module = _load_pretrained(cls, source, subfolder)
            if module is not None:
                pretrained.append(name)
                return module
        random.append(name)
        with torch.random.fork_rng(devices=[]):  # leaves the global generator as it was
            torch.manual_seed((torch.initial_seed() + zlib.crc32(name.encode())) % 2**63)
            return build()

    vae = text_encoder = text_encoder_2 = tokenizer = tokenizer_2 = unet = None
    vae_sources = [(vae_name, ""), (vae_name, "vae")] if base and vae_name else [(lookup, "vae")]
    if with_vae:
        vae = part("vae", AutoencoderKL, lambda: build_vae(model_config), vae_sources)
    if with_text_encoders:
        text_encoder = part("text_encoder", CLIPTextModel,
                            lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])), [(lookup, "text_encoder")])
        text_encoder_2 = part("text_encoder_2", CLIPTextModelWithProjection,
                              lambda: CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"])),
                              [(lookup, "text_encoder_2")])
    if with_tokenizers:
        tokenizer = _load_pretrained(CLIPTokenizer, lookup, "tokenizer")
        tokenizer_2 = _load_pretrained(CLIPTokenizer, lookup, "tokenizer_2")
        if tokenizer is None or tokenizer_2 is None:  # the bundled ones are SDXL's own: not random parts
            tokenizer, tokenizer_2 = bundled_tokenizers()
        else:
            pretrained += ["tokenizer", "tokenizer_2"]
    # SDXL base trains on SD2's DDPM schedule (1000 steps, scaled_linear 0.00085..0.012, epsilon);
    # its hub scheduler/ is the Euler sampler for inference, so the training schedule is built here.
    scheduler = DDPMScheduler(**SCHEDULER_CONFIG)
    if with_unet:
        unet = UNet2DConditionModel(**cfg["unet"])  # always from scratch: that is the benchmark
    if vae is not None:
        latent_scale = vae.config.scaling_factor
    else:  # precomputed latents: the scale of the VAE that encoded them, read from its config only
        latent_scale = cfg["vae"]["scaling_factor"]
        for source, subfolder in vae_sources:
            if source:
                try:
                    latent_scale = AutoencoderKL.load_config(source, subfolder=subfolder or None,
                                                             local_files_only=True)["scaling_factor"]
                    break
                except Exception:  # noqa: BLE001 - not available offline: SDXL's own value from the config
                    continue
    return Components(unet, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, scheduler,
                      pretrained, random, float(latent_scale))


def meta_components(model_config: str = "sdxl-base") -> Components:
    """UNet, VAE and both text encoders on the meta device: shapes, parameter counts and FLOPs without memory."""
    cfg = CONFIGS[model_config]
    with torch.device("meta"):
        return Components(
            UNet2DConditionModel(**cfg["unet"]), AutoencoderKL(**cfg["vae"]),
            CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])),
            CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"])),
            None, None, DDPMScheduler(**SCHEDULER_CONFIG))


def parameter_counts(model_config: str = "sdxl-base") -> dict[str, int]:
    """Parameters of each part (built on the meta device)."""
    parts = meta_components(model_config)
    return {name: sum(p.numel() for p in getattr(parts, name).parameters())
            for name in ("unet", "vae", "text_encoder", "text_encoder_2")}


def vae_dtype(vae: AutoencoderKL, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype to store the frozen VAE in under autocast: fp32 for a VAE that overflows in fp16.

    SDXL's own VAE produces inf/NaN in fp16 and says so in its config (`force_upcast`); in bf16
    (fp32's range) it is fine. The fp16-fix VAE has `force_upcast: false`.
    """
    if autocast_dtype is None:
        return torch.float32
    if autocast_dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
        return torch.float32
    return autocast_dtype


# -----------------------------------------------------------------------------------------------
# Conditioning: what a caption, an image's size and its crop become.
# -----------------------------------------------------------------------------------------------

def repad(token_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Token ids (B, 77) with every position after the first end token set to `pad_token_id`.

    The data is tokenized once with bigG's padding; ViT-L was trained with its own (the end token),
    and its hidden states at padded positions, which the UNet attends to, depend on it.
    """
    position = torch.arange(token_ids.shape[-1], device=token_ids.device)
    is_end = token_ids == END_TOKEN_ID
    first_end = torch.where(is_end.any(-1), is_end.int().argmax(-1), token_ids.shape[-1])
    return torch.where(position > first_end.unsqueeze(-1), torch.full_like(token_ids, pad_token_id), token_ids)


@dataclass
class Conditioning:
    """What the SDXL UNet is conditioned on, besides the timestep.

    text_states: (B, 77, 2048) both encoders' penultimate states, concatenated.
    pooled: (B, 1280) bigG's projected end-of-text embedding.
    time_ids: (B, 6) TIME_IDS in pixels.
    """

    text_states: torch.Tensor
    pooled: torch.Tensor
    time_ids: torch.Tensor

    def unet_kwargs(self, dtype: torch.dtype | None = None) -> dict:
        """Keyword arguments of UNet2DConditionModel.forward after the sample and the timestep."""
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return {"encoder_hidden_states": cast(self.text_states),
                "added_cond_kwargs": {"text_embeds": cast(self.pooled), "time_ids": cast(self.time_ids)}}


@torch.no_grad()
def encode_text(text_encoder: CLIPTextModel, text_encoder_2: CLIPTextModelWithProjection, token_ids: torch.Tensor,
                pad_token_id: int = END_TOKEN_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate states of both encoders concatenated (B, 77, W1 + W2), pooled bigG embedding (B, P)).

    `token_ids` (B, 77) are padded as bigG's tokenizer pads ("!"); ViT-L gets them re-padded with
    `pad_token_id` (its tokenizer's). As diffusers' StableDiffusionXLPipeline.encode_prompt: each
    encoder's hidden_states[-2], and text_encoder_2's `text_embeds`.
    """
    first = text_encoder(repad(token_ids, pad_token_id), output_hidden_states=True).hidden_states[-2]
    second = text_encoder_2(token_ids, output_hidden_states=True)
    return torch.cat([first, second.hidden_states[-2]], dim=-1), second.text_embeds


def time_ids(original_size: torch.Tensor, crop_top_left: torch.Tensor, target_size: int | tuple[int, int]) -> torch.Tensor:
    """(B, 6) float time ids from (B, 2) original (height, width) and (B, 2) crop (top, left), in pixels."""
    target = (target_size, target_size) if isinstance(target_size, int) else tuple(target_size)
    target_ids = torch.tensor(target, dtype=torch.float32, device=original_size.device).expand(original_size.shape[0], 2)
    return torch.cat([original_size.float(), crop_top_left.float(), target_ids], dim=-1)


def uncropped_time_ids(batch_size: int, image_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Time ids of images that were already `image_size` squares (synthetic data, samples)."""
    size = torch.full((batch_size, 2), image_size, dtype=torch.float32, device=device)
    return time_ids(size, torch.zeros_like(size), image_size)


def drop_conditioning(conditioning: Conditioning, prob: float) -> Conditioning:
    """Each row's text states and pooled embedding zeroed with probability `prob`; time ids kept.

    Zeros, not the empty caption's encoding: the reference SDXL trainer zeroes dropped conditioning, and the
    pipeline's unconditional branch (force_zeros_for_empty_prompt) is zeros, so guidance at
    sampling time asks the UNet exactly what dropout taught it. The draw uses the global RNG on
    the states' device (Composer seeds and checkpoints it), so a resumed run drops the same rows.
    """
    states = conditioning.text_states
    keep = (torch.rand(states.shape[0], device=states.device) >= prob).to(states.dtype)
    return Conditioning(states * keep.view(-1, 1, 1), conditioning.pooled * keep.view(-1, 1).to(conditioning.pooled.dtype),
                        conditioning.time_ids)


def predict(unet: torch.nn.Module, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: Conditioning) -> torch.Tensor:
    """The UNet's output (noise or velocity) for noisy latents at `timesteps`."""
    return unet(noisy_latents, timesteps, **conditioning.unet_kwargs()).sample


# -----------------------------------------------------------------------------------------------
# FLOPs per image.
# -----------------------------------------------------------------------------------------------

def count_flops_per_image(unet: torch.nn.Module, vae: torch.nn.Module | None, text_encoder: torch.nn.Module | None,
                          text_encoder_2: torch.nn.Module | None, image_size: int,
                          seq_len: int = MAX_LENGTH) -> dict[str, float]:
    """FLOPs of one training image, counted by `torch.utils.flop_counter` on meta tensors.

    As throughput.count_flops_per_image counts SD2's: pass modules built on the meta device
    (`meta_components`); nothing is computed or allocated. The UNet gets its added conditioning
    (pooled embedding and time ids); None for an encoder means its output is precomputed.
    Returns FLOPs for `unet_fwd`, `unet_fwd_bwd`, `vae_encoder`, `text_encoder` (both encoders), `total`.
    """
    latent_size = image_size // 8
    device = next(unet.parameters()).device
    width = unet.config.cross_attention_dim
    pooled_width = unet.config.projection_class_embeddings_input_dim - len(TIME_IDS) * unet.config.addition_time_embed_dim

    def counted(fn: Callable[[], object]) -> float:
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    latents = torch.randn(1, unet.config.in_channels, latent_size, latent_size, device=device)
    timesteps = torch.tensor([500], device=device)
    conditioning = Conditioning(torch.randn(1, seq_len, width, device=device), torch.randn(1, pooled_width, device=device),
                                torch.randn(1, len(TIME_IDS), device=device))
    # One pass: the forward's count read before the backward runs (half the time of counting a
    # forward and a forward+backward separately; tracing SDXL's ~2,000 modules is what takes long).
    with FlopCounterMode(display=False) as counter:
        output = predict(unet, latents, timesteps, conditioning)
        unet_fwd = float(counter.get_total_flops())
        output.sum().backward()
        unet_fwd_bwd = float(counter.get_total_flops())
    unet.zero_grad(set_to_none=True)
    flops = {"unet_fwd": unet_fwd, "unet_fwd_bwd": unet_fwd_bwd, "vae_encoder": 0.0, "text_encoder": 0.0}
    with torch.no_grad():
        if vae is not None:
            images = torch.randn(1, 3, image_size, image_size, device=device)
            flops["vae_encoder"] = counted(lambda: vae.encode(images))
        ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
        for encoder in (text_encoder, text_encoder_2):
            if encoder is not None:
                flops["text_encoder"] += counted(lambda: encoder(ids, output_hidden_states=True))
    flops["total"] = flops["unet_fwd_bwd"] + flops["vae_encoder"] + flops["text_encoder"]
    return flops


# -----------------------------------------------------------------------------------------------
# The diffusers pipeline: sampling and export.
# -----------------------------------------------------------------------------------------------

def write_pipeline(out, unet: UNet2DConditionModel, vae: AutoencoderKL, text_encoder: CLIPTextModel,
                   text_encoder_2: CLIPTextModelWithProjection, tokenizer: CLIPTokenizer, tokenizer_2: CLIPTokenizer,
                   scheduler) -> None:
    """Save a complete StableDiffusionXLPipeline folder (`StableDiffusionXLPipeline.from_pretrained(out)`).

    `scheduler` is the sampler (sample.make_sampler on the training schedule). The unconditional
    branch is zeros (`force_zeros_for_empty_prompt`), what caption dropout trained; no watermarker.
    """
    pipeline = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
        add_watermarker=False)
    pipeline.save_pretrained(out, safe_serialization=True)
