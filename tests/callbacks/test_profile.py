"""--profile_batches (t2ibench/callbacks/profile.py): a profile that adds up and says what it did.

* the summarizer, fed a GPU-like profile (an annotation spanning the batch on the host and on the
  device, an op launching kernels on two streams, a copy launched outside any op, a kernel past the
  window): busy is the union of the device's work, never above 100%; the table holds ops and
  kernels, never annotations; on a CPU, busy is the union of time inside ops and the table self time;
* the profiler's own events classified: annotations, CUPTI's records and runtime calls kept out;
* a real CPU profile through benchmark.py: its busy fraction is the union of the trace's own
  `cpu_op` intervals, and Composer's `Optimizer.step#AdamW.step`, which spans the batch, is not an op;
* a resumed run profiles the batches it trains, or says before training why it profiles none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from composer.core import Callback

import benchmark
from t2ibench.callbacks.profile import ANNOTATION, DEVICE, OP, Record, format_profile, records_of, summarize, union_us
from tests.helpers import TINY_SYNTH

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread

STEP = "Optimizer.step#AdamW.step"  # Composer's closure puts the whole batch inside it


def gpu_profile() -> list[Record]:
    """One batch of 100 us as a GPU run records it."""
    return [
        Record(ANNOTATION, "ProfilerStep#3", 0, 100, thread=1, correlation=1),
        Record(ANNOTATION, STEP, 1, 99, thread=1, correlation=2),
        Record(ANNOTATION, STEP, 5, 98),  # the same range on the GPU's timeline, as Kineto copies it there
        Record(OP, "aten::linear", 9, 14, thread=1, correlation=3),
        Record(OP, "aten::mm", 10, 12, thread=1, correlation=4),
        Record(DEVICE, "gemm_kernel", 12, 40, correlation=4),
        Record(DEVICE, "gemm_kernel", 35, 60, correlation=4),  # another stream: overlaps the first
        Record(OP, "aten::mm", 20, 21, thread=1, correlation=5),
        Record(DEVICE, "gemm_kernel", 60, 64, correlation=5),
        Record(DEVICE, "Memcpy HtoD (Pageable -> Device)", 70, 75),  # launched outside any op
        Record(DEVICE, "elementwise_kernel", 95, 110, correlation=2),  # launched under the annotation; past the end
    ]


def test_busy_is_the_union_of_device_work_and_the_table_holds_no_annotation():
    summary = summarize(gpu_profile(), 0, 100, on_device=True)
    # [12, 64] + [70, 75] + [95, 100]: overlaps once, the annotations not at all, clipped to the window.
    assert summary["device_busy_fraction"] == pytest.approx((52 + 5 + 5) / 100)
    rows = {row["name"]: row for row in summary["profile_top_ops"]}
    assert STEP not in rows and "ProfilerStep#3" not in rows and "aten::linear" not in rows  # launched nothing itself
    assert rows["aten::mm"] == {"name": "aten::mm", "kind": OP, "calls": 2, "self_seconds": pytest.approx(57e-6)}
    assert rows["Memcpy HtoD (Pageable -> Device)"]["kind"] == "kernel"
    assert rows["elementwise_kernel"] == {"name": "elementwise_kernel", "kind": "kernel", "calls": 1,
                                          "self_seconds": pytest.approx(15e-6)}
    assert [row["name"] for row in summary["profile_top_ops"]][0] == "aten::mm"  # the costliest first


def test_busy_never_exceeds_the_window_however_the_work_overlaps():
    streams = [Record(DEVICE, f"k{i}", -50 + i, 150 + i) for i in range(8)]  # eight streams, all past both ends
    assert summarize(streams, 0, 100, on_device=True)["device_busy_fraction"] == 1.0
    assert union_us([(0, 10), (5, 20), (30, 40), (35, 38)], 0, 100) == 30
    assert summarize([], 0, 100, on_device=True)["device_busy_fraction"] == 0.0


@pytest.mark.parametrize("intervals, busy_us", [
    ([(0, 5), (12, 15)], 5),  # one wholly after the window: nothing of it (once 3, less its clipped -2)
    ([(0, 5), (30, 40)], 5),  # further after (once -15)
    ([(-20, -10), (0, 5)], 5),  # one wholly before
    ([(-20, -10), (2, 4), (30, 40), (10, 10)], 2),  # before, inside, after, and one of no length at the end
    ([(-5, 3), (8, 14)], 5),  # across each end: the parts inside
    ([(-5, 15)], 10),  # across both: the whole window
    ([(1, 6), (2, 3), (4, 9), (9, 9.5)], 8.5),  # overlapping and nested, one touching the next
    ([(11, 12), (-3, -1)], 0),  # none inside
])
def test_busy_counts_only_what_lies_inside_the_window(intervals, busy_us):
    assert union_us(intervals, 0, 10) == busy_us
    assert union_us(reversed(intervals), 0, 10) == busy_us  # the order the profiler lists them in does not matter
    # The same through the summary: a kernel stamped after the window takes nothing from the busy time.
    records = [Record(DEVICE, "k", begin, end) for begin, end in intervals]
    assert summarize(records, 0, 10, on_device=True)["device_busy_fraction"] == pytest.approx(busy_us / 10)


def test_on_a_cpu_busy_is_time_inside_ops_and_the_table_self_time():
    records = [
        Record(ANNOTATION, STEP, 0, 100, thread=1),
        Record(OP, "aten::linear", 10, 30, thread=1),
        Record(OP, "aten::addmm", 12, 28, thread=1),
        Record(OP, "aten::copy_", 14, 16, thread=1),
        Record(OP, "aten::copy_", 40, 45, thread=1),
        Record(OP, "aten::copy_", 42, 60, thread=2),  # another thread (a loader's): overlaps
        Record(DEVICE, "never on a cpu", 0, 100),
    ]
    summary = summarize(records, 0, 100, on_device=False)
    assert summary["device_busy_fraction"] == pytest.approx((20 + 20) / 100)  # [10, 30] and [40, 60]
    rows = {row["name"]: row for row in summary["profile_top_ops"]}
    assert set(rows) == {"aten::linear", "aten::addmm", "aten::copy_"}
    assert rows["aten::linear"]["self_seconds"] == pytest.approx(4e-6)  # 20 less addmm's 16
    assert rows["aten::addmm"]["self_seconds"] == pytest.approx(14e-6)  # 16 less copy_'s 2
    assert rows["aten::copy_"] == {"name": "aten::copy_", "kind": OP, "calls": 3, "self_seconds": pytest.approx(25e-6)}


# -- The profiler's events, classified ---------------------------------------------------------

@dataclass
class TreeEvent:
    """torch's _ProfilerEvent as records_of reads it."""

    name: str
    start_time_ns: int
    end_time_ns: int
    scope: str = "FUNCTION"
    tag: object = None  # _EventType.TorchOp, set by the test
    start_tid: int = 1
    correlation_id: int = 0
    children: list = field(default_factory=list)

    @property
    def typed(self):
        from torch._C._profiler import RecordScope
        return None, type("Fields", (), {"scope": getattr(RecordScope, self.scope)})()


@dataclass
class KinetoEvent:
    """torch's _KinetoEvent as records_of reads it."""

    label: str
    device: str
    start: int
    end: int
    annotation: bool = False
    linked: int = 0

    def name(self): return self.label
    def device_type(self):
        from torch.autograd import DeviceType
        return getattr(DeviceType, self.device)
    def is_user_annotation(self): return self.annotation
    def start_ns(self): return self.start
    def end_ns(self): return self.end
    def linked_correlation_id(self): return self.linked


def test_records_keep_annotations_and_profiler_records_out_of_the_ops():
    from torch._C._profiler import _EventType

    step = TreeEvent(STEP, 0, 100_000, scope="USER_SCOPE", correlation_id=1, children=[
        TreeEvent("aten::mm", 10_000, 12_000, correlation_id=2)])
    for event in (step, *step.children):
        event.tag = _EventType.TorchOp
    results = type("Results", (), {
        "experimental_event_tree": lambda self: [step],
        "events": lambda self: [
            KinetoEvent("aten::mm", "CPU", 10_000, 12_000),  # the host's copy of an op: from the tree instead
            KinetoEvent("cudaLaunchKernel", "CPU", 10_500, 11_000, linked=2),  # a runtime call
            KinetoEvent("Command Buffer Full", "CPU", 11_000, 99_000),  # CUPTI's overhead record
            KinetoEvent("gemm_kernel", "CUDA", 12_000, 40_000, linked=2),
            KinetoEvent(STEP, "CUDA", 5_000, 98_000, annotation=True),  # gpu_user_annotation
            KinetoEvent(STEP, "CUDA", 5_000, 98_000),  # the same, should a torch not flag it
        ]})()
    prof = type("Profile", (), {"profiler": type("P", (), {"kineto_results": results})()})()
    records = sorted(records_of(prof), key=lambda r: (r.kind, r.name))
    assert [(r.kind, r.name) for r in records] == [(ANNOTATION, STEP), (DEVICE, "gemm_kernel"), (OP, "aten::mm")]
    summary = summarize(records, 0, 100, on_device=True)
    assert summary["device_busy_fraction"] == pytest.approx(0.28)
    assert [(row["name"], row["calls"]) for row in summary["profile_top_ops"]] == [("aten::mm", 1)]


# -- Through benchmark.py ----------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_cpu_profile_adds_up(tmp_path, capsys):
    results = benchmark.main([*TINY_SYNTH, "--max_duration", "4ba", "--warmup_batches", "1", "--profile_batches", "1",
                              "--profile_dir", str(tmp_path / "prof")])
    trace = json.loads(Path(results["profile_trace"]).read_text())["traceEvents"]
    annotations = {e["name"] for e in trace if e.get("cat") == "user_annotation"}
    assert STEP in annotations  # Composer's closure: the batch is inside the optimizer step's range
    names = {row["name"] for row in results["profile_top_ops"]}
    assert len(names) == 15 and not names & annotations and all(row["kind"] == OP for row in results["profile_top_ops"])
    # Busy is the union of the trace's own op intervals (Kineto's "cpu_op" category) over the wall time.
    ops = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("cat") == "cpu_op"]
    union_s = union_us(ops, min(b for b, _ in ops), max(e for _, e in ops)) / 1e6
    assert 0 < results["device_busy_fraction"] <= 1
    assert results["device_busy_fraction"] == pytest.approx(union_s / results["profile_wall_seconds"], rel=0.02)
    # The table's self times are parts of that union (one training thread).
    assert sum(row["self_seconds"] for row in results["profile_top_ops"]) <= union_s * 1.001
    out = capsys.readouterr().out
    assert f"device busy {100 * results['device_busy_fraction']:.1f}%" in out and STEP not in out


class ErrAtFirstBatch(Callback):
    """From outside: what the run had written to stderr when its first batch started."""

    def __init__(self, capsys) -> None:
        self.capsys, self.err = capsys, None

    def batch_start(self, state, logger) -> None:
        if self.err is None:
            self.err = self.capsys.readouterr().err


class CutAfter(Callback):
    """From outside: the job is killed once batch `batch`'s checkpoint is saved."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_start(self, state, logger) -> None:
        if int(state.timestamp.batch) == self.batch:
            raise KeyboardInterrupt(f"cut after batch {self.batch}")


@pytest.mark.slow
def test_a_resumed_run_profiles_the_batches_it_trains_or_says_why_none(tmp_path, capsys):
    run = [*TINY_SYNTH, "--save_folder", str(tmp_path / "run"), "--save_interval", "1ba", "--run_name", "p",
           "--autoresume", "--warmup_batches", "1"]
    profiled = ["--profile_batches", "2", "--profile_dir", str(tmp_path / "prof")]
    with pytest.raises(KeyboardInterrupt):
        benchmark.main([*run, "--max_duration", "6ba"], extra_callbacks=[CutAfter(1)])
    # Resumed at batch 1 of 6: 5 batches here hold 1 warm-up, 2 profiled and 2 measured.
    resumed = benchmark.main([*run, "--max_duration", "6ba", *profiled])
    assert resumed["profile_batches"] == 2 and Path(resumed["profile_trace"]).is_file()
    assert resumed["warmup_batches"] == 3 and resumed["measured_batches"] == 2
    (tmp_path / "prof" / "trace-rank0.json").unlink()
    capsys.readouterr()
    # Lengthened to 8 and resumed at 6: 2 batches here cannot hold 1 + 2 + 1; said before training.
    first_batch = ErrAtFirstBatch(capsys)
    lengthened = benchmark.main([*run, "--max_duration", "8ba", *profiled], extra_callbacks=[first_batch])
    captured = capsys.readouterr()
    assert ("note: --profile_batches 2: this run resumes at batch 6 and trains 2 more, fewer than --warmup_batches 1 "
            "(counted again after a resume) + 2 profiled + 1 to measure; nothing is profiled") in first_batch.err
    assert lengthened["profile_batches"] == 0 and lengthened["profile_trace"] is None
    assert lengthened["profile_skipped"].startswith("this run resumes at batch 6")
    assert "profile      none: this run resumes at batch 6" in captured.out
    assert not (tmp_path / "prof" / "trace-rank0.json").exists()
    assert format_profile(lengthened).count("\n") == 1
