"""The model-family interface: what a family supplies (its configs, parts, conditioning, objective and
pipeline) and what every family shares, written once here (building its parts offline or pretrained,
the parts on the meta device, the tiny VAE, FLOPs per image). The interface is described in
docs/design.md ("A model family is one module").
"""
from __future__ import annotations

import functools
import os
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from diffusers import AutoencoderKL, Transformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.autoencoders.vae import Encoder
from diffusers.models.resnet import ResnetBlock2D
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from t2ibench.core.errors import fail
from t2ibench.families.flops import count_flops, count_forward_backward
from t2ibench.core.images import image_shape
from t2ibench.families.objectives import Objective

TextInputs = dict[str, torch.Tensor]  # tokenized captions by batch key, e.g. {"captions": (B, 77) ids}
Conditioning = dict[str, torch.Tensor]  # what the denoiser is conditioned on, e.g. {"text_states": (B, 77, D)}
# The batch keys of SD2's and SDXL's text, defined once here: the families and the precomputed format, which
# stores and yields them as they are, import them (Flux.1 names its own).
TOKENS_KEY = "captions"  # a caption's token ids (the 2023 benchmark's batch key)
TEXT_STATES_KEY = "text_states"  # the text encoders' states the denoiser attends to (encoded, or precomputed)
TOKEN_IDS_COLUMN = "token_ids"  # the precomputed column of TOKENS_KEY's ids (the format's first release)


# ModelFamily.counted_once's counts (FLOPs: floats), by family, part, configuration and image shape.
_PART_FLOPS: dict[tuple, Any] = {}


@dataclass
class Parts:
    """A family's modules (diffusers' pipeline names), and which were loaded pretrained.

    `denoiser` is trained from scratch (SD2: the UNet); the VAE and the text encoders are frozen.
    A part the run does not need is None (or absent from the dicts): training on precomputed
    latents builds no VAE. `latent_scale` and `latent_shift` map VAE latents to the denoiser's
    (latents - shift) * scale; they are known also when the VAE is not built.
    """

    denoiser: torch.nn.Module | None
    vae: torch.nn.Module | None
    text_encoders: dict[str, torch.nn.Module]
    tokenizers: dict[str, Any]
    noise_scheduler: Any  # the training noise schedule (a diffusers scheduler)
    latent_scale: float
    latent_shift: float = 0.0
    pretrained: list[str] = field(default_factory=list)
    random: list[str] = field(default_factory=list)

    @property
    def text_encoder(self) -> torch.nn.Module | None:
        """The first text encoder (every family so far has one named `text_encoder`)."""
        return self.text_encoders.get("text_encoder")

    @property
    def tokenizer(self) -> Any:
        return self.tokenizers.get("tokenizer")

    @property
    def random_encoders(self) -> list[str]:
        """The frozen networks that are randomly initialized (not the tokenizers)."""
        return [name for name in self.random if is_frozen_network(name)]


def is_frozen_network(name: str) -> bool:
    """Whether a part (diffusers' folder name) is one of the frozen networks: the VAE or a text encoder."""
    return name == "vae" or name.startswith("text_encoder")


# A tiny config's random VAE starts its log-variance channels here (a std of e^-6), so that its posterior
# is nearly deterministic, as a trained VAE's is; a random one's std of ~1 buries the latent means in
# noise (docs/design.md, "The tiny VAEs").
TINY_VAE_LOGVAR_BIAS = -12.0


class ModelFamily(ABC):
    """One kind of text-to-image model: the class attributes and abstract methods are what differs
    between families; the methods written here are the same for every family."""

    name: ClassVar[str]  # "sd2"
    # Each --model_config of the family (the first the full-size one, then its miniature): the
    # configs of its parts by diffusers part name (the denoiser under `denoiser_name`, "vae",
    # "text_encoder", ...), plus any setting of the family's own (Flux: "max_sequence_length"). A
    # tiny config sets "vae_logvar_bias" (TINY_VAE_LOGVAR_BIAS).
    architectures: ClassVar[dict[str, dict[str, Any]]]
    pretrained_configs: ClassVar[tuple[str, ...]]  # those whose frozen parts exist pretrained (--model_name)
    default_model_name: ClassVar[str]  # hub id of the pretrained frozen parts
    denoiser_name: ClassVar[str]  # its diffusers name, the attribute of the training model: checkpoint keys unet.*
    denoiser_class: ClassVar[type]  # the diffusers class of the denoiser, always built from scratch
    # The frozen text encoders by diffusers name, in the order they are built: transformers classes,
    # each built from its own `config_class`.
    text_encoder_classes: ClassVar[dict[str, type]]
    scheduler_class: ClassVar[type]  # the diffusers scheduler of the training noise schedule
    scheduler_config: ClassVar[dict[str, Any]]  # that schedule, used when --model_name has none
    # Whether --model_name's scheduler/ is the training schedule (SDXL's hub folder holds its sampler instead).
    scheduler_from_pretrained: ClassVar[bool] = True
    pipeline_class: ClassVar[str]  # the diffusers pipeline class of samples and export
    pipeline_parts: ClassVar[tuple[str, ...]]  # the folders of an exported pipeline (beside model_index.json)
    parallelism: ClassVar[str] = "ddp"  # the default data parallelism: "ddp" or "fsdp"
    text_input_keys: ClassVar[tuple[str, ...]]  # batch keys of tokenized captions
    conditioning_keys: ClassVar[tuple[str, ...]]  # batch keys of precomputed conditioning
    latent_downsample: ClassVar[int] = 8  # image pixels per latent pixel (the VAE's downsampling)
    patch_size: ClassVar[int] = 1  # latent pixels per token side (Flux.1 packs 2x2)
    # Conditioned on each image's original size and crop (SDXL): the data yields them with every
    # sample (data.GEOMETRY_KEYS), latents.py stores them, and the model passes them to `predict`.
    micro_conditioning: ClassVar[bool] = False
    # Classifier-free guidance's "no caption": "empty_caption" (SD2: the empty caption's encoding;
    # caption dropout swaps in its token ids, or its stored encoding) or "zeros" (SDXL: the text
    # conditioning zeroed after encoding, as SDXL's trainer dropped it and its pipeline samples it).
    unconditional: ClassVar[str] = "empty_caption"
    timestep_samplings: ClassVar[tuple[str, ...]] = ("uniform",)  # --timestep_sampling values it trains with
    # --sampler name -> diffusers scheduler class for sample grids and export, built from the training
    # schedule's config; the first is the default.
    samplers: ClassVar[dict[str, type]]
    # benchmark.py flags the family does not take, with why: refused by name when given.
    refused_flags: ClassVar[dict[str, str]] = {}
    # Precomputed data stores the text encoders' outputs by default (latents.py, and what --precomputed
    # --use_synth_data imitates) rather than token ids: t2ibench.datasets.precomputed.default_format names it.
    precomputes_text_states: ClassVar[bool] = False
    # MDS columns of token ids stored under another name than their batch key (SD2: captions -> token_ids).
    token_columns: ClassVar[dict[str, str]] = {}

    def flops_exact_multiple(self, config: str) -> int:
        """Pixels per side at which `flops_per_image` is exactly a quadratic in the pixel count: sides of
        this multiple divide evenly at every level (the VAE's, the patches'), so no level rounds a side;
        `BucketFlops` fits the others of a bucket list only at such sides."""
        return self.latent_downsample * self.patch_size

    @property
    def configs(self) -> tuple[str, ...]:
        """Its --model_config values; the first is the full-size one."""
        return tuple(self.architectures)

    @property
    def frozen_parts(self) -> tuple[str, ...]:
        """The folders of the pretrained frozen networks (SD2: vae, text_encoder; SDXL and Flux.1 add
        text_encoder_2), read from `pipeline_parts` so that the two cannot disagree."""
        return tuple(name for name in self.pipeline_parts if is_frozen_network(name))

    def stored_text_columns(self, text_states: bool) -> tuple[str, ...]:
        """The text columns of the family's precomputed shards (data.py and latents.py write them)."""
        if text_states:
            return tuple(self.conditioning_keys)
        return tuple(self.token_columns.get(key, key) for key in self.text_input_keys)

    # -- building --------------------------------------------------------------------------------
    def build(self, config: str, model_name: str | None = None, *, denoiser: bool = True, vae: bool = True,
              text_encoders: bool = True, tokenizers: bool = True) -> Parts:
        """The parts asked for: the denoiser random (from the global RNG), frozen parts pretrained
        from `model_name` when available, else random (each from its own seeded generator, see
        `seeded`), tokenizers always usable offline."""
        architecture = self.architectures[config]
        lookup = model_name if config in self.pretrained_configs else None  # no pretrained weights have tiny shapes
        pretrained: list[str] = []
        random: list[str] = []

        def frozen(name: str, cls: type, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
            module = load_pretrained(cls, lookup, name)
            (pretrained if module is not None else random).append(name)
            # In eval mode from the start: a frozen part is never trained, and dropout (T5's 0.1) would
            # make its outputs random wherever it is used outside the training model (latents.py, samples).
            return (module if module is not None else seeded(name, build)).eval()

        built_vae = frozen("vae", AutoencoderKL, lambda: self.build_vae(config)) if vae else None
        encoders = {}
        if text_encoders:
            for name, cls in self.text_encoder_classes.items():
                encoders[name] = frozen(name, cls, functools.partial(new_text_encoder, cls, architecture[name]))
        found: dict[str, Any] = {}
        if tokenizers:
            found, loaded = self.build_tokenizers(config, lookup)
            pretrained += loaded
        scheduler = (load_pretrained(self.scheduler_class, lookup, "scheduler") if self.scheduler_from_pretrained
                     else None)
        if scheduler is None:
            scheduler = self.scheduler_class(**self.scheduler_config)
        # Always from scratch (that is the benchmark), last: the only part drawn from the global RNG.
        network = self.denoiser_class(**architecture[self.denoiser_name]) if denoiser else None
        scale, shift = latent_scale_and_shift(built_vae, architecture["vae"], lookup)
        return Parts(network, built_vae, encoders, found, scheduler, scale, shift, pretrained=pretrained, random=random)

    @abstractmethod
    def build_tokenizers(self, config: str, model_name: str | None) -> tuple[dict[str, Any], list[str]]:
        """The tokenizers by diffusers name, and the names of those loaded from `model_name` (None: build
        them offline). A tokenizer built offline is the family's own, not a random part."""

    def build_vae(self, config: str) -> AutoencoderKL:
        """A randomly initialized VAE of `config`; a tiny one as a miniature of a trained one (TINY_VAE_LOGVAR_BIAS)."""
        architecture = self.architectures[config]
        vae = AutoencoderKL(**architecture["vae"])
        if "vae_logvar_bias" in architecture:
            # The layer that outputs the posterior's mean and log-variance: quant_conv in SD's VAE, the
            # encoder's last convolution in Flux's (which has no quant convs).
            moments = vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out
            with torch.no_grad():
                moments.bias[vae.config.latent_channels:] = architecture["vae_logvar_bias"]
        return vae

    def meta_parts(self, config: str) -> Parts:
        """Every module on the meta device: shapes, parameter counts and FLOPs without memory."""
        architecture = self.architectures[config]
        with torch.device("meta"):
            network = self.denoiser_class(**architecture[self.denoiser_name])
            vae = AutoencoderKL(**architecture["vae"])
            encoders = {name: new_text_encoder(cls, architecture[name])
                        for name, cls in self.text_encoder_classes.items()}
        # The schedule's tensors are real: they are tiny, and a model built on these parts trains.
        scale, shift = latent_scale_and_shift(None, architecture["vae"], None)
        return Parts(network, vae, encoders, {}, self.scheduler_class(**self.scheduler_config), scale, shift)

    def default_image_size(self, config: str) -> int:
        """Pixels a run trains at without --image_size (the 2023 benchmark's 512 unless a family says)."""
        return 512

    def pretrained_missing(self, model_name: str) -> list[str]:
        """The frozen networks (`frozen_parts`) that `model_name` cannot provide, judged without loading
        anything (see the module's `pretrained_missing`); [] when all can be had. Only meaningful for the
        `pretrained_configs`: the others never load pretrained parts."""
        return pretrained_missing(model_name, self.frozen_parts)

    def latent_channels(self, config: str) -> int:
        """Channels of the VAE latents (before any patching)."""
        return self.architectures[config]["vae"]["latent_channels"]

    @abstractmethod
    def conditioning_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of each conditioning tensor, as stored by latents.py --store_text_states."""

    @abstractmethod
    def text_input_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of each token-id tensor (`text_input_keys`), as latents.py stores them."""

    @abstractmethod
    def vocabulary_sizes(self, config: str) -> dict[str, int]:
        """Token ids each text input (`text_input_keys`) takes: every id is below its size."""

    def random_text_inputs(self, generator: torch.Generator, config: str) -> TextInputs:
        """Token ids of one random caption (synthetic data) of `config`, drawn from `generator` in the
        order of `text_input_shapes`."""
        vocabulary = self.vocabulary_sizes(config)
        return {key: torch.randint(0, vocabulary[key], shape, generator=generator)
                for key, shape in self.text_input_shapes(config).items()}

    # -- conditioning ------------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, tokenizers: dict[str, Any], captions: list[str]) -> TextInputs:
        """Token ids of `captions` for every text encoder, by batch key."""

    @abstractmethod
    def encode_text(self, text_encoders: dict[str, torch.nn.Module], text_inputs: TextInputs) -> Conditioning:
        """The frozen text encoders' outputs the denoiser is conditioned on."""

    def as_unconditional(self, empty_caption: Conditioning) -> Conditioning:
        """Guidance's "no caption" conditioning (`unconditional`), from the empty caption's encoding."""
        if self.unconditional == "zeros":
            return {key: torch.zeros_like(value) for key, value in empty_caption.items()}
        return empty_caption

    # -- training ----------------------------------------------------------------------------------
    @abstractmethod
    def objective(self, noise_scheduler: Any, timestep_sampling: str = "uniform") -> Objective:
        """The training objective on this noise schedule; `timestep_sampling` one of `timestep_samplings`."""

    @abstractmethod
    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning) -> torch.Tensor:
        """The denoiser's output for noisy latents (B, C, h, w), in the objective's target space."""

    def fsdp_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The denoiser's submodules that FSDP shards as units of their own (`DiffusionModel.mark_fsdp_units`).

        The default is a diffusers UNet's (SD2, SDXL): each down block, the mid block and each up
        block, so that full_shard gathers one block's weights at a time; what is outside them (conv_in,
        the time and added embeddings, conv_out) is the root unit. A family with another denoiser says.
        """
        return [*denoiser.down_blocks, denoiser.mid_block, *denoiser.up_blocks]

    # The blocks `--compile` compiles one at a time (`compile_blocks`), in any part a step runs: the
    # UNet's resnets and transformer blocks, CLIP's layers, and the VAE encoder whole (a forward of
    # about 140 ops whose 10 resnets have 8 distinct shapes: as blocks they would need 8 graphs and
    # leave 40% of its ops eager; `bench/compile_graphs.py`).
    compile_block_classes: ClassVar[tuple[type, ...]] = (ResnetBlock2D, BasicTransformerBlock, CLIPEncoderLayer,
                                                         Encoder)

    def compile_blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks of `module` (the denoiser, the VAE encoder or a text encoder) that `--compile`
        compiles one at a time, so that blocks of the same shapes run one compiled graph
        (`t2ibench.train.compiling`): the outermost modules of `compile_block_classes`, except that a
        Transformer2DModel holding a single transformer block (all of SD2's) is compiled whole, its
        norm and projections with its block, at no more graphs; one holding several (SDXL's 2 and 10)
        has its blocks compiled, which repeat. No block holds another, so no graph is compiled inside
        another."""
        blocks: list[torch.nn.Module] = []

        def visit(part: torch.nn.Module) -> None:
            if isinstance(part, self.compile_block_classes) or (
                    isinstance(part, Transformer2DModel) and len(part.transformer_blocks) == 1):
                blocks.append(part)
                return
            for child in part.children():
                visit(child)

        visit(module)
        return blocks

    # -- figures -----------------------------------------------------------------------------------
    def flops_per_image(self, config: str, image_size: int | tuple[int, int], *, vae: bool = True,
                        text_encoders: bool = True) -> dict[str, float]:
        """FLOPs of one training image, counted on meta tensors: `denoiser_fwd`, `denoiser_fwd_bwd`,
        `vae_encoder`, `text_encoder` (all encoders) and `total` (the step: the denoiser's forward and
        backward and the encoders that run); a part left out (its outputs precomputed) costs 0.
        `image_size`: the side of a square image, or (height, width) of a bucket. Each part is counted once
        per process (`counted_once`)."""
        height, width = image_shape(image_size)
        parts = functools.cache(lambda: self.meta_parts(config))  # built only if a part is not counted yet

        def denoiser() -> tuple[float, float]:
            latent_height, latent_width = height // self.latent_downsample, width // self.latent_downsample
            noisy = torch.randn(1, self.latent_channels(config), latent_height, latent_width, device="meta")
            timesteps = torch.full((1,), 500, device="meta")
            conditioning = {key: torch.randn(1, *shape, device="meta")
                            for key, shape in self.conditioning_shapes(config).items()}
            return count_forward_backward(lambda: self.predict(parts().denoiser, noisy, timesteps, conditioning))

        def vae_encoder() -> float:
            images = torch.randn(1, 3, height, width, device="meta")
            with torch.no_grad():
                return count_flops(lambda: parts().vae.encode(images))

        def text_encoder() -> float:
            ids = {key: torch.zeros(1, *shape, dtype=torch.long, device="meta")
                   for key, shape in self.text_input_shapes(config).items()}
            with torch.no_grad():
                return count_flops(lambda: self.encode_text(parts().text_encoders, ids))

        forward, forward_backward = self.counted_once("denoiser", config, (height, width), denoiser)
        flops = {"denoiser_fwd": forward, "denoiser_fwd_bwd": forward_backward,
                 "vae_encoder": self.counted_once("vae_encoder", config, (height, width), vae_encoder) if vae else 0.0,
                 "text_encoder": self.counted_once("text_encoder", config, None, text_encoder) if text_encoders
                 else 0.0}
        flops["total"] = flops["denoiser_fwd_bwd"] + flops["vae_encoder"] + flops["text_encoder"]
        return flops

    def counted_once(self, part: str, config: str, shape: tuple[int, int] | None, count: Callable[[], Any]):
        """`count()` of this family's `part` at `config` and (height, width) `shape`, counted once per
        process: a plan or a cost table asks for a count with and without each encoder, and the denoiser's
        count, most of the time (tracing SDXL's ~2,000 modules or Flux.1's 11.9B parameters), is the same."""
        key = (type(self).__name__, part, config, shape)
        if key not in _PART_FLOPS:
            _PART_FLOPS[key] = count()
        return _PART_FLOPS[key]

    # -- use ---------------------------------------------------------------------------------------
    @abstractmethod
    def make_pipeline(self, parts: Parts, sampler: Any) -> Any:
        """A diffusers pipeline (`pipeline_class`) of these parts with `sampler` as its scheduler."""


def new_text_encoder(cls: type, config: dict[str, Any]) -> torch.nn.Module:
    """A randomly initialized transformers text encoder of `cls` from its config dict."""
    return cls(cls.config_class(**config))


# -- helpers for families ---------------------------------------------------------------------------

HUB_PROBE_SECONDS = 5.0  # one request to the hub's endpoint; huggingface_hub itself retries each file for minutes


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids downloads (any value but unset, 0, empty or false)."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers at all, asked once per process with a short timeout.

    Offline without HF_HUB_OFFLINE set, huggingface_hub retries every file of every part with
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


def latent_scale_and_shift(vae: torch.nn.Module | None, vae_config: dict[str, Any],
                           model_name: str | None) -> tuple[float, float]:
    """The VAE's scaling and shift factors (latents = (z - shift) x scale; SD's VAEs have no shift): the
    built VAE's, or, on precomputed latents (no VAE built), those of the VAE that encoded them, read from
    `model_name`'s vae/config.json only, else `vae_config`'s (the family's own)."""
    if vae is not None:
        vae_config = dict(vae.config)
    elif model_name:
        try:
            loaded = AutoencoderKL.load_config(model_name, subfolder="vae", local_files_only=True)
            return float(loaded["scaling_factor"]), float(loaded.get("shift_factor") or 0.0)
        except Exception:  # noqa: BLE001 - not available offline: the family's own values
            pass
    return float(vae_config["scaling_factor"]), float(vae_config.get("shift_factor") or 0.0)


def load_pretrained(cls: Any, model_name: str | None, subfolder: str) -> Any:
    """`cls.from_pretrained(model_name, subfolder)`, or None when unavailable offline.

    A local folder is read directly. A hub id is looked up in the local hub cache first and only
    downloaded when HF_HUB_OFFLINE is not set and the hub answers (`hub_reachable`), so that runs on
    air-gapped clusters neither hang nor spend minutes in huggingface_hub's retries.
    """
    if not model_name:
        return None
    attempts = [dict(local_files_only=True)]
    if not Path(model_name).is_dir() and not hub_offline() and hub_reachable():
        attempts.append(dict(local_files_only=False))
    for kwargs in attempts:
        try:
            return cls.from_pretrained(model_name, subfolder=subfolder, **kwargs)
        except Exception:  # noqa: BLE001 - missing files, no network, bad repo: all mean "not available"
            continue
    return None


def pretrained_missing(model_name: str, parts: tuple[str, ...]) -> list[str]:
    """The `parts` (folder names) of `model_name` that cannot be loaded, judged without loading anything:
    not in the local folder (or in the local hub cache, for a hub id), and not downloadable (HF_HUB_OFFLINE
    set, or the hub does not answer). A part found here may still fail to load later (missing weights);
    the family's `build` then makes it random, and `require_pretrained` refuses that where it matters.
    """
    if Path(model_name).is_dir():
        return [part for part in parts if not Path(model_name, part, "config.json").is_file()]
    from huggingface_hub import try_to_load_from_cache

    try:
        # A path to the cached file is a str; "known absent" and "not cached" are other values.
        missing = [part for part in parts
                   if not isinstance(try_to_load_from_cache(model_name, f"{part}/config.json"), str)]
    except Exception:  # noqa: BLE001 - not a valid hub id (e.g. a folder that does not exist): nothing to load
        return list(parts)
    if missing and not hub_offline() and hub_reachable():
        return []  # downloadable: load_pretrained will fetch them
    return missing


def seeded(name: str, build: Callable[[], Any]) -> Any:
    """`build()` drawn from its own generator, seeded from the global seed and the part's name, so a
    random part is the same whatever else is built (the text encoder of latents.py and of a training
    run on its tokens, for one); the global generator is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((torch.initial_seed() + zlib.crc32(name.encode())) % 2**63)
        return build()


def build_aside(family: ModelFamily, config: str, model_name: str | None, seed: int) -> Parts:
    """The frozen parts and tokenizers as latents.py builds them under `seed`, leaving the RNG as it was.

    For a run that trains without encoders (precomputed) but needs them for the empty caption's
    conditioning, for sampling or for export: random encoders come out identical to the ones that
    encoded the data, and the denoiser's initialization is not disturbed.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return family.build(config, model_name, denoiser=False)


def require_pretrained(parts: Parts, *, needed: bool, allowed: bool, model_name: str | None) -> None:
    """Refuse random frozen encoders where their outputs would be trained on or stored (`needed`:
    real data, full-size model) unless `allowed` (--allow_random_encoders)."""
    missing = parts.random_encoders
    if missing and needed and not allowed:
        fail(f"pretrained {' and '.join(missing)} not found for --model_name {model_name}: outputs of random "
             "encoders are useless for training (download the model to a local folder and pass it), or pass "
             "--allow_random_encoders to measure throughput anyway")
