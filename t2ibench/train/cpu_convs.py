"""Convolutions whose kernel reaches past a small input, made right under bf16 on the CPU: their zero
padding is made explicit. torch 2.7.0's oneDNN (3.7.1) bf16 weight gradient of a convolution with a tap
that sees only padding returns, in such taps, memory it never wrote (their gradient is exactly 0):
NaN, 1e19 or small garbage, another value on every call. The tiny SD2 model at 32 px met it in its last
downsampler (a 1x1 map) and reached a gradient norm of inf in its first batches. Given the input padded
with zeros and no padding, oneDNN computes every tap from real zeros. Cause, shapes and cost:
docs/speed.md, "CPU bf16 convolutions".
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def tap_sees_only_padding(size: int, kernel: int, stride: int, padding: int, dilation: int) -> bool:
    """Whether some tap of a convolution reads zero padding at every output position, along one
    dimension of `size` input pixels. Cached: one dict look-up per call after a shape's first (the
    check runs on every forward of every convolution it guards)."""
    outputs = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return any(all(not 0 <= out * stride + tap * dilation - padding < size for out in range(outputs))
               for tap in range(kernel))


def reaches_past(conv: torch.nn.Conv2d, input: torch.Tensor) -> bool:
    """Whether `conv` on `input` has a tap that sees only padding, in height or width. Padding given as
    a word ('same', 'valid') or made by the module itself (a padding mode other than zeros) is left as
    it is: no model here has it."""
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return False
    return any(tap_sees_only_padding(size, kernel, stride, padding, dilation) for size, kernel, stride, padding, dilation
               in zip(input.shape[-2:], conv.kernel_size, conv.stride, conv.padding, conv.dilation))


def computes_in_bf16(input: torch.Tensor) -> bool:
    """Whether a convolution of `input` runs in bf16 on the CPU: under CPU bf16 autocast, or on bf16 input."""
    if input.device.type != "cpu":
        return False
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else input.dtype
    return dtype == torch.bfloat16


class CpuBf16Conv2d(torch.nn.Conv2d):
    """Conv2d that pads its input with zeros itself and convolves without padding where it computes in
    bf16 on the CPU and reaches past its input (`reaches_past`): the same sums, and a weight gradient
    oneDNN gets right. Elsewhere (a GPU, fp32, a map as large as the kernel's reach) Conv2d's own call."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if computes_in_bf16(input) and reaches_past(self, input):
            height, width = self.padding
            padded = torch.nn.functional.pad(input, (width, width, height, height))  # its backward: a slice
            return torch.nn.functional.conv2d(padded, weight, bias, self.stride, 0, self.dilation, self.groups)
        return super()._conv_forward(input, weight, bias)


def guard_convolutions(module: torch.nn.Module) -> int:
    """Make every Conv2d of `module` a `CpuBf16Conv2d`, in place (the class alone: parameters, devices,
    checkpoint keys and the optimizer's references stay), as t2ibench.train.norms changes the norms. Returns
    how many. For a CPU run under bf16 autocast; a module's subclasses of Conv2d are left as they are."""
    convs = [m for m in module.modules() if type(m) is torch.nn.Conv2d]
    for conv in convs:
        conv.__class__ = CpuBf16Conv2d
    return len(convs)
