"""Stop at the end of an epoch that trained no batch, before its checkpoint; logs nothing.

It raises `EmptyEpochError`, which benchmark.py reports in one line.
"""
from __future__ import annotations

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


class EmptyEpochError(RuntimeError):
    """An epoch that trained no batch: the data gives this rank less than one batch."""


class StopOnEmptyEpoch(Callback):
    """Stop at the end of an epoch that started and trained no batch, before its checkpoint.

    validate() refuses data smaller than one global batch up front; this catches what it cannot
    see (shards that shrank, a partition that leaves a rank short). Composer 0.32.1 only warns
    "No batches were trained": a run in epochs then writes empty results and exits 0, and a run in
    batches starts empty epochs forever. An epoch resumed at its end (a retried finished job) is
    not started here (no EPOCH_START), so it does not count.
    """

    def __init__(self):
        self.batches_in_epoch: int | None = None  # None: the current epoch was not started by this process

    def epoch_start(self, state: State, logger: Logger) -> None:
        self.batches_in_epoch = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.batches_in_epoch is not None:
            self.batches_in_epoch += 1

    def epoch_end(self, state: State, logger: Logger) -> None:
        started, self.batches_in_epoch = self.batches_in_epoch, None
        if started == 0:
            raise EmptyEpochError(
                f"epoch {int(state.timestamp.epoch)} trained no batch: the data gives rank {dist.get_global_rank()} "
                "less than one batch per epoch; use a smaller --batch_size, a larger --epoch_size, or more data")
