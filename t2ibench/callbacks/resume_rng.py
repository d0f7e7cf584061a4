"""The random state of a run resumed in the middle of an epoch of streamed data, restored.

Composer 0.32.1 (`Trainer._train_loop`) restores the RNG state it read from the checkpoint only
when the run resumes at the start of an epoch, or while it spins a plain DataLoader forward to the
batch the run had reached. A StreamingDataLoader resumes by itself (Composer's "dataset
resumption"), so the spin is skipped, and the state is never restored: after a SIGKILL and
`--autoresume` in the middle of an epoch of streamed images or precomputed latents, every draw
after the restart (noise, timesteps, VAE posterior samples, caption dropout) differed from the
uninterrupted run's. This restores it where Composer's spin would have: when the first batch has
been fetched, after the loader's iterator was created (which draws its base seed from the global
generator at the start of the epoch in both runs). Logs nothing.
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
