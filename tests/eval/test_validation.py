"""MLPerf's validation loss for every model: SD2's tiny model evaluated every --eval_interval at its
DDPM steps k x 1000 / 8, in the progress line, the results and the curve's picture; the flags refused
when incomplete; a run that stops at --eval_target (two ranks, reached and not), timed and counted as
MLPerf counts, its curve in W&B; an evaluation of no sample refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger
from PIL import Image

import benchmark
from t2ibench.families import family_of
from t2ibench.families.objectives import DDPMObjective
from tests.helpers import (LAUNCH_TIMEOUT_S, TINY_SYNTH, Launch, composer_launcher, rank_env, run_cli, supervise,
                           two_ranks)

TINY = [*TINY_SYNTH, "--warmup_batches", "1", "--log_interval", "1ba"]
# Two ranks of 2 samples (global batch 4), evaluated every 2 batches on 8 held-out samples (4 a rank).
TWO_RANKS = [*TINY, "--seed", "17", "--max_duration", "6ba", "--eval_interval", "2ba", "--eval_samples", "8"]
EVERY_LOSS = "100"  # a target every loss meets: the first evaluation reaches it
NO_LOSS = "1e-9"  # a target no loss of a few batches meets


def test_sd2_validation_loss_every_interval_in_the_progress_line_results_and_picture(tmp_path, capsys):
    benchmark.main(TINY + ["--max_duration", "4ba", "--eval_interval", "2ba", "--eval_samples", "16",
                           "--results_json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    assert [e["batch"] for e in r["eval_history"]] == [2, 4]
    assert all(e["held_out_samples"] == 16 and None not in e["per_timestep"] for e in r["eval_history"])
    # MLPerf's clock (evaluations included) runs ahead of the training seconds, by at least the evaluations.
    for e in r["eval_history"]:
        assert e["elapsed_seconds"] >= e["training_seconds"] + e["seconds"] > 0
    assert f"eval loss {r['eval_history'][0]['loss']:.4f}" in out and "eval loss    " in out  # line and summary
    assert r["eval_target"] is None and r["eval_target_reached"] is None and r["converged"] is None
    assert r["samples_to_target"] is None and r["time_to_target_s"] is None
    picture = tmp_path / "r-eval.png"  # beside the results JSON
    assert f"validation curve drawn in {picture}" in out
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.width > 500


class EvaluateNothing(Callback):
    """A fault from outside: every evaluation runs no batch (Composer 0.32.1 only warns then)."""

    def eval_before_all(self, state: State, logger: Logger) -> None:
        for evaluator in state.evaluators:
            evaluator.subset_num_batches = 0


@pytest.mark.filterwarnings("ignore:No batches were evaluated", "ignore:The ``compute`` method")  # the fault's own
def test_an_evaluation_that_scores_no_sample_stops_the_run_in_one_line():
    with pytest.raises(SystemExit, match="the evaluation at batch 2 scored no held-out sample on any rank"):
        benchmark.main(TINY + ["--max_duration", "4ba", "--eval_interval", "2ba"], extra_callbacks=[EvaluateNothing()])


def test_a_retried_job_whose_run_reached_its_target_trains_no_further(tmp_path):
    run = TINY + ["--max_duration", "6ba", "--eval_interval", "2ba", "--eval_samples", "8", "--eval_target", EVERY_LOSS,
                  "--save_folder", str(tmp_path / "ckpt"), "--run_name", "target", "--autoresume"]
    first = benchmark.main(run)
    assert first["converged"] is True and [e["batch"] for e in first["eval_history"]] == [2]
    # The run stopped where it reached the target: its last checkpoint is that batch's.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("ep*-rank0.pt")) == ["ep0-ba2-rank0.pt"]
    again = benchmark.main(run)  # the same job retried: its checkpoint says the target was reached
    assert again["already_complete"] is True and again["trained_batches"] == 2
    assert again["eval_history"] == first["eval_history"] and again["time_to_target_s"] == first["time_to_target_s"]


def test_sd2_fixed_timesteps_span_the_schedule():
    objective = DDPMObjective(family_of("tiny").build("tiny", denoiser=False, vae=False, text_encoders=False,
                                                      tokenizers=False).noise_scheduler)
    assert objective.fixed_timesteps(torch.arange(8), 8).tolist() == [0, 125, 250, 375, 500, 625, 750, 875]


@pytest.mark.parametrize("flags, message", [
    (["--eval_samples", "8"], "--eval_samples needs --eval_interval"),
    (["--eval_interval", "0ba"], "--eval_interval '0ba' must be a positive"),
    (["--eval_interval", "2ba", "--eval_local", "/nonexistent"], "--use_synth_data evaluates on synthetic held-out"),
])
def test_incomplete_validation_flags_fail_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit, match=message):
        benchmark.main(TINY + ["--max_duration", "2ba", *flags])


def offline_wandb_records(run_file: Path) -> list:
    """Every record of an offline W&B run, read with wandb's own file reader."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(run_file))
    records = []
    while (raw := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Two ranks with a target the first evaluation reaches (and W&B offline), and with one no evaluation
    reaches, launched side by side."""
    tmp = tmp_path_factory.mktemp("targets")
    launches = {
        name: Launch(two_ranks("benchmark.py", *TWO_RANKS, "--eval_target", target, "--results_json",
                               str(tmp / f"{name}.json"), *extra), tmp / f"{name}.log", env=env)
        for name, target, extra, env in [
            ("reached", EVERY_LOSS, ["--save_folder", str(tmp / "ckpt"), "--wandb_project", "t2i", "--wandb_name", "t"],
             rank_env(WANDB_MODE="offline", WANDB_DIR=str(tmp), WANDB_SILENT="true")),
            ("unreached", NO_LOSS, [], rank_env())]}
    supervise(list(launches.values()))
    return tmp, launches


@pytest.mark.multirank
def test_two_ranks_stop_together_at_the_first_evaluation_that_reaches_the_target(two_rank_runs):
    tmp, launches = two_rank_runs
    assert launches["reached"].proc.returncode == 0, launches["reached"].tail()
    r = json.loads((tmp / "reached.json").read_text())
    assert r["world_size"] == 2 and r["converged"] is True
    (entry,) = r["eval_history"]  # the batch-2 evaluation reached it, and none followed
    assert entry["batch"] == 2 and entry["held_out_samples"] == 8  # both ranks' 4, summed
    assert r["samples_to_target"] == entry["samples_trained"] == 2 * 4  # 2 batches of 4, counted over both ranks
    # Evaluations on MLPerf's clock, not in the training seconds kept beside it.
    assert r["time_to_target_s"] == entry["elapsed_seconds"] >= r["training_seconds_to_target"] + entry["seconds"]
    # The run stopped at batch 2, its checkpoint written there (DDP: rank 0's). Both ranks stopped: a rank
    # that trained on would wait for the other in batch 3's gradient all-reduce until the launch timed out.
    assert sorted(p.name for p in (tmp / "ckpt").glob("ep*-rank*.pt")) == ["ep0-ba2-rank0.pt"]
    out = launches["reached"].output()
    assert "batch 2/6" in out and "batch 3/6" not in out
    assert "target       loss <= 100.0 reached at batch 2, 8 samples (all ranks): time to target" in out
    assert (tmp / "reached-eval.png").is_file()
    # In W&B the validation losses are drawn against the samples trained, beside the target.
    (run_file,) = (tmp / "wandb").glob("offline-run-*/run-*.wandb")
    records = offline_wandb_records(run_file)
    axes = {r.metric.glob_name or r.metric.name: r.metric.step_metric for r in records
            if r.WhichOneof("record_type") == "metric"}
    assert axes["eval/*"] == axes["eval/loss"] == axes["eval/loss_t0"] == "eval/samples_trained"
    logged = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for r in records
              if r.WhichOneof("record_type") == "history" for item in r.history.item}
    assert logged["eval/samples_trained"] == 8 and logged["eval/loss"] == pytest.approx(entry["loss"])
    assert logged["eval/target"] == 100


@pytest.mark.multirank
def test_two_ranks_that_miss_the_target_train_to_max_duration_and_say_not_converged(two_rank_runs):
    tmp, launches = two_rank_runs
    assert launches["unreached"].proc.returncode == 0, launches["unreached"].tail()
    r = json.loads((tmp / "unreached.json").read_text())
    assert r["converged"] is False and r["eval_target_reached"] is None
    assert r["samples_to_target"] is None and r["time_to_target_s"] is None
    assert [(e["batch"], e["samples_trained"], e["held_out_samples"]) for e in r["eval_history"]] == [
        (2, 8, 8), (4, 16, 8), (6, 24, 8)]
    assert "target       loss <= 1e-09 not reached in 24 samples (converged: false" in launches["unreached"].output()


@pytest.mark.multirank
def test_three_ranks_score_two_held_out_samples_each_once_as_one_rank_does(tmp_path):
    # Fewer held-out samples than ranks: rank 2 has none of its own (it runs its forward on the sampler's
    # repeat, which Composer leaves out of the metric) and waits on nobody. The learning rate is so small
    # that no weight moves (float32), so both runs evaluate the same weights: the one-rank run is the
    # reference for the loss. Its own launch: no shared run has 3 ranks.
    flags = [*TINY, "--batch_size", "3", "--max_duration", "1ba", "--eval_interval", "1ba", "--eval_samples", "2",
             "--lr", "1e-30", "--seed", "5"]
    three = run_cli([*flags, "--results_json", str(tmp_path / "three.json")], launcher=composer_launcher(3),
                    env=rank_env(), timeout=LAUNCH_TIMEOUT_S)
    assert three.returncode == 0, three.stdout[-3000:] + three.stderr[-3000:]
    one = benchmark.main([*flags, "--results_json", str(tmp_path / "one.json")])
    (spread,) = json.loads((tmp_path / "three.json").read_text())["eval_history"]
    (alone,) = one["eval_history"]
    assert spread["held_out_samples"] == alone["held_out_samples"] == 2
    assert spread["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert [value is None for value in spread["per_timestep"]] == [value is None for value in alone["per_timestep"]]
