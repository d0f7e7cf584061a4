"""Stable Diffusion 2 base as a Composer model: UNet trained from scratch, VAE and text encoder frozen.

The architecture is defined here as plain config dicts (`sd2-base` mirrors the diffusers /
transformers configs of stabilityai/stable-diffusion-2-base; `tiny` keeps its structure at a few
million parameters for CPUs and tests), so the model builds offline. Pretrained VAE, text encoder
and tokenizer come from `--model_name` when that folder or cached hub id is available.
"""
from __future__ import annotations

import copy
import functools
import os
import zlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.models import ComposerModel
from composer.utils import dist
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

MODEL_CONFIGS = {"sd2-base": SD2_BASE, "tiny": TINY}

# The DDPM training schedule of SD2 base (1000 steps, scaled_linear betas 0.00085..0.012).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    prediction_type="epsilon", clip_sample=False, steps_offset=1,
)
NUM_TRAIN_TIMESTEPS = SCHEDULER_CONFIG["num_train_timesteps"]
LATENT_SCALE = 0.18215  # SD2's VAE scaling_factor: latents * 0.18215 have roughly unit variance


def scale_images(images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pixels (as the loaders yield them) -> `dtype` in [-1, 1]; float input is taken as already scaled.

    Done on the device, after the transfer, so loader workers, pinned memory and the host-to-device
    copy carry one byte per pixel instead of four.
    """
    if images.dtype == torch.uint8:
        return images.to(dtype).div_(127.5).sub_(1.0)
    return images.to(dtype)


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast lowers to on `tensor`'s device, or None when autocast is off there."""
    device_type = tensor.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


class AutocastGroupNorm(torch.nn.GroupNorm):
    """GroupNorm that runs in the autocast dtype (`norm_dtype = None`) or in fp32 under autocast.

    CUDA autocast runs group_norm in fp32 (torch 2.7's fp32 list): a bf16 activation is read, an
    fp32 one written and kept for backward, and the frozen VAE's bf16 norm weights are upcast on
    every call. In the autocast dtype the kernels still accumulate in fp32 (CUDA's and the CPU's
    group_norm use an fp32 accumulator for bf16/fp16), as Composer's LowPrecisionGroupNorm does.
    Composer's algorithm is not used: it downcasts only under CUDA autocast (so the CPU tests could
    never run this path), and it replaces each module by a new one with fresh fp32 parameters that
    require grad, which would upcast the frozen bf16 VAE again and hand DDP parameters that never
    get a gradient. `set_norm_precision` changes the class in place instead: same parameters,
    dtypes, devices and checkpoint keys. `norm_dtype = torch.float32` runs the norm in fp32 under
    autocast on every device: CUDA autocast's own behaviour, and on a CPU (whose autocast runs norms
    in the input's dtype) an emulation of it. Without autocast both are plain GroupNorm.
    """

    norm_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        dtype = self.norm_dtype or dtype
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.group_norm(_cast(x, dtype), self.num_groups, _cast(self.weight, dtype),
                                                  _cast(self.bias, dtype), self.eps)


class AutocastLayerNorm(torch.nn.LayerNorm):
    """LayerNorm in the autocast dtype or in fp32 under autocast: see `AutocastGroupNorm`."""

    norm_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        dtype = self.norm_dtype or dtype
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.layer_norm(_cast(x, dtype), self.normalized_shape, _cast(self.weight, dtype),
                                                  _cast(self.bias, dtype), self.eps)


class Fp32GroupNorm(AutocastGroupNorm):
    norm_dtype = torch.float32


class Fp32LayerNorm(AutocastLayerNorm):
    norm_dtype = torch.float32


NORM_CLASSES = {"autocast": (AutocastGroupNorm, AutocastLayerNorm), "fp32": (Fp32GroupNorm, Fp32LayerNorm)}


def set_norm_precision(module: torch.nn.Module, precision: str) -> int:
    """Make every GroupNorm and LayerNorm in `module` run in the autocast dtype ("autocast") or in fp32
    ("fp32") under autocast, by changing their class in place; returns how many were changed."""
    group_norm, layer_norm = NORM_CLASSES[precision]
    # Exact classes only: a subclass with its own forward (diffusers' FP32LayerNorm) keeps it.
    group_norms = {torch.nn.GroupNorm, *(classes[0] for classes in NORM_CLASSES.values())}
    layer_norms = {torch.nn.LayerNorm, *(classes[1] for classes in NORM_CLASSES.values())}
    changed = 0
    for sub in module.modules():
        if type(sub) in group_norms:
            sub.__class__ = group_norm
            changed += 1
        elif type(sub) in layer_norms:
            sub.__class__ = layer_norm
            changed += 1
    return changed


def build_vae(model_config: str) -> AutoencoderKL:
    """A randomly initialized VAE of `model_config`; the tiny one as a miniature of a trained one."""
    vae = AutoencoderKL(**MODEL_CONFIGS[model_config]["vae"])
    if model_config == "tiny":
        with torch.no_grad():
            vae.quant_conv.bias[vae.config.latent_channels:] = TINY_VAE_LOGVAR_BIAS
    return vae


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
    latent_scale: float = LATENT_SCALE  # the VAE config's scaling_factor (also without the VAE built)


HUB_PROBE_SECONDS = 5.0  # one request to the hub's endpoint; huggingface_hub itself retries each file for minutes


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers at all, asked once per process with a short timeout.

    Offline without HF_HUB_OFFLINE set, huggingface_hub 0.x retries every file of every part with
    back-off (65 retry lines over 337 s measured for sd2-base) before giving up: one probe instead
    makes an unreachable hub cost seconds. Any HTTP answer, even an error status, means reachable.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_SECONDS, allow_redirects=False)
    except Exception:  # noqa: BLE001 - DNS, refused, timeout, proxy: all mean "not reachable from here"
        return False
    return True


def _load_pretrained(cls, model_name: str | None, subfolder: str):
    """`cls.from_pretrained(model_name, subfolder)`, or None when unavailable offline.

    A local folder is read directly. A hub id is looked up in the local hub cache first and only
    downloaded when HF_HUB_OFFLINE is not set, so that runs on air-gapped clusters do not hang.
    """
    if not model_name:
        return None
    attempts = [dict(local_files_only=True)]
    if not Path(model_name).is_dir() and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false") \
            and hub_reachable():
        attempts.append(dict(local_files_only=False))
    for kwargs in attempts:
        try:
            return cls.from_pretrained(model_name, subfolder=subfolder, **kwargs)
        except Exception:  # noqa: BLE001 - missing files, no network, bad repo: all mean "not available"
            continue
    return None


def pretrained_missing(model_name: str, parts: tuple[str, ...] = ("vae", "text_encoder")) -> list[str]:
    """The `parts` of `model_name` that cannot be loaded, judged without loading anything: not in the
    local folder (or the local hub cache for a hub id), and not downloadable (offline, or the hub does
    not answer). A part found here may still fail to load later (missing weights): build_components
    then reports it random, as before."""
    if Path(model_name).is_dir():
        return [p for p in parts if not Path(model_name, p, "config.json").is_file()]
    from huggingface_hub import try_to_load_from_cache

    try:
        missing = [p for p in parts if not isinstance(try_to_load_from_cache(model_name, f"{p}/config.json"), str)]
    except Exception:  # noqa: BLE001 - not a valid hub id (e.g. a path that does not exist): nothing to load
        return list(parts)
    if missing and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false") and hub_reachable():
        return []  # downloadable
    return missing


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
        vae = part("vae", AutoencoderKL, lambda: build_vae(model_config))
    if with_encoders if with_text_encoder is None else with_text_encoder:
        text_encoder = part("text_encoder", CLIPTextModel, lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])))
    if with_encoders if with_tokenizer is None else with_tokenizer:
        tokenizer = part("tokenizer", CLIPTokenizer, bundled_tokenizer)
        if "tokenizer" in random:  # the bundled tokenizer is SD2's own: not a random part
            random.remove("tokenizer")
    scheduler = _load_pretrained(DDPMScheduler, lookup, "scheduler") or DDPMScheduler(**SCHEDULER_CONFIG)
    if with_unet:
        unet = UNet2DConditionModel(**cfg["unet"])  # always from scratch: that is the benchmark
    if vae is not None:
        latent_scale = vae.config.scaling_factor
    else:  # precomputed latents: the scale of the VAE that encoded them, read from its config only
        latent_scale = cfg["vae"]["scaling_factor"]
        if lookup:
            try:
                latent_scale = AutoencoderKL.load_config(lookup, subfolder="vae", local_files_only=True)["scaling_factor"]
            except Exception:  # noqa: BLE001 - not available offline: SD2's own value from the config above
                pass
    return Components(unet, vae, text_encoder, tokenizer, scheduler, pretrained, random, float(latent_scale))


def build_encoders_aside(model_config: str, model_name: str | None, seed: int) -> Components:
    """VAE, text encoder and tokenizer as latents.py builds them under `seed`, leaving the RNG as it was.

    For a run that trains without encoders (precomputed) but needs them for the empty caption's
    text states, for sampling or for export: the random tiny encoders come out identical to the
    ones that encoded the data, and the UNet's initialization is not disturbed.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_components(model_config, model_name, with_unet=False)


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

    Training-recipe options (all off by default, and then the step is exactly the plain one):
    `snr_gamma` (min-SNR-gamma loss weighting), `offset_noise` (a per-channel constant added to the
    noise) and `caption_drop_prob` (see `set_caption_dropout`). Every step also adds its per-sample
    errors to `loss_bins` sums by timestep (a few element-wise ops on the latents, no host sync).
    """

    def __init__(self, unet: torch.nn.Module, vae: torch.nn.Module | None, text_encoder: torch.nn.Module | None,
                 noise_scheduler: DDPMScheduler, latent_scale: float | None = None, *, snr_gamma: float | None = None,
                 offset_noise: float = 0.0, num_loss_bins: int = 10):
        super().__init__()
        self.unet, self.vae, self.text_encoder = unet, vae, text_encoder
        self.noise_scheduler = copy.deepcopy(noise_scheduler)
        if latent_scale is None:  # the VAE's own factor (the tiny VAE's differs from SD2's)
            latent_scale = vae.config.scaling_factor if vae is not None else LATENT_SCALE
        self.latent_scale = latent_scale
        self.vae_channels_last = False  # set with --channels_last: feed the VAE channels-last images
        self.cpu_autocast_dtype: torch.dtype | None = None  # set for --precision amp_bf16 on CPU
        self.flops_per_image = 0.0  # set by the benchmark from throughput.count_flops_per_image
        self.num_timesteps = self.noise_scheduler.config.num_train_timesteps
        self.prediction_type = self.noise_scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"scheduler prediction_type '{self.prediction_type}' is not supported for training")
        self.snr_gamma, self.offset_noise = snr_gamma, offset_noise
        alphas_cumprod = self.noise_scheduler.alphas_cumprod.float()
        self.snr = alphas_cumprod / (1.0 - alphas_cumprod)  # signal-to-noise ratio of each timestep
        self.loss_bins = LossBins(self.num_timesteps, num_loss_bins)
        self.caption_drop_prob = 0.0
        self.empty_caption_ids: torch.Tensor | None = None
        self.empty_text_states: torch.Tensor | None = None
        for frozen in self._frozen():
            frozen.requires_grad_(False)
            frozen.eval()

    def set_caption_dropout(self, prob: float, empty_caption_ids: torch.Tensor | None = None,
                            empty_text_states: torch.Tensor | None = None) -> None:
        """Replace each caption by the empty one with probability `prob` (for classifier-free guidance).

        Rows of `captions` become `empty_caption_ids` (1, 77); rows of stored `text_states` become
        `empty_text_states` (1, 77, D), the text encoder's output for the empty caption. The draw
        uses the global RNG, which Composer seeds and checkpoints, so a resumed run drops the same rows.
        """
        self.caption_drop_prob = prob
        self.empty_caption_ids, self.empty_text_states = empty_caption_ids, empty_text_states

    def train(self, mode: bool = True) -> "StableDiffusion":
        # Composer calls model.train() every epoch: the frozen encoders must stay in eval mode.
        super().train(mode)
        for frozen in self._frozen():
            frozen.eval()
        return self

    def _frozen(self) -> list[torch.nn.Module]:
        """The encoders; absent when training on precomputed latents."""
        return [m for m in (self.vae, self.text_encoder) if m is not None]

    def mark_fsdp_units(self) -> None:
        """Tell Composer's FSDP2 wrapping (its policy for a ComposerModel) to shard the UNet only.

        Composer 0.32.1 (`generate_composer_model_policy`) wraps every direct child of the model
        with `fully_shard` unless the child says `_fsdp_wrap = False`; inside a child it asks the
        child's `fsdp_wrap_fn`. The frozen encoders are therefore marked off: sharded, they would be
        all-gathered on every forward for nothing (they hold no gradients or optimizer state), and
        they stay in the dtype the benchmark stored them in. The UNet is one FSDP unit per down
        block, the mid block and each up block (plus the root: conv_in, time embedding, conv_out),
        so that full-shard gathers one block at a time instead of the whole UNet.
        """
        for frozen in self._frozen():
            frozen._fsdp_wrap = False
        blocks = {*self.unet.down_blocks, self.unet.mid_block, *self.unet.up_blocks}
        self.unet.fsdp_wrap_fn = lambda module: module in blocks

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

    def _drop_captions(self, batch: dict) -> dict:
        """The batch with a random subset of its captions replaced by the empty caption."""
        key = "text_states" if "text_states" in batch else "captions"
        rows = batch[key]
        attribute = "empty_text_states" if key == "text_states" else "empty_caption_ids"
        empty = getattr(self, attribute)
        if empty is None:
            raise ValueError(f"caption dropout on '{key}' batches needs the empty caption's {key} (set_caption_dropout)")
        if empty.device != rows.device or empty.dtype != rows.dtype:
            # Moved (and cast) once and kept there: not a host-to-device copy on every microbatch.
            empty = empty.to(device=rows.device, dtype=rows.dtype)
            setattr(self, attribute, empty)
        drop = torch.rand(rows.shape[0], device=rows.device) < self.caption_drop_prob
        drop = drop.view(-1, *([1] * (rows.dim() - 1)))
        return {**batch, key: torch.where(drop, empty, rows)}

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cpu_autocast_dtype is not None:
            # Composer autocasts on CUDA only (and refuses AMP on CPU): on CPU the model does it itself.
            with torch.autocast("cpu", dtype=self.cpu_autocast_dtype):
                return self._forward(batch)
        return self._forward(batch)

    def _forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.caption_drop_prob > 0:
            batch = self._drop_captions(batch)
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
        if self.offset_noise:
            # Offset noise: a per-image, per-channel constant lets the model shift mean brightness.
            noise = noise + self.offset_noise * torch.randn(*latents.shape[:2], 1, 1, device=latents.device)
        timesteps = torch.randint(0, self.num_timesteps, (latents.shape[0],), device=latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        else:
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, text_states).sample
        return prediction, target, timesteps

    def flops_per_batch(self, batch: dict) -> float:
        """Model FLOPs of one training step on `batch` (read by Composer's SpeedMonitor for MFU)."""
        key = "latent_mean" if "latent_mean" in batch else "image"
        return self.flops_per_image * batch[key].shape[0]

    def loss(self, outputs: tuple[torch.Tensor, ...], batch: dict) -> torch.Tensor:
        prediction, target, timesteps = outputs
        # Per-sample squared error, computed once: the loss, and (detached) the loss-by-timestep bins.
        errors = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
        self.loss_bins.add(errors.detach(), timesteps)
        if self.snr_gamma is None:
            return errors.mean()  # every sample has the same size: the plain MSE
        # Min-SNR-gamma (Hang et al. 2023): weight each timestep's MSE by min(SNR, gamma) / SNR for
        # epsilon targets, / (SNR + 1) for velocity targets, so the easy low-noise steps stop dominating.
        if self.snr.device != timesteps.device:
            self.snr = self.snr.to(timesteps.device)  # once, as diffusers moves alphas_cumprod: not per microbatch
        snr = self.snr[timesteps]
        clipped = torch.clamp(snr, max=self.snr_gamma)
        weight = clipped / snr if self.prediction_type == "epsilon" else clipped / (snr + 1.0)
        return (errors * weight).mean()


class LossBins:
    """Running sums of the training loss per bin of timesteps (which noise levels lag).

    Kept on the loss's device and never synchronized during the step; `take()` reads and resets
    the sums of one logging window (`LossByTimestep` logs them and keeps the run's total).
    """

    def __init__(self, num_timesteps: int, num_bins: int):
        if num_bins > num_timesteps:  # benchmark.py refuses --loss_bins above the timesteps first
            raise ValueError(f"{num_bins} loss bins for {num_timesteps} timesteps: some bins would stay empty")
        self.num_timesteps, self.num_bins = num_timesteps, num_bins
        self.window: torch.Tensor | None = None  # (2, bins): loss sums, counts

    def edges(self) -> list[tuple[int, int]]:
        """[first, last] timestep of each bin: exactly the timesteps `add` puts there. Timestep t goes
        to bin floor(t * bins / timesteps), so bin i starts at ceil(i * timesteps / bins), in integers."""
        first = [-(-i * self.num_timesteps // self.num_bins) for i in range(self.num_bins + 1)]
        return [(first[i], first[i + 1] - 1) for i in range(self.num_bins)]

    def add(self, per_sample_loss: torch.Tensor, timesteps: torch.Tensor) -> None:
        if self.num_bins <= 0:
            return
        if self.window is None or self.window.device != per_sample_loss.device:
            self.window = torch.zeros(2, self.num_bins, dtype=torch.float64, device=per_sample_loss.device)
        index = (timesteps * self.num_bins) // self.num_timesteps
        self.window[0].index_add_(0, index, per_sample_loss.double())
        self.window[1].index_add_(0, index, torch.ones_like(per_sample_loss, dtype=torch.float64))

    def take(self) -> torch.Tensor | None:
        """The window's (2, bins) sums (None if nothing was added), and a fresh window."""
        window, self.window = self.window, None
        return window


class LossByTimestep(Callback):
    """Log the loss in bins of timesteps every `interval` batches (`loss/timestep_<first>-<last>`).

    Reads the model's `loss_bins` window sums (summed over ranks: one small all-reduce per log
    interval, none per step); `summary()` gives the whole run's per-bin mean losses for the JSON.
    """

    def __init__(self, interval: str):
        time = Time.from_timestring(interval)
        self.interval = int(time.value) if time.unit == TimeUnit.BATCH else 0  # else only at the end
        self.run: torch.Tensor | None = None  # (2, bins) loss sums and counts over all ranks and the run
        self.edges: list[tuple[int, int]] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval and int(state.timestamp.batch) % self.interval == 0:
            self._log(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._log(state, logger)

    def _log(self, state: State, logger: Logger) -> None:
        bins = _unwrap_model(state.model).loss_bins
        if bins.num_bins <= 0:
            return
        window = bins.take()
        if window is None:
            window = torch.zeros(2, bins.num_bins, dtype=torch.float64)  # this rank saw none: still all-reduce
        window = state.device.tensor_to_device(window)
        dist.all_reduce(window, reduce_operation="SUM")
        self.run = window.clone() if self.run is None else self.run.to(window.device) + window
        self.edges = bins.edges()
        means = (window[0] / window[1].clamp(min=1)).tolist()
        counts = window[1].tolist()
        logger.log_metrics({f"loss/timestep_{a}-{b}": m for (a, b), m, c in zip(bins.edges(), means, counts) if c},
                           step=int(state.timestamp.batch))

    def state_dict(self) -> dict:
        # In the checkpoint, so that a resumed run's summary covers the whole run.
        return {"run": None if self.run is None else self.run.cpu(), "edges": self.edges}

    def load_state_dict(self, state: dict) -> None:
        self.run, self.edges = state["run"], [tuple(e) for e in state["edges"]]

    def summary(self) -> list[dict]:
        """Per bin: first and last timestep, mean loss and number of samples over the whole run."""
        if self.run is None:
            return []
        return [{"timesteps": [a, b], "mean_loss": (s / c if c else None), "samples": int(c)}
                for (a, b), s, c in zip(self.edges, self.run[0].tolist(), self.run[1].tolist())]


def _unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def count_parameters(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def warn_about_random_parts(components: Components) -> None:
    if components.random:
        warnings.warn(
            f"Pretrained {' and '.join(components.random)} not found; using randomly initialized ones "
            "(throughput does not depend on the weights).", stacklevel=2,
        )
