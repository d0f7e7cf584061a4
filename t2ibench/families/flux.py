"""Flux.1-schnell, MLPerf Training's text-to-image model since v5.1, as a model family: its configs
(`flux1-schnell`, and `flux1-tiny`, its structure at a few million parameters), its T5 and CLIP
conditioning, 2x2 latent patches, the rectified-flow objective and its pipeline; the rest is
`ModelFamily`'s. What MLPerf trains, and how this follows it, is in docs/flux.md.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.models.autoencoders.vae import Encoder
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from transformers import ByT5Tokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.t5.modeling_t5 import T5Block

from t2ibench.core.errors import fail
from t2ibench.families.family import TINY_VAE_LOGVAR_BIAS, ModelFamily, Parts, load_pretrained, new_text_encoder
from t2ibench.families.flops import count_flops
from t2ibench.core.images import image_shape
from t2ibench.families.objectives import RectifiedFlowObjective
from t2ibench.core.tokenizer import MAX_LENGTH as CLIP_MAX_LENGTH
from t2ibench.core.tokenizer import VOCAB_SIZE as CLIP_VOCAB_SIZE
from t2ibench.core.tokenizer import bundled_tokenizer, tokenize

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

# The tiny VAE's shift and scale: the mean and 1/std of its latent means, measured as Flux's 0.1159 and
# 0.3611 were (`python -m t2ibench.families.flux --measure_tiny_vae`: uniform images with a rectangle).
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
    "vae_logvar_bias": TINY_VAE_LOGVAR_BIAS,  # a miniature of a trained VAE (family.TINY_VAE_LOGVAR_BIAS)
}

CONFIGS = {"flux1-schnell": FLUX1_SCHNELL, "flux1-tiny": FLUX1_TINY}

# FLUX.1-schnell's sampler (its scheduler/ folder): flow-matching Euler with no resolution shift.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2 * W/2, C * 4) tokens, in FluxPipeline's order (channel, row, column)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // PATCH_SIZE, PATCH_SIZE, w // PATCH_SIZE, PATCH_SIZE)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // PATCH_SIZE) * (w // PATCH_SIZE), c * PATCH_SIZE ** 2)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents`: (B, H/2 * W/2, C * 4) -> (B, C, H, W), H and W in latent pixels."""
    b, _, d = tokens.shape
    c = d // PATCH_SIZE ** 2
    x = tokens.reshape(b, height // PATCH_SIZE, width // PATCH_SIZE, c, PATCH_SIZE, PATCH_SIZE)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def image_ids(latent_height: int, latent_width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions of the image tokens, (H/2 * W/2, 3): (0, row, column), as FluxPipeline makes them."""
    rows, cols = latent_height // PATCH_SIZE, latent_width // PATCH_SIZE
    ids = torch.zeros(rows, cols, 3, device=device)
    ids[..., 1] = torch.arange(rows, device=device)[:, None]
    ids[..., 2] = torch.arange(cols, device=device)[None, :]
    return ids.reshape(rows * cols, 3)


def text_ids(sequence_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions of the text tokens: all zero (their order is carried by T5's own attention)."""
    return torch.zeros(sequence_length, 3, device=device)


def clip_tokenizer() -> CLIPTokenizer:
    """CLIP-L's tokenizer, built offline: SD2's CLIP BPE vocabulary, padded with the end token as Flux's is."""
    return bundled_tokenizer(pad_token="<|endoftext|>")


def t5_tokenizer(config: str, model_name: str | None) -> Any:
    """ByT5's byte-level tokenizer for `flux1-tiny` (needs no files); for `flux1-schnell`, T5-XXL's
    SentencePiece tokenizer from `--model_name`'s tokenizer_2/, which cannot be built offline."""
    length = CONFIGS[config]["max_sequence_length"]
    if config == "flux1-tiny":
        # model_max_length carries the trained length (the exported tokenizer_2/ records it).
        return ByT5Tokenizer(model_max_length=length)
    tokenizer = load_pretrained(T5TokenizerFast, model_name, "tokenizer_2")
    if tokenizer is None:
        fail(f"--model_name {model_name}: flux1-schnell tokenizes captions with T5-XXL's SentencePiece tokenizer, "
             "which cannot be built offline; pass a local FLUX.1-schnell diffusers folder (with tokenizer_2/) or a "
             "cached hub id, or train on text states precomputed by latents.py (--precomputed) or --use_synth_data")
    tokenizer.model_max_length = length  # FLUX.1-schnell's tokenizer_2 says 512; MLPerf and schnell use 256
    return tokenizer


def measure_tiny_vae(seeds: tuple[int, ...] = (0, 1, 17, 42), image_size: int = 64) -> tuple[float, float]:
    """(shift, scale) of the tiny VAE: the mean and 1/std of its latent means on uniform images with a
    rectangle, averaged over `seeds` of its initialization (how TINY_SHIFT_FACTOR and TINY_SCALING_FACTOR were set)."""
    g = torch.Generator().manual_seed(0)
    images = []
    for _ in range(32):
        image = torch.rand(3, 1, 1, generator=g).expand(3, image_size, image_size).clone()
        a, b = sorted(torch.randint(0, image_size, (2,), generator=g).tolist())
        image[:, a:b + 1, a:b + 1] = torch.rand(3, 1, 1, generator=g)
        images.append(image * 2 - 1)
    batch = torch.stack(images)
    shifts, scales = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        with torch.no_grad():
            means = Flux().build_vae("flux1-tiny").encode(batch).latent_dist.mean
        shifts.append(means.mean().item())
        scales.append(1.0 / means.std().item())
    return sum(shifts) / len(shifts), sum(scales) / len(scales)


def analytic_transformer_flops(config: str, image_size: int | tuple[int, int]) -> dict[str, float]:
    """An independent forward count of the transformer from its architecture alone (2 FLOPs per
    multiply-add), to check the flop counter's; `image_size` a square's side or (height, width) of a bucket.

    Per double-stream block, each stream (image tokens, text tokens) has its own q, k, v, output and
    4x MLP weights (12 d^2 multiply-adds per token) and AdaLN modulation (6 d x d, once per sample);
    per single-stream block every token goes through q, k, v and the 4x MLP input (7 d^2) and the
    joint output projection (5 d^2), AdaLN 3 d x d once per sample. Attention over all S tokens
    costs 2 S^2 d multiply-adds (scores and weighted sum). Embedders and the output layer as their
    shapes say.
    """
    c, length = CONFIGS[config]["transformer"], CONFIGS[config]["max_sequence_length"]
    d = c["num_attention_heads"] * c["attention_head_dim"]
    height, width = image_shape(image_size)
    n_img = (height // VAE_DOWNSAMPLE // PATCH_SIZE) * (width // VAE_DOWNSAMPLE // PATCH_SIZE)
    s = n_img + length
    macs_linear = (
        n_img * c["in_channels"] * d + length * c["joint_attention_dim"] * d  # x_embedder, context_embedder
        + (256 * d + d * d) + (c["pooled_projection_dim"] * d + d * d)  # timestep and pooled-text MLPs
        + c["num_layers"] * (s * 12 * d * d + 2 * 6 * d * d)
        + c["num_single_layers"] * (s * 12 * d * d + 3 * d * d)
        + 2 * d * d + n_img * d * c["in_channels"]  # final AdaLN, output projection
    )
    macs_attention = (c["num_layers"] + c["num_single_layers"]) * 2 * s * s * d
    return {"linear": 2.0 * macs_linear, "attention": 2.0 * macs_attention,
            "forward": 2.0 * (macs_linear + macs_attention)}


class Flux(ModelFamily):
    name = "flux"
    architectures = CONFIGS
    pretrained_configs = ("flux1-schnell",)
    default_model_name = "black-forest-labs/FLUX.1-schnell"
    denoiser_name = "transformer"
    denoiser_class = FluxTransformer2DModel
    text_encoder_classes = {"text_encoder": CLIPTextModel, "text_encoder_2": T5EncoderModel}  # CLIP-L, T5-XXL
    scheduler_class = FlowMatchEulerDiscreteScheduler
    scheduler_config = SCHEDULER_CONFIG
    pipeline_class = "FluxPipeline"
    pipeline_parts = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
    # 11.9B parameters: fp32 weights, gradients and two AdamW moments are 190 GB (238 GB with an EMA),
    # more than any one GPU holds. The model trains sharded (FSDP full_shard), as MLPerf's entries do.
    parallelism = "fsdp"
    text_input_keys = ("clip_ids", "t5_ids")
    conditioning_keys = ("t5_states", "clip_pooled")
    latent_downsample = VAE_DOWNSAMPLE
    patch_size = PATCH_SIZE
    timestep_samplings = ("uniform", "logit_normal")
    samplers = {"euler": FlowMatchEulerDiscreteScheduler}  # FluxPipeline's: Euler on the flow
    refused_flags = {
        "snr_gamma": "min-SNR-gamma weights DDPM timesteps by their signal-to-noise ratio; rectified flow "
                     "trains with the plain MSE to the velocity, as MLPerf's reference does",
        "xformers": "xFormers' attention processor has no rotary embedding; the transformer uses PyTorch SDPA",
    }
    precomputes_text_states = True  # MLPerf's set-up: T5 and CLIP outputs stored, no encoder in the step
    # --compile: the double- and single-stream blocks (its FSDP units too), CLIP's and T5's layers, the
    # VAE encoder whole (as SD2's: `ModelFamily.compile_block_classes`).
    compile_block_classes = (FluxTransformerBlock, FluxSingleTransformerBlock, CLIPEncoderLayer, T5Block, Encoder)

    # -- building --------------------------------------------------------------------------------
    def default_image_size(self, config: str) -> int:
        """MLPerf trains Flux.1 at 256x256; the tiny model at 64x64, its size for CPU runs and tests."""
        return 256 if config == "flux1-schnell" else 64

    def build_tokenizers(self, config: str, model_name: str | None) -> tuple[dict[str, Any], list[str]]:
        # CLIP-L's is built from its vocabulary offline; T5's loads from model_name or stops (t5_tokenizer).
        clip = load_pretrained(CLIPTokenizer, model_name, "tokenizer")
        tokenizers = {"tokenizer": clip or clip_tokenizer(), "tokenizer_2": t5_tokenizer(config, model_name)}
        loaded = ["tokenizer"] if clip is not None else []
        if model_name:  # t5_tokenizer loaded it (or stopped)
            loaded.append("tokenizer_2")
        return tokenizers, loaded

    def max_sequence_length(self, config: str) -> int:
        """T5 tokens per caption (256 for flux1-schnell, as MLPerf; pass it to FluxPipeline as max_sequence_length)."""
        return self.architectures[config]["max_sequence_length"]

    def conditioning_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        architecture = self.architectures[config]
        return {"t5_states": (architecture["max_sequence_length"], architecture["text_encoder_2"]["d_model"]),
                "clip_pooled": (architecture["text_encoder"]["hidden_size"],)}

    def text_input_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        return {"clip_ids": (CLIP_MAX_LENGTH,), "t5_ids": (self.architectures[config]["max_sequence_length"],)}

    def vocabulary_sizes(self, config: str) -> dict[str, int]:
        return {"clip_ids": CLIP_VOCAB_SIZE, "t5_ids": self.architectures[config]["text_encoder_2"]["vocab_size"]}

    # -- conditioning ------------------------------------------------------------------------------
    def tokenize(self, tokenizers: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        t5 = tokenizers["tokenizer_2"]
        # Padded and truncated as FluxPipeline does, so an exported pipeline conditions the same way;
        # the length is the config's, carried by the tokenizer (see t5_tokenizer).
        t5_ids = t5(captions, padding="max_length", max_length=t5.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
        return {"clip_ids": tokenize(tokenizers["tokenizer"], captions), "t5_ids": t5_ids}

    def encode_text(self, text_encoders: dict[str, torch.nn.Module],
                    text_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # T5's last hidden states (no attention mask: Flux attends to the padding too, as FluxPipeline
        # encodes), and CLIP's pooled output (not projected), as FluxPipeline does.
        return {"t5_states": text_encoders["text_encoder_2"](text_inputs["t5_ids"])[0],
                "clip_pooled": text_encoders["text_encoder"](text_inputs["clip_ids"]).pooler_output}

    # -- training ----------------------------------------------------------------------------------
    def objective(self, noise_scheduler: Any, timestep_sampling: str = "uniform") -> RectifiedFlowObjective:
        return RectifiedFlowObjective(noise_scheduler, timestep_sampling)

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        b, _, h, w = noisy.shape
        t5_states, pooled = conditioning["t5_states"], conditioning["clip_pooled"]
        # The transformer takes s = t / 1000 in [0, 1] (it scales by 1000 itself), as FluxPipeline passes it.
        s = (timesteps.float() / 1000.0).expand(b) if timesteps.dim() == 0 else timesteps.float() / 1000.0
        tokens = denoiser(pack_latents(noisy), t5_states.to(noisy.dtype), pooled.to(noisy.dtype), s.to(noisy.dtype),
                          image_ids(h, w, noisy.device), text_ids(t5_states.shape[1], noisy.device)).sample
        return unpack_latents(tokens, h, w)

    def fsdp_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Every double-stream and single-stream block: for flux1-schnell 19 units of 0.34B and 38 of 0.14B parameters.

        These are also the modules that diffusers' gradient checkpointing (`--activation_checkpointing`,
        `enable_gradient_checkpointing`) wraps one at a time in the transformer's forward, so
        checkpointing and sharding have the same granularity: a block's recompute runs in its own
        unit's backward, while that unit's weights are gathered. The embedders, the final norm and
        the output projection stay in the root unit.
        """
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    # -- figures -----------------------------------------------------------------------------------
    def flops_per_image(self, config: str, image_size: int | tuple[int, int], *, vae: bool = True,
                        text_encoders: bool = True) -> dict[str, float]:
        """`ModelFamily.flops_per_image`, with CLIP-L's and T5-XXL's shares of `text_encoder` apart (`clip`, `t5`)."""
        flops = super().flops_per_image(config, image_size, vae=vae, text_encoders=False)
        flops["clip"] = flops["t5"] = 0.0
        if text_encoders:  # each encoder counted once, on its own
            shapes = self.text_input_shapes(config)
            for key, name, ids in (("clip", "text_encoder", "clip_ids"), ("t5", "text_encoder_2", "t5_ids")):
                def count(name: str = name, ids: str = ids) -> float:
                    with torch.device("meta"), torch.no_grad():
                        encoder = new_text_encoder(self.text_encoder_classes[name], self.architectures[config][name])
                        return count_flops(lambda: encoder(torch.zeros(1, *shapes[ids], dtype=torch.long)))
                flops[key] = self.counted_once(key, config, None, count)
            flops["text_encoder"] = flops["clip"] + flops["t5"]
            flops["total"] += flops["text_encoder"]
        return flops

    def precomputed_bytes_per_sample(self, config: str, image_size: int, itemsize: int = 2) -> dict[str, int]:
        """Bytes of one precomputed sample before compression, at `itemsize` bytes per value (fp16,
        as latents.py stores; MLPerf's bf16 is the same size): VAE moments (mean and log-variance, 16
        channels), T5 states (L x 4096) and CLIP's pooled output (768), plus an int64 index."""
        latent = self.latent_channels(config) * (image_size // self.latent_downsample) ** 2
        shapes = self.conditioning_shapes(config)
        sizes = {"vae_moments": 2 * latent * itemsize,
                 "t5_states": shapes["t5_states"][0] * shapes["t5_states"][1] * itemsize,
                 "clip_pooled": shapes["clip_pooled"][0] * itemsize, "index": 8}
        sizes["total"] = sum(sizes.values())
        return sizes

    # -- use ---------------------------------------------------------------------------------------
    def make_pipeline(self, parts: Parts, sampler: Any) -> FluxPipeline:
        """A FluxPipeline of the parts. Sample from it with max_sequence_length = the trained T5 length
        (`max_sequence_length`; FluxPipeline's default is 512); guidance_scale is ignored (schnell has no
        guidance embedding), true_cfg_scale with a negative_prompt gives classifier-free guidance."""
        return FluxPipeline(scheduler=sampler, vae=parts.vae, text_encoder=parts.text_encoders.get("text_encoder"),
                            tokenizer=parts.tokenizers.get("tokenizer"),
                            text_encoder_2=parts.text_encoders.get("text_encoder_2"),
                            tokenizer_2=parts.tokenizers.get("tokenizer_2"), transformer=parts.denoiser)


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--measure_tiny_vae"]:
        print("tiny VAE: shift {:.4f}, scale {:.4f}".format(*measure_tiny_vae()))
