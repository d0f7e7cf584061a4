"""GPU memory of a training step, counted for any model family: bytes saved for backward, fixed bytes
per GPU, and the largest microbatch that fits.

    python bench/memory.py --model_config sd2-base --image_size 512 --gpu_memory_gib 80 --json
    python bench/memory.py --model_config flux1-schnell --image_size 256 --precomputed --fsdp full_shard --table

Guessing the microbatch costs a first GPU run (the README's old SD2 table doubled it for
`--precomputed` and would have asked an 80 GB GPU for 108 GiB). Here the step the run takes is run
on the meta device (shapes and dtypes, no memory, no arithmetic) and counted:

* **The step.** The family's own parts (`ModelFamily.meta_parts`) in the project's training model
  (`t2ibench.model.DiffusionModel`): its forward (encoders, noising, the family's `predict`) and
  loss, on a batch of the shapes and dtypes the loaders yield for the family (`meta_batch`: images
  and token ids online; latent moments with token ids or the stored conditioning on precomputed
  latents; SDXL's size/crop ids).
* **Activations.** `torch.autograd.graph.saved_tensors_hooks` see every tensor autograd keeps for
  backward (the frozen encoders run under no_grad and keep nothing). Saved tensors are deduplicated
  by storage (a view keeps its whole storage alive), and the parameters' own storages are left out
  (they are weights). The count is taken at microbatch 2 and 4: half the difference is the bytes
  per image, the rest is what every microbatch keeps whatever its size (the bf16 weight casts that
  autocast caches and autograd keeps until backward). A dispatch mode also follows every storage an
  op creates and frees, which gives the step's peak, backward transients included.
* **Activation checkpointing** (`--activation_checkpointing`, diffusers' gradient checkpointing) is
  counted by applying it: the denoiser's blocks are wrapped by the same non-reentrant
  `torch.utils.checkpoint.checkpoint` the run uses, so only each block's inputs are saved and the
  backward's recomputation of one block shows in the peak. The only difference from the run is the
  recomputation's autocast: torch re-enters real autocast there, which does nothing on the meta
  device, so the recomputation is given a fresh `AutocastRules` (with its own weight-cast cache, as
  a fresh autocast context has) through checkpoint's `context_fn`.
* **CUDA autocast on the meta device.** Autocast only casts tensors of its own device, and a fake
  CUDA tensor cannot enter autograd without a CUDA driver, so `AutocastRules` applies CUDA
  autocast's policy itself at the level autocast works at (before autograd records the op, so casts
  are saved as autocast's are): the op lists of torch 2.7.0's `ATen/autocast_mode.h`, the
  weight-cast cache, and the SDPA kernel CUDA picks (flash attention for bf16/fp16, memory-efficient
  for fp32). `--norm_precision autocast` (t2ibench.norms) moves GroupNorm and LayerNorm to the
  lower-precision list. `bench/memory.py --check_cpu` and tests/test_memory.py check the method
  against real CPU autocast and a real CPU forward and backward.
* **FSDP.** Composer's FSDP2 hands the forward unsharded parameters already in the autocast dtype
  (its mixed precision), so under `--fsdp` the denoiser is counted with its parameters in that
  dtype: autocast casts none of them. The gathered parameters are fixed bytes (all of them under
  shard_grad_op; under full_shard the root unit and two of the family's FSDP units, one computing
  and one prefetched: `ModelFamily.fsdp_blocks`), and so is the reduce-scatter of the largest unit's
  gradient.
* **Float8** (`--fp8`): the meta model's Linear layers are converted as the run converts them
  (`t2ibench.fp8.convert`, torchao's Float8Linear with `torch._scaled_mm`'s meta kernel), their input
  cast to the autocast dtype and their product left outside autocast as `fp8`'s layer does, so
  what float8 saves for backward (tensorwise: the float8 weight, 1 byte per parameter, instead of
  autocast's bf16 cast) is counted by the same hooks, tensor subclasses by their inner tensors.
* **Fixed bytes per GPU.** Weights, gradients, DDP buckets (or FSDP shards), AdamW's two moments,
  the EMA, the frozen encoders in their dtype, plus a stated CUDA context and an allocator reserve
  (`CUDA_CONTEXT_BYTES`, `ALLOCATOR_RESERVE_FRACTION`).

`plan(...)` returns all of it and the largest power-of-two microbatch that fits; benchmark.py's
`auto` with several ranks (`t2ibench.runtime.safe_auto_microbatch`), bench/bench_gpu.py's rows and
the README's table take theirs from it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

from t2ibench import fp8 as float8
from t2ibench.families import ModelFamily, family_of
from t2ibench.images import GEOMETRY_KEYS
from t2ibench.model import DiffusionModel
from t2ibench.norms import NORM_PRECISIONS
from t2ibench.parallel import FSDP_MODES
from t2ibench.precision import PRECISIONS
from t2ibench.weight_casts import WEIGHT_CASTS

GIB = 2**30
# Device memory the PyTorch allocator never sees: the CUDA context with its kernels (about 0.5-0.6
# GiB on A100/H100 under torch 2.7), cuBLAS/cuDNN handles, and NCCL's communicator buffers (a few
# hundred MiB for 8 ranks on NVLink).
CUDA_CONTEXT_BYTES = int(1.5 * GIB)
# The caching allocator's reserve over what tensors hold (max_memory_reserved / max_memory_allocated
# - 1): blocks rounded up and split, kept for reuse. 10% is a margin for a step with fixed shapes.
ALLOCATOR_RESERVE_FRACTION = 0.10
# torch.cuda.get_device_properties(0).total_memory of common GPUs, GiB: what `auto` compares with.
GPU_MEMORY_GIB = {"A100 40GB": 39.4, "A100 80GB": 79.1, "H100 80GB": 79.1, "H200 141GB": 139.8}
TEXT_FORMATS = ("tokens", "text_states")  # what precomputed batches carry: token ids or encoder outputs
MAX_MICROBATCH = 1024
COUNTED_MICROBATCHES = (2, 4)  # the step is counted at these sizes; bytes are linear in the size from 2 on
__all__ = [
    "ALLOCATOR_RESERVE_FRACTION", "COUNTED_MICROBATCHES", "CUDA_AUTOCAST", "CUDA_CONTEXT_BYTES", "FSDP_MODES", "GIB",
    "GPU_MEMORY_GIB", "MAX_MICROBATCH", "NORM_PRECISIONS", "PRECISIONS", "TEXT_FORMATS", "WEIGHT_CASTS", "ActivationModel",
    "AutocastPolicy", "AutocastRules", "LiveBytes", "SavedForBackward", "StepCount", "activation_model",
    "auto_microbatch", "build_meta_model", "count_step", "fixed_bytes", "linear_rows_per_sample", "fsdp_unit_params", "gib",
    "largest_microbatch", "meta_batch", "plan", "predicted_bytes", "probe_cpu_autocast", "train_flops_per_image",
    "use_checkpointing",
]

# CUDA autocast's policy in torch 2.7.0 (ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE), by the name of the Python function through which
# the op is reached: `torch.conv2d`, `F.linear`, `Tensor.exp` are intercepted before autograd, as
# autocast's own kernels are. F.interpolate reaches upsample_* (all fp32-listed) except mode "area".
CUDA_LOWER_PRECISION_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "scaled_dot_product_attention",
})
CUDA_FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
})
CUDA_FP32_SET_OPT_DTYPE_OPS = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum",
                                         "vector_norm", "matrix_norm"})
NORM_OPS = frozenset({"group_norm", "layer_norm"})


@dataclasses.dataclass(frozen=True)
class AutocastPolicy:
    """Which ops autocast runs in its lower-precision dtype, which in fp32, which get dtype=fp32."""

    lower_precision: frozenset[str]
    fp32: frozenset[str]
    fp32_set_opt_dtype: frozenset[str] = frozenset()

    def with_low_precision_norms(self) -> "AutocastPolicy":
        """GroupNorm and LayerNorm moved to the lower-precision list (`norms.set_norm_precision(m, "autocast")`)."""
        return AutocastPolicy(self.lower_precision | NORM_OPS, self.fp32 - NORM_OPS, self.fp32_set_opt_dtype)

    def with_fp32_norms(self) -> "AutocastPolicy":
        """GroupNorm and LayerNorm in fp32 (`norms.set_norm_precision(m, "fp32")`, on the CPU too)."""
        return AutocastPolicy(self.lower_precision - NORM_OPS, self.fp32 | NORM_OPS, self.fp32_set_opt_dtype)

    def with_norms(self, norm_precision: str) -> "AutocastPolicy":
        if norm_precision not in NORM_PRECISIONS:
            raise ValueError(f"norm_precision must be one of {NORM_PRECISIONS}, not {norm_precision!r}")
        return self.with_low_precision_norms() if norm_precision == "autocast" else self.with_fp32_norms()


CUDA_AUTOCAST = AutocastPolicy(CUDA_LOWER_PRECISION_OPS, CUDA_FP32_OPS, CUDA_FP32_SET_OPT_DTYPE_OPS)


def probe_cpu_autocast() -> AutocastPolicy:
    """CPU autocast's policy for the ops the families' steps reach, read off the real CPU autocast.

    Only for checking the counting method on a CPU (the real run to compare with is a CPU run):
    torch ships CPU autocast's lists compiled in, not in a header.
    """
    x = torch.randn(2, 8, 4, 4)
    probes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "conv2d": lambda t: torch.conv2d(t, torch.randn(8, 8, 1, 1, dtype=t.dtype)),
        "linear": lambda t: F.linear(t, torch.randn(4, 4, dtype=t.dtype)),
        "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(t, t, t),
        "group_norm": lambda t: F.group_norm(t, 2), "layer_norm": lambda t: F.layer_norm(t, (4,)),
        "interpolate": lambda t: F.interpolate(t, scale_factor=2.0, mode="nearest"),
        "exp": torch.exp, "pow": lambda t: t.pow(2), "rsqrt": torch.rsqrt, "softmax": lambda t: torch.softmax(t, -1),
        "sum": lambda t: t.sum(), "mse_loss": lambda t: F.mse_loss(t, t), "matmul": lambda t: t @ t,
        "bmm": lambda t: torch.bmm(t[0], t[0]), "baddbmm": lambda t: torch.baddbmm(t[0], t[0], t[0]),
        "silu": F.silu, "gelu": F.gelu,
    }
    lower, fp32 = set(), set()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, fn in probes.items():
            if fn(x).dtype == torch.bfloat16:
                lower.add(name)
            elif fn(x.bfloat16()).dtype == torch.float32:
                fp32.add(name)
    aliases = {"matmul": "__matmul__", "pow": "__pow__"}  # the names `a @ b` and `a ** b` reach the mode by
    lower |= {aliases[n] for n in lower if n in aliases}
    fp32 |= {aliases[n] for n in fp32 if n in aliases}
    return AutocastPolicy(frozenset(lower), frozenset(fp32))


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it); valid while the storage lives."""
    return tensor.untyped_storage()._cdata


class AutocastRules(TorchFunctionMode):
    """Autocast's dtype rules and the attention kernel of `device_type`, applied to meta tensors.

    Lower-precision ops get their floating inputs cast to `dtype` (fp32 leaf tensors that require
    grad, the weights, through a cache that lives as long as this mode, as autocast's cache lives
    as long as its context); fp32 ops get theirs cast to fp32; the `dtype=` of fp32_set_opt_dtype
    ops defaults to fp32. Everything else runs as called. `dtype=None` applies no casts (an fp32
    run) but still picks the attention kernel.

    Attention: on the meta device F.scaled_dot_product_attention takes the math path, which keeps
    the L x L attention matrix for backward. CUDA (sm80+) picks flash attention for bf16/fp16 without
    a mask and head size <= 256, else memory-efficient attention; the CPU picks its own flash kernel.
    The chosen kernel is called directly, so its own saved tensors are counted.
    """

    def __init__(self, policy: AutocastPolicy, dtype: torch.dtype | None, device_type: str = "cuda"):
        super().__init__()
        self.policy, self.dtype, self.device_type = policy, dtype, device_type
        self.weight_casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def weight_cast_keys(self) -> set[int]:
        """Storage keys of the cached weight casts (what every microbatch keeps, whatever its size)."""
        return {_storage_key(cast) for _, cast in self.weight_casts.values()}

    def _cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64) or is_traceable_wrapper_subclass(
                tensor):  # torchao's float8 tensors: fp8's layer runs its product outside autocast
            return tensor
        cacheable = (dtype == self.dtype and tensor.dtype == torch.float32 and tensor.requires_grad
                     and tensor.is_leaf and not tensor._is_view())
        if not cacheable:
            return tensor.to(dtype)
        entry = self.weight_casts.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            entry = (weakref.ref(tensor), tensor.to(dtype))
            self.weight_casts[id(tensor)] = entry
        return entry[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.dtype is not None:
            if name in self.policy.lower_precision:
                args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, self.dtype), (args, kwargs))
            elif name in self.policy.fp32 and not (name == "interpolate" and kwargs.get("mode") == "area"):
                args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, torch.float32), (args, kwargs))
            elif name in self.policy.fp32_set_opt_dtype and kwargs.get("dtype") is None:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None and first.is_floating_point() and first.dtype != torch.float64:
                    kwargs = {**kwargs, "dtype": torch.float32}
        if name == "scaled_dot_product_attention":
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        if self.device_type == "cpu":
            if attn_mask is None:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query, key, value, dropout_p, is_causal, scale=scale)[0]
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)
        if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, needs_grad and torch.is_grad_enabled(), dropout_p, is_causal,
            scale=scale)[0]


class SavedForBackward:
    """Bytes autograd keeps for backward, by storage: `with SavedForBackward(exclude) as saved: ...`.

    `exclude`: storage keys not to count (parameters: they are weights). The hooks hand every saved
    tensor back unchanged, so the step still runs its backward. Inside a checkpointed block the
    checkpoint's own hooks are the innermost and keep nothing: what is counted there is what the
    checkpoint saves, the block's inputs.
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.storages: dict[int, tuple[int, torch.Tensor]] = {}  # key -> (bytes, a tensor keeping it alive)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for inner in _tensors(tensor):
            key = _storage_key(inner)
            if key not in self.exclude and key not in self.storages:
                self.storages[key] = (inner.untyped_storage().nbytes(), inner)
        return tensor

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def bytes(self, keys: set[int] | None = None) -> int:
        """Bytes of the saved storages (only those in `keys` when given)."""
        return sum(n for k, (n, _) in self.storages.items() if keys is None or k in keys)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create that are still alive, and their peak, since entering.

    Storages that existed before (parameters, buffers) are not counted. A storage is forgotten when
    its last tensor goes (a weakref on the storage object, which PyTorch keeps as long as the storage).
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._known: set[int] = set()

    def mark(self) -> int:
        """Restart the peak from what is alive now; returns that."""
        self.peak_bytes = self.live_bytes
        return self.live_bytes

    def _free(self, key: int, nbytes: int) -> None:
        self._known.discard(key)
        self.live_bytes -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._known:
            return
        self._known.add(key)
        nbytes = storage.nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {_storage_key(t) for t in _tensors((args, kwargs or {}))}
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            if _storage_key(tensor) not in before:  # not a view or an in-place result of an input
                self._track(tensor)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (what ops take and return); faster than pytree.
    A tensor subclass (torchao's float8 tensors) stands for the tensors it holds."""
    if isinstance(tree, torch.Tensor):
        if is_traceable_wrapper_subclass(tree):
            return [t for name in tree.__tensor_flatten__()[0] for t in _tensors(getattr(tree, name))]
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


@dataclasses.dataclass
class StepCount:
    """One forward and backward at one microbatch size, in bytes above the weights, buffers and
    gradients that exist before it (meta device, nothing allocated)."""

    microbatch: int
    saved_bytes: int  # everything saved for backward (parameters' own storages excluded)
    weight_cast_bytes: int  # of which: autocast's cached weight casts
    forward_peak_bytes: int  # peak of storages created during forward and loss (encoders' transients included)
    after_forward_bytes: int  # alive when backward starts: saved tensors, outputs, loss
    backward_peak_bytes: int  # peak from the start of forward to the end of backward (existing gradients aside)


def _dtype_of(precision: str) -> torch.dtype | None:
    """The autocast dtype of a --precision (None: fp32, no autocast)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    return {"fp32": None, "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}[precision]


def _text_format(family: ModelFamily, precomputed: bool, precomputed_format: str | None) -> str | None:
    """What the batches carry for the text: None online (captions' token ids, encoders in the step),
    else the precomputed format (the family's default when not given)."""
    if not precomputed:
        return None
    text_format = precomputed_format or family.default_precomputed_format
    if text_format not in TEXT_FORMATS:
        raise ValueError(f"precomputed_format must be one of {TEXT_FORMATS}, not {text_format!r}")
    return text_format


def build_meta_model(model_config: str, *, precomputed: bool = False, precomputed_format: str | None = None,
                     frozen_dtype: torch.dtype | None = None,
                     denoiser_dtype: torch.dtype | None = None) -> DiffusionModel:
    """The training model with every part on the meta device, built as benchmark.py builds it: no VAE
    on precomputed latents, no text encoders on stored text states, the frozen parts in
    `frozen_dtype` (the autocast dtype under AMP). `denoiser_dtype`: the trained parameters' dtype
    as the forward sees them (FSDP's mixed precision gathers them in the autocast dtype)."""
    family = family_of(model_config)
    text_format = _text_format(family, precomputed, precomputed_format)
    parts = family.meta_parts(model_config)
    if precomputed:
        parts.vae = None
        if text_format == "text_states":
            parts.text_encoders = {}
    model = DiffusionModel(family, parts, num_loss_bins=0)
    if frozen_dtype is not None:
        for frozen in model.frozen():
            frozen.to(frozen_dtype)
    if denoiser_dtype is not None:
        model.denoiser.to(denoiser_dtype)
    return model


def meta_batch(model: DiffusionModel, model_config: str, image_size: int, microbatch: int,
               device: str = "meta") -> dict[str, torch.Tensor]:
    """A batch of the shapes and dtypes the loaders yield for this model (data.py): uint8 images and
    int64 token ids online; fp16 latent moments with the token ids or the fp16 stored conditioning
    on precomputed latents; with micro-conditioning (SDXL) each image's int64 size and crop."""
    family = model.family
    batch: dict[str, torch.Tensor] = {}
    if model.vae is not None:
        batch["image"] = torch.zeros(microbatch, 3, image_size, image_size, dtype=torch.uint8, device=device)
    else:
        latent = image_size // family.latent_downsample
        shape = (microbatch, family.latent_channels(model_config), latent, latent)
        batch["latent_mean"] = torch.zeros(shape, dtype=torch.float16, device=device)
        batch["latent_logvar"] = torch.zeros(shape, dtype=torch.float16, device=device)
    if model.text_encoder_names:
        for key, shape in family.text_input_shapes(model_config).items():
            batch[key] = torch.zeros(microbatch, *shape, dtype=torch.long, device=device)
    else:
        for key, shape in family.conditioning_shapes(model_config).items():
            batch[key] = torch.zeros(microbatch, *shape, dtype=torch.float16, device=device)
    if family.micro_conditioning:
        for key in GEOMETRY_KEYS:
            batch[key] = torch.full((microbatch, 2), image_size, dtype=torch.long, device=device)
    return batch


@functools.lru_cache(maxsize=None)
def linear_rows_per_sample(model_config: str, image_size: int, text_format: str | None) -> dict[str, int]:
    """Rows of input each Linear layer of the denoiser sees per sample in the training step (its
    tokens; 1 for a layer applied once per sample), by module name, read off one forward on the meta
    device (`text_format`: None online, else the precomputed format). t2ibench.fp8 converts by them."""
    model = build_meta_model(model_config, precomputed=text_format is not None, precomputed_format=text_format)
    microbatch, rows = COUNTED_MICROBATCHES[0], {}

    def record(name: str) -> Callable[..., None]:
        return lambda module, inputs, output: rows.__setitem__(name, inputs[0].numel() // inputs[0].shape[-1]
                                                               // microbatch)

    handles = [module.register_forward_hook(record(name)) for name, module in model.denoiser.named_modules()
               if isinstance(module, torch.nn.Linear)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(meta_batch(model, model_config, image_size, microbatch))
    finally:
        for handle in handles:
            handle.remove()
    return rows


def use_float8(model: DiffusionModel, mode: str, rows_per_sample: dict[str, int], dtype: torch.dtype | None,
               device_type: str = "cuda") -> float8.Conversion:
    """Convert the denoiser's Linear layers as benchmark.py's --fp8 does (`fp8.convert`; emulated for a
    CPU count, `torch._scaled_mm`'s meta kernel for CUDA), each converted layer's input cast to the
    autocast dtype as its forward does under real autocast (which the meta device does not enter)."""
    conversion = float8.convert(model.denoiser, mode, rows_per_sample, emulate=device_type != "cuda")
    if dtype is not None:
        modules = dict(model.denoiser.named_modules())
        for name in conversion.converted:
            modules[name].register_forward_pre_hook(
                lambda module, args: tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                                           else a for a in args))
    return conversion


def use_checkpointing(model: DiffusionModel, policy: AutocastPolicy, dtype: torch.dtype | None,
                      device_type: str = "cuda") -> None:
    """Turn on the denoiser's gradient checkpointing as benchmark.py's --activation_checkpointing does
    (diffusers' `enable_gradient_checkpointing`: non-reentrant `torch.utils.checkpoint` per block),
    with the recomputation under a fresh `AutocastRules`: torch re-enters real autocast there, which
    the meta device ignores, and a fresh context starts with an empty weight-cast cache. What the
    checkpoint also keeps per block, the RNG states it replays dropout with, are host tensors (CPU
    and CUDA generator states alike) and not counted."""

    def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), AutocastRules(policy, dtype, device_type)

    def checkpoint_block(block: Callable[..., Any], *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False,
                                                 context_fn=recompute_contexts)

    model.denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_block)


def count_step(model: DiffusionModel, batch: dict[str, torch.Tensor], policy: AutocastPolicy | None,
               dtype: torch.dtype | None, device_type: str = "cuda") -> StepCount:
    """Count one forward, loss and backward of `model` on `batch` (see the module docstring)."""
    params = [p for p in model.parameters()]
    # Gradient accumulation's steady state: the gradients exist before backward (they are fixed
    # bytes) and backward adds into them. The first microbatch of a step, which creates them while
    # the activations are being freed, peaks lower.
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    exclude = {_storage_key(t) for t in [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None)]}
    rules = AutocastRules(policy or CUDA_AUTOCAST, dtype, device_type)
    live = LiveBytes()
    with live:
        with SavedForBackward(exclude) as saved, rules:
            loss = model.loss(model(batch), batch)
        forward_peak = live.peak_bytes
        saved_bytes, cast_bytes = saved.bytes(), saved.bytes(rules.weight_cast_keys())
        # Autocast empties its cast cache when its context exits (casts of biases, not saved, go),
        # and the counter's own references must not keep saved tensors alive through backward.
        rules.weight_casts.clear()
        saved.storages.clear()
        after_forward = live.live_bytes
        loss.backward()
        del loss
        backward_peak = live.peak_bytes
    for p in params:
        p.grad = None
    return StepCount(_batch_size(batch), saved_bytes, cast_bytes, forward_peak, after_forward, backward_peak)


def _batch_size(batch: dict[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """Bytes of a microbatch of `b` images: `per_image * b + per_microbatch`, from counts at b = 2, 4."""

    saved_per_image: float  # activation_bytes_per_image: saved for backward
    saved_per_microbatch: float  # saved whatever the size (weight casts)
    peak_per_image: float  # peak of the step above the fixed bytes (backward transients, gradients aside)
    peak_per_microbatch: float
    weight_cast_bytes: int

    def saved_bytes(self, microbatch: int) -> float:
        return self.saved_per_image * microbatch + self.saved_per_microbatch

    def peak_bytes(self, microbatch: int) -> float:
        return self.peak_per_image * microbatch + self.peak_per_microbatch


# Cached: a count runs two meta-device steps (seconds to a minute), and a matrix of plans (bench_gpu.py,
# --table) asks for the same count under several GPU sizes, FSDP modes and EMA settings.
@functools.lru_cache(maxsize=None)
def activation_model(model_config: str, image_size: int, *, precision: str = "amp_bf16",
                     norm_precision: str = "autocast", precomputed: bool = False,
                     precomputed_format: str | None = None, activation_checkpointing: bool = False,
                     sharded: bool = False, device_type: str = "cuda", weight_casts: str = "microbatch",
                     fp8: str = "off") -> ActivationModel:
    """Count the step at microbatch 2 and 4 under `precision` ("fp32", "amp_bf16", "amp_fp16").

    `sharded`: under FSDP (the denoiser's parameters reach the forward in the autocast dtype);
    `weight_casts` "step" (t2ibench.weight_casts): the forward computes with bf16 copies of the
    weights, so, as under FSDP, autocast casts none of them. `fp8`: `--fp8`'s recipe (t2ibench.fp8),
    "off" for none.
    Counted once per process and setting (seconds on a CPU: about 10 s for SD2, 30 s for SDXL at
    1024, longer for Flux.1's 11.9B parameters)."""
    text_format = _text_format(family_of(model_config), precomputed, precomputed_format)
    if weight_casts not in WEIGHT_CASTS:
        raise ValueError(f"weight_casts must be one of {WEIGHT_CASTS}, not {weight_casts!r}")
    low_precision_weights = (sharded or weight_casts == "step") and precision != "fp32"
    return _activation_model(model_config, image_size, precision, norm_precision, text_format,
                             activation_checkpointing, low_precision_weights, device_type, fp8)


@functools.lru_cache(maxsize=None)
def _activation_model(model_config: str, image_size: int, precision: str, norm_precision: str,
                      text_format: str | None, activation_checkpointing: bool, sharded: bool,
                      device_type: str, fp8: str = "off") -> ActivationModel:
    with torch.random.fork_rng(devices=[]):  # the run that asks (benchmark.py's auto) draws the same numbers after
        return _count_activations(model_config, image_size, precision, norm_precision, text_format,
                                  activation_checkpointing, sharded, device_type, fp8)


def _count_activations(model_config: str, image_size: int, precision: str, norm_precision: str,
                       text_format: str | None, activation_checkpointing: bool, sharded: bool,
                       device_type: str, fp8: str = "off") -> ActivationModel:
    dtype = _dtype_of(precision)
    policy = (CUDA_AUTOCAST if device_type == "cuda" else probe_cpu_autocast()).with_norms(norm_precision)
    model = build_meta_model(model_config, precomputed=text_format is not None, precomputed_format=text_format,
                             frozen_dtype=dtype, denoiser_dtype=dtype if sharded else None)
    if fp8 != "off":
        use_float8(model, fp8, linear_rows_per_sample(model_config, image_size, text_format), dtype, device_type)
    if activation_checkpointing:
        use_checkpointing(model, policy, dtype, device_type)
    model.train()
    # Counted at 2 and 4 images, not 1 and 2: with one image some reshapes are views (a dimension of
    # size 1 keeps them contiguous) that copy from two on (Flux.1's transformer saves 1.3% less per
    # image at 1 than the slope from 2 on). The line through 2 and 4 is exact from 2 on (counted
    # at 1, 2, 3, 4 for SD2, SDXL and Flux.1) and over-counts a microbatch of 1 a little.
    two, four = (count_step(model, meta_batch(model, model_config, image_size, microbatch), policy, dtype,
                            device_type)
                 for microbatch in COUNTED_MICROBATCHES)
    return ActivationModel(
        saved_per_image=(four.saved_bytes - two.saved_bytes) / 2,
        saved_per_microbatch=2 * two.saved_bytes - four.saved_bytes,
        peak_per_image=(four.backward_peak_bytes - two.backward_peak_bytes) / 2,
        peak_per_microbatch=2 * two.backward_peak_bytes - four.backward_peak_bytes,
        weight_cast_bytes=two.weight_cast_bytes)


def _nbytes(module: torch.nn.Module | None, dtype: torch.dtype | None = None) -> int:
    """Bytes of a module's parameters and buffers, in `dtype` when given (else their own)."""
    if module is None:
        return 0
    itemsize = torch.empty(0, dtype=dtype).element_size() if dtype is not None else None
    return sum(t.numel() * (itemsize if itemsize and t.is_floating_point() else t.element_size())
               for t in [*module.parameters(), *module.buffers()])


@functools.lru_cache(maxsize=None)
def _meta_parts(model_config: str):
    """The family's parts on the meta device, built once per config (read only: parameter counts)."""
    return family_of(model_config).meta_parts(model_config)


def fsdp_unit_params(model_config: str) -> dict[str, int]:
    """Parameters of the denoiser's FSDP units as the run wraps them (`ModelFamily.fsdp_blocks`, which
    `DiffusionModel.mark_fsdp_units` hands Composer): the largest block, and the root unit (what no
    block holds: embeddings, input and output layers), which FSDP2 keeps gathered from the root's
    forward to the end of its backward."""
    denoiser = _meta_parts(model_config).denoiser
    blocks = family_of(model_config).fsdp_blocks(denoiser)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    return {"largest_block": max(sum(p.numel() for p in block.parameters()) for block in blocks),
            "root": sum(p.numel() for p in denoiser.parameters() if id(p) not in in_blocks)}


def fixed_bytes(model_config: str, *, precision: str = "amp_bf16", precomputed: bool = False,
                precomputed_format: str | None = None, use_ema: bool = True, fsdp: str = "none", num_gpus: int = 8,
                bucket_view: bool = False, weight_cast_bytes: int = 0, weight_casts: str = "microbatch"
                ) -> dict[str, int]:
    """Bytes per GPU that do not depend on the microbatch, by what holds them (see `plan`).

    `weight_casts` "step": the bf16 copies of the weights live all run (in place of autocast's cached
    casts) and the step's gradients are bf16 until the end of backward; their fp32 upcast exists only
    after the activations are gone (`plan` checks that moment apart: "step_end_bytes")."""
    if fsdp not in FSDP_MODES:
        raise ValueError(f"fsdp must be one of {FSDP_MODES}, not {fsdp!r}")
    if weight_casts not in WEIGHT_CASTS:
        raise ValueError(f"weight_casts must be one of {WEIGHT_CASTS}, not {weight_casts!r}")
    family = family_of(model_config)
    text_format = _text_format(family, precomputed, precomputed_format)
    parts = _meta_parts(model_config)
    num_params = sum(p.numel() for p in parts.denoiser.parameters())
    dtype = _dtype_of(precision)
    compute_bytes = 4 if dtype is None else 2
    shards = num_gpus if fsdp != "none" else 1
    copies = fsdp == "none" and weight_casts == "step" and dtype is not None
    if copies:
        gathered = compute_bytes * num_params  # t2ibench.weight_casts' bf16 copies
    elif fsdp == "none":
        # Autocast's cached weight casts, kept by autograd until backward (counted in the step).
        gathered = weight_cast_bytes
    elif fsdp == "shard_grad_op":
        # Every unit gathered in the autocast dtype, kept from its forward to the end of the backward.
        gathered = compute_bytes * num_params
    else:
        # Each block freed after its forward and gathered again for its backward: two at once (one
        # computing, the next prefetched), beside the root unit, gathered throughout.
        units = fsdp_unit_params(model_config)
        gathered = compute_bytes * (2 * units["largest_block"] + units["root"])
    if fsdp == "none":
        reduce_scatter = 0
    else:
        # FSDP2's reduce-scatter of a unit's gradient (torch 2.7, foreach_reduce): the unsharded
        # gradients in the compute dtype, copied into an fp32 reduce-scatter input (Composer reduces
        # in fp32) of the unit's full size, for the largest unit.
        units = fsdp_unit_params(model_config)
        reduce_scatter = (compute_bytes + 4) * max(units["largest_block"], units["root"])
    vae_encoder = 0
    if not precomputed and parts.vae is not None:
        # Only the VAE's encoder is on the GPU: benchmark.py keeps the decoder on the host.
        vae_encoder = _nbytes(parts.vae.encoder, dtype) + _nbytes(getattr(parts.vae, "quant_conv", None), dtype)
    text_encoders = 0 if text_format == "text_states" else sum(
        _nbytes(encoder, dtype) for encoder in parts.text_encoders.values())
    return {
        # fp32 master weights: replicated under DDP; sharded at rest under both FSDP strategies (what
        # computes is the gathered copy: `weight_casts_or_gathered`).
        "weights": 4 * num_params // shards,
        "gradients": (compute_bytes if copies else 4) * num_params // shards,
        # DDP's reducer buckets: a second copy of the gradients unless they are views into the buckets
        # (`gradient_as_bucket_view`, which Composer 0.32.1's prepare_ddp_module does not pass on).
        "ddp_buckets": 4 * num_params if fsdp == "none" and num_gpus > 1 and not bucket_view else 0,
        "adamw_moments": 8 * num_params // shards,
        "ema": 4 * num_params // shards if use_ema else 0,
        "weight_casts_or_gathered": int(gathered),
        "fsdp_reduce_scatter": int(reduce_scatter),
        # Frozen encoders in their stored dtype (the autocast dtype under AMP), replicated on every
        # GPU under FSDP too (mark_fsdp_units leaves them out of the sharding).
        "frozen_encoders": vae_encoder + text_encoders,
    }


def largest_microbatch(fixed_total_bytes: float, activations: ActivationModel, gpu_memory_bytes: float,
                       per_device_batch: int | None = None) -> int:
    """Largest power of two b (dividing `per_device_batch` when given) with
    (fixed + peak(b)) * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES <= gpu memory; 0 if none."""
    best, size = 0, 1
    limit = per_device_batch or MAX_MICROBATCH
    while size <= limit:
        tensors = fixed_total_bytes + activations.peak_bytes(size)
        need = tensors * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES
        if need > gpu_memory_bytes:
            break
        if per_device_batch is None or per_device_batch % size == 0:
            best = size
        size *= 2
    return best


@functools.lru_cache(maxsize=None)
def train_flops_per_image(model_config: str, image_size: int) -> float:
    """FLOPs of the trained network alone (the denoiser's forward and backward) per image, the
    family's count with the encoders left out (recomputation under checkpointing not included)."""
    return family_of(model_config).flops_per_image(model_config, image_size, vae=False, text_encoders=False)["total"]


def plan(model_config: str = "sd2-base", image_size: int | None = None, gpu_memory_bytes: float = 80 * GIB, *,
         precision: str = "amp_bf16", norm_precision: str = "autocast", precomputed: bool = False,
         precomputed_format: str | None = None, use_ema: bool = True, fsdp: str = "none", num_gpus: int = 8,
         bucket_view: bool = False, per_device_batch: int | None = None,
         activation_checkpointing: bool = False, weight_casts: str = "microbatch", fp8: str = "off"
         ) -> dict[str, Any]:
    """The memory of a training step per GPU and the largest microbatch that fits, as a JSON-able dict.

    `image_size` None: the family's training resolution (`ModelFamily.default_image_size`);
    `precomputed_format` None: the family's (`default_precomputed_format`)."""
    if fsdp not in FSDP_MODES:
        raise ValueError(f"fsdp must be one of {FSDP_MODES}, not {fsdp!r}")
    family = family_of(model_config)
    image_size = image_size or family.default_image_size(model_config)
    text_format = _text_format(family, precomputed, precomputed_format)
    activations = activation_model(model_config, image_size, precision=precision, norm_precision=norm_precision,
                                   precomputed=precomputed, precomputed_format=text_format,
                                   activation_checkpointing=activation_checkpointing, sharded=fsdp != "none",
                                   weight_casts=weight_casts, fp8=fp8)
    parts = fixed_bytes(model_config, precision=precision, precomputed=precomputed, precomputed_format=text_format,
                        use_ema=use_ema, fsdp=fsdp, num_gpus=num_gpus, bucket_view=bucket_view,
                        weight_cast_bytes=activations.weight_cast_bytes, weight_casts=weight_casts)
    tensors = sum(parts.values())
    # With bf16 weight copies, the fp32 gradients are made from the bf16 ones after the last backward:
    # both exist then, the activations no longer (4 more bytes per parameter, whatever the microbatch).
    step_end = tensors + (4 * sum(p.numel() for p in _meta_parts(model_config).denoiser.parameters())
                          if weight_casts == "step" and fsdp == "none" and precision != "fp32" else 0)
    # Weight casts are per microbatch in the activation model too: counted once, in the fixed part.
    activations_without_casts = dataclasses.replace(
        activations, saved_per_microbatch=activations.saved_per_microbatch - activations.weight_cast_bytes,
        peak_per_microbatch=activations.peak_per_microbatch - activations.weight_cast_bytes)
    microbatch = largest_microbatch(tensors, activations_without_casts, gpu_memory_bytes, per_device_batch)
    if step_end * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES > gpu_memory_bytes:
        microbatch = 0
    fixed = tensors * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES
    result = {
        "model_config": model_config, "family": family.name, "image_size": image_size, "precision": precision,
        "norm_precision": norm_precision, "precomputed": precomputed, "precomputed_format": text_format,
        "use_ema": use_ema, "fsdp": fsdp, "num_gpus": num_gpus, "ddp_bucket_view": bucket_view,
        "activation_checkpointing": activation_checkpointing, "weight_casts": weight_casts, "fp8": fp8,
        "gpu_memory_bytes": int(gpu_memory_bytes),
        "activation_bytes_per_image": int(activations.saved_per_image),
        "activation_bytes_per_microbatch": int(activations_without_casts.saved_per_microbatch),
        "peak_bytes_per_image": int(activations.peak_per_image),
        "peak_bytes_per_microbatch": int(activations_without_casts.peak_per_microbatch),
        "fixed_tensor_bytes": int(tensors),
        "fixed_bytes_breakdown": {k: int(v) for k, v in parts.items()},
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "allocator_reserve_fraction": ALLOCATOR_RESERVE_FRACTION,
        "fixed_bytes": int(fixed),
        "step_end_bytes": int(step_end),
        "microbatch": microbatch,
        "train_flops_per_image": train_flops_per_image(model_config, image_size),
    }
    result["predicted_bytes_at_microbatch"] = predicted_bytes(result, microbatch) if microbatch else None
    return result


def predicted_bytes(plan_result: dict[str, Any], microbatch: int) -> int:
    """GPU memory a step at `microbatch` needs by `plan`'s figures, context and reserve included."""
    tensors = (plan_result["fixed_tensor_bytes"] + plan_result["peak_bytes_per_image"] * microbatch
               + plan_result["peak_bytes_per_microbatch"])
    return int(tensors * (1 + plan_result["allocator_reserve_fraction"]) + plan_result["cuda_context_bytes"])


def auto_microbatch(model_config: str, image_size: int | None, gpu_memory_bytes: float, per_device_batch: int,
                    **options: Any) -> int:
    """benchmark.py's `auto` with several ranks: the plan's microbatch for this per-device batch (at
    least 1: when nothing fits, the run's own OOM says so rather than a refusal here)."""
    return max(1, plan(model_config, image_size, gpu_memory_bytes, per_device_batch=per_device_batch,
                       **options)["microbatch"])


def gib(nbytes: float) -> float:
    return nbytes / GIB
