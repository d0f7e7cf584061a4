"""Profile a few batches after the warm-up with the torch profiler (`--profile_batches`): a trace per
rank, the costliest ops and how busy the device was. What it reports and how it is counted:
docs/metrics.md.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import math
import os
import sys
import time
from typing import Iterable, Iterator

import torch
from composer.core import Callback, State, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from torch.profiler import ProfilerActivity, profile

from t2ibench.callbacks.throughput import Pauses
from t2ibench.core.files import atomic_path, write_error

TOP_OPS = 15

# What a profile's records are (Record.kind).
DEVICE = "device"  # a kernel, memory copy or memory set the GPU ran
OP = "op"  # a torch op on the host (aten::mm, autograd::engine::evaluate_function: ...)
ANNOTATION = "annotation"  # a record_function range: Optimizer.step#AdamW.step, ProfilerStep#N, a user's

BUSY_KINDS = {True: "union of the GPU's kernel, memcpy and memset intervals / wall time",
              False: "union of the intervals any host thread spent inside a torch op / wall time"}


@dataclasses.dataclass(frozen=True)
class Record:
    """One interval of a profile, in microseconds on the profiler's clock."""

    kind: str  # DEVICE, OP or ANNOTATION
    name: str
    start_us: float
    end_us: float
    thread: int = 0  # host records: the thread that ran it
    # OP, ANNOTATION: the profiler's id of the range; DEVICE: the id of the host range that was
    # innermost when it was launched (0: none), which names the op it is counted under.
    correlation: int = 0


def profile_fits(warmup_batches: int, profile_batches: int, batches_to_train: int) -> bool:
    """Whether `batches_to_train` hold the warm-up, the profiled batches and one batch to measure."""
    return warmup_batches + profile_batches < batches_to_train


def union_us(intervals: Iterable[tuple[float, float]], start_us: float, end_us: float) -> float:
    """Length of the union of `intervals`, each clipped to [start_us, end_us]: never more than that window,
    never less than 0. An interval wholly before or after the window clips to nothing and is dropped (kept,
    one after the window, (12, 15) in [0, 10], clipped to (12, 10), once counted as -2 us)."""
    total, reach = 0.0, start_us
    for begin, end in sorted((max(b, start_us), min(e, end_us)) for b, e in intervals):
        begin = max(begin, reach)  # what an earlier interval covered is counted already
        if end <= begin:
            continue
        total += end - begin
        reach = end
    return total


def _self_times_us(ops: list[Record]) -> Iterator[tuple[Record, float]]:
    """Each host op with its self time: its length less that of the ops nested directly in it on its
    thread (annotations are not ops: an op inside Optimizer.step counts as top-level)."""
    by_thread: dict[int, list[Record]] = collections.defaultdict(list)
    for op in ops:
        by_thread[op.thread].append(op)
    for thread_ops in by_thread.values():
        stack: list[list] = []  # [record, time in direct children]
        for op in sorted(thread_ops, key=lambda r: (r.start_us, -r.end_us)):
            while stack and stack[-1][0].end_us <= op.start_us:
                done, children = stack.pop()
                yield done, done.end_us - done.start_us - children
            if stack:
                stack[-1][1] += op.end_us - op.start_us
            stack.append([op, 0.0])
        while stack:
            done, children = stack.pop()
            yield done, done.end_us - done.start_us - children


def summarize(records: Iterable[Record], start_us: float, end_us: float, on_device: bool) -> dict:
    """The profile of the window [start_us, end_us]: how busy the device was and the costliest ops.

    On a GPU, busy is the union of the device's own work (kernels, copies, sets), and an op's time is
    that of the device work it launched itself (a kernel launched outside any op is listed under its
    own name). On a CPU, busy is the union of the time any host thread spent inside an op, and an op's
    time is its self time on the host. Annotations are never ops: they only span other work."""
    records = list(records)
    ops = [r for r in records if r.kind == OP]
    wall_us = max(end_us - start_us, 0.0)
    rows: dict[str, dict] = {}
    if on_device:
        device = [r for r in records if r.kind == DEVICE]
        busy_us = union_us(((r.start_us, r.end_us) for r in device), start_us, end_us)
        launcher = {op.correlation: op for op in ops if op.correlation}
        launches: dict[str, set[int]] = collections.defaultdict(set)
        for record in device:
            op = launcher.get(record.correlation)
            name = op.name if op else record.name
            row = rows.setdefault(name, {"name": name, "kind": OP if op else "kernel", "calls": 0, "self_seconds": 0.0})
            row["self_seconds"] += (record.end_us - record.start_us) / 1e6
            if op:
                launches[name].add(op.correlation)
                row["calls"] = len(launches[name])
            else:
                row["calls"] += 1
    else:
        busy_us = union_us(((r.start_us, r.end_us) for r in ops), start_us, end_us)
        for op, self_us in _self_times_us(ops):
            row = rows.setdefault(op.name, {"name": op.name, "kind": OP, "calls": 0, "self_seconds": 0.0})
            row["calls"] += 1
            row["self_seconds"] += self_us / 1e6
    top = sorted(rows.values(), key=lambda row: row["self_seconds"], reverse=True)[:TOP_OPS]
    return {"device_busy_fraction": busy_us / wall_us if wall_us > 0 else None,
            "profile_busy_kind": BUSY_KINDS[on_device], "profile_top_ops": top}


def records_of(prof: profile) -> list[Record]:
    """A finished torch profile as records, classified by the profiler's own data: torch's event tree
    tells ops from annotations (a record_function is a TorchOp of USER_SCOPE) and leaves out what is
    not a torch op at all (CUDA runtime calls, CUPTI's overhead records such as "Command Buffer
    Full", memory instants); the device's work is every event on a device that is not an annotation
    (kernels, memcpy, memset: this profile asks for no CUDA sync events)."""
    from torch._C._profiler import _EventType, RecordScope
    from torch.autograd import DeviceType

    results = prof.profiler.kineto_results
    records, annotations = [], set()
    pending = list(results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag != _EventType.TorchOp:
            continue
        kind = ANNOTATION if event.typed[1].scope == RecordScope.USER_SCOPE else OP
        if kind == ANNOTATION:
            annotations.add(event.name)
        records.append(Record(kind, event.name, event.start_time_ns / 1e3, event.end_time_ns / 1e3,
                              thread=event.start_tid, correlation=event.correlation_id))
    for event in results.events():
        # A range's copy on the GPU's timeline (Kineto's gpu_user_annotation) is an annotation too.
        if event.device_type() == DeviceType.CPU or event.is_user_annotation() or event.name() in annotations:
            continue
        records.append(Record(DEVICE, event.name(), event.start_ns() / 1e3, event.end_ns() / 1e3,
                              correlation=event.linked_correlation_id()))
    return records


def batches_to_train(state: State, global_batch_size: int) -> int | None:
    """Batches the fit about to start trains: the whole run, less what a resumed checkpoint had done
    (None: a run in epochs of a loader of unknown length)."""
    done, duration = int(state.timestamp.batch), state.max_duration
    if duration.unit == TimeUnit.BATCH:
        total = int(duration.value)
    elif duration.unit == TimeUnit.EPOCH:
        if state.dataloader_len is None:
            return None
        total = int(duration.value) * int(state.dataloader_len)
    else:  # samples, rounded up to whole batches as Composer stops
        total = math.ceil(int(duration.value) / global_batch_size)
    return total - done


def _trace_complete(path: str) -> bool:
    """Whether the profiler's trace at `path` was written to its end: its writer (Kineto) reports no
    failed write, but ends every trace with its own name (`"traceName"`) and the closing brace, so a
    trace cut short by a full disk lacks them."""
    size = os.path.getsize(path)
    if size == 0:
        return False
    with open(path, "rb") as handle:
        handle.seek(max(0, size - 4096))
        tail = handle.read()
    return tail.rstrip().endswith(b"}") and os.path.basename(path).encode() in tail


class ProfileBatches(Callback):
    """Profile `num_batches` batches after the first `first_batch` batches this process trains.

    Counted in this process, as the throughput window's warm-up is: a resumed run warms up again, and
    one that resumes too close to its end to hold them profiles nothing and says so before training.
    """

    def __init__(self, first_batch: int, num_batches: int, folder: str, global_batch_size: int,
                 pauses: Pauses | None = None):
        self.first_batch, self.num_batches, self.folder = first_batch, num_batches, folder
        self.global_batch_size = global_batch_size
        # Stopping the profiler and writing its trace take seconds at the end of the last profiled
        # batch, where the throughput window may already have started: recorded as a pause.
        self.pauses = pauses if pauses is not None else Pauses()
        self.summary: dict = {}
        self._profiler: profile | None = None
        self._start = 0.0
        self._window_start_ns = 0
        self._batches_done = 0
        self._skipped = False

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def fit_start(self, state: State, logger: Logger) -> None:
        left = batches_to_train(state, self.global_batch_size)
        if left is None or left <= 0 or profile_fits(self.first_batch, self.num_batches, left):
            return
        done = int(state.timestamp.batch)
        reason = (f"this run resumes at batch {done} and trains {left} more, fewer than --warmup_batches "
                  f"{self.first_batch} (counted again after a resume) + {self.num_batches} profiled + 1 to measure")
        self._skipped = True
        self.summary = {"profile_trace": None, "profile_trace_error": None, "profile_batches": 0,
                        "profile_skipped": reason}
        if dist.get_global_rank() == 0:
            print(f"note: --profile_batches {self.num_batches}: {reason}; nothing is profiled (profile a fresh run, "
                  "or resume with a longer --max_duration)", file=sys.stderr, flush=True)

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._skipped or self._batches_done != self.first_batch or self._profiler is not None:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._sync()
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._start = time.perf_counter()
        self._window_start_ns = time.time_ns()  # the profiler's clock: its events are in Unix-epoch ns

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
        stop, window_end_ns = time.perf_counter(), time.time_ns()
        self._profiler.__exit__(None, None, None)
        trace, error = self._write_trace(self._profiler)
        on_device = torch.cuda.is_available()
        self.summary = {"profile_trace": trace, "profile_trace_error": error, "profile_batches": self.num_batches,
                        "profile_wall_seconds": stop - self._start, "profile_skipped": None,
                        **summarize(records_of(self._profiler), self._window_start_ns / 1e3, window_end_ns / 1e3,
                                    on_device)}
        self.pauses.record(stop, time.perf_counter() - stop)

    def _write_trace(self, prof: profile) -> tuple[str | None, str | None]:
        """This rank's trace, whole under its name or absent: (its path, None) or (None, why not)."""
        trace = os.path.join(self.folder, f"trace-rank{dist.get_global_rank()}.json")
        what = f"--profile_dir {self.folder}: {os.path.basename(trace)}"
        try:
            with atomic_path(trace) as temporary:
                prof.export_chrome_trace(str(temporary))
                if not _trace_complete(str(temporary)):
                    full = os.statvfs(temporary.parent).f_bavail == 0
                    raise OSError(errno.ENOSPC if full else errno.EIO,
                                  os.strerror(errno.ENOSPC) if full else "the profiler wrote it incompletely")
        except OSError as error:
            message = write_error(what, error)
            print(f"warning: {message}; the profile's figures are still reported", file=sys.stderr, flush=True)
            return None, message
        return trace, None


def format_profile(summary: dict) -> str:
    """The summary's profile lines: busy fraction, trace, and the top ops as a table."""
    if summary.get("profile_skipped"):
        return f"profile      none: {summary['profile_skipped']}\n"
    if "profile_wall_seconds" not in summary:
        return ""
    trace = (f"trace {summary['profile_trace']}" if summary.get("profile_trace")
             else f"NO TRACE: {summary['profile_trace_error']}")
    busy = summary["device_busy_fraction"]
    lines = [f"profile      {summary['profile_batches']} batch(es) after the warm-up, "
             f"{summary['profile_wall_seconds']:.2f} s: device busy {f'{100 * busy:.1f}%' if busy is not None else 'n/a'} "
             f"({summary['profile_busy_kind']}); {trace}",
             f"             {'op (or kernel launched outside an op)':<60} {'calls':>8} {'self s':>9} {'of wall':>8}"]
    for op in summary["profile_top_ops"]:
        share = op["self_seconds"] / summary["profile_wall_seconds"]
        lines.append(f"             {op['name'][:60]:<60} {op['calls']:>8} {op['self_seconds']:>9.4f} {100 * share:>7.1f}%")
    return "\n".join(lines) + "\n"
