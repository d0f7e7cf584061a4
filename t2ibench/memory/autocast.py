"""CUDA autocast's dtype rules and attention kernel, applied on the meta device (where real autocast
casts nothing), so that a step counted there keeps what it keeps on a GPU (docs/gpu-runs.md, "The
memory model")."""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

from t2ibench.memory.saved import storage_key
from t2ibench.train.norms import NORM_PRECISIONS
from t2ibench.train.precision import PRECISIONS

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


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a --precision (None: fp32, no autocast)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    return {"fp32": None, "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}[precision]


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
        return {storage_key(cast) for _, cast in self.weight_casts.values()}

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
