"""Restore the checkpoint's random state after a mid-epoch resume on streamed data: Composer 0.32.1
restores it only when it spins a plain DataLoader forward, which a StreamingDataLoader skips, so
every draw after an --autoresume differed from the uninterrupted run's. Logs nothing.
"""
from __future__ import annotations

from typing import Any

from composer import Trainer
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import reproducibility


class RestoreRngOnStreamingResume(Callback):
    """Call `arm(trainer)` once the Trainer is built (it has loaded the checkpoint by then)."""

    def __init__(self) -> None:
        self.rng_state: list[dict[str, Any]] | None = None

    def arm(self, trainer: Trainer) -> None:
        state = trainer.state
        # `_rng_state`: what Composer loaded and will not restore (see the module docstring).
        loaded = getattr(trainer, "_rng_state", None)
        if loaded is not None and int(state.timestamp.batch_in_epoch) > 0 and "train" in state.dataset_resumption:
            self.rng_state = loaded

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if self.rng_state is not None:
            reproducibility.load_rng_state(self.rng_state)
            self.rng_state = None
