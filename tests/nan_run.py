"""benchmark.py with a NaN put into the loss of one batch, to test that the run stops cleanly.

    PYTHONPATH=. composer -n 2 tests/nan_run.py --nan_at_batch 3 [--nan_rank 1] [--report DIR] <benchmark.py flags>

`--nan_at_batch N` poisons the loss of the N-th training batch (1-based: Composer's `[batch=N/...]`,
whose checkpoint would be `ep*-baN-rank0.pt`). `--nan_rank R` does it on global rank R only (default:
every rank), which checks that the other ranks stop at the same batch instead of hanging.
`--nan_microbatch M` poisons only the M-th (0-based) microbatch of that batch (default: every one), which
checks that a NaN in a microbatch other than the last is caught at its own batch. With
`--report DIR` every rank writes `DIR/rank<R>.txt`: a line when it poisons the loss and the message
of the exception that ended its run (the launcher shows rank 0's output, and terminates the other
ranks once rank 0 has exited, so rank 0 waits for their reports first). All other flags go to
`benchmark.main` unchanged.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

import benchmark


class PoisonLoss(Callback):
    """Multiply the loss by NaN right after it is computed, so the backward pass sees it too."""

    def __init__(self, at_batch: int, rank: int | None = None, report: Path | None = None,
                 microbatch: int | None = None):
        self.at_batch, self.rank, self.report, self.microbatch = at_batch, rank, report, microbatch
        self.microbatch_index = -1

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self.microbatch_index = -1  # once per batch, before its microbatches

    def after_loss(self, state: State, logger: Logger) -> None:
        self.microbatch_index += 1
        # At AFTER_LOSS the timestamp still counts only the batches completed before this one.
        if int(state.timestamp.batch) + 1 != self.at_batch:
            return
        if self.microbatch is not None and self.microbatch_index != self.microbatch:
            return
        if self.rank is not None and dist.get_global_rank() != self.rank:
            return
        state.loss = state.loss * float("nan")
        which = "" if self.microbatch is None else f" microbatch {self.microbatch_index}"
        note(self.report, f"poisoned the loss of batch {self.at_batch}{which}")


def note(report: Path | None, line: str) -> None:
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        with open(report / f"rank{dist.get_global_rank()}.txt", "a") as f:
            f.write(line.replace("\n", " ") + "\n")


def wait_for_reports(report: Path, world_size: int, timeout: float = 20.0) -> None:
    """Rank 0 exits last: once it is gone the launcher terminates the other ranks, maybe mid-report."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [report / f"rank{rank}.txt" for rank in range(world_size)]
        if all(f.exists() and "stopped:" in f.read_text() for f in files):
            return
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--nan_at_batch", type=int, required=True)
    p.add_argument("--nan_rank", type=int, default=None)
    p.add_argument("--report", type=Path, default=None)
    p.add_argument("--nan_microbatch", type=int, default=None)
    ours, rest = p.parse_known_args(argv)
    try:
        benchmark.main(rest, extra_callbacks=[PoisonLoss(ours.nan_at_batch, ours.nan_rank, ours.report,
                                                                ours.nan_microbatch)])
    except Exception as error:
        note(ours.report, f"stopped: {type(error).__name__}: {error}")
        if ours.report is not None and dist.get_global_rank() == 0:
            wait_for_reports(ours.report, dist.get_world_size())
        raise
    note(ours.report, "finished")


if __name__ == "__main__":
    main()
