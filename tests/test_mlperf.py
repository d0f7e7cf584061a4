"""MLPerf's own tools on the project's runs: the MLPerf-format log of a run of recipes/flux1-mlperf.args
(flux1-tiny on a CPU) accepted by MLCommons' compliance checker against Flux.1's closed rules with only
the target and the evaluation frequency the run's, and refused with a key missing or a hyperparameter
wrong; its clock equal to the run's time to target; the recipe holding every value the rules check;
MLPerf's reference convergence points read from the installed package as rcp_checker reads them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import benchmark
from t2ibench.callbacks.mlperf_log import hyperparameters
from t2ibench.costs.mlperf import RULESET, newest_rcp_round, rcp_rounds, rcp_verdict, reference_samples_to_target
from tests.helpers import ROOT, error_of, mlperf_ruleset_copy

RECIPE = f"@{ROOT}/recipes/flux1-mlperf.args"
TARGET = 100.0  # reached at the first evaluation: the checker needs one eval_accuracy at or under it
# The recipe's own global batch 512, flux1-tiny at 32 px on synthetic latents: one batch, then one
# evaluation of one global batch of held-out samples (the least a batch of 512 allows).
RUN = [RECIPE, "--model_config", "flux1-tiny", "--use_synth_data", "--image_size", "32", "--num_workers", "0",
       "--eval_interval", "1ba", "--eval_samples", "512", "--eval_target", repr(TARGET), "--max_duration", "2ba",
       "--lr_warmup_batches", "1", "--warmup_batches", "1"]
EVALUATION_FREQUENCY = 512  # samples: --eval_interval 1ba at batch 512


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, one_thread) -> tuple[dict, Path]:
    """One run of the recipe (its own training run: no other file trains with the recipe's flags):
    its results and its MLPerf log, beside the results JSON by default."""
    folder = tmp_path_factory.mktemp("recipe")
    results = benchmark.main([*RUN, "--results_json", str(folder / "run.json")])
    return results, folder / "run.mlperf.log"


@pytest.fixture(scope="module")
def checker_env(tmp_path_factory) -> dict[str, str]:
    return mlperf_ruleset_copy(tmp_path_factory.mktemp("ruleset"), TARGET, EVALUATION_FREQUENCY)


def lines_of(log: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines() if ":::MLLOG" in line]


def check(log: Path, env: dict[str, str] | None, tmp_path: Path) -> subprocess.CompletedProcess:
    """MLCommons' compliance checker, as a user runs it, on `log`."""
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", RULESET, "--log_output", str(tmp_path / "checker.log"), str(log)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.slow
def test_the_recipe_runs_log_passes_mlperfs_checker_with_only_the_target_and_frequency_the_runs(
        recipe_run, checker_env, tmp_path):
    results, log = recipe_run
    assert results["converged"]
    accepted = check(log, checker_env, tmp_path)
    assert accepted.returncode == 0 and "SUCCESS" in accepted.stderr, accepted.stderr[-3000:]
    # Against the rules as installed, the same log fails on those two values and nothing else.
    refused = check(log, None, tmp_path)
    assert refused.returncode == 1
    failures = [line for line in refused.stderr.splitlines() if line.startswith(("WARNING -  CHECK", "Failed checks"))]
    assert len(failures) == 2, refused.stderr[-3000:]
    assert "CHECK for 'evaluation_frequency' failed" in failures[0]
    assert failures[1] == "Failed checks for eval_accuracy : v['value'] <= 0.586 and v['value'] > 0.0"


@pytest.mark.parametrize("change, named", [
    (lambda line: None if '"key": "opt_adamw_epsilon"' in line else line, "opt_adamw_epsilon"),  # a key missing
    (lambda line: line.replace('"value": 0.95', '"value": 0.999') if '"key": "opt_adamw_beta_2"' in line else line,
     "CHECK for 'opt_adamw_beta_2' failed"),  # a hyperparameter other than MLPerf's
])
def test_a_log_with_a_key_missing_or_a_hyperparameter_wrong_is_refused(recipe_run, checker_env, tmp_path, change,
                                                                        named):
    _, log = recipe_run
    changed = tmp_path / "changed.log"
    changed.write_text("".join(line for line in map(change, log.read_text().splitlines(keepends=True)) if line))
    assert changed.read_text() != log.read_text()
    refused = check(changed, checker_env, tmp_path)
    assert refused.returncode == 1 and "FAILED" in refused.stderr
    assert named in refused.stderr


def test_the_log_follows_mlperfs_order_on_the_runs_own_clock(recipe_run):
    results, log = recipe_run
    events = lines_of(log)
    keys = [e["key"] for e in events]
    assert keys[:8] == ["submission_benchmark", "submission_org", "submission_division", "submission_status",
                        "submission_platform", "cache_clear", "init_start", "init_stop"]
    assert keys[8] == "run_start" and keys[-1] == "run_stop" and events[-1]["metadata"]["status"] == "success"
    assert events[0]["value"] == "flux1" and events[4]["value"] == "1xcpu"
    at = {e["key"]: e for e in events}
    # run_start to run_stop is the run's time to target (to the millisecond the log keeps).
    assert (at["run_stop"]["time_ms"] - at["run_start"]["time_ms"]) / 1000 == pytest.approx(
        results["time_to_target_s"], abs=1e-3)
    history = results["eval_history"]
    scored = [e for e in events if e["key"] == "eval_accuracy"]
    assert [(e["value"], e["metadata"]["samples_count"]) for e in scored] == [
        (entry["loss"], entry["samples_trained"]) for entry in history]
    assert at["eval_samples"]["value"] == history[0]["held_out_samples"]
    assert at["global_batch_size"]["value"] == 512 and at["evaluation_frequency"]["value"] == EVALUATION_FREQUENCY
    assert at["gradient_accumulation_steps"]["value"] == 1 and at["seed"]["value"] == benchmark.parse_args(RUN).seed
    assert keys.index("block_start") > keys.index("run_start") and keys.index("block_stop") < keys.index("eval_start")


def test_the_recipe_holds_every_value_mlperfs_closed_flux1_rules_check():
    args = benchmark.parse_args([RECIPE])
    logged = hyperparameters(args)
    logged["evaluation_frequency"] = int(args.eval_interval.removesuffix("ba")) * args.batch_size
    import mlperf_logging.compliance_checker as checker
    rules = yaml.safe_load((Path(checker.__file__).parent / f"training_{RULESET}" / "closed_flux1.yaml").read_text())
    checked = {rule["KEY"]["NAME"]: rule["KEY"] for rule in rules if "KEY" in rule}
    exact = {name: rule["CHECK"].split("==")[1].strip().strip("'") for name, rule in checked.items()
             if isinstance(rule.get("CHECK"), str) and "==" in rule["CHECK"]}
    assert set(exact) >= {"evaluation_frequency", "opt_name", "opt_adamw_beta_1", "opt_adamw_beta_2",
                          "opt_adamw_epsilon", "opt_adamw_weight_decay", "opt_gradient_clip_norm"}
    for name, value in exact.items():
        assert str(logged[name]) == value or float(logged[name]) == float(value), name
    assert args.eval_target == 0.586 and "<= 0.586" in checked["eval_accuracy"]["ATLEAST_ONE_CHECK"]
    # The batch, learning rate and warm-up the rules leave free are the reference's at batch 512.
    reference = next(r for r in json.loads((Path(checker.__file__).parents[1] / "rcp_checker" / f"training_{RULESET}" /
                                            "rcps_flux1.json").read_text()).values() if r["BS"] == args.batch_size)
    for name, value in reference["Hyperparams"].items():
        assert logged[name] == value, name


def test_reference_convergence_is_read_as_rcp_checker_reads_it():
    from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker
    assert newest_rcp_round() == rcp_rounds()[-1] and RULESET in rcp_rounds()
    for round_ in (RULESET, newest_rcp_round()):
        checker = RCP_Checker("training", round_, "flux1", verbose=False)
        assert reference_samples_to_target(round_) == {
            record["BS"]: round(record["RCP Mean"]) for record in checker.rcp_data.values()}


def test_rcp_checkers_verdict_on_runs_at_a_batch_the_rcps_list(recipe_run, tmp_path):
    # The recipe run's log as ten result files (one real log, for rcp_checker's arithmetic): 512 samples
    # to a target is far faster than MLPerf's reference allows, and rcp_checker says so.
    _, log = recipe_run
    for i in range(10):
        (tmp_path / f"result_{i}.txt").write_text(log.read_text())
    verdict = rcp_verdict(tmp_path, newest_rcp_round(), "flux1", 512)
    assert verdict["checked"] and not verdict["passed"] and verdict["message"] == "RCP found"
    assert verdict["reference_samples_to_target"] == reference_samples_to_target(newest_rcp_round())[512]
    unlisted = rcp_verdict(tmp_path, newest_rcp_round(), "flux1", 16)
    assert not unlisted["checked"] and "not this result's 16" in unlisted["why"]


def test_the_log_can_go_elsewhere_or_nowhere_and_needs_an_evaluation(tmp_path):
    assert "--adamw_beta2" in error_of(benchmark.main, [RECIPE, "--adamw_beta2", "1"], "benchmark.py")
    assert "--adamw_eps" in error_of(benchmark.main, [RECIPE, "--adamw_eps", "0"], "benchmark.py")
    assert "--mlperf_log x.log needs --eval_interval" in error_of(
        benchmark.main, ["--model_config", "flux1-tiny", "--use_synth_data", "--mlperf_log", "x.log"], "benchmark.py")
    settings = benchmark.validate(benchmark.parse_args([*RUN, "--results_json", str(tmp_path / "r.json"),
                                                        "--mlperf_log", "off"]), 1)
    assert settings.mlperf_log is None
    settings = benchmark.validate(benchmark.parse_args([*RUN, "--mlperf_log", str(tmp_path / "m.txt")]), 1)
    assert settings.mlperf_log == str(tmp_path / "m.txt")
