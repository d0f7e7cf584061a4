"""benchmark.py with FSDP2's collectives counted from outside: the bytes each rank sends per batch.

    PYTHONPATH=. composer -n 2 tests/traffic_run.py --report DIR <benchmark.py flags>

Wraps torch.distributed's `all_gather_into_tensor` and `reduce_scatter_tensor` in this process (what
FSDP2 calls for its weights and gradients, torch 2.7: `_fsdp_collectives`, which looks them up on the
module at each call) and counts, per training batch, the bytes a ring sends per rank: (W-1)/W of the
gathered or reduced buffer, by collective. Every rank writes `DIR/rank<R>.json`: `batches`, a list of
{"all_gather": bytes, "reduce_scatter": bytes, "all_gather_calls": n, "reduce_scatter_calls": n},
and `world_size`. Other flags go to `benchmark.main` unchanged.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
from pathlib import Path

import torch
import torch.distributed

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

import benchmark

SENT: collections.Counter = collections.Counter()


def count(name: str, buffer_arg: str) -> None:
    """Wrap torch.distributed.`name` to add (W-1)/W of its full buffer (`buffer_arg`) to SENT[name]."""
    original = getattr(torch.distributed, name)
    signature = inspect.signature(original)

    def wrapper(*args, **kwargs):
        called = signature.bind(*args, **kwargs).arguments
        buffer = called[buffer_arg]
        world_size = torch.distributed.get_world_size(called.get("group"))
        SENT[name] += buffer.numel() * buffer.element_size() * (world_size - 1) / world_size
        SENT[f"{name}_calls"] += 1
        return original(*args, **kwargs)

    setattr(torch.distributed, name, wrapper)


class PerBatch(Callback):
    """What was sent in each training batch, from its start to its end (the optimizer step included)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, float]] = []

    def batch_start(self, state: State, logger: Logger) -> None:
        SENT.clear()

    def batch_end(self, state: State, logger: Logger) -> None:
        self.batches.append({"all_gather": SENT["all_gather_into_tensor"],
                             "reduce_scatter": SENT["reduce_scatter_tensor"],
                             "all_gather_calls": SENT["all_gather_into_tensor_calls"],
                             "reduce_scatter_calls": SENT["reduce_scatter_tensor_calls"]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    args, rest = parser.parse_known_args()
    count("all_gather_into_tensor", "output_tensor")
    count("reduce_scatter_tensor", "input")
    per_batch = PerBatch()
    benchmark.main(rest, extra_callbacks=[per_batch])
    args.report.mkdir(parents=True, exist_ok=True)
    report = {"batches": per_batch.batches, "world_size": dist.get_world_size()}
    (args.report / f"rank{dist.get_global_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
