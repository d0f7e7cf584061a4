"""bench/time_to_target.py: MLPerf's score of N runs to a target (the fastest and slowest dropped, a run
that did not converge the slowest, at most one of ten), its refusals, its CPU default end to end on a
target its first evaluation reaches, killed and continued, scored again by MLCommons' scorer, and failed
runs counted as not converged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tests import preloaded
from tests.helpers import ROOT, bench_script, error_of, kill_group, mlperf_ruleset_copy

pytestmark = pytest.mark.usefixtures("preloaded_commands")  # the commands they start: forks (conftest)

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


def test_fewer_than_ten_runs_drop_nothing_as_mlperfs_scorer_and_are_no_mlperf_result():
    assert ttt.mlperf_score([4.0, 6.0])["score_s"] == 5.0
    assert ttt.mlperf_score([4.0])["score_s"] == 4.0 and ttt.mlperf_score([4.0])["spread_s"] is None
    assert ttt.mlperf_score([4.0, None])["score_s"] is None
    three = ttt.mlperf_score([1.0, 2.0, 30.0])  # MLCommons' compute_score: the mean of all below 10 runs
    assert three["score_s"] == 11.0 and three["valid"] and not three["mlperf_result"]
    assert "this is 3" in three["validity"] and "nothing dropped" in three["score_rule"]
    assert ttt.mlperf_score([1.0, 2.0, 30.0], required_runs=3)["score_s"] == 2.0  # a benchmark of 3 runs


@pytest.mark.parametrize("argv, message", [
    (["--", "--use_synth_data", "--eval_interval", "2ba", "--seed", "3"], "--seed after -- is the script's"),
    (["--", "--use_synth_data", "--results_json=r.json", "--eval_interval", "2ba"], "--results_json after --"),
    (["--", "--use_synth_data", "--max_duration", "4ba"], "needs --eval_interval"),
    (["--max_batches", "9", "--", "--eval_interval", "2ba"], "--max_batches sets the CPU default's run"),
])
def test_flags_the_script_sets_or_needs_are_refused_in_one_line(tmp_path, argv, message):
    assert message in error_of(ttt.main, ["--out", str(tmp_path / "out"), *argv], "time_to_target.py")


def test_an_out_folder_holding_anything_but_a_campaign_of_the_same_flags_is_refused(tmp_path):
    (tmp_path / "earlier.json").write_text("{}")
    assert "is not empty and holds no campaign of this script" in error_of(
        ttt.main, ["--out", str(tmp_path), "--runs", "1"], "time_to_target.py")
    (tmp_path / ttt.PLAN_FILE).write_text(json.dumps({"flags": ttt.campaign(ttt.parse_args(
        ["--out", str(tmp_path), "--runs", "2"]))}))
    assert "holds a campaign of other flags (--runs 2 there, 3 now)" in error_of(
        ttt.main, ["--out", str(tmp_path), "--runs", "3"], "time_to_target.py")


@pytest.mark.multirank  # one training process per run
def test_cpu_default_killed_after_a_run_continues_and_mlperfs_scorer_gives_its_score(tmp_path: Path):
    out = tmp_path / "out"
    argv = ["--runs", "2", "--out", str(out), "--target", "100", "--max_batches", "3", "--eval_interval_batches", "2"]
    # Killed (the whole process group, as a terminal's Ctrl-\ or an OOM killer would) once run 1 finished.
    first = preloaded.PreloadedPopen([sys.executable, str(ROOT / "bench" / "time_to_target.py"), *argv], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    finished = out / "runs" / "seed-1.outcome.json"
    deadline = time.monotonic() + 600
    while not finished.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_group(first.pid)
    first.wait()
    assert finished.exists() and not (out / "time_to_target.json").exists()
    kept = finished.read_text()
    record = ttt.main(argv)  # the same flags again: the campaign goes on
    assert finished.read_text() == kept  # run 1 was not run again
    saved = json.loads((out / "time_to_target.json").read_text())
    assert saved == json.loads(json.dumps(record))
    assert saved["seeds"] == [1, 2] and saved["converged"] == [True, True] and saved["not_converged"] == 0
    assert saved["failed"] == [None, None]
    assert saved["samples_to_target"] == [32, 32]  # two batches of 16
    assert saved["score_s"] == pytest.approx(sum(saved["time_to_target_s"]) / 2)  # two runs: nothing dropped
    assert saved["model_config"] == "flux1-tiny" and saved["cpu_default"] and not saved["mlperf_result"]
    assert not saved["rcp_check"]["checked"] and "not this result's 16" in saved["rcp_check"]["why"]
    for seed in (1, 2):
        run = json.loads((out / "runs" / f"seed-{seed}.json").read_text())
        assert run["time_to_target_s"] == saved["time_to_target_s"][seed - 1] and run["eval_target"] == 100
        assert run["eval_history"][0]["held_out_samples"] == ttt.HELD_OUT_PER_CAPTION * len(ttt.CAPTIONS)
    with Image.open(out / "time_to_target.png") as image:
        assert image.format == "PNG"
    # MLCommons' scorer on the runs' logs, with Flux.1's rules copied but for this set-up's target and
    # evaluation frequency (2 batches of 16): the script's score, in minutes, to the second. The scorer's
    # own function, as its command calls it: that command (compute_score's __main__, mlperf-logging 4.1.60
    # to 4.1.68) unpacks 4 of the 5 values the function returns and stops before printing a score.
    env = mlperf_ruleset_copy(tmp_path / "ruleset", 100.0, 2 * 16)
    assert sorted(p.name for p in (out / ttt.MLPERF_FOLDER).iterdir()) == ["result_0.txt", "result_1.txt"]
    scored = subprocess.run([sys.executable, "-c", ttt.SCORER, str(out / ttt.MLPERF_FOLDER), "flux1", ttt.RULESET],
                            capture_output=True, text=True, env=env, timeout=300)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    per_run_min, score_min = json.loads(scored.stdout.splitlines()[-1])
    assert sorted(per_run_min) == pytest.approx(sorted(t / 60 for t in saved["time_to_target_s"]), abs=1 / 60)
    assert score_min is None  # two runs: its olympic average keeps none; below 10 its command prints the mean
    assert sum(per_run_min) / len(per_run_min) * 60 == pytest.approx(saved["score_s"], abs=1.0)


@pytest.mark.multirank  # one training process per run
def test_a_failed_run_is_one_not_converged_and_a_second_ends_the_campaign(tmp_path: Path):
    out = tmp_path / "out"
    # AdamW at a learning rate of 1e30: every seed's loss is non-finite by its second batch (exit 1).
    setup = ["--model_config", "flux1-tiny", "--use_synth_data", "--precomputed", "--batch_size", "4",
             "--image_size", "32", "--num_workers", "0", "--eval_interval", "2ba", "--eval_samples", "4",
             "--max_duration", "4ba", "--warmup_batches", "1", "--lr", "1e30"]
    error = error_of(ttt.main, ["--runs", "3", "--out", str(out), "--", *setup], "time_to_target.py")
    assert "the runs of seed 1 and seed 2 failed: the result is invalid by MLPerf's rule" in error
    for seed in (1, 2):  # each recorded as a run that did not converge, the diverged record saying so too
        outcome = json.loads((out / "runs" / f"seed-{seed}.outcome.json").read_text())
        assert outcome["converged"] is False and outcome["failed"].startswith("exit 1: ")
        assert outcome["diverged"] and outcome["time_to_target_s"] is None
        assert json.loads((out / "runs" / f"seed-{seed}.json").read_text())["converged"] is False
    assert not (out / "runs" / "seed-3.outcome.json").exists()
    # Each failed run's MLPerf log ends as MLPerf's aborted run, which the scorer counts as not converged.
    for i in (0, 1):
        last = json.loads((out / ttt.MLPERF_FOLDER / f"result_{i}.txt").read_text().splitlines()[-1].split(" ", 1)[1])
        assert (last["key"], last["metadata"]["status"]) == ("run_stop", "aborted")
