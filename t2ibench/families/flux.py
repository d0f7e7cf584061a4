"""Flux.1-schnell, MLPerf Training's text-to-image model since v5.1, as a model family: configs, parts, training.

MLPerf Training v5.1 trains the Flux.1-schnell architecture from scratch (a rectified-flow
multimodal diffusion transformer of 11.9B parameters) on CC12M at 256x256, with the 16-channel VAE,
CLIP-L (pooled output) and T5-XXL (256 tokens) frozen and their outputs precomputed. This module
holds everything specific to that model, so the commands only choose it:

- `flux1-schnell` mirrors the diffusers configs of black-forest-labs/FLUX.1-schnell
  (`FluxTransformer2DModel`: 19 double-stream + 38 single-stream blocks, width 3072 = 24 heads x 128,
  16-channel latents patched 2x2 into 64 input channels, RoPE axes (16, 56, 56), no guidance
  embedding); `flux1-tiny` keeps its structure at a few million parameters for CPUs and tests.
  Both build offline; pretrained VAE, CLIP-L and T5-XXL come from `--model_name` when present.
- Rectified flow as the MLPerf reference trains it (read from its training step):
  x_t = (1 - t) x0 + t noise with t ~ U(0, 1), the transformer predicts the velocity noise - x0,
  MSE loss; latents are (VAE sample - shift) x scale. SD3's logit-normal t is offered as a flag.
- MLPerf's quality measure: the validation loss at 8 fixed timesteps t = k/8 (see validation.py).
- FLOPs per sample, bytes per precomputed sample, and a `FluxPipeline` folder for export.

    python -c "import flux; print(flux.count_parameters(flux.meta_components('flux1-schnell')['transformer']))"
"""
from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from composer.models import ComposerModel
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from torch.utils.flop_counter import FlopCounterMode
from transformers import (ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel,
                          T5TokenizerFast)

from model import LossBins, _load_pretrained, scale_images
from tokenizer import MAX_LENGTH as CLIP_MAX_LENGTH
from tokenizer import bundled_tokenizer, tokenize
from validation import NUM_VALIDATION_TIMESTEPS, validation_noise, validation_timestep_index

PATCH_SIZE = 2  # latents are cut into 2x2 patches: 16 channels -> 64 per token
VAE_DOWNSAMPLE = 8  # pixels per latent pixel (four VAE blocks, three downsamplings)

FLUX1_SCHNELL: dict[str, Any] = {
    "transformer": dict(
        patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
        guidance_embeds=False, axes_dims_rope=(16, 56, 56),
    ),
    # Flux's VAE: SD's architecture with 16 latent channels, no quant convs, and a shift as well as a scale.
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True,
    ),
    # CLIP ViT-L/14's text tower (openai/clip-vit-large-patch14): Flux reads its pooled output (768).
    # eos_token_id 2 is that checkpoint's (legacy) value: transformers then pools at argmax(input_ids),
    # the end token, as the pretrained model was trained to.
    "text_encoder": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        hidden_act="quick_gelu", vocab_size=49408, max_position_embeddings=77, projection_dim=768,
        bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
    # T5 v1.1 XXL, encoder only (google/t5-v1_1-xxl): 4096 wide, 24 layers, gated GELU.
    "text_encoder_2": dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6, dropout_rate=0.1, tie_word_embeddings=False, is_encoder_decoder=False,
    ),
    "max_sequence_length": 256,  # T5 tokens: MLPerf's (and schnell's) length
}

# The tiny VAE is random, but must behave like a trained one: its posterior nearly deterministic
# (a random encoder's log-variance is ~0, a std of ~1 that buries the means), so the log-variance
# half of the encoder's output convolution starts at -12 (Flux's VAE has no quant_conv, where SD2's
# tiny VAE puts it). Shift and scale are the mean and 1/std of this VAE's latent means, measured as
# Flux's 0.1159 and 0.3611 were (`python flux.py --measure_tiny_vae`, shape and uniform images).
TINY_VAE_LOGVAR_BIAS = -12.0
TINY_SHIFT_FACTOR = -0.01  # measured -0.0101 (means of seeds 0, 1, 17, 42)
TINY_SCALING_FACTOR = 2.83  # measured 2.827

FLUX1_TINY: dict[str, Any] = {
    # Same structure (double- then single-stream blocks, 2x2 patches of 16 channels, 3-axis RoPE whose
    # dimensions add up to the head size, no guidance embedding) at 96 wide: 4 heads of 24. 1.3M
    # parameters and 0.21 GFLOP per 64x64 sample (fwd+bwd), about the SD2 tiny UNet's 0.18.
    "transformer": dict(
        FLUX1_SCHNELL["transformer"], num_layers=2, num_single_layers=4, attention_head_dim=24, num_attention_heads=4,
        joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=(8, 8, 8),
    ),
    "vae": dict(
        FLUX1_SCHNELL["vae"], block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
        sample_size=64, scaling_factor=TINY_SCALING_FACTOR, shift_factor=TINY_SHIFT_FACTOR,
    ),
    "text_encoder": dict(
        FLUX1_SCHNELL["text_encoder"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, projection_dim=64,
    ),
    # Byte-level T5 (ByT5's tokenizer: 384 ids, no vocabulary file), so the tiny model needs nothing
    # that cannot be built offline.
    "text_encoder_2": dict(
        FLUX1_SCHNELL["text_encoder_2"], vocab_size=384, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
    ),
    # Bytes of caption (with the end token): short captions fit. Text tokens are most of the sequence
    # at 64x64 (16 image tokens), so 32 rather than 256 keeps a CPU step cheap (64 would cost 1.7x).
    "max_sequence_length": 32,
}

MODEL_CONFIGS = {"flux1-schnell": FLUX1_SCHNELL, "flux1-tiny": FLUX1_TINY}

# FLUX.1-schnell's sampler (its scheduler/ folder): flow-matching Euler with no resolution shift.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)

TIMESTEP_SAMPLING = ("uniform", "logit_normal")  # MLPerf's reference draws t ~ U(0, 1)

# MLPerf Training v5.1 text-to-image (Flux.1), published elsewhere: set-up and results per GPU.
MLPERF_TRAIN_SAMPLES = 1_099_776  # the CC12M subset, 256x256
MLPERF_TARGET_EVAL_LOSS = 0.586  # validation loss over 8 timesteps
NVIDIA_DECLARED_FLOP_PER_SAMPLE = 20.3e12
MLPERF_SAMPLES_PER_SEC_PER_GPU = {"B200": 51.0, "GB200": 56.0, "GB300": 62.0}  # GB300 62-70 over entries


def config(model_config: str) -> dict[str, Any]:
    """The configs of `model_config`; ValueError naming the flag for an unknown one."""
    if model_config not in MODEL_CONFIGS:
        raise ValueError(f"--model_config: unknown '{model_config}', choose from {sorted(MODEL_CONFIGS)}")
    return MODEL_CONFIGS[model_config]


# -----------------------------------------------------------------------------------------------
# Latents: packing into tokens, positions for RoPE, shift and scale
# -----------------------------------------------------------------------------------------------

def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2 * W/2, C * 4) tokens, in FluxPipeline's order (channel, row, column)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH_SIZE, PATCH_SIZE, w // PATCH_SIZE, PATCH_SIZE)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // PATCH_SIZE) * (w // PATCH_SIZE), c * PATCH_SIZE ** 2)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents`: (B, H/2 * W/2, C * 4) -> (B, C, H, W), H and W in latent pixels."""
    b, _, d = tokens.shape
    c = d // PATCH_SIZE ** 2
    x = tokens.view(b, height // PATCH_SIZE, width // PATCH_SIZE, c, PATCH_SIZE, PATCH_SIZE)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def image_ids(latent_height: int, latent_width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions of the image tokens, (H/2 * W/2, 3): (0, row, column), as FluxPipeline makes them."""
    rows, cols = latent_height // PATCH_SIZE, latent_width // PATCH_SIZE
    ids = torch.zeros(rows, cols, 3, device=device)
    ids[..., 1] = torch.arange(rows, device=device)[:, None]
    ids[..., 2] = torch.arange(cols, device=device)[None, :]
    return ids.reshape(rows * cols, 3)


def text_ids(sequence_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions of the text tokens: all zero (text order is carried by T5's own attention)."""
    return torch.zeros(sequence_length, 3, device=device)


def to_model_latents(unscaled: torch.Tensor, shift: float, scale: float) -> torch.Tensor:
    """VAE latents -> the transformer's (unit-variance) space: (z - shift) * scale, as Flux and MLPerf do."""
    return (unscaled - shift) * scale


def from_model_latents(latents: torch.Tensor, shift: float, scale: float) -> torch.Tensor:
    """The inverse, for decoding (FluxPipeline: latents / scale + shift)."""
    return latents / scale + shift


def sample_posterior(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """A draw from the stored VAE posterior, mean + std * eps (what `latent_dist.sample()` computes), in fp32."""
    mean, logvar = mean.float(), logvar.float()
    eps = torch.randn(mean.shape, device=mean.device)
    return mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps


# -----------------------------------------------------------------------------------------------
# Rectified flow
# -----------------------------------------------------------------------------------------------

def sample_timesteps(num: int, device: torch.device | str, sampling: str = "uniform", logit_mean: float = 0.0,
                     logit_std: float = 1.0) -> torch.Tensor:
    """t in (0, 1) per sample: `uniform` as MLPerf's reference (torch.rand), or SD3's `logit_normal`
    (sigmoid of a normal with `logit_mean`, `logit_std`), which puts more samples at mid noise levels."""
    if sampling == "uniform":
        return torch.rand(num, device=device)
    if sampling == "logit_normal":
        return torch.sigmoid(torch.randn(num, device=device) * logit_std + logit_mean)
    raise ValueError(f"--timestep_sampling: unknown '{sampling}', choose from {list(TIMESTEP_SAMPLING)}")


def interpolate(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise: data at t = 0, pure noise at t = 1."""
    t = t.view(-1, *([1] * (latents.dim() - 1)))
    return (1.0 - t) * latents + t * noise


def velocity_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """d x_t / dt = noise - x0: what the transformer predicts (FluxPipeline's Euler step integrates it)."""
    return noise - latents


# -----------------------------------------------------------------------------------------------
# Parts: tokenizers, encoders, VAE, transformer
# -----------------------------------------------------------------------------------------------

def clip_tokenizer() -> CLIPTokenizer:
    """CLIP-L's tokenizer, built offline: SD2's CLIP BPE, padded with the end token as Flux's is."""
    return bundled_tokenizer(pad_token="<|endoftext|>")


class MissingPart(ValueError):
    """A part that cannot be built offline is needed and `--model_name` does not provide it."""


def t5_tokenizer(model_config: str, model_name: str | None = None):
    """The T5 tokenizer: ByT5's byte-level one for `flux1-tiny` (needs no files); for `flux1-schnell`
    T5-XXL's SentencePiece tokenizer from `--model_name`'s tokenizer_2/ (it cannot be built offline)."""
    if model_config == "flux1-tiny":
        return ByT5Tokenizer()
    tokenizer = _load_pretrained(T5TokenizerFast, model_name, "tokenizer_2")
    if tokenizer is None:
        raise MissingPart(
            f"--model_name {model_name}: flux1-schnell tokenizes captions with T5-XXL's SentencePiece tokenizer, "
            "which cannot be built offline; pass a local FLUX.1-schnell diffusers folder (with tokenizer_2/) or a "
            "cached hub id, or train on precomputed text states (latents.py) or --use_synth_data")
    return tokenizer


def tokenize_t5(tokenizer, captions: list[str], max_length: int) -> torch.Tensor:
    """T5 token ids (len(captions), max_length), padded and truncated as FluxPipeline does."""
    return tokenizer(captions, padding="max_length", max_length=max_length, truncation=True,
                     return_tensors="pt").input_ids


def build_vae(model_config: str) -> AutoencoderKL:
    """A randomly initialized VAE of `model_config`; the tiny one as a miniature of a trained one."""
    vae = AutoencoderKL(**config(model_config)["vae"])
    if model_config == "flux1-tiny":
        with torch.no_grad():
            vae.encoder.conv_out.bias[vae.config.latent_channels:] = TINY_VAE_LOGVAR_BIAS
    return vae


def build_transformer(model_config: str) -> FluxTransformer2DModel:
    return FluxTransformer2DModel(**config(model_config)["transformer"])


@dataclass
class FluxComponents:
    """The parts of Flux (None where not built), plus what was loaded pretrained and what was not."""

    transformer: FluxTransformer2DModel | None
    vae: AutoencoderKL | None
    text_encoder: CLIPTextModel | None
    tokenizer: CLIPTokenizer | None
    text_encoder_2: T5EncoderModel | None
    tokenizer_2: Any
    scheduler: FlowMatchEulerDiscreteScheduler
    max_sequence_length: int
    latent_shift: float
    latent_scale: float
    pretrained: list[str] = field(default_factory=list)
    random: list[str] = field(default_factory=list)


def build_components(model_config: str, model_name: str | None = None, *, with_transformer: bool = True,
                     with_vae: bool = True, with_text_encoders: bool = True,
                     with_tokenizers: bool | None = None) -> FluxComponents:
    """Build Flux's parts: a random transformer, frozen VAE/CLIP/T5 (pretrained from `model_name` if found).

    `model_name` (hub id or local diffusers folder of FLUX.1-schnell) is only consulted for
    `flux1-schnell`. Each random part is drawn from its own generator, seeded from the global seed
    and the part's name, so a part is the same whatever else is built (latents.py's encoders and a
    training run's). `with_tokenizers` defaults to `with_text_encoders`; flux1-schnell's T5 tokenizer
    raises MissingPart when `model_name` does not hold it. Shift and scale come from the VAE's
    config (also when the VAE itself is not built: precomputed latents are unscaled moments).
    """
    cfg = config(model_config)
    lookup = model_name if model_config == "flux1-schnell" else None
    pretrained: list[str] = []
    random: list[str] = []

    def part(name: str, cls, build):
        module = _load_pretrained(cls, lookup, name)
        (pretrained if module is not None else random).append(name)
        if module is not None:
            return module
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((torch.initial_seed() + zlib.crc32(name.encode())) % 2**63)
            return build()

    vae = text_encoder = text_encoder_2 = tokenizer = tokenizer_2 = transformer = None
    if with_vae:
        vae = part("vae", AutoencoderKL, lambda: build_vae(model_config))
    if with_text_encoders:
        text_encoder = part("text_encoder", CLIPTextModel, lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])))
        text_encoder_2 = part("text_encoder_2", T5EncoderModel,
                              lambda: T5EncoderModel(T5Config(**cfg["text_encoder_2"])))
    if with_text_encoders if with_tokenizers is None else with_tokenizers:
        tokenizer = _load_pretrained(CLIPTokenizer, lookup, "tokenizer") or clip_tokenizer()
        tokenizer_2 = t5_tokenizer(model_config, lookup)
    scheduler = _load_pretrained(FlowMatchEulerDiscreteScheduler, lookup, "scheduler") \
        or FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    if with_transformer:
        transformer = build_transformer(model_config)  # always from scratch: that is the benchmark
    vae_config = dict(vae.config) if vae is not None else dict(cfg["vae"])
    if vae is None and lookup:
        try:
            vae_config = AutoencoderKL.load_config(lookup, subfolder="vae", local_files_only=True)
        except Exception:  # noqa: BLE001 - not available offline: the config above holds Flux's own values
            pass
    return FluxComponents(transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, scheduler,
                          cfg["max_sequence_length"], float(vae_config["shift_factor"]),
                          float(vae_config["scaling_factor"]), pretrained, random)


def meta_components(model_config: str = "flux1-schnell") -> dict[str, torch.nn.Module]:
    """Transformer, VAE, CLIP and T5 on the meta device: shapes, parameter counts and FLOPs without memory."""
    cfg = config(model_config)
    with torch.device("meta"):
        return {
            "transformer": FluxTransformer2DModel(**cfg["transformer"]),
            "vae": AutoencoderKL(**cfg["vae"]),
            "text_encoder": CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])),
            "text_encoder_2": T5EncoderModel(T5Config(**cfg["text_encoder_2"])),
        }


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def encode_text(text_encoder: CLIPTextModel, text_encoder_2: T5EncoderModel, clip_ids: torch.Tensor,
                t5_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 last hidden states (B, L, D), CLIP pooled output (B, 768)) of token ids: the transformer's text input."""
    return text_encoder_2(t5_ids)[0], text_encoder(clip_ids).pooler_output


def tokenize_captions(components: FluxComponents, captions: list[str]) -> dict[str, torch.Tensor]:
    """{"clip_ids": (B, 77), "t5_ids": (B, L)}: both tokenizers, as FluxPipeline runs them."""
    return {"clip_ids": tokenize(components.tokenizer, captions),
            "t5_ids": tokenize_t5(components.tokenizer_2, captions, components.max_sequence_length)}


# -----------------------------------------------------------------------------------------------
# FLOPs and bytes
# -----------------------------------------------------------------------------------------------

def count_flops_per_image(parts: dict[str, torch.nn.Module], image_size: int, max_sequence_length: int,
                          online: bool = False) -> dict[str, float]:
    """FLOPs of one training sample, counted by `torch.utils.flop_counter` on meta tensors (as SD2's).

    Pass `meta_components(...)`. The trained network's forward and forward+backward at
    `image_size`; with `online`, also the frozen VAE encoder, CLIP and T5 forwards (the
    precomputed set-up MLPerf runs has none of them in the step). FLOPs, not GFLOP.
    """
    transformer = parts["transformer"]
    device = next(transformer.parameters()).device
    latent = image_size // VAE_DOWNSAMPLE
    channels = transformer.config.in_channels // PATCH_SIZE ** 2
    tokens = torch.randn(1, (latent // PATCH_SIZE) ** 2, transformer.config.in_channels, device=device)
    t5_states = torch.randn(1, max_sequence_length, transformer.config.joint_attention_dim, device=device)
    pooled = torch.randn(1, transformer.config.pooled_projection_dim, device=device)
    t = torch.full((1,), 0.5, device=device)
    ids_img, ids_txt = image_ids(latent, latent, device), text_ids(max_sequence_length, device)
    assert channels * PATCH_SIZE ** 2 == transformer.config.in_channels

    def counted(fn) -> float:
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    def forward():
        return transformer(tokens, t5_states, pooled, t, ids_img, ids_txt).sample

    with FlopCounterMode(display=False) as counter:  # one pass: forward, then backward
        output = forward()
        forward_flops = float(counter.get_total_flops())
        output.sum().backward()
    flops = {"transformer_fwd": forward_flops, "transformer_fwd_bwd": float(counter.get_total_flops()),
             "vae_encoder": 0.0, "text_encoder": 0.0, "text_encoder_2": 0.0}
    transformer.zero_grad(set_to_none=True)
    if online:
        with torch.no_grad():
            images = torch.randn(1, 3, image_size, image_size, device=device)
            flops["vae_encoder"] = counted(lambda: parts["vae"].encode(images))
            flops["text_encoder"] = counted(
                lambda: parts["text_encoder"](torch.zeros(1, CLIP_MAX_LENGTH, dtype=torch.long, device=device)))
            flops["text_encoder_2"] = counted(
                lambda: parts["text_encoder_2"](torch.zeros(1, max_sequence_length, dtype=torch.long, device=device)))
    flops["total"] = sum(flops[k] for k in ("transformer_fwd_bwd", "vae_encoder", "text_encoder", "text_encoder_2"))
    return flops


def analytic_transformer_flops(transformer_config: dict[str, Any], image_size: int, max_sequence_length: int) -> dict:
    """An independent forward count from the architecture alone (2 FLOPs per multiply-add).

    Per double-stream block, each stream (image and text tokens) has its own q, k, v, output and
    4x MLP weights (12 d^2 multiply-adds per token) and AdaLN modulation (6 d x d, once per sample);
    per single-stream block all tokens share q, k, v and the 4x MLP in (7 d^2), and the output
    projection of attention and MLP together (5 d^2), AdaLN 3 d x d once per sample. Attention over
    all S tokens costs 2 S^2 d multiply-adds (scores and the weighted sum). Embedders and the
    output layer as their shapes say. Used by the tests against the flop counter.
    """
    c = transformer_config
    d = c["num_attention_heads"] * c["attention_head_dim"]
    n_img = (image_size // VAE_DOWNSAMPLE // PATCH_SIZE) ** 2
    n_txt = max_sequence_length
    s = n_img + n_txt
    macs_linear = (
        n_img * c["in_channels"] * d + n_txt * c["joint_attention_dim"] * d  # x_embedder, context_embedder
        + (256 * d + d * d) + (c["pooled_projection_dim"] * d + d * d)  # timestep and pooled-text MLPs
        + c["num_layers"] * ((n_img + n_txt) * 12 * d * d + 2 * 6 * d * d)
        + c["num_single_layers"] * (s * 12 * d * d + 3 * d * d)
        + 2 * d * d + n_img * d * c["in_channels"]  # final AdaLN, output projection
    )
    macs_attention = (c["num_layers"] + c["num_single_layers"]) * 2 * s * s * d
    return {"linear": 2.0 * macs_linear, "attention": 2.0 * macs_attention,
            "forward": 2.0 * (macs_linear + macs_attention)}


def precomputed_bytes_per_sample(model_config: str, image_size: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes of one precomputed sample before compression: VAE moments (mean and log-variance, 16
    channels), T5 states (L x 4096) and CLIP's pooled output (768), at `itemsize` bytes (fp16/bf16: 2),
    plus an int64 index; captions and MDS offsets not counted."""
    cfg = config(model_config)
    latent = cfg["vae"]["latent_channels"] * (image_size // VAE_DOWNSAMPLE) ** 2
    sizes = {
        "vae_moments": 2 * latent * itemsize,
        "t5_states": cfg["max_sequence_length"] * cfg["text_encoder_2"]["d_model"] * itemsize,
        "clip_pooled": cfg["text_encoder"]["hidden_size"] * itemsize,
        "index": 8,
    }
    sizes["total"] = sum(sizes.values())
    return sizes


# -----------------------------------------------------------------------------------------------
# Training
# -----------------------------------------------------------------------------------------------

class Flux(ComposerModel):
    """Rectified-flow training of the Flux transformer on VAE latents, conditioned on T5 and CLIP outputs.

    Batches are dicts, in one of two forms:
    - precomputed (latents.py; MLPerf's set-up, the default): `latent_mean`, `latent_logvar`
      (B, 16, H/8, W/8: the VAE posterior before shift and scale), `t5_states` (B, L, 4096) and
      `clip_pooled` (B, 768); no encoder runs.
    - online: `image` (B, 3, H, W) uint8 or float in [-1, 1], `clip_ids` (B, 77), `t5_ids` (B, L);
      the frozen VAE, CLIP and T5 run in the step.
    The step: latents x0 = (z - shift) * scale, t per sample (`timestep_sampling`), noise, x_t =
    (1 - t) x0 + t noise; the transformer sees x_t as 2x2-patch tokens with RoPE positions, the
    T5 states, the pooled CLIP output and t; the loss is the MSE to noise - x0. Every step adds
    its per-sample errors to `loss_bins` (t x 1000 in bins), as SD2's model does.
    `eval_forward` computes MLPerf's validation loss (validation.py) on batches that carry
    `sample_index`.
    """

    def __init__(self, transformer: FluxTransformer2DModel, *, latent_shift: float, latent_scale: float,
                 vae: AutoencoderKL | None = None, text_encoder: CLIPTextModel | None = None,
                 text_encoder_2: T5EncoderModel | None = None, timestep_sampling: str = "uniform",
                 logit_mean: float = 0.0, logit_std: float = 1.0, num_loss_bins: int = 10,
                 validation_seed: int = 0):
        super().__init__()
        if timestep_sampling not in TIMESTEP_SAMPLING:
            raise ValueError(f"--timestep_sampling: unknown '{timestep_sampling}', choose from {list(TIMESTEP_SAMPLING)}")
        self.transformer, self.vae = transformer, vae
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
        self.latent_shift, self.latent_scale = latent_shift, latent_scale
        self.timestep_sampling, self.logit_mean, self.logit_std = timestep_sampling, logit_mean, logit_std
        self.num_timesteps = 1000  # for the loss bins: t in [0, 1) read as 1000 steps, like SD2's
        self.loss_bins = LossBins(self.num_timesteps, num_loss_bins)
        self.validation_seed = validation_seed
        self.cpu_autocast_dtype: torch.dtype | None = None  # set for --precision amp_bf16 on CPU
        self.flops_per_image = 0.0  # set by the benchmark from count_flops_per_image
        self.caption_drop_prob = 0.0
        self.empty: dict[str, torch.Tensor] = {}
        for frozen in self._frozen():
            frozen.requires_grad_(False)
            frozen.eval()

    def _frozen(self) -> list[torch.nn.Module]:
        return [m for m in (self.vae, self.text_encoder, self.text_encoder_2) if m is not None]

    def train(self, mode: bool = True) -> "Flux":
        super().train(mode)  # Composer calls train() every epoch: the frozen parts stay in eval mode
        for frozen in self._frozen():
            frozen.eval()
        return self

    def set_caption_dropout(self, prob: float, empty: dict[str, torch.Tensor]) -> None:
        """Replace each caption by the empty one with probability `prob`, as MLPerf's reference does
        (0.1, its `classifier_free_guidance_prob`). `empty` holds the empty caption's rows of the
        batch keys it may replace (`t5_states` (1, L, D) and `clip_pooled` (1, 768), or `clip_ids` and
        `t5_ids`). The draw uses the global RNG, which Composer seeds and checkpoints."""
        self.caption_drop_prob, self.empty = prob, empty

    def _drop_captions(self, batch: dict) -> dict:
        keys = [k for k in ("t5_states", "clip_pooled", "clip_ids", "t5_ids") if k in batch]
        missing = [k for k in keys if k not in self.empty]
        if missing:
            raise ValueError(f"caption dropout needs the empty caption's {missing} (set_caption_dropout)")
        rows = batch[keys[0]].shape[0]
        drop = torch.rand(rows, device=batch[keys[0]].device) < self.caption_drop_prob
        out = dict(batch)
        for k in keys:
            mask = drop.view(-1, *([1] * (batch[k].dim() - 1)))
            out[k] = torch.where(mask, self.empty[k].to(device=batch[k].device, dtype=batch[k].dtype), batch[k])
        return out

    def latents_and_text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x0 in the transformer's latent space (fp32), T5 states, CLIP pooled) of a batch of either form."""
        if "latent_mean" in batch:
            unscaled = sample_posterior(batch["latent_mean"], batch["latent_logvar"])
        elif self.vae is None:
            raise ValueError("this model was built without a VAE (precomputed latents) but got an image batch")
        else:
            with torch.no_grad():
                images = scale_images(batch["image"], next(self.vae.parameters()).dtype)
                unscaled = self.vae.encode(images).latent_dist.sample().float()
        if "t5_states" in batch:
            t5_states, pooled = batch["t5_states"], batch["clip_pooled"]
        elif self.text_encoder is None or self.text_encoder_2 is None:
            raise ValueError("this model was built without text encoders (precomputed text states) but got token ids")
        else:
            t5_states, pooled = encode_text(self.text_encoder, self.text_encoder_2, batch["clip_ids"], batch["t5_ids"])
        return to_model_latents(unscaled, self.latent_shift, self.latent_scale), t5_states, pooled

    def predict(self, noisy: torch.Tensor, t: torch.Tensor, t5_states: torch.Tensor,
                pooled: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity for latents `noisy` (B, C, H, W) at times `t` (B,) in [0, 1]."""
        _, _, h, w = noisy.shape
        dtype = noisy.dtype
        tokens = self.transformer(
            pack_latents(noisy), t5_states.to(dtype), pooled.to(dtype), t.to(dtype),
            image_ids(h, w, noisy.device), text_ids(t5_states.shape[1], noisy.device),
        ).sample
        return unpack_latents(tokens, h, w)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cpu_autocast_dtype is not None:
            # Composer autocasts on CUDA only (and refuses AMP on CPU): on CPU the model does it itself.
            with torch.autocast("cpu", dtype=self.cpu_autocast_dtype):
                return self._forward(batch)
        return self._forward(batch)

    def _forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.caption_drop_prob > 0:
            batch = self._drop_captions(batch)
        latents, t5_states, pooled = self.latents_and_text(batch)
        # Noise drawn in fp32 with torch.randn (not randn_like), so draws do not depend on dtype or layout.
        noise = torch.randn(latents.shape, device=latents.device)
        t = sample_timesteps(latents.shape[0], latents.device, self.timestep_sampling, self.logit_mean, self.logit_std)
        prediction = self.predict(interpolate(latents, noise, t), t, t5_states, pooled)
        return prediction, velocity_target(latents, noise), t

    def loss(self, outputs: tuple[torch.Tensor, ...], batch: dict) -> torch.Tensor:
        prediction, target, t = outputs
        errors = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
        self.loss_bins.add(errors.detach(), self.timestep_bins(t))
        return errors.mean()

    def timestep_bins(self, t: torch.Tensor) -> torch.Tensor:
        """t in [0, 1] as integer steps 0..999 for `loss_bins`."""
        return (t * self.num_timesteps).long().clamp_(0, self.num_timesteps - 1)

    def flops_per_batch(self, batch: dict) -> float:
        key = "latent_mean" if "latent_mean" in batch else "image"
        return self.flops_per_image * batch[key].shape[0]

    @torch.no_grad()
    def validation_errors(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """MLPerf's validation: per sample, the MSE at t = k/8 with k = its `sample_index` mod 8 and
        noise fixed by that index, so every evaluation scores the same problems. Returns the
        per-sample errors and timestep indices k (validation.ValidationLoss averages them)."""
        latents, t5_states, pooled = self.latents_and_text(batch)
        index = batch["sample_index"]
        k = validation_timestep_index(index)
        t = k.to(latents.device, torch.float32) / NUM_VALIDATION_TIMESTEPS
        noise = validation_noise(index, latents.shape[1:], self.validation_seed).to(latents.device)
        prediction = self.predict(interpolate(latents, noise, t), t, t5_states, pooled)
        errors = (prediction.float() - velocity_target(latents, noise)).pow(2).flatten(1).mean(1)
        return errors, k.to(errors.device)

    def eval_forward(self, batch: dict, outputs: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cpu_autocast_dtype is not None:
            with torch.autocast("cpu", dtype=self.cpu_autocast_dtype):
                return self.validation_errors(batch)
        return self.validation_errors(batch)


# -----------------------------------------------------------------------------------------------
# Sampling and export: a FluxPipeline
# -----------------------------------------------------------------------------------------------

def make_pipeline(components: FluxComponents, transformer: FluxTransformer2DModel) -> FluxPipeline:
    """An in-memory FluxPipeline of `transformer` and the frozen parts (text encoders may be None
    when sampling from precomputed text states: pass prompt_embeds and pooled_prompt_embeds)."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(components.scheduler.config)
    return FluxPipeline(scheduler=scheduler, vae=components.vae, text_encoder=components.text_encoder,
                        tokenizer=components.tokenizer, text_encoder_2=components.text_encoder_2,
                        tokenizer_2=components.tokenizer_2, transformer=transformer)


def write_pipeline(out: str | Path, components: FluxComponents, transformer: FluxTransformer2DModel) -> None:
    """Save a complete FluxPipeline folder (transformer/, vae/, text_encoder/, tokenizer/,
    text_encoder_2/, tokenizer_2/, scheduler/, model_index.json) that `FluxPipeline.from_pretrained`
    loads offline. Sample from it with `max_sequence_length` = the trained T5 length (`guidance_scale`
    is ignored: schnell has no guidance embedding)."""
    missing = [n for n in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
               if getattr(components, n) is None]
    if missing:
        raise ValueError(f"a FluxPipeline needs {missing}; build them (build_components) before exporting")
    make_pipeline(components, transformer).save_pretrained(str(out), safe_serialization=True)


@torch.no_grad()
def sample_images(pipeline: FluxPipeline, *, prompts: list[str] | None = None, t5_states: torch.Tensor | None = None,
                  clip_pooled: torch.Tensor | None = None, image_size: int, num_steps: int, seed: int,
                  max_sequence_length: int) -> torch.Tensor:
    """Images (N, 3, S, S) in [0, 1] from prompts or precomputed text states, with FluxPipeline's
    flow-matching Euler sampler. Image i starts from the noise of seed `seed + i`, so a grid does not
    depend on how prompts are shared out over ranks."""
    count = len(prompts) if prompts is not None else t5_states.shape[0]
    generators = [torch.Generator().manual_seed(seed + i) for i in range(count)]
    kwargs: dict[str, Any] = dict(height=image_size, width=image_size, num_inference_steps=num_steps,
                                  generator=generators, output_type="pt", max_sequence_length=max_sequence_length)
    if prompts is not None:
        kwargs["prompt"] = prompts
    else:
        kwargs["prompt_embeds"], kwargs["pooled_prompt_embeds"] = t5_states, clip_pooled
    return pipeline(**kwargs).images


def measure_tiny_vae(seeds: tuple[int, ...] = (0, 1, 17, 42), image_size: int = 64) -> tuple[float, float]:
    """(shift, scale) of the tiny VAE: mean and 1/std of its latent means on shape and uniform images,
    averaged over `seeds` of the VAE's initialization (how TINY_SHIFT_FACTOR and TINY_SCALING_FACTOR were set)."""
    g = torch.Generator().manual_seed(0)
    images = []
    for i in range(32):  # uniform colours and random rectangles on them
        image = torch.rand(3, 1, 1, generator=g).expand(3, image_size, image_size).clone()
        a, b = sorted(torch.randint(0, image_size, (2,), generator=g).tolist())
        image[:, a:b + 1, a:b + 1] = torch.rand(3, 1, 1, generator=g)
        images.append(image * 2 - 1)
    batch = torch.stack(images)
    shifts, scales = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        with torch.no_grad():
            means = build_vae("flux1-tiny").encode(batch).latent_dist.mean
        shifts.append(means.mean().item())
        scales.append(1.0 / means.std().item())
    return sum(shifts) / len(shifts), sum(scales) / len(scales)


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--measure_tiny_vae"]:
        shift, scale = measure_tiny_vae()
        print(f"tiny VAE: shift {shift:.4f}, scale {scale:.4f}")
    else:
        parts = meta_components("flux1-schnell")
        for name, module in parts.items():
            print(f"{name}: {count_parameters(module):,} parameters")
