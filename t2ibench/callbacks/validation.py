"""Log MLPerf's validation loss at 8 fixed timesteps every `--eval_interval`, and when it first
reaches `--eval_target`. What it logs: docs/metrics.md.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.callbacks.throughput import Pauses
from t2ibench.validation import ValidationLoss

EVAL_LABEL = "eval"  # the Evaluator's label: Composer logs metrics/eval/ValidationLoss too


class ValidationLog(Callback):
    """Log and keep the validation loss of every evaluation; record its seconds in `pauses`.

    Args:
        pauses: the run's Pauses (Throughput leaves them out of the measured time).
        target: the validation loss a run aims for (MLPerf Flux.1: 0.586), or None.
    """

    def __init__(self, pauses: Pauses, target: float | None = None):
        self.pauses, self.target = pauses, target
        self.history: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None
        self._start = 0.0
        self._fit_start = 0.0
        self._trained_before = 0.0  # training seconds of earlier runs of a resumed job

    @property
    def last_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._fit_start = time.perf_counter()

    def eval_start(self, state: State, logger: Logger) -> None:
        self._start = time.perf_counter()

    def eval_end(self, state: State, logger: Logger) -> None:
        metric = state.eval_metrics.get(EVAL_LABEL, {}).get("ValidationLoss")
        if not isinstance(metric, ValidationLoss):
            return
        sums = torch.stack([metric.sums.detach().double(), metric.counts.detach().double()])
        sums = state.device.tensor_to_device(sums)
        if dist.get_world_size() > 1:
            dist.all_reduce(sums, reduce_operation="SUM")
        sums = sums.cpu()
        counts = sums[1]
        loss = float(sums[0].sum() / counts.sum().clamp(min=1))
        per_timestep = [float(s / c) if c else None for s, c in zip(sums[0].tolist(), counts.tolist())]
        seconds = time.perf_counter() - self._start
        self.pauses.record(self._start, seconds)
        batch = int(state.timestamp.batch)
        entry = {"batch": batch, "samples_trained": int(state.timestamp.sample), "loss": loss,
                 "per_timestep": per_timestep, "held_out_samples": int(counts.sum()), "seconds": seconds,
                 "training_seconds": self.training_seconds()}
        self.history.append(entry)
        if self.target is not None and self.reached is None and loss <= self.target:
            self.reached = entry
        metrics = {"eval/loss": loss, "eval/seconds": seconds}
        metrics.update({f"eval/loss_t{k}": value for k, value in enumerate(per_timestep) if value is not None})
        logger.log_metrics(metrics, step=batch)

    def training_seconds(self) -> float:
        """Seconds of this job's fit so far, evaluations and sample grids left out, plus earlier jobs'."""
        now = time.perf_counter()
        elapsed = now - self._fit_start if self._fit_start else 0.0
        return self._trained_before + elapsed - self.pauses.seconds_within(self._fit_start, now)

    def summary(self) -> dict[str, Any]:
        """What the results JSON keeps: the last loss, the history, the target and when it was reached."""
        return {"eval_loss": self.last_loss, "eval_history": self.history, "eval_target": self.target,
                "eval_target_reached": self.reached,
                "eval_seconds": sum(entry["seconds"] for entry in self.history)}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "reached": self.reached, "trained_seconds": self.training_seconds()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.reached = list(state["history"]), state["reached"]
        self._trained_before = float(state["trained_seconds"])
