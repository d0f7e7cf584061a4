"""Profile a few batches after the warm-up with the torch profiler (`--profile_batches`): a trace per
rank, the costliest ops and how busy the device was. What it reports: docs/metrics.md.
"""
from __future__ import annotations

import os
import time

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist
from torch.profiler import ProfilerActivity, profile

from t2ibench.callbacks.throughput import Pauses

TOP_OPS = 15


class ProfileBatches(Callback):
    """Profile `num_batches` batches after the first `first_batch` batches this process trains.

    Counted in this process, as the throughput window's warm-up is: a resumed run warms up again.
    """

    def __init__(self, first_batch: int, num_batches: int, folder: str, pauses: Pauses | None = None):
        self.first_batch, self.num_batches, self.folder = first_batch, num_batches, folder
        # Stopping the profiler and writing its trace take seconds at the end of the last profiled
        # batch, where the throughput window may already have started: recorded as a pause.
        self.pauses = pauses if pauses is not None else Pauses()
        self.summary: dict = {}
        self._profiler: profile | None = None
        self._start = 0.0
        self._batches_done = 0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._batches_done != self.first_batch or self._profiler is not None:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._sync()
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._start = time.perf_counter()

    def batch_end(self, state: State, logger: Logger) -> None:
        self._batches_done += 1
        if self._profiler is None or self.summary or self._batches_done < self.first_batch + self.num_batches:
            return
        self._finish()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._profiler is not None and not self.summary:  # the run ended inside the profiled batches
            self._finish()

    def _finish(self) -> None:
        self._sync()
        stop = time.perf_counter()
        self._profiler.__exit__(None, None, None)
        self.summary = self._summarize(self._profiler, stop - self._start)
        self.pauses.record(stop, time.perf_counter() - stop)

    def _summarize(self, prof: profile, wall_seconds: float) -> dict:
        os.makedirs(self.folder, exist_ok=True)
        trace = os.path.join(self.folder, f"trace-rank{dist.get_global_rank()}.json")
        prof.export_chrome_trace(trace)
        on_gpu = torch.cuda.is_available()
        events = prof.key_averages()

        def self_us(event) -> float:
            return float(event.self_device_time_total if on_gpu else event.self_cpu_time_total)

        busy_us = sum(self_us(e) for e in events)
        top = sorted(events, key=self_us, reverse=True)[:TOP_OPS]
        return {"profile_trace": trace, "profile_batches": self.num_batches, "profile_wall_seconds": wall_seconds,
                "device_busy_fraction": busy_us / 1e6 / wall_seconds if wall_seconds > 0 else None,
                "profile_busy_kind": "CUDA kernel time" if on_gpu else "CPU time inside ops",
                "profile_top_ops": [{"name": e.key, "calls": e.count, "self_seconds": self_us(e) / 1e6} for e in top]}


def format_profile(summary: dict) -> str:
    """The summary's profile lines: busy fraction, trace, and the top ops as a table."""
    if not summary.get("profile_trace"):
        return ""
    lines = [f"profile      {summary['profile_batches']} batch(es) after the warm-up, "
             f"{summary['profile_wall_seconds']:.2f} s: device busy {100 * summary['device_busy_fraction']:.1f}% "
             f"({summary['profile_busy_kind']} / wall time); trace {summary['profile_trace']}",
             f"             {'op':<60} {'calls':>8} {'self s':>9} {'of wall':>8}"]
    for op in summary["profile_top_ops"]:
        share = op["self_seconds"] / summary["profile_wall_seconds"]
        lines.append(f"             {op['name'][:60]:<60} {op['calls']:>8} {op['self_seconds']:>9.4f} {100 * share:>7.1f}%")
    return "\n".join(lines) + "\n"
