"""bench/time_to_target.py: MLPerf's score of N runs to a target (the fastest and slowest dropped, a run
that did not converge the slowest, at most one of ten), its refusals, and its CPU default end to end
on a target its first evaluation reaches."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import bench_script, error_of

ttt = bench_script("time_to_target")


def test_the_score_drops_the_fastest_and_slowest_and_averages_the_rest():
    times = [7.0, 3.0, 5.0, 9.0, 4.0, 6.0, 8.0, 10.0, 2.0, 11.0]
    score = ttt.mlperf_score(times)
    assert score["score_s"] == pytest.approx(sum(range(3, 11)) / 8)  # 2 and 11 dropped
    assert score["kept_s"] == [float(t) for t in range(3, 11)]
    assert score["not_converged"] == 0 and score["valid"] and score["mlperf_result"]
    assert (score["spread_s"]["min"], score["spread_s"]["max"]) == (2.0, 11.0)


def test_one_run_that_did_not_converge_is_dropped_as_the_slowest_two_make_the_result_invalid():
    one = ttt.mlperf_score([5.0, None, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0])
    assert one["score_s"] == pytest.approx(sum(range(2, 10)) / 8)  # 1.0 and the failed run dropped
    assert one["not_converged"] == 1 and one["valid"] and one["mlperf_result"]
    two = ttt.mlperf_score([5.0, None, 1.0, 3.0, None, 4.0, 6.0, 7.0, 8.0, 9.0])
    assert two["score_s"] is None and two["not_converged"] == 2 and not two["valid"] and not two["mlperf_result"]
    assert "invalid by MLPerf's rule" in two["validity"]


def test_fewer_than_three_runs_drop_nothing_and_fewer_than_ten_are_no_mlperf_result():
    assert ttt.mlperf_score([4.0, 6.0])["score_s"] == 5.0
    assert ttt.mlperf_score([4.0])["score_s"] == 4.0 and ttt.mlperf_score([4.0])["spread_s"] is None
    assert ttt.mlperf_score([4.0, None])["score_s"] is None
    three = ttt.mlperf_score([1.0, 2.0, 30.0])
    assert three["score_s"] == 2.0 and three["valid"] and not three["mlperf_result"]
    assert "this is 3" in three["validity"]


@pytest.mark.parametrize("argv, message", [
    (["--", "--use_synth_data", "--eval_interval", "2ba", "--seed", "3"], "--seed after -- is the script's"),
    (["--", "--use_synth_data", "--results_json=r.json", "--eval_interval", "2ba"], "--results_json after --"),
    (["--", "--use_synth_data", "--max_duration", "4ba"], "needs --eval_interval"),
    (["--max_batches", "9", "--", "--eval_interval", "2ba"], "--max_batches sets the CPU default's run"),
])
def test_flags_the_script_sets_or_needs_are_refused_in_one_line(tmp_path, argv, message):
    assert message in error_of(ttt.main, ["--out", str(tmp_path / "out"), *argv], "time_to_target.py")


def test_an_out_folder_holding_anything_is_refused(tmp_path):
    (tmp_path / "earlier.json").write_text("{}")
    assert "is not empty" in error_of(ttt.main, ["--out", str(tmp_path), "--runs", "1"], "time_to_target.py")


@pytest.mark.multirank  # one training process per run
def test_cpu_default_two_runs_to_a_target_their_first_evaluation_reaches(tmp_path: Path):
    out = tmp_path / "out"
    record = ttt.main(["--runs", "2", "--out", str(out), "--target", "100", "--max_batches", "3",
                       "--eval_interval_batches", "2"])
    saved = json.loads((out / "time_to_target.json").read_text())
    assert saved == json.loads(json.dumps(record))
    assert saved["seeds"] == [1, 2] and saved["converged"] == [True, True] and saved["not_converged"] == 0
    assert saved["samples_to_target"] == [32, 32]  # two batches of 16
    assert saved["score_s"] == pytest.approx(sum(saved["time_to_target_s"]) / 2)  # two runs: nothing dropped
    assert saved["model_config"] == "flux1-tiny" and saved["cpu_default"] and not saved["mlperf_result"]
    for seed in (1, 2):
        run = json.loads((out / "runs" / f"seed-{seed}.json").read_text())
        assert run["time_to_target_s"] == saved["time_to_target_s"][seed - 1] and run["eval_target"] == 100
        assert run["eval_history"][0]["held_out_samples"] == ttt.HELD_OUT_PER_CAPTION * len(ttt.CAPTIONS)
    with Image.open(out / "time_to_target.png") as image:
        assert image.format == "PNG"
