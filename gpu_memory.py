"""GPU memory of a training step, counted: bytes saved for backward, fixed bytes per GPU, microbatch.

    python bench/memory.py --model_config sd2-base --image_size 512 --gpu_memory_gib 80 --json

Guessing the microbatch costs a first GPU run: the README's old table doubled it for `--precomputed`
and would have asked an 80 GB GPU for 108 GiB (87 with bf16 norms). Here the step is run on the meta
device (shapes and dtypes, no memory, no arithmetic) and counted:

* **Activations.** `torch.autograd.graph.saved_tensors_hooks` see every tensor autograd keeps for
  backward during the real `StableDiffusion` forward and loss (encoders included: they run under
  no_grad and keep nothing). Saved tensors are deduplicated by storage (a view keeps its whole
  storage alive) and the parameters' own storages are left out (they are counted as weights). The
  count is taken at microbatch 1 and 2: the difference is the bytes per image, the rest is what
  every microbatch keeps whatever its size (the bf16 weight casts that autocast caches and autograd
  keeps until backward). A dispatch mode also follows every storage an op creates and frees, which
  gives the step's peak, backward transients included.
* **CUDA autocast on the meta device.** Autocast only casts tensors of its own device, and a fake
  CUDA tensor cannot enter autograd without a CUDA driver, so `AutocastRules` applies CUDA
  autocast's policy itself at the level autocast works at (before autograd records the op, so
  casts are saved as autocast's are): the op lists of torch 2.7.0's `ATen/autocast_mode.h`, the
  weight-cast cache, and the SDPA kernel CUDA picks (flash attention for bf16/fp16, memory-efficient
  for fp32). `tests/test_memory.py` checks the method against real CPU autocast and a real CPU
  forward and backward.
* **Fixed bytes per GPU.** Weights, gradients, DDP buckets (or FSDP shards), AdamW's two moments,
  the EMA, the frozen encoders in their dtype, weights gathered under FSDP, plus a stated CUDA
  context and an allocator reserve (`CUDA_CONTEXT_BYTES`, `ALLOCATOR_RESERVE_FRACTION`).

`plan(...)` returns all of it and the largest power-of-two microbatch that fits; benchmark.py's
`auto` with several ranks, bench/bench_gpu.py's rows and the README's table take theirs from it.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

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
FSDP_MODES = ("none", "shard_grad_op", "full_shard")
NORM_PRECISIONS = ("autocast", "fp32")
MAX_MICROBATCH = 1024

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
        """GroupNorm and LayerNorm moved to the lower-precision list (`model.set_norm_precision`)."""
        return AutocastPolicy(self.lower_precision | NORM_OPS, self.fp32 - NORM_OPS, self.fp32_set_opt_dtype)

    def with_fp32_norms(self) -> "AutocastPolicy":
        return AutocastPolicy(self.lower_precision - NORM_OPS, self.fp32 | NORM_OPS, self.fp32_set_opt_dtype)


CUDA_AUTOCAST = AutocastPolicy(CUDA_LOWER_PRECISION_OPS, CUDA_FP32_OPS, CUDA_FP32_SET_OPT_DTYPE_OPS)


def probe_cpu_autocast() -> AutocastPolicy:
    """CPU autocast's policy for the ops SD2's step reaches, read off the real CPU autocast.

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
        "exp": torch.exp, "pow": lambda t: t.pow(2), "softmax": lambda t: torch.softmax(t, -1),
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
        if not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
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
    tensor back unchanged, so the step still runs its backward.
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.storages: dict[int, tuple[int, torch.Tensor]] = {}  # key -> (bytes, a tensor keeping it alive)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self.exclude and key not in self.storages:
            self.storages[key] = (tensor.untyped_storage().nbytes(), tensor)
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
    """The tensors in nested tuples, lists and dicts (what ops take and return); faster than pytree."""
    if isinstance(tree, torch.Tensor):
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


def build_meta_model(model_config: str, *, precomputed: bool = False, precomputed_format: str = "tokens",
                     frozen_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`model.StableDiffusion` with every part on the meta device, as benchmark.py builds it."""
    from model import SCHEDULER_CONFIG, StableDiffusion, sd2_meta_components
    from diffusers import DDPMScheduler

    unet, vae, text_encoder = sd2_meta_components(model_config)
    if precomputed:
        vae = None
        if precomputed_format == "text_states":
            text_encoder = None
    model = StableDiffusion(unet, vae, text_encoder, DDPMScheduler(**SCHEDULER_CONFIG), num_loss_bins=0)
    if frozen_dtype is not None:
        for frozen in model._frozen():
            frozen.to(frozen_dtype)
    return model


def meta_batch(model: torch.nn.Module, image_size: int, microbatch: int, device: str = "meta") -> dict:
    """A batch of the shapes and dtypes the loaders yield for this model."""
    latent = image_size // 8
    captions = torch.zeros(microbatch, 77, dtype=torch.long, device=device)
    if model.vae is not None:
        return {"image": torch.zeros(microbatch, 3, image_size, image_size, dtype=torch.uint8, device=device),
                "captions": captions}
    channels = model.unet.config.in_channels
    batch = {"latent_mean": torch.zeros(microbatch, channels, latent, latent, dtype=torch.float16, device=device),
             "latent_logvar": torch.zeros(microbatch, channels, latent, latent, dtype=torch.float16, device=device)}
    if model.text_encoder is None:
        batch["text_states"] = torch.zeros(microbatch, 77, model.unet.config.cross_attention_dim,
                                           dtype=torch.float16, device=device)
    else:
        batch["captions"] = captions
    return batch


def count_step(model: torch.nn.Module, batch: dict, policy: AutocastPolicy | None, dtype: torch.dtype | None,
               device_type: str = "cuda") -> StepCount:
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
    return StepCount(int(batch_size(batch)), saved_bytes, cast_bytes, forward_peak, after_forward, backward_peak)


def batch_size(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]


@dataclasses.dataclass
class ActivationModel:
    """Bytes of a microbatch of `b` images: `per_image * b + per_microbatch`, from counts at b = 1, 2."""

    saved_per_image: float  # activation_bytes_per_image: saved for backward
    saved_per_microbatch: float  # saved whatever the size (weight casts)
    peak_per_image: float  # peak of the step above the fixed bytes (backward transients, gradients aside)
    peak_per_microbatch: float
    weight_cast_bytes: int

    def saved_bytes(self, microbatch: int) -> float:
        return self.saved_per_image * microbatch + self.saved_per_microbatch

    def peak_bytes(self, microbatch: int) -> float:
        return self.peak_per_image * microbatch + self.peak_per_microbatch


def activation_model(model_config: str, image_size: int, *, precision: str = "amp_bf16",
                     norm_precision: str = "autocast", precomputed: bool = False,
                     precomputed_format: str = "tokens", device_type: str = "cuda") -> ActivationModel:
    """Count the step at microbatch 1 and 2 under `precision` ("fp32", "amp_bf16", "amp_fp16").

    Counted once per process and setting (about 5 s for the tiny model, 10 s for SD2 on a CPU)."""
    if not precomputed:
        precomputed_format = "tokens"  # not used online: one cache entry
    return _activation_model(model_config, image_size, precision, norm_precision, precomputed, precomputed_format,
                             device_type)


@functools.lru_cache(maxsize=None)
def _activation_model(model_config: str, image_size: int, precision: str, norm_precision: str, precomputed: bool,
                      precomputed_format: str, device_type: str) -> ActivationModel:
    with torch.random.fork_rng(devices=[]):  # the run that asks (benchmark.py's auto) draws the same numbers after
        return _count_activations(model_config, image_size, precision, norm_precision, precomputed,
                                  precomputed_format, device_type)


def _count_activations(model_config: str, image_size: int, precision: str, norm_precision: str, precomputed: bool,
                       precomputed_format: str, device_type: str) -> ActivationModel:
    dtype = {"fp32": None, "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}[precision]
    policy = CUDA_AUTOCAST if device_type == "cuda" else probe_cpu_autocast()
    policy = policy.with_low_precision_norms() if norm_precision == "autocast" else policy.with_fp32_norms()
    model = build_meta_model(model_config, precomputed=precomputed, precomputed_format=precomputed_format,
                             frozen_dtype=dtype)
    model.train()
    one, two = (count_step(model, meta_batch(model, image_size, microbatch), policy, dtype, device_type)
                for microbatch in (1, 2))
    peak_one, peak_two = one.backward_peak_bytes, two.backward_peak_bytes
    return ActivationModel(
        saved_per_image=two.saved_bytes - one.saved_bytes, saved_per_microbatch=2 * one.saved_bytes - two.saved_bytes,
        peak_per_image=peak_two - peak_one, peak_per_microbatch=2 * peak_one - peak_two,
        weight_cast_bytes=one.weight_cast_bytes)


def _nbytes(module: torch.nn.Module | None, dtype: torch.dtype | None = None) -> int:
    """Bytes of a module's parameters and buffers, in `dtype` when given (else their own)."""
    if module is None:
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (torch.tensor([], dtype=dtype).element_size() if dtype and t.is_floating_point()
                            else t.element_size()) for t in tensors)


def largest_fsdp_unit_params(unet: torch.nn.Module) -> int:
    """Parameters of the largest block an FSDP wrap would gather at once (the UNet's top-level blocks)."""
    blocks = [*unet.down_blocks, *unet.up_blocks, unet.mid_block]
    return max(sum(p.numel() for p in block.parameters()) for block in blocks)


@functools.lru_cache(maxsize=None)
def _meta_components(model_config: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    from model import sd2_meta_components

    return sd2_meta_components(model_config)


def fixed_bytes(model_config: str, *, precision: str = "amp_bf16", precomputed: bool = False,
                precomputed_format: str = "tokens", use_ema: bool = True, fsdp: str = "none", num_gpus: int = 8,
                bucket_view: bool = False, weight_cast_bytes: int = 0) -> dict[str, int]:
    """Bytes per GPU that do not depend on the microbatch, by what holds them (see `plan`)."""
    unet, vae, text_encoder = _meta_components(model_config)
    num_params = sum(p.numel() for p in unet.parameters())
    compute_bytes = 4 if precision == "fp32" else 2
    frozen_dtype = None if precision == "fp32" else (torch.bfloat16 if precision == "amp_bf16" else torch.float16)
    shards = num_gpus if fsdp != "none" else 1
    parts = {
        # fp32 master weights: replicated under DDP; sharded at rest under both FSDP strategies (what
        # computes is the gathered copy below: SHARD_GRAD_OP keeps it from forward to the end of backward).
        "weights": 4 * num_params // shards,
        "gradients": 4 * num_params // shards,
        # DDP's reducer buckets: a second copy of the gradients unless they are views into the buckets
        # (`gradient_as_bucket_view`, which Composer 0.32.1's prepare_ddp_module does not pass on).
        "ddp_buckets": 4 * num_params if fsdp == "none" and num_gpus > 1 and not bucket_view else 0,
        "adamw_moments": 8 * num_params // shards,
        "ema": 4 * num_params // shards if use_ema else 0,
        # DDP: autocast's cached weight casts, kept by autograd until backward. FSDP (Composer's
        # default mixed precision: parameters gathered in the autocast dtype) instead keeps the
        # gathered parameters between forward and backward under shard_grad_op, and under full_shard
        # frees them after each block: two blocks gathered at once (one computing, one prefetched).
        "weight_casts_or_gathered": (weight_cast_bytes if fsdp == "none" else
                                     compute_bytes * num_params if fsdp == "shard_grad_op" else
                                     2 * compute_bytes * largest_fsdp_unit_params(unet)),
        # Frozen encoders in their stored dtype; only the VAE's encoder is on the GPU (benchmark.py
        # keeps the decoder on the host).
        "frozen_encoders": ((0 if precomputed else _nbytes(vae.encoder, frozen_dtype) + _nbytes(vae.quant_conv, frozen_dtype))
                            + (0 if precomputed and precomputed_format == "text_states"
                               else _nbytes(text_encoder, frozen_dtype))),
    }
    return parts


def largest_microbatch(fixed_total_bytes: float, activations: ActivationModel, gpu_memory_bytes: float,
                       per_device_batch: int | None = None) -> int:
    """Largest power of two b (dividing `per_device_batch` when given) with
    (fixed + peak(b)) * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES <= gpu memory; 0 if none."""
    best, size = 0, 1
    limit = per_device_batch or MAX_MICROBATCH
    while size <= limit:
        need = (fixed_total_bytes + activations.peak_bytes(size)) * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES
        if need > gpu_memory_bytes:
            break
        if per_device_batch is None or per_device_batch % size == 0:
            best = size
        size *= 2
    return best


@functools.lru_cache(maxsize=None)
def train_flops_per_image(model_config: str, image_size: int) -> float:
    """FLOPs of the trained network alone (the UNet's forward and backward) per image."""
    from model import sd2_meta_components
    from throughput import count_flops_per_image

    unet, _, _ = sd2_meta_components(model_config)
    return count_flops_per_image(unet, None, None, image_size)["unet_fwd_bwd"]


def plan(model_config: str = "sd2-base", image_size: int = 512, gpu_memory_bytes: float = 80 * GIB, *,
         precision: str = "amp_bf16", norm_precision: str = "autocast", precomputed: bool = False,
         precomputed_format: str = "tokens", use_ema: bool = True, fsdp: str = "none", num_gpus: int = 8,
         bucket_view: bool = False, per_device_batch: int | None = None) -> dict[str, Any]:
    """The memory of a training step per GPU and the largest microbatch that fits, as a JSON-able dict."""
    if fsdp not in FSDP_MODES:
        raise ValueError(f"fsdp must be one of {FSDP_MODES}, not {fsdp!r}")
    activations = activation_model(model_config, image_size, precision=precision, norm_precision=norm_precision,
                                   precomputed=precomputed, precomputed_format=precomputed_format)
    parts = fixed_bytes(model_config, precision=precision, precomputed=precomputed,
                        precomputed_format=precomputed_format, use_ema=use_ema, fsdp=fsdp, num_gpus=num_gpus,
                        bucket_view=bucket_view, weight_cast_bytes=activations.weight_cast_bytes)
    tensors = sum(parts.values())
    # Weight casts are per microbatch in the activation model too: counted once, in the fixed part.
    activations_without_casts = dataclasses.replace(
        activations, saved_per_microbatch=activations.saved_per_microbatch - activations.weight_cast_bytes,
        peak_per_microbatch=activations.peak_per_microbatch - activations.weight_cast_bytes)
    microbatch = largest_microbatch(tensors, activations_without_casts, gpu_memory_bytes, per_device_batch)
    fixed = tensors * (1 + ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES
    result = {
        "model_config": model_config, "image_size": image_size, "precision": precision,
        "norm_precision": norm_precision, "precomputed": precomputed,
        "precomputed_format": precomputed_format if precomputed else None, "use_ema": use_ema, "fsdp": fsdp,
        "num_gpus": num_gpus, "ddp_bucket_view": bucket_view, "gpu_memory_bytes": int(gpu_memory_bytes),
        "activation_bytes_per_image": int(activations.saved_per_image),
        "activation_bytes_per_microbatch": int(activations_without_casts.saved_per_microbatch),
        "peak_bytes_per_image": int(activations.peak_per_image),
        "peak_bytes_per_microbatch": int(activations_without_casts.peak_per_microbatch),
        "fixed_tensor_bytes": int(tensors),
        "fixed_bytes_breakdown": {k: int(v) for k, v in parts.items()},
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "allocator_reserve_fraction": ALLOCATOR_RESERVE_FRACTION,
        "fixed_bytes": int(fixed),
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


def auto_microbatch(model_config: str, image_size: int, gpu_memory_bytes: float, per_device_batch: int,
                    **options: Any) -> int:
    """benchmark.py's `auto` with several ranks: the plan's microbatch for this per-device batch (at least 1)."""
    return max(1, plan(model_config, image_size, gpu_memory_bytes, per_device_batch=per_device_batch,
                       **options)["microbatch"])


def gib(nbytes: float) -> float:
    return nbytes / GIB

