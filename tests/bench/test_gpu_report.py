"""bench/gpu_report.py, the one GPU driver, without a GPU: bad input refused before any row, the rows chosen
(the report's, the matrix, both), the budget rule (a row the time left cannot hold is not started), the
plan for an 8 x 80 GB node (every matrix row's microbatch from the memory model, for every family), the
rows' blocks.py commands as blocks.py parses them, the timeout that ends a launch's whole process group,
the match with earlier results of the same set-up and device (the project's own results/), and --smoke
runs end to end with the files they write: two rows on one rank, a matrix row on two ranks through
Composer's launcher, each read back by cost.py."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

import cost
from gpu import budget as gpu_budget
from gpu import launch as gpu_launch
from gpu import plan as gpu_plan
from gpu import predict as gpu_predict
from gpu import record as gpu_record
import gpu_report
from gpu import rows as gpu_rows
from t2ibench.core import devices
from t2ibench import memory
from t2ibench.commands.gpu_setup import choose_setup
from tests.helpers import ROOT, error_of

pytestmark = pytest.mark.usefixtures("preloaded_commands")  # the commands they start: forks (conftest)

H100 = "NVIDIA H100 80GB HBM3"


def _run(argv: list[str]) -> list[gpu_record.Outcome]:
    return gpu_report.main(argv)


@pytest.mark.parametrize("make, argv, expect", [
    ("file", ["--smoke"], "is a file"),
    ("full", ["--smoke"], "is not empty: give the report a new folder"),
    (None, ["--smoke", "--budget_s", "0"], "--budget_s 0 must be a finite number in (0, 86400]"),
    (None, ["--smoke", "--budget_s", "-60"], "--budget_s -60 must be"),
    (None, ["--smoke", "--budget_s", "nan"], "--budget_s nan must be"),
    (None, ["--smoke", "--budget_s", "1e9"], "--budget_s 1e9 must be"),
    (None, ["--smoke", "--rows", "sd2-512"], "argument --rows: invalid choice: 'sd2-512'"),
    (None, ["--smoke", "--rows", "blocks-sdxl"], "--rows blocks-sdxl compares blocks.py with the run of row "
                                                 "sdxl-1024-compile: add it to --rows"),
    (None, ["--smoke", "--results_root", "{tmp}/nowhere"], "--results_root {tmp}/nowhere is not a folder"),
    (None, ["--smoke", "--batches", "2", "--warmup_batches", "2"], "--batches 2 must exceed --warmup_batches 2"),
    (None, ["--smoke", "--gpus", "0"], "--gpus 0 must be an integer from 1"),
])
def test_bad_input_is_one_line_before_any_row(tmp_path, make, argv, expect):
    out = tmp_path / "report"
    if make == "file":
        out.write_text("mine\n")
    elif make == "full":
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
    message = error_of(gpu_report.main, ["--out", str(out), *[a.format(tmp=tmp_path) for a in argv]],
                       prog="gpu_report.py")
    assert expect.format(tmp=tmp_path) in message
    if make == "file":
        assert out.read_text() == "mine\n"
    elif make == "full":
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing added, nothing removed
    else:
        assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_it_refuses_unless_smoke_or_a_dry_run_of_a_named_node(tmp_path):
    message = error_of(gpu_report.main, ["--out", str(tmp_path / "report")], prog="gpu_report.py")
    assert "no CUDA GPU visible" in message and "--smoke" in message and "--dry_run" in message
    message = error_of(gpu_report.main, ["--dry_run", "--gpus", "8"], prog="gpu_report.py")
    assert "--dry_run without a visible GPU needs --device NAME or --gpu_memory_gib" in message
    assert "--out is required" in error_of(gpu_report.main, ["--smoke"], prog="gpu_report.py")
    assert not (tmp_path / "report").exists()


def test_rows_by_name_or_group_run_in_one_order(tmp_path):
    def chosen(*rows: str) -> list[str]:
        args = gpu_report.validate(gpu_report.build_parser().parse_args(["--smoke", "--out", str(tmp_path / "r"),
                                                                         "--rows", *rows]))
        return [row.name for row in args.report_rows]

    report = [row.name for row in gpu_rows.REPORT_ROWS]
    assert chosen("report") == report == gpu_rows.ROW_GROUPS["report"] and len(report) == 8
    assert chosen("matrix") == list(gpu_rows.MATRIX) and len(gpu_rows.MATRIX) == 21
    assert chosen("all") == report + list(gpu_rows.MATRIX) == gpu_rows.ROW_NAMES
    # A matrix row beside the report's rows runs after them, each once; names are unique across both.
    assert chosen("online-bf16", "report", "sd2-512-online") == report + ["online-bf16"]
    assert len(set(gpu_rows.ROW_NAMES)) == len(gpu_rows.ROW_NAMES)
    for row in gpu_rows.MATRIX_ROWS:  # each matrix row trains its setting as named, described in its words
        assert row.setting is gpu_rows.MATRIX[row.name] and row.setting.model_config in row.what


def test_a_budget_that_holds_no_row_starts_none_and_still_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    outcomes = _run(["--smoke", "--out", str(out), "--budget_s", "5"])
    printed = capsys.readouterr().out
    assert [o.name for o in outcomes] == gpu_rows.ROW_GROUPS["report"]  # the report's rows, highest first
    for outcome in outcomes:
        if outcome.name.startswith("blocks-"):  # comparisons need their measured run
            assert outcome.status.startswith("skipped: needs ") and outcome.estimate_s is None
        else:  # even the first estimate exceeds 5 s: nothing was started
            assert outcome.status == f"skipped: estimated {outcome.estimate_s:.0f} s, 5 s left"
            assert outcome.estimate_s > 5 and outcome.wall_s is None
        assert f"{outcome.name}: {outcome.status}" in printed
    assert not list((out / "logs").iterdir()) and not list(out.glob("*-*.json"))  # no row ran
    readme = (out / "README.md").read_text()
    assert "0 of 8 rows run" in readme and readme.count("| skipped: ") == 8
    summary = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in summary["rows"]] == [o.status for o in outcomes] and summary["budget_s"] == 5
    env = json.loads((out / "environment.json").read_text())
    assert env["versions"]["mosaicml"] == "0.32.1" and env["torchao"] and env["date_utc"] and env["budget_s"] == 5
    assert env["commit"] is None or len(env["commit"].split("+")[0]) == 40


@pytest.mark.slow
def test_the_budget_rule_learns_from_the_rows_before():
    estimator = gpu_budget.Estimator(first_flops_per_second=1e12)
    # --smoke's set-ups resolve checkpointing as their CPU run does (`auto`: off); left to `auto` (a GPU's
    # rows), checkpointing is counted on: the longer estimate.
    assert gpu_plan.run_setting(gpu_rows.REPORT_ROWS[0], smoke=True).activation_checkpointing == "off"
    eager = dataclasses.replace(gpu_plan.run_setting(gpu_rows.REPORT_ROWS[0], smoke=True), activation_checkpointing="auto")
    compiled = gpu_plan.run_setting(gpu_rows.REPORT_ROWS[1], smoke=True)
    flops = gpu_budget.flops_of(eager, True)
    batches = 3
    # Before any row: the first estimates, the batches at the first FLOP/s.
    assert estimator.run_seconds(eager, batches) == pytest.approx(
        gpu_budget.FIRST_STARTUP_SECONDS + batches * eager.global_batch * flops / 1e12)
    assert estimator.fixed_seconds(compiled) == gpu_budget.FIRST_STARTUP_SECONDS + gpu_budget.FIRST_COMPILE_SECONDS
    assert estimator.blocks_seconds() == gpu_budget.FIRST_BLOCKS_SECONDS
    # An eager row of 40 s whose measured batches took 2 s each at 8 images/s: 34 s of start-up.
    # It ran without checkpointing: its FLOP/s are 8 images/s times the plain step's FLOPs.
    estimator.observe_run(eager, batches, 40.0, {"measured_seconds": 4.0, "measured_batches": 2, "images_per_sec": 8.0,
                                                 "activation_checkpointing": False})
    seconds_per_batch = eager.global_batch * flops / (8 * gpu_budget.flops_of(eager, False))
    assert estimator.run_seconds(eager, batches) == pytest.approx(34 + batches * seconds_per_batch)
    # A compiled row that reports its compilation: the rest of its overhead is start-up (the largest is kept).
    estimator.observe_run(compiled, batches, 100.0, {"measured_seconds": 2.0, "measured_batches": 2,
                                                    "images_per_sec": 16.0, "compile_seconds": 50.0,
                                                    "activation_checkpointing": False})
    assert estimator.fixed_seconds(compiled) == pytest.approx(47 + 50)
    # The lowest FLOP/s seen is kept (8 images/s, not 16), and the longest blocks.py run.
    assert estimator.run_seconds(eager, batches) == pytest.approx(47 + batches * seconds_per_batch)
    estimator.observe_blocks(70.0)
    estimator.observe_blocks(30.0)
    assert estimator.blocks_seconds() == 70.0
    # A row's own timeout: twice its estimate, a minute more at least, never past the budget.
    assert gpu_budget.row_timeout(100, 1000) == 200 and gpu_budget.row_timeout(20, 1000) == 80
    assert gpu_budget.row_timeout(100, 150) == 150


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.slow
def test_blocks_rows_are_commands_blocks_py_accepts(tmp_path, smoke):
    import argparse

    import blocks

    args = argparse.Namespace(out=tmp_path, smoke=smoke, model_name=gpu_rows.DEFAULT_MODEL_NAME, gpu_device=None)
    gpu_memory_bytes = 79.1 * 2**30  # an H100's, as torch reports it
    measured = {"sd2-512-precomputed": {
        "model_config": "sd2-base", "image_size": 512, "precomputed": True, "precomputed_format": "tokens",
        "global_batch_size": 512, "device_train_microbatch_size": 32, "world_size": 1, "use_ema": True,
        "compile": False, "fsdp": "none", "weight_casts": "step", "norm_precision": "autocast",
        "activation_checkpointing": False}}
    rows = [row for row in gpu_rows.REPORT_ROWS if row.blocks_of or row.compare_with in measured]
    if not smoke:  # Flux.1-schnell's node planned on the meta device takes minutes here: its tiny model's
        rows = [dataclasses.replace(row, blocks_of=dataclasses.replace(row.blocks_of, model_config="flux1-tiny",
                                                                       image_size=32))
                if row.blocks_of else row for row in rows]
    compiles = "--compile" in gpu_plan.blocks_options()
    for row in rows:
        command, notes = gpu_plan.blocks_command(row, args, gpu_memory_bytes, measured.get(row.compare_with))
        assert command[1] == str(ROOT / "bench" / "blocks.py") and command[-1] == "--json"
        parsed = blocks.build_parser().parse_args(command[2:])  # blocks.py takes every flag as given
        if row.blocks_of:
            assert parsed.model_config == "flux1-tiny"
            assert parsed.fp8 == row.blocks_of.fp8 and parsed.precomputed_format == "text_states"
            assert parsed.fsdp == ("none" if smoke else row.blocks_of.fsdp) and not parsed.use_ema
            if not smoke:  # the run of its set-up on 8 of these GPUs: its checkpointing and microbatch
                node = gpu_plan.plan_row(row.name, row.blocks_of, 8, gpu_memory_bytes, tmp_path, 1, 0, False, "")
                assert (parsed.activation_checkpointing, parsed.microbatch) == (node.activation_checkpointing,
                                                                                node.microbatch)
                assert parsed.gpus == [8] and parsed.global_batch == row.blocks_of.global_batch
            # Compiled where blocks.py can compile; else eager, and the row says so.
            assert ("--compile" in command) is compiles
            assert notes == ([] if compiles else ["blocks.py has no --compile: timed without it"])
        else:
            assert parsed.compare_results_json == str(tmp_path / "sd2-512-precomputed.json")
            assert (parsed.model_config, parsed.image_size, parsed.microbatch) == ("sd2-base", 512, 32)
            assert parsed.gpus == [1]
            assert parsed.global_batch == 512 and parsed.use_ema and parsed.precomputed and "--compile" not in command
            assert parsed.weight_casts == "step" and not parsed.activation_checkpointing
    # A compiled run is predicted only where blocks.py compiles.
    compiled = {"sdxl-1024-compile": gpu_record.Outcome("sdxl-1024-compile", "run", "", status="ok",
                                                        result={"compile": True})}
    why = gpu_report.cannot_compare(gpu_rows.REPORT_ROWS[-1], compiled)
    assert why == (None if compiles else "blocks.py has no --compile to predict the compiled run sdxl-1024-compile")


def _outcome(name: str, kind: str, result: dict) -> gpu_record.Outcome:
    return gpu_record.Outcome(name, kind, "", status="ok", result=result)


def test_earlier_results_of_the_same_set_up_and_device_give_the_ratio(tmp_path):
    # The project's own results/: benchmark.py JSONs and blocks.py's JSON lines of earlier H100 runs (those of
    # two days: a newer report of the same set-ups, committed later, would be the newest match).
    earlier = [found for found in gpu_record.earlier_results(ROOT / "results", tmp_path)
               if found.path.startswith(("h100-2026-11-25/", "h100-2026-11-26/"))]
    step = json.loads((ROOT / "results/h100-2026-11-26/sd2-pre-step.json").read_text())
    mine = _outcome("sd2-512-precomputed", "run", {**step, "images_per_sec": 2 * step["images_per_sec"],
                                                   "global_batch_size": 256})
    found, ratio = gpu_record.earlier_match(mine, earlier)
    assert found.path == "h100-2026-11-26/sd2-pre-step.json" and ratio == pytest.approx(2.0)
    assert "it had global_batch_size 512" in gpu_record.earlier_cells(mine, earlier)[0]
    # Compiled, it matches the compiled run of 2026-11-25 (which cast its weights per microbatch) and
    # nothing eager; on another device, nothing.
    compiled = _outcome("sd2-512-precomputed-compile", "run", {**step, "compile": True})
    found, ratio = gpu_record.earlier_match(compiled, earlier)
    earlier_compiled = json.loads((ROOT / "results/h100-2026-11-25/sd2-pre-compile.json").read_text())
    assert found.path == "h100-2026-11-25/sd2-pre-compile.json"
    assert ratio == pytest.approx(step["images_per_sec"] / earlier_compiled["images_per_sec"])
    assert "it had global_batch_size 256)" in gpu_record.earlier_cells(compiled, earlier)[0]
    assert gpu_record.earlier_match(_outcome("x", "run", {**step, "device": "NVIDIA A100-SXM4-80GB"}), earlier) is None
    assert gpu_record.earlier_match(_outcome("x", "run", {**step, "device_train_microbatch_size": 64}), earlier) is None
    # blocks.py's SD2 line (blocks2.jsonl) against the same set-up, at the same GPU count.
    line = next(r.result for r in earlier if r.path == "h100-2026-11-26/blocks2.jsonl"
                and r.result["model_config"] == "sd2-base")
    predicted = [{**p, "samples_per_sec_per_gpu": p["samples_per_sec_per_gpu"] / 2} for p in line["predicted"]]
    found, ratio = gpu_record.earlier_match(_outcome("blocks-sd2", "blocks", {**line, "predicted": predicted}), earlier)
    assert found.path == "h100-2026-11-26/blocks2.jsonl" and ratio == pytest.approx(0.5)
    # Flux.1's bf16 blocks: the JSON line at the end of the earlier run's log.
    log = gpu_launch.last_json_line((ROOT / "results/h100-2026-11-26/flux-blocks-bf16.log").read_text())
    found, ratio = gpu_record.earlier_match(_outcome("flux-blocks-bf16", "blocks", log), earlier)
    assert found.path == "h100-2026-11-26/flux-blocks-bf16.log" and ratio == pytest.approx(1.0)
    compiled_blocks = _outcome("flux-blocks-bf16", "blocks", {**log, "compile": True})
    assert gpu_record.earlier_match(compiled_blocks, earlier) is None  # no earlier compiled blocks


@pytest.mark.multirank  # each row is a process of its own (benchmark.py on one rank, then blocks.py)
def test_smoke_two_rows_end_to_end_with_their_files_and_the_earlier_ratio(tmp_path, capsys):
    out, root = tmp_path / "report", tmp_path / "results"
    # Earlier results: the tiny SD2 row's set-up on this CPU at 1 image/s (another global batch), the same on
    # another device and at another microbatch (neither may be used), and a blocks.py line at 2 samples/s.
    setup = {"model_config": "tiny", "image_size": 32, "precomputed": True, "precomputed_format": "tokens",
             "compile": False, "activation_checkpointing": False, "fp8": "off", "use_ema": True, "fsdp": "none",
             "world_size": 1, "device_train_microbatch_size": 2, "device": "cpu", "global_batch_size": 8,
             "weight_casts": "microbatch"}
    (root / "cpu-old").mkdir(parents=True)
    (root / "cpu-old" / "run.json").write_text(json.dumps({**setup, "images_per_sec": 1.0}))
    (root / "cpu-old" / "other.json").write_text(json.dumps({**setup, "images_per_sec": 0.001, "device": H100}))
    (root / "cpu-old" / "mb4.json").write_text(json.dumps({**setup, "images_per_sec": 0.001,
                                                           "device_train_microbatch_size": 4}))
    blocks_line = {"model_config": "tiny", "image_size": 32, "precision": "amp_bf16", "precomputed": True,
                   "precomputed_format": "tokens", "activation_checkpointing": False, "fp8": "off", "use_ema": True,
                   "microbatch": 2, "global_batch": 4, "device": "cpu", "measured": {},
                   "predicted": [{"gpus": 1, "samples_per_sec_per_gpu": 2.0}]}
    (root / "cpu-old" / "blocks.log").write_text("timing...\n" + json.dumps(blocks_line) + "\n")

    outcomes = _run(["--smoke", "--out", str(out), "--budget_s", "3600", "--results_root", str(root),
                     "--rows", "sd2-512-precomputed", "blocks-sd2"])
    printed = capsys.readouterr().out
    run, blocks = outcomes
    assert (run.status, blocks.status) == ("ok", "ok"), (out / "logs" / f"{run.name}.log").read_text()[-3000:]
    for outcome in outcomes:  # progress: each row's start and end, with the time left
        assert f"{outcome.name}: starting, estimated {outcome.estimate_s:.0f} s" in printed
        assert f"{outcome.name}: ok in {outcome.wall_s:.0f} s" in printed
        command = shlex.split((out / "logs" / f"{outcome.name}.log").read_text().splitlines()[0])
        assert str(ROOT / ("benchmark.py" if outcome.kind == "run" else "bench/blocks.py")) in command
    assert run.estimate_s < 3600 and blocks.estimate_s == gpu_budget.FIRST_BLOCKS_SECONDS
    # The training row: benchmark.py's results, the tiny model as --smoke runs it, the memory model's count.
    result = json.loads((out / "sd2-512-precomputed.json").read_text())
    assert (result["model_config"], result["image_size"], result["device_train_microbatch_size"]) == ("tiny", 32, 2)
    assert result["memory_model"]["predicted_bytes_at_microbatch"] > 0 and result["images_per_sec"] > 0
    # blocks.py's prediction of that run, compared with its measurement.
    predicted = json.loads((out / "blocks-sd2.json").read_text())
    assert predicted["comparison"]["measured_images_per_sec_per_device"] == pytest.approx(result["images_per_sec"])
    assert predicted["model_config"] == "tiny" and predicted["microbatch"] == 2
    # The README: both rows with their figures, and the ratio to the earlier result of the same set-up.
    readme = (out / "README.md").read_text()
    run_line = next(line for line in readme.splitlines() if line.startswith("| sd2-512-precomputed |"))
    cells = [cell.strip() for cell in run_line.split("|")[1:-1]]
    assert cells[2] == "ok" and cells[3] == f"{result['images_per_sec']:.1f}"
    # Columns 4 and 5: the prediction made before this measurement and the ratio (none here: no prediction given).
    assert cells[8] == f"{result['memory_model']['predicted_bytes_at_microbatch'] / 2**30:.1f}" and cells[9] == "-"
    assert cells[11] == "1.00 (cpu-old/run.json; it had global_batch_size 8)"
    assert cells[12] == f"{result['images_per_sec'] / 1.0:.2f}"
    blocks_cells = [c.strip() for c in next(line for line in readme.splitlines()
                                            if line.startswith("| blocks-sd2 |")).split("|")[1:-1]]
    mine = predicted["predicted"][0]["samples_per_sec_per_gpu"]
    assert blocks_cells[3] == f"{mine:.2f} on 1 (none)"
    assert blocks_cells[6] == (f"{predicted['comparison']['measured_images_per_sec_per_device']:.2f}, "
                               f"{predicted['comparison']['ratio']:.2f}")
    assert blocks_cells[9] == "2.00 (cpu-old/blocks.log)" and blocks_cells[10] == f"{mine / 2.0:.2f}"
    summary = json.loads((out / "report.json").read_text())
    assert [r["earlier"]["path"] for r in summary["rows"]] == ["cpu-old/run.json", "cpu-old/blocks.log"]
    env = json.loads((out / "environment.json").read_text())
    assert env["device"] == "cpu (--smoke)" and env["versions"]["torch"] == torch.__version__.split("+")[0]
    assert "nvidia_smi" in env and env["load_average"] and env["command"].startswith("python bench/gpu_report.py")
    assert env["gpus"] == 1 and env["date_utc"] and env["versions"]["mosaicml"] == "0.32.1"
    rows = cost.main([str(out / "sd2-512-precomputed.json")])  # cost.py reads a row's JSON as written
    assert rows and rows[0].images_per_sec == pytest.approx(result["images_per_sec"])


def test_rows_are_the_issues_in_priority_order():
    # SD2 precomputed eager then compiled, SDXL 1024, SD2 online, Flux.1's blocks, then the two comparisons.
    kinds = [(row.setting and (row.setting.model_config, row.setting.precomputed, row.setting.compile))
             or (row.blocks_of and (row.blocks_of.model_config, row.blocks_of.fp8)) or row.compare_with
             for row in gpu_rows.REPORT_ROWS]
    assert kinds == [("sd2-base", True, False), ("sd2-base", True, True), ("sdxl-base", True, True),
                     ("sd2-base", False, False), ("flux1-schnell", "off"), ("flux1-schnell", gpu_rows.FLUX_FP8),
                     "sd2-512-precomputed", "sdxl-1024-compile"]
    assert all(row.blocks_of.compile for row in gpu_rows.REPORT_ROWS if row.blocks_of)


def test_smoke_runs_benchmark_py_on_one_rank_and_says_its_compiled_rows_ran_eager(tmp_path):
    row = gpu_rows.REPORT_ROWS[1]  # sd2-512-precomputed-compile
    planned = gpu_plan.plan_row(row.name, row.setting, 1, gpu_report.SMOKE_GPU_MEMORY_BYTES, tmp_path, 3, 1, True, "")
    # benchmark.py itself, with every flag of the row (--compile among them), and no launcher before it; two
    # ranks go through Composer's launcher.
    assert planned.command[:2] == [sys.executable, str(ROOT / "benchmark.py")] and "--compile" in planned.command
    two = gpu_plan.plan_row(row.name, row.setting, 2, gpu_report.SMOKE_GPU_MEMORY_BYTES, tmp_path, 3, 1, True, "")
    assert two.command[:5] == [sys.executable, "-m", "composer.cli.launcher", "-n", "2"]
    assert two.command[5] == str(ROOT / "benchmark.py") and (planned.batch_size, two.batch_size) == (4, 8)
    assert {**_flags(two.command), "--batch_size": "4"} == _flags(planned.command)  # two microbatches per rank
    # The tiny step as it runs here, counted by the memory model (the README's counted column).
    assert planned.plan["microbatch"] == 2 and planned.plan["predicted_bytes_at_microbatch"] > 0
    assert gpu_launch.row_env(row, smoke=True, pretrained=False)["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in gpu_launch.row_env(row, smoke=False, pretrained=False)
    ran = gpu_record.Outcome(row.name, "run", "", status="ok", result={"compile": True, "compile_seconds": 0.0},
                             compiled_ran_eager=True)
    assert gpu_record.compile_cell(ran) == "eager (--smoke)"
    ran.compiled_ran_eager = False
    assert gpu_record.compile_cell(ran) == "0"
    ran.result = {"compile": False, "compile_seconds": 0.0}  # an eager run: nothing compiled, no figure
    assert gpu_record.compile_cell(ran) == "-"


def test_sd2_rows_run_offline_with_random_encoders_unless_the_pretrained_ones_are_here(tmp_path):
    # Only the SD2 rows whose step runs the VAE or the text encoder look for them (--model_name); without them
    # every row runs offline (no rank tries the hub), with random parts, and the README says so.
    online = next(row for row in gpu_rows.MATRIX_ROWS if row.name == "online-bf16")
    states = next(row for row in gpu_rows.MATRIX_ROWS if row.name == "flux-precomputed-states-bf16-fsdp")
    assert online.setting.needs_pretrained and not states.setting.needs_pretrained
    assert not any(row.setting.needs_pretrained for row in gpu_rows.MATRIX_ROWS if row.setting.model_config != "sd2-base")
    assert not gpu_launch.pretrained_available(str(tmp_path / "no-such-model"))
    local = tmp_path / "sd2"  # a local diffusers folder (its configs are what is checked)
    for part in ("vae", "text_encoder"):
        (local / part).mkdir(parents=True)
        (local / part / "config.json").write_text("{}")
    assert gpu_launch.pretrained_available(str(local))
    for row, pretrained in ((online, False), (states, True), (states, False)):
        assert gpu_launch.row_env(row, smoke=False, pretrained=pretrained)["HF_HUB_OFFLINE"] == "1"
    assert gpu_launch.row_env(online, smoke=False, pretrained=True).get("HF_HUB_OFFLINE") == os.environ.get(
        "HF_HUB_OFFLINE")


# -- the matrix: the plan for an 8 x 80 GB node, without a GPU ------------------------------------------------

SD2_ROWS = [name for name, setting in gpu_rows.MATRIX.items() if setting.model_config == "sd2-base"]


def _flags(command: list[str]) -> dict[str, str | bool]:
    """A command's flags and values (True for a switch); a flag given twice keeps its last value, as argparse does."""
    values = [*command[1:], "--"]  # what follows each item
    return {item: True if following.startswith("--") else following
            for item, following in zip(command, values) if item.startswith("--")}


def _check_planned(rows: list[dict], printed: str) -> None:
    """Every row of a dry run on 8 x 79.1 GiB: its global batch (2048; Flux.1: MLPerf's 512), EMA as the row
    says, and the memory model's microbatch for its own settings."""
    for row in rows:
        setting = gpu_rows.MATRIX[row["name"]]
        command = row["command"]
        flag = _flags(command)
        assert command[command.index("-n") + 1] == "8" and flag["--batch_size"] == str(setting.global_batch)
        assert ("--use_ema" in flag) is setting.use_ema
        assert (flag["--model_config"], int(flag["--image_size"])) == (setting.model_config, setting.resolution)
        micro = int(flag["--device_train_microbatch_size"])
        # Checkpointing as benchmark.py resolves the row's flag on this node (auto: the rule's choice).
        options = dict(norm_precision=setting.norm_precision, precomputed=setting.precomputed,
                       precomputed_format=setting.text_format, fsdp=setting.fsdp, num_gpus=8,
                       use_ema=setting.use_ema)
        setup = choose_setup(setting.model_config, setting.resolution, 79.1 * 2**30, setting.global_batch // 8,
                             activation_checkpointing=setting.activation_checkpointing, **options)
        checkpointing = setup.activation_checkpointing
        assert row["activation_checkpointing"] is checkpointing is row["plan"]["activation_checkpointing"]
        assert row["plan"]["activation_checkpointing_reason"] == setup.reason
        # The memory model's largest microbatch for the row's own settings (halved where the row says).
        plan = memory.plan(setting.model_config, setting.resolution, 79.1 * 2**30,
                           per_device_batch=setting.global_batch // 8,
                           activation_checkpointing=setup.activation_checkpointing, **options)
        assert plan["microbatch"] >= 1, row["name"]  # every row fits the GPU
        assert micro == plan["microbatch"] // setting.microbatch_divisor and (setting.global_batch // 8) % micro == 0
        assert memory.predicted_bytes(plan, micro) <= 79.1 * 2**30
        assert flag["--fsdp"] == setting.fsdp  # the run shards as the plan counted
        # The row's flag as the row sets it; a row that leaves it out takes benchmark.py's auto, whose
        # choice with this microbatch (on only when it does not fit without) is the planned one.
        assert flag.get("--activation_checkpointing", "auto") == setting.activation_checkpointing
        if setting.activation_checkpointing == "auto":
            assert choose_setup(setting.model_config, setting.resolution, 79.1 * 2**30, setting.global_batch // 8,
                                microbatch=micro, **options).activation_checkpointing is setup.activation_checkpointing
        assert ("--model_name" in flag) is setting.needs_pretrained
        assert shlex.join(command) in printed  # the full command, as a shell would run it
        assert row["estimated_seconds"] > gpu_budget.FIRST_STARTUP_SECONDS


@pytest.mark.slow
def test_dry_run_plans_every_sd2_row_of_an_8_x_80gb_node_at_batch_2048(tmp_path, capsys):
    out = tmp_path / "matrix"
    rows = gpu_report.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--out", str(out),
                            "--rows", *SD2_ROWS])
    printed = capsys.readouterr().out
    assert not out.exists()  # nothing run, nothing written
    assert [r["name"] for r in rows] == SD2_ROWS
    assert "estimated time: about" in printed
    _check_planned(rows, printed)
    online = {r["name"]: r["microbatch"] for r in rows}
    assert online["online-bf16"] == online["precomputed-bf16"]  # the same UNet activations (no doubling)


@pytest.mark.slow
def test_dry_run_plans_flux_sharded_from_the_memory_model(capsys):
    # Flux.1-schnell's 11.9B parameters only train sharded; checkpointing its blocks fits more images.
    names = ["flux-precomputed-states-bf16-fsdp", "flux-precomputed-states-bf16-fsdp-ckpt",
             "flux-precomputed-states-bf16-fsdp-nockpt"]
    rows = gpu_report.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--rows", *names])
    _check_planned(rows, capsys.readouterr().out)
    default, checkpointed, plain = rows  # in the matrix's order
    assert checkpointed["microbatch"] > plain["microbatch"]
    assert checkpointed["activation_checkpointing"] and not plain["activation_checkpointing"]
    assert plain["microbatch"] == 8 and checkpointed["microbatch"] == 64
    # The default row (docs/flux.md): shard_grad_op with checkpointing, the per-GPU batch (512 / 8) in one
    # microbatch, so each step gathers the weights once and reduce-scatters once.
    assert _flags(default["command"])["--fsdp"] == "shard_grad_op" and default["activation_checkpointing"]
    assert default["microbatch"] == 64 and default["plan"]["fsdp"] == "shard_grad_op"


@pytest.mark.slow
def test_fp8_goes_to_every_training_row_and_into_its_memory_plan(capsys):
    # MLPerf's set-up with float8 on 8 x 80 GB: the command takes --fp8 and --compile, the microbatch is
    # counted with float8.
    name = "flux-precomputed-states-bf16-fsdp-nockpt"
    (row,) = gpu_report.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--rows", name,
                              "--fp8", "tensorwise"])
    assert _flags(row["command"])["--fp8"] == "tensorwise" and row["plan"]["fp8"] == "tensorwise"
    assert "--compile" in row["command"]  # benchmark.py refuses float8 without it
    plain = memory.plan("flux1-schnell", 256, 79.1 * 2**30, precomputed=True, fsdp="full_shard", use_ema=False,
                        per_device_batch=64)
    # Tensorwise keeps each Linear's float8 weight for backward: more bytes per microbatch than bf16.
    assert row["plan"]["activation_bytes_per_microbatch"] > plain["activation_bytes_per_microbatch"]
    assert 1 <= row["microbatch"] <= plain["microbatch"]


def test_every_matrix_row_runs_as_planned_and_smoke_runs_each_familys_tiny_model():
    # Commands are made from the same settings as the plan: check each row's flags without counting.
    for name, setting in gpu_rows.MATRIX.items():
        flag = _flags(["launcher", *setting.flags()])
        assert flag["--fsdp"] == setting.fsdp and flag["--model_config"] == setting.model_config
        assert ("--precomputed_format" in flag) is setting.precomputed
        if setting.precomputed:
            assert flag["--precomputed_format"] == setting.text_format
        # --model_name is SD2's: the rows of other families must need no pretrained part.
        assert setting.model_config == "sd2-base" or not setting.needs_pretrained, name
        smoke = _flags(["launcher", *setting.flags(), *gpu_rows.smoke_flags(setting, gpus=1)])
        assert smoke["--model_config"] == gpu_rows.SMOKE_CONFIGS[setting.model_config]
        assert smoke["--fsdp"] == "none"  # one CPU rank: nothing to shard over


@pytest.mark.multirank
def test_timeout_ends_the_launchers_whole_process_group(tmp_path):
    # A fake launcher that starts a rank, which starts a worker: all sleep and record their pids.
    pids, script = tmp_path / "pids", tmp_path / "spawn.py"
    script.write_text("import os, subprocess, sys, time\n"
                      "open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
                      "if int(sys.argv[2]) > 0:\n"
                      "    subprocess.Popen([sys.executable, __file__, sys.argv[1], str(int(sys.argv[2]) - 1)])\n"
                      "time.sleep(600)\n")
    command = [sys.executable, str(script), str(pids), "2"]
    start = time.monotonic()
    code = gpu_launch.run_command(command, tmp_path / "log.txt", timeout_s=10)  # all three started by then
    assert code == "timeout" and time.monotonic() - start < 60
    recorded = [int(line) for line in pids.read_text().split()]
    assert len(recorded) == 3  # launcher, rank, worker
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in recorded):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in recorded), recorded
    assert "timeout after 10 s" in (tmp_path / "log.txt").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) holds nothing: count it as ended.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.multirank  # two CPU ranks through Composer's launcher
def test_smoke_matrix_row_on_two_ranks_leaves_results_that_cost_reads(tmp_path):
    out = tmp_path / "matrix"
    (outcome,) = _run(["--smoke", "--out", str(out), "--rows", "precomputed-bf16", "--gpus", "2", "--batches", "2",
                       "--warmup_batches", "1", "--budget_s", "3600"])
    log = (out / "logs" / "precomputed-bf16.log").read_text()
    assert outcome.status == "ok", log[-3000:]
    assert shlex.split(log.splitlines()[0])[1:5] == ["-m", "composer.cli.launcher", "-n", "2"]
    result = json.loads((out / "precomputed-bf16.json").read_text())
    assert result["precomputed"] and result["use_ema"] and result["precision"] == "amp_bf16"
    assert result["device_train_microbatch_size"] == 2 and result["world_size"] == 2
    assert result["global_batch_size"] == 8 and result["memory_model"]["microbatch"] == 2
    assert result["mfu_trained_network"] is None and result["flops_per_image_trained_network"] > 0  # no CPU peak
    assert json.loads((out / "environment.json").read_text())["gpus"] == 2
    readme = (out / "README.md").read_text()
    assert readme.startswith("# GPU report: 2 x cpu (--smoke)") and "| precomputed-bf16 |" in readme
    assert f"({result['images_per_sec_per_device']:.1f} per device)" in readme
    rows = cost.main([str(out / "precomputed-bf16.json")])  # cost.py reads a row's JSON as written
    assert rows[0].num_gpus == 2 and rows[0].images_per_sec == pytest.approx(result["images_per_sec"])


def test_a_diverged_row_is_a_failure_never_a_measurement(tmp_path):
    # benchmark.py's record of a run that stopped on a non-finite gradient norm, and an older file whose
    # figures were written with an infinite norm: neither is tabled as images/s.
    stopped = {"diverged": "the gradient norm is inf at batch 3", "diverged_at_batch": 3,
               "diverged_on": "gradient norm", "images_per_sec": None}
    assert gpu_launch.diverged(stopped) == "at batch 3 (gradient norm)"
    assert gpu_launch.diverged({"images_per_sec": 5.0, "grad_norm": float("inf"), "final_loss": 0.5}) == "grad_norm inf"
    assert gpu_launch.diverged({"images_per_sec": 5.0, "grad_norm": 2.0, "final_loss": 0.5}) is None
    # A launch that writes that record and exits 1, as benchmark.py does: the row says diverged, with no result.
    (tmp_path / "logs").mkdir()
    write = f"import json, sys; open({str(tmp_path / 'row.json')!r}, 'w').write(json.dumps({stopped!r})); sys.exit(1)"
    planned = gpu_plan.PlannedRun("row", None, 1, 1, [sys.executable, "-c", write])
    status, result = gpu_launch.run_training(planned, tmp_path, 60.0, dict(os.environ))
    assert status == "diverged: at batch 3 (gradient norm), see logs/row.log" and result is None


def test_an_earlier_result_with_a_rate_no_run_measures_is_no_earlier_figure():
    run = {"model_config": "sd2-base", "device": H100, "world_size": 1}
    assert gpu_record.kind_of({**run, "images_per_sec": 115.1}) == "run"
    for rate in (-5, 5e-324, 1e308, 0):  # once a table cell of -5.00, or a ratio of 0 or inf
        assert gpu_record.kind_of({**run, "images_per_sec": rate}) is None



# -- a GPU that is not here: --device, the predictions (bench/gpu/predict.py) ------------------------------

@pytest.mark.parametrize("device", ["h200", "b200"])
def test_dry_run_of_a_named_gpu_plans_its_memory_and_says_whether_the_budget_holds(device, capsys):
    gpu = devices.get(device)
    (row,) = gpu_report.main(["--dry_run", "--device", device, "--rows", "sd2-512-precomputed"])
    printed = capsys.readouterr().out
    assert f"on 1 {gpu.label} GPU(s) of {gpu.cuda_memory_gib:.1f} GiB" in printed
    assert row["plan"]["gpu_memory_bytes"] == pytest.approx(gpu.cuda_memory_bytes)
    assert row["plan"]["predicted_bytes_at_microbatch"] <= memory.usable_bytes(gpu.cuda_memory_bytes)
    # More memory than an H100's: a microbatch at least as large as the H100's plan, which measured 32.
    h100 = memory.plan("sd2-base", 512, memory.GPU_MEMORY_GIB["H100 80GB"] * memory.GIB, precomputed=True,
                       precomputed_format="tokens", per_device_batch=512, weight_casts="step")
    assert row["microbatch"] >= min(h100["microbatch"], 512) >= 32
    assert "--budget_s 480: every row fits" in printed  # one row: its estimate is well under eight minutes
    assert row["estimated_seconds"] < 480


@pytest.mark.slow
def test_predictions_of_a_gpu_not_here_rest_on_the_h100s_measurement_and_reproduce_it_on_an_h100(tmp_path, capsys):
    written = tmp_path / "h200.json"
    gpu_report.main(["--dry_run", "--device", "h200", "--rows", "sd2-512-precomputed", "--predictions", str(written)])
    printed = capsys.readouterr().out
    saved = json.loads(written.read_text())
    assert saved["device"] == "h200" and saved["never_measured_here"]
    h200 = saved["rows"]["sd2-512-precomputed"]
    basis = json.loads((ROOT / gpu_predict.BASES["sd2-512-precomputed"].path).read_text())
    assert h200["rests_on"]["measured"] == gpu_predict.BASES["sd2-512-precomputed"].path
    assert h200["rests_on"]["measured_images_per_sec"] == basis["images_per_sec"]
    assert h200["rests_on"]["flops_per_image"] > 1e12 and h200["rests_on"]["bytes_per_image"] > 1e9
    # The H200 has the H100's FLOP/s and 1.43x its bandwidth: faster, by less than the bandwidth and the
    # launches it saves at its larger microbatch together.
    assert basis["images_per_sec"] < h200["images_per_sec"] < basis["images_per_sec"] * 4.8 / 3.35 * 1.2
    assert f"predicted {h200['images_per_sec']:.1f} images/s" in printed
    # The rule on the H100 itself, at the measured set-up, gives back the measurement.
    run = gpu_plan.plan_row("sd2-512-precomputed", gpu_rows.REPORT_ROWS[0].setting, 1,
                            memory.GPU_MEMORY_GIB["H100 80GB"] * memory.GIB, tmp_path, 5, 2, False, "none",
                            devices.reference())
    assert run.microbatch == basis["device_train_microbatch_size"]
    again = gpu_predict.training_prediction("sd2-512-precomputed", run, devices.reference())
    assert again["images_per_sec"] == pytest.approx(basis["images_per_sec"])
    # On the H200 itself the report reads the predictions back: beside the measurement, and their ratio.
    predicted = gpu_predict.read_predictions(written, devices.get("h200"), tmp_path)
    result = {**basis, "device": "NVIDIA H200", "images_per_sec": 150.0, "images_per_sec_per_device": 150.0}
    outcome = gpu_record.Outcome("sd2-512-precomputed", "run", "SD2", status="ok", result=result)
    (line,) = gpu_record.run_table([outcome], [], predicted)[2:]
    assert f"| 150.0 | {h200['images_per_sec']:.1f} | {150.0 / h200['images_per_sec']:.2f} |" in line


def test_predictions_need_a_named_gpu_and_device_must_be_the_visible_one(tmp_path):
    message = error_of(gpu_report.main, ["--dry_run", "--gpu_memory_gib", "139.8", "--predictions",
                                         str(tmp_path / "p.json")], prog="gpu_report.py")
    assert "--predictions with --dry_run predicts a GPU of t2ibench.core.devices' table: give --device NAME" in message
    message = error_of(gpu_report.main, ["--dry_run", "--device", "h300"], prog="gpu_report.py")
    assert "--device" in message and "invalid choice: 'h300'" in message
