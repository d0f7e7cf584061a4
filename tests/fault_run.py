"""benchmark.py with timing faults injected from outside: a slow checkpoint save, a slow rank.

    PYTHONPATH=. composer -n 2 tests/fault_run.py --report DIR [--slow_save_s S] [--slow_rank R --slow_rank_s S]
        [--compile_backend NAME] <benchmark.py flags>

`--slow_save_s S` makes every checkpoint save sleep S seconds on global rank 0 (the rank that writes
the file; the other ranks wait for it), by wrapping Composer's `save_checkpoint` in this process.
`--slow_rank R --slow_rank_s S` makes global rank R sleep S seconds at the end of every batch, after
the batch's last collective, so the other ranks wait for it in the next batch's first collective
(Composer's end-of-data all-reduce, between BEFORE_ and AFTER_DATALOADER). Every rank writes
`DIR/rank<R>.json`: the perf_counter times at which saves started, and the Throughput callback's
`window_end`, so a test can check which saves fell inside the measured window, and `losses`: each
batch's loss as Composer all-reduced it, at full precision (the progress line rounds), and
`grad_norms`: each step's gradient norm as this rank's run reads it (t2ibench.train.grad_norm), and
`batch_shapes`: each batch's image (or latent) height and width on this rank. Other flags go to
`benchmark.main` unchanged. `--compile_backend aot_eager` makes `--compile` trace with dynamo and AOT
autograd (graphs, DDP, parameter names) but skip inductor's code generation, which on CPU compiles
C++ with gcc for minutes on a busy two-core machine (and on a GPU generates Triton instead).
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import checkpoint, dist

import benchmark
from t2ibench.callbacks.throughput import Throughput
from t2ibench.train.grad_norm import GradientNorm

SAVE_STARTS: list[float] = []


def slow_saves(seconds: float) -> None:
    """Wrap the function Composer's CheckpointSaver calls (`checkpoint.save_checkpoint`)."""
    original = checkpoint.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        SAVE_STARTS.append(time.perf_counter())
        if dist.get_global_rank() == 0:
            time.sleep(seconds)
        return original(*args, **kwargs)

    checkpoint.save_checkpoint = save_checkpoint


class SlowRank(Callback):
    """Sleep at BATCH_END on one rank: after the loss all-reduce and Composer's time accumulation."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == self.rank:
            time.sleep(self.seconds)


class Report(Callback):
    """At FIT_END (after Throughput's, which runs earlier in the callback list) record the window's end."""

    def __init__(self, report: Path):
        self.report = report
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float | None] = {}
        self.batch_shapes: dict[int, list[int]] = {}  # each batch's image (or latent) height and width

    def after_dataloader(self, state: State, logger: Logger) -> None:
        pixels = state.batch.get("image", state.batch.get("latent_mean"))
        if pixels is not None:
            self.batch_shapes[int(state.timestamp.batch) + 1] = list(pixels.shape[-2:])

    def batch_end(self, state: State, logger: Logger) -> None:
        # Written every batch, so a run killed from outside leaves the losses of the batches it trained.
        self.losses[int(state.timestamp.batch)] = state.total_loss_dict.get("loss/train/total")
        # Every rank reads it here, as benchmark.py does at the end (a collective under FSDP).
        norm = next(a for a in state.algorithms if isinstance(a, GradientNorm))
        self.grad_norms[int(state.timestamp.batch)] = norm.last_norm()
        self.write({"losses": self.losses, "grad_norms": self.grad_norms, "batch_shapes": self.batch_shapes})

    def fit_end(self, state: State, logger: Logger) -> None:
        throughput = next(cb for cb in state.callbacks if isinstance(cb, Throughput))
        ema = next((a for a in state.algorithms if hasattr(a, "shadow_nbytes")), None)
        self.write({"window_end": throughput.window_end, "save_starts": SAVE_STARTS, "losses": self.losses,
                    "grad_norms": self.grad_norms, "batch_shapes": self.batch_shapes,
                    "ema_shadow_bytes": ema.shadow_nbytes if ema is not None else None})

    def write(self, report: dict) -> None:
        self.report.mkdir(parents=True, exist_ok=True)
        (self.report / f"rank{dist.get_global_rank()}.json").write_text(json.dumps(report))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --compile is benchmark.py's
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--slow_save_s", type=float, default=0.0)
    p.add_argument("--slow_rank", type=int, default=None)
    p.add_argument("--slow_rank_s", type=float, default=0.0)
    p.add_argument("--compile_backend", type=str, default=None)
    ours, rest = p.parse_known_args(argv)
    if ours.compile_backend:
        torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend=ours.compile_backend)
    if ours.slow_save_s:
        slow_saves(ours.slow_save_s)
    callbacks: list[Callback] = [Report(ours.report)]
    if ours.slow_rank is not None:
        callbacks.insert(0, SlowRank(ours.slow_rank, ours.slow_rank_s))
    benchmark.main(rest, extra_callbacks=callbacks)


if __name__ == "__main__":
    main()
