"""Log the training loss by noise level (`--loss_bins`): which timesteps the model has not learned
yet. What it logs: docs/metrics.md.
"""
from __future__ import annotations

import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.train.model import unwrap_model


class LossByTimestep(Callback):
    """Log the loss in bins of timesteps every `interval` batches (`loss/timestep_<first>-<last>`)."""

    def __init__(self, interval: str):
        time = Time.from_timestring(interval)
        self.interval = int(time.value) if time.unit == TimeUnit.BATCH else 0  # else only at the end
        self.run: torch.Tensor | None = None  # (2, bins) loss sums and counts over all ranks and the run
        self.edges: list[tuple[int, int]] = []
        self._attempts = 0  # of this batch: Composer's OOM search runs a batch that ran out of memory again
        self._kept: torch.Tensor | None = None  # the window before the batch's first attempt

    def batch_start(self, state: State, logger: Logger) -> None:
        self._attempts = 0

    def before_train_batch(self, state: State, logger: Logger) -> None:
        # Composer 0.32.1 runs this event at each attempt of a batch; the sums an attempt that ran out of
        # memory added are dropped, so a retried batch counts its samples once (only while it searches).
        if not state.auto_microbatching:
            return
        bins = unwrap_model(state.model).loss_bins
        if self._attempts == 0:
            self._kept = bins.kept()
        else:
            bins.restore(self._kept)
        self._attempts += 1

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval and int(state.timestamp.batch) % self.interval == 0:
            self._log(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._log(state, logger)

    def _log(self, state: State, logger: Logger) -> None:
        bins = unwrap_model(state.model).loss_bins
        if bins.num_bins <= 0:
            return
        window = bins.take()
        if window is None:
            window = torch.zeros(2, bins.num_bins, dtype=torch.float64)  # this rank saw none: still all-reduce
        window = state.device.tensor_to_device(window)
        dist.all_reduce(window, reduce_operation="SUM")
        self.run = window.clone() if self.run is None else self.run.to(window.device) + window
        self.edges = bins.edges()
        means = (window[0] / window[1].clamp(min=1)).tolist()
        counts = window[1].tolist()
        logger.log_metrics({f"loss/timestep_{a}-{b}": m for (a, b), m, c in zip(bins.edges(), means, counts) if c},
                           step=int(state.timestamp.batch))

    def state_dict(self) -> dict:
        # In the checkpoint (under this class's name), so that a resumed run's summary covers the whole run.
        return {"run": None if self.run is None else self.run.cpu(), "edges": self.edges}

    def load_state_dict(self, state: dict) -> None:
        self.run, self.edges = state["run"], [tuple(e) for e in state["edges"]]

    def summary(self) -> list[dict]:
        """Per bin: first and last timestep, mean loss and number of samples over the whole run."""
        if self.run is None:
            return []
        return [{"timesteps": [a, b], "mean_loss": (s / c if c else None), "samples": int(c)}
                for (a, b), s, c in zip(self.edges, self.run[0].tolist(), self.run[1].tolist())]
