"""The bench scripts no other test runs: each prints its figures and they mean what they say."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import bench_script


def test_value_check_times_reads_with_and_without_the_check():
    figures = bench_script("value_check").main(["--samples", "32", "--repeats", "1"])
    assert figures["us_per_sample_without"] > 0 and figures["us_per_sample_with"] > 0
    assert figures["ratio"] == pytest.approx(figures["us_per_sample_with"] / figures["us_per_sample_without"])


@pytest.mark.multirank  # each EMA is measured in a worker process of its own
def test_bench_ema_our_ema_holds_one_copy_composers_two(tmp_path: Path):
    out = tmp_path / "ema.json"
    bench_script("bench_ema").main(["--model_config", "tiny", "--device", "cpu", "--updates", "3",
                                    "--no_interleaved", "--json", str(out)])
    rows = {row["variant"]: row for row in json.loads(out.read_text())["isolated"]}
    params_bytes = rows["ours"]["trainable_params"] * 4  # fp32
    # The memory-efficient EMA adds one copy of the trained weights; Composer's adds about two.
    assert rows["ours"]["added_bytes"] < 1.2 * params_bytes < rows["composer"]["added_bytes"]


@pytest.mark.multirank  # one training process per run
@pytest.mark.usefixtures("preloaded_commands")  # its runs: forks (conftest); bench_ema's measure a new process
def test_cpu_speed_times_every_batch_of_each_run(tmp_path: Path):
    out = tmp_path / "speed.json"
    report = bench_script("cpu_speed").main(["--batches", "4", "--window", "2", "--settings", "default",
                                             "--json", str(out)])
    saved = json.loads(out.read_text())
    assert len(saved["runs"]["default"]) == 1 and len(saved["runs"]["default"][0]) == 4
    assert report["default"]["s_per_batch"] > 0 and len(report["default"]["windows"]) == 2


@pytest.mark.slow
def test_bench_data_times_the_loader_on_generated_photos(capsys):
    rows = bench_script("bench_data").main(["--num_samples", "24", "--source_size", "160x120", "--image_size", "64",
                                            "--batch_size", "4", "--num_workers", "0", "--image_dtype", "uint8,float32"])
    assert rows[0]["workers"] == 0 and rows[0]["images"] == 20 and rows[0]["images_per_sec"] > 0
    assert [row["image_dtype"] for row in rows] == ["uint8", "float32"]  # before/after, side by side
    assert "images/s" in capsys.readouterr().out
