"""Write the run's MLPerf-format log (`:::MLLOG` lines, through MLCommons' `mlperf_logging.mllog`) beside
its results JSON: the keys MLPerf Training's rules require, in their order, timed by the run's own clock
so that run_start to run_stop is the run's time_to_target_s. The keys and what each holds: docs/mlperf.md.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from mlperf_logging.mllog import constants as keys
from mlperf_logging.mllog.mllog import MLLogger

from t2ibench.callbacks.validation import ValidationLog
from t2ibench.core.files import write_text
from t2ibench.costs.mlperf import BENCHMARKS, benchmark_of

# MLPerf's init_start: when benchmark.main began (`note_init_start`); the set-up, data and model included,
# is initialization, off the clock, which starts at run_start. A process's first run falls back on the import.
_init_start_s = time.time()
ROOT = Path(__file__).resolve().parents[2]  # the caller's file in each line's metadata, from the repository root
MS_PER_S = 1000
# Flux.1's rules name a key mllog's constants (4.1.68) do not have: the samples between evaluations.
EVALUATION_FREQUENCY = "evaluation_frequency"


def note_init_start() -> None:
    """Mark MLPerf's init_start: benchmark.main calls it first (a process may run several runs)."""
    global _init_start_s
    _init_start_s = time.time()


class _Lines(logging.Handler):
    """The formatted lines mllog emits, kept in order (the file is written whole after each event)."""

    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(line for line in record.getMessage().splitlines() if line.strip())


def hyperparameters(settings: Any) -> dict[str, Any]:
    """A benchmark.py run's MLPerf hyperparameters (Settings), in the order the log gives them; the
    evaluation interval as the flag gives it (converted to samples by `MlperfLog.run_hyperparameters`)."""
    return {"global_batch_size": settings.batch_size, keys.OPT_NAME: keys.ADAMW,
            keys.OPT_BASE_LR: settings.lr, keys.OPT_LR_WARMUP_STEPS: settings.lr_warmup_batches,
            keys.OPT_ADAMW_BETA_1: settings.adamw_beta1, keys.OPT_ADAMW_BETA_2: settings.adamw_beta2,
            keys.OPT_ADAMW_EPSILON: settings.adamw_eps, keys.OPT_ADAMW_WEIGHT_DECAY: settings.weight_decay,
            keys.OPT_GRADIENT_CLIP_NORM: settings.grad_clip_norm, keys.SEED: settings.seed,
            EVALUATION_FREQUENCY: settings.eval_interval}


class MlperfLog(Callback):
    """The MLPerf log of one run, written by rank 0 to `path` after every event (a killed run leaves
    the lines up to its last evaluation; a resumed one continues them from its checkpoint).

    Args:
        path: the log file.
        submission: submission_benchmark, _org, _division, _status, _platform.
        hyperparameters: {MLPerf key: value} known before the run (batch, optimizer, seed, frequency).
        validation: the run's ValidationLog: its clock, evaluations and target.
        metrics: "loss" (eval_accuracy is the validation loss: Flux.1) or "images" (FID and CLIP: SD2).
    """

    @classmethod
    def for_run(cls, settings: Any, validation: ValidationLog | None) -> MlperfLog | None:
        """The log of a benchmark.py run (Settings) that evaluates and has a log path; else None."""
        if validation is None or settings.mlperf_log is None:
            return None
        benchmark = benchmark_of(settings.family.name)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        platform = settings.mlperf_platform or f"{dist.get_world_size()}x{device}"
        submission = {"benchmark": benchmark, "org": settings.mlperf_org, "division": keys.CLOSED,
                      "status": keys.ONPREM, "platform": platform}
        return cls(settings.mlperf_log, submission, hyperparameters(settings), validation,
                   "images" if benchmark == BENCHMARKS["sd2"] else "loss")

    def __init__(self, path: str, submission: dict[str, str], hyperparameters: dict[str, Any],
                 validation: ValidationLog, metrics: str):
        self.path, self.submission, self.hyperparameters = path, submission, hyperparameters
        self.validation, self.metrics = validation, metrics
        self.lines: list[str] = []
        self.run_start_ms: int | None = None  # wall-clock ms of run_start; later events add the run's clock
        self.stopped = False
        self._scored = 0  # evaluations of validation.history already logged
        name = f"t2ibench.costs.mlperf.{id(self)}"  # one logger per run: mllog writes through a logging.Logger
        sink = logging.getLogger(name)
        sink.propagate, sink.handlers = False, [_Lines(self.lines)]
        sink.setLevel(logging.INFO)
        self.mllog = MLLogger(logger=sink, default_stack_offset=2, root_dir=str(ROOT))

    def _at(self, seconds: float) -> int:
        """The run's clock (seconds from run_start, evaluations included) as MLPerf's time_ms."""
        return self.run_start_ms + round(seconds * MS_PER_S)

    def _event(self, key: str, value: Any = None, seconds: float | None = None, kind: str = "event",
               time_ms: int | None = None, **metadata: Any) -> None:
        time_ms = self._at(seconds) if seconds is not None else time_ms
        getattr(self.mllog, kind)(key=key, value=value, metadata=metadata or None, time_ms=time_ms)

    def _write(self) -> None:
        if dist.get_global_rank() == 0:
            write_text(self.path, "\n".join(self.lines) + "\n")

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.run_start_ms is not None:  # a resumed run: its log goes on from the checkpoint's lines
            return
        run_start_s = time.time() - self.validation.elapsed_seconds()
        self.run_start_ms = round(run_start_s * MS_PER_S)
        init_ms = round(min(_init_start_s, run_start_s) * MS_PER_S)
        for key in ("benchmark", "org", "division", "status", "platform"):
            self._event(f"submission_{key}", self.submission[key], time_ms=init_ms)
        self._event(keys.CACHE_CLEAR, True, time_ms=init_ms)
        self._event(keys.INIT_START, time_ms=init_ms, kind="start")
        self._event(keys.INIT_STOP, seconds=0.0, kind="end")
        self._event(keys.RUN_START, seconds=0.0, kind="start")
        for key, value in self.run_hyperparameters(state).items():  # as the run uses them, at run_start
            self._event(key, value, seconds=0.0)
        samples = int(state.timestamp.sample)
        self._event(keys.BLOCK_START, seconds=0.0, kind="start", samples_count=samples)
        self._write()

    def run_hyperparameters(self, state: State) -> dict[str, Any]:
        """The hyperparameters in MLPerf's keys, with what only the trainer knows: the microbatches a
        device accumulates per step, the samples of an epoch (MLPerf's train_samples: its training
        set) and the samples between evaluations."""
        given = dict(self.hyperparameters)
        batch, interval = given["global_batch_size"], Time.from_timestring(given.pop(EVALUATION_FREQUENCY))
        microbatch = state.device_train_microbatch_size
        per_device = batch // dist.get_world_size()
        accumulation = -(-per_device // microbatch) if isinstance(microbatch, int) and microbatch > 0 else 1
        epoch_samples = int(state.dataloader_len) * batch if state.dataloader_len is not None else None
        every = interval.value * (batch if interval.unit == TimeUnit.BATCH else (epoch_samples or 0))
        return {"global_batch_size": batch, keys.GRADIENT_ACCUMULATION_STEPS: accumulation,
                **{key: value for key, value in given.items() if key != "global_batch_size"},
                EVALUATION_FREQUENCY: every, keys.TRAIN_SAMPLES: epoch_samples}

    def eval_start(self, state: State, logger: Logger) -> None:
        if self.stopped:
            return
        now, samples = self.validation.elapsed_seconds(), int(state.timestamp.sample)
        self._event(keys.BLOCK_STOP, seconds=now, kind="end", samples_count=samples)
        self._event(keys.EVAL_START, seconds=now, kind="start", samples_count=samples)

    def eval_end(self, state: State, logger: Logger) -> None:
        if self.stopped:
            return
        history = self.validation.history
        new, self._scored = history[self._scored:], len(history)
        for entry in new:  # one per evaluation (none for a retried job's repeat of its checkpoint's)
            at, samples = entry["elapsed_seconds"], entry["samples_trained"]
            if entry is history[0]:
                # The held-out samples the evaluation scored, as t2ibench.eval.validation counts them.
                self._event(keys.EVAL_SAMPLES, entry["held_out_samples"], seconds=at)
            if self.metrics == "images":
                for metric, score, scale in (("FID", entry.get("fid"), 1.0), ("CLIP", entry.get("clip_score"), 0.01)):
                    if score is not None:  # MLPerf's CLIP is the cosine (0.15); the project's is 100 x it
                        self._event(keys.EVAL_ACCURACY, score * scale, seconds=at, samples_count=samples, metric=metric)
                self._event("validation_loss", entry["loss"], seconds=at, samples_count=samples)
            else:
                self._event(keys.EVAL_ACCURACY, entry["loss"], seconds=at, samples_count=samples)
            self._event(keys.EVAL_STOP, seconds=at, kind="end", samples_count=samples)
            if entry is self.validation.reached:
                self._stop(keys.SUCCESS, at)
            else:
                self._event(keys.BLOCK_START, seconds=at, kind="start", samples_count=samples)
        self._write()

    def _stop(self, status: str, seconds: float) -> None:
        self._event(keys.RUN_STOP, seconds=seconds, kind="end", status=status)
        self.stopped = True
        if dist.get_global_rank() == 0:
            print(f"MLPerf log ({status}) written to {self.path}", file=sys.stderr, flush=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        if not self.stopped and self.run_start_ms is not None:
            # The training length ended before any target: MLPerf's aborted run (not converged).
            now = self.validation.elapsed_seconds()
            self._event(keys.BLOCK_STOP, seconds=now, kind="end", samples_count=int(state.timestamp.sample))
            self._stop(keys.ABORTED, now)
            self._write()

    def close(self, state: State, logger: Logger) -> None:
        if not self.stopped and self.run_start_ms is not None:
            self._stop(keys.ABORTED, self.validation.elapsed_seconds())  # a run ended by an error
            self._write()

    def state_dict(self) -> dict[str, Any]:
        return {"lines": list(self.lines), "run_start_ms": self.run_start_ms, "scored": self._scored,
                "stopped": self.stopped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lines[:] = state["lines"]
        self.run_start_ms, self._scored, self.stopped = state["run_start_ms"], state["scored"], state["stopped"]
