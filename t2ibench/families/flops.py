"""FLOPs of a computation, counted by `torch.utils.flop_counter` (on meta tensors: nothing is computed).

Model families count their networks with it (`ModelFamily.flops_per_image`); the figure feeds MFU
(`callbacks.throughput.Throughput`) and Composer's SpeedMonitor (`DiffusionModel.flops_per_batch`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode


def count_flops(call: Callable[[], Any]) -> float:
    """FLOPs of `call()` (a matmul of m x k by k x n counts 2mkn)."""
    with FlopCounterMode(display=False) as counter:
        call()
    return float(counter.get_total_flops())


def count_forward_backward(call: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """FLOPs of `call()`, and of it plus the backward of its output's sum.

    One pass, the forward's count read before the backward runs: half the time of counting the two
    apart (tracing SDXL's ~2,000 modules, or Flux.1's 11.9B parameters, is what takes long).
    """
    with FlopCounterMode(display=False) as counter:
        output = call()
        forward = float(counter.get_total_flops())
        output.sum().backward()
        return forward, float(counter.get_total_flops())
