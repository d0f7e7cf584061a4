"""The one progress line a run prints (rank 0): batch, images/s, loss, time left; updated in place on a
terminal, one line per `--log_interval` in a log file. It replaces Composer's console logger and
progress bar, which print every metric and count batches per epoch; it logs nothing.
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from typing import Any, TextIO

from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

TERMINAL_REFRESH_SECONDS = 0.5  # a terminal line is redrawn at most this often


def format_seconds(seconds: float) -> str:
    """1h02m, 3m07s, 42s: short enough for one line."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def total_batches(state: State) -> int | None:
    """Batches the run will train in all, from `max_duration` (None when that cannot be known)."""
    duration = state.max_duration
    if duration is None:
        return None
    batches_per_epoch = state.dataloader_len.value if state.dataloader_len is not None else None
    if duration.unit == TimeUnit.BATCH:
        return int(duration.value)
    if duration.unit == TimeUnit.EPOCH and batches_per_epoch:
        return int(duration.value) * int(batches_per_epoch)
    if duration.unit == TimeUnit.SAMPLE:
        # The global batch is constant, so the samples of the first batch give the count.
        samples_per_batch = int(state.timestamp.sample) / max(1, int(state.timestamp.batch))
        return math.ceil(int(duration.value) / samples_per_batch) if samples_per_batch else None
    return None


class ConsoleProgress(Callback):
    """One line of progress on global rank 0: batch, images/s over the last batches, loss, time left.

    Args:
        log_interval: on a non-terminal stream, print a line every this many batches (a Composer
            Time in batches or epochs); on a terminal the line is redrawn in place instead.
        window_batches: images/s and time left are computed over this many recent batches.
        stream: where to write (standard output by default).
        terminal: force terminal (True) or log-file (False) behaviour; None asks the stream.
    """

    def __init__(self, log_interval: str | Time = "10ba", window_batches: int = 20, stream: TextIO | None = None,
                 terminal: bool | None = None, validation: Any = None):
        self.log_interval = Time.from_timestring(log_interval) if isinstance(log_interval, str) else log_interval
        self.stream = stream or sys.stdout
        if terminal is None:
            terminal = hasattr(self.stream, "fileno") and _isatty(self.stream)
        self.terminal = terminal
        self.window: deque[tuple[float, int]] = deque(maxlen=window_batches + 1)  # (seconds, samples)
        self.total_batches: int | None = None
        self.fit_start_seconds = 0.0
        self.last_draw_seconds = 0.0
        self.line_open = False  # a terminal line was drawn and not ended yet
        self.validation = validation  # callbacks.validation.ValidationLog: its last loss joins the line

    def fit_start(self, state: State, logger: Logger) -> None:
        self.fit_start_seconds = time.perf_counter()
        self.window.clear()
        self.window.append((self.fit_start_seconds, int(state.timestamp.sample)))

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        now = time.perf_counter()
        self.window.append((now, int(state.timestamp.sample)))
        if self.total_batches is None:
            self.total_batches = total_batches(state)
        batch = int(state.timestamp.batch)
        if self.terminal:
            last = self.total_batches is not None and batch >= self.total_batches
            if now - self.last_draw_seconds >= TERMINAL_REFRESH_SECONDS or last:
                self.last_draw_seconds = now
                self._write("\r\033[K" + self.line(state, now), newline=False)
        elif self._due(state):
            self._write(self.line(state, now), newline=True)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0 and not self.terminal and self.log_interval.unit == TimeUnit.EPOCH \
                and int(state.timestamp.epoch) % max(1, int(self.log_interval.value)) == 0:
            self._write(self.line(state, time.perf_counter()), newline=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.line_open:
            self._write("", newline=True)  # end the terminal line before the summary

    def _due(self, state: State) -> bool:
        if self.log_interval.unit != TimeUnit.BATCH:
            return False
        batch = int(state.timestamp.batch)
        return batch == 1 or batch % max(1, int(self.log_interval.value)) == 0 or batch == self.total_batches

    def images_per_sec(self) -> float:
        """Images per second over the batches in the window (all ranks: the timestamp is global)."""
        (t0, s0), (t1, s1) = self.window[0], self.window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else float("nan")

    def line(self, state: State, now: float) -> str:
        batch = int(state.timestamp.batch)
        total = self.total_batches
        loss = state.total_loss_dict.get("loss/train/total")  # mean over ranks and microbatches
        images_per_sec = self.images_per_sec()
        elapsed = now - self.fit_start_seconds
        parts = [f"batch {batch}/{total}" if total else f"batch {batch}"]
        if total:
            parts[0] += f" ({100 * batch / total:3.0f}%)"
        parts.append(f"{images_per_sec:8.2f} images/s" if math.isfinite(images_per_sec) else "    ---- images/s")
        parts.append(f"loss {loss:.4f}" if loss is not None else "loss ?")
        if self.validation is not None and self.validation.last_loss is not None:
            parts.append(f"eval loss {self.validation.last_loss:.4f}")
            last = self.validation.history[-1]
            parts += [f"{name} {last[key]:.2f}" for key, name in (("fid", "FID"), ("clip_score", "CLIP")) if key in last]
        parts.append(f"elapsed {format_seconds(elapsed)}")
        if total and len(self.window) > 1:
            (t0, _), (t1, _) = self.window[0], self.window[-1]
            seconds_per_batch = (t1 - t0) / (len(self.window) - 1)
            parts.append(f"left {format_seconds(seconds_per_batch * max(0, total - batch))}")
        return " | ".join(parts)

    def _write(self, text: str, newline: bool) -> None:
        self.stream.write(text + ("\n" if newline else ""))
        self.stream.flush()
        self.line_open = self.terminal and not newline


def _isatty(stream: TextIO) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or a stream without a file descriptor
        return False
