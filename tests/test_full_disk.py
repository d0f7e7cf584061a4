"""A full disk, the fuzz's fifth class of bad input (tests/test_input_faults.py has the others): one line
naming what could not be written; every file is the old one or the complete new one; results kept. The
disk is a 64 KiB tmpfs mounted for the test (the tests run as root, as CI does; they are skipped, saying
why, where mounting is not allowed)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import benchmark
import cost
import export
from tests.helpers import TINY_MODEL, error_of

SYNTH = [*TINY_MODEL, "--max_duration", "2ba", "--warmup_batches", "1", "--use_synth_data", "--num_workers", "0"]



@pytest.fixture
def full_disk(tmp_path):
    """A folder on a 64 KiB tmpfs (mounted for the test: it needs root, as CI runs), filled by `fill`."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"a full disk is a 64 KiB tmpfs, and mounting one needs root: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> None:
    """Fill the file system of `folder` up to its last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


def leftovers(folder: Path) -> list[str]:
    """Temporary or partial files a writer left behind."""
    return sorted(p.name for p in folder.rglob("*") if "partial" in p.name or p.name.endswith(".tmp"))


def test_results_json_on_a_full_disk_keeps_the_old_file_and_says_so(full_disk, capsys):
    results = full_disk / "results.json"
    results.write_text('{"old": true}\n')
    fill(full_disk)
    message = error_of(benchmark.cli, [*SYNTH, "--results_json", str(results)], "benchmark.py")
    assert f"--results_json {results} could not be written (No space left on device)" in message
    assert results.read_text() == '{"old": true}\n' and leftovers(full_disk) == []
    assert "throughput" in capsys.readouterr().out  # the figures were printed before


def test_ema_export_on_a_full_disk_keeps_the_results_and_export_py_leaves_nothing(full_disk, tmp_path):
    fill(full_disk)
    results, run = tmp_path / "results.json", tmp_path / "run"
    message = error_of(benchmark.cli, [*SYNTH, "--use_ema", "--ema_export_dir", str(full_disk / "ema"),
                                       "--results_json", str(results), "--save_folder", str(run),
                                       "--save_interval", "2ba"], "benchmark.py")
    assert f"--ema_export_dir {full_disk / 'ema'} could not be written (No space left on device)" in message
    assert json.loads(results.read_text())["images_per_sec"] > 0  # measured, and kept
    assert not (full_disk / "ema").exists() or leftovers(full_disk) == list(os.listdir(full_disk / "ema")) == []
    message = error_of(export.main, [str(run / "latest-rank0.pt"), "--out", str(full_disk / "pipe")], "export.py")
    assert f"--out {full_disk / 'pipe'}: the pipeline could not be written (No space left on device)" in message
    assert not (full_disk / "pipe").exists()


def test_checkpoint_on_a_full_disk_is_one_line_and_leaves_no_part(full_disk):
    message = error_of(benchmark.cli, [*SYNTH, "--save_folder", str(full_disk / "run"), "--save_interval", "1ba"],
                       "benchmark.py")
    assert "ep0-ba1-rank0.pt could not be written (No space left on device)" in message
    assert not list((full_disk / "run").glob("*.pt")) and leftovers(full_disk) == []


def test_profile_trace_on_a_full_disk_is_reported_unwritten_and_leaves_no_part(full_disk, tmp_path, capsys):
    fill(full_disk)
    results_json = tmp_path / "results.json"
    results = benchmark.main([*SYNTH, "--max_duration", "3ba", "--profile_batches", "1", "--profile_dir",
                              str(full_disk / "prof"), "--results_json", str(results_json)])
    # The run goes on (its figures hold, the profile's too); the trace it could not write is named as such.
    written = json.loads(results_json.read_text())
    assert written["profile_trace"] is None and results["profile_trace"] is None
    assert written["profile_trace_error"].startswith(f"--profile_dir {full_disk / 'prof'}: trace-rank0.json could not "
                                                     "be written (No space left on device)")
    assert 0 < written["device_busy_fraction"] <= 1 and written["profile_top_ops"] and written["images_per_sec"] > 0
    captured = capsys.readouterr()
    assert "warning: --profile_dir" in captured.err and "NO TRACE: --profile_dir" in captured.out
    assert not list(full_disk.rglob("trace-rank0.json")) and leftovers(full_disk) == []
    assert [p.name for p in full_disk.rglob("*") if p.is_file()] == ["filler"]


@pytest.mark.parametrize("flag, name", [("--csv", "t.csv"), ("--markdown", "t.md"), ("--plot", "t.png")])
def test_cost_outputs_on_a_full_disk_keep_the_old_file(full_disk, flag, name):
    old = full_disk / name
    old.write_bytes(b"old table")
    fill(full_disk)
    message = error_of(cost.main, ["--gpus", "8", "--images_per_sec", "128.2", flag, str(old)], "cost.py")
    assert f"{flag} {old} could not be written (No space left on device)" in message
    assert old.read_bytes() == b"old table" and leftovers(full_disk) == []
