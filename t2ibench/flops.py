"""FLOPs of a computation, counted by `torch.utils.flop_counter` (on meta tensors: nothing is computed).

Model families count their networks with it (`ModelFamily.flops_per_image`); the figure feeds MFU
(`callbacks.throughput.Throughput`) and Composer's SpeedMonitor (`DiffusionModel.flops_per_batch`).
"""
from __future__ import annotations

from typing import Any, Callable

from torch.utils.flop_counter import FlopCounterMode


def count_flops(call: Callable[[], Any]) -> float:
    """FLOPs of `call()` (a matmul of m x k by k x n counts 2mkn)."""
    with FlopCounterMode(display=False) as counter:
        call()
    return float(counter.get_total_flops())
