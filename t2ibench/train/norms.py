"""GroupNorm and LayerNorm in the autocast dtype (`--norm_precision autocast`, the default under
AMP) instead of CUDA autocast's fp32, changed in place so parameters and checkpoint keys stay.
Which layers of each family it touches and why not Composer's algorithms: docs/speed.md, "Norms".
"""
from __future__ import annotations

import torch

NORM_PRECISIONS = ("autocast", "fp32")  # --norm_precision values


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast lowers to on `tensor`'s device, or None when autocast is off there."""
    device_type = tensor.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`tensor` in `dtype`; None (a norm without affine parameters) stays None, and no copy when it already is."""
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


class AutocastGroupNorm(torch.nn.GroupNorm):
    """GroupNorm that runs in the autocast dtype (`norm_dtype = None`) or in fp32 under autocast.

    In the autocast dtype the kernels still accumulate in fp32 (CUDA's and the CPU's group_norm use
    an fp32 accumulator for bf16/fp16 inputs), as Composer's LowPrecisionGroupNorm does. Composer's
    algorithm is not used: it downcasts only under CUDA autocast (so CPU runs and tests could never
    take this path), and it replaces each module by a new one with fresh fp32 parameters that
    require grad, which would upcast the frozen bf16 VAE and text encoders again and hand DDP
    parameters that never get a gradient. `set_norm_precision` changes the class in place instead:
    same parameters, dtypes, devices, requires_grad and checkpoint keys.

    `norm_dtype = torch.float32` (`Fp32GroupNorm`) runs the norm in fp32 under autocast on every
    device: CUDA autocast's own behaviour, and on a CPU (whose autocast runs norms in the input's
    dtype) an emulation of it. Without autocast both are plain GroupNorm.
    """

    norm_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        dtype = self.norm_dtype or dtype
        # Autocast off inside: it would send group_norm back to its own list's dtype.
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
    """GroupNorm in fp32 under autocast, on any device (`--norm_precision fp32`)."""

    norm_dtype = torch.float32


class Fp32LayerNorm(AutocastLayerNorm):
    """LayerNorm in fp32 under autocast, on any device (`--norm_precision fp32`)."""

    norm_dtype = torch.float32


# --norm_precision -> (GroupNorm class, LayerNorm class).
NORM_CLASSES: dict[str, tuple[type[AutocastGroupNorm], type[AutocastLayerNorm]]] = {
    "autocast": (AutocastGroupNorm, AutocastLayerNorm),
    "fp32": (Fp32GroupNorm, Fp32LayerNorm),
}


def set_norm_precision(module: torch.nn.Module, precision: str) -> int:
    """Make every GroupNorm and LayerNorm in `module` run in the autocast dtype ("autocast") or in fp32
    ("fp32") under autocast, by changing their class in place; returns how many were changed.

    Exact classes only (torch's two, or ones this function set before, so it can be called again
    with the other precision): a subclass with its own forward keeps it.
    """
    if precision not in NORM_CLASSES:
        raise ValueError(f"norm precision '{precision}' is not one of {NORM_PRECISIONS}")
    group_norm, layer_norm = NORM_CLASSES[precision]
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
