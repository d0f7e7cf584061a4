"""bench/gpu_report.py without a GPU: bad input refused before any row, the budget rule (a row the time
left cannot hold is not started), the rows' blocks.py commands as blocks.py parses them, the match with
earlier results of the same set-up and device (the project's own results/), and a --smoke run of two rows
end to end with the files it writes."""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

import gpu_report
from tests.helpers import ROOT, error_of

H100 = "NVIDIA H100 80GB HBM3"


def _run(argv: list[str]) -> list[gpu_report.Outcome]:
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
def test_without_a_gpu_it_refuses_unless_smoke(tmp_path):
    message = error_of(gpu_report.main, ["--out", str(tmp_path / "report")], prog="gpu_report.py")
    assert "no CUDA GPU visible" in message and "--smoke" in message and not (tmp_path / "report").exists()


def test_a_budget_that_holds_no_row_starts_none_and_still_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    outcomes = _run(["--smoke", "--out", str(out), "--budget_s", "5"])
    printed = capsys.readouterr().out
    assert [o.name for o in outcomes] == gpu_report.ROW_NAMES  # every row, highest first
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


def test_the_budget_rule_learns_from_the_rows_before():
    estimator = gpu_report.Estimator(first_flops_per_second=1e12)
    # --smoke's set-ups resolve checkpointing as their CPU run does (`auto`: off); left to `auto` (a GPU's
    # rows), checkpointing is counted on: the longer estimate.
    assert gpu_report.run_setting(gpu_report.ROWS[0], smoke=True).activation_checkpointing == "off"
    eager = dataclasses.replace(gpu_report.run_setting(gpu_report.ROWS[0], smoke=True), activation_checkpointing="auto")
    compiled = gpu_report.run_setting(gpu_report.ROWS[1], smoke=True)
    flops = gpu_report.flops_of(eager, True)
    batches = 3
    # Before any row: the first estimates, the batches at the first FLOP/s.
    assert estimator.run_seconds(eager, batches) == pytest.approx(
        gpu_report.FIRST_STARTUP_SECONDS + batches * eager.global_batch * flops / 1e12)
    assert estimator.fixed_seconds(compiled) == gpu_report.FIRST_STARTUP_SECONDS + gpu_report.FIRST_COMPILE_SECONDS
    assert estimator.blocks_seconds() == gpu_report.FIRST_BLOCKS_SECONDS
    # An eager row of 40 s whose measured batches took 2 s each at 8 images/s: 34 s of start-up.
    # It ran without checkpointing: its FLOP/s are 8 images/s times the plain step's FLOPs.
    estimator.observe_run(eager, batches, 40.0, {"measured_seconds": 4.0, "measured_batches": 2, "images_per_sec": 8.0,
                                                 "activation_checkpointing": False})
    seconds_per_batch = eager.global_batch * flops / (8 * gpu_report.flops_of(eager, False))
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
    assert gpu_report.row_timeout(100, 1000) == 200 and gpu_report.row_timeout(20, 1000) == 80
    assert gpu_report.row_timeout(100, 150) == 150


@pytest.mark.parametrize("smoke", [False, True])
def test_blocks_rows_are_commands_blocks_py_accepts(tmp_path, smoke):
    import argparse
    import dataclasses

    import blocks
    import bench_gpu

    args = argparse.Namespace(out=tmp_path, smoke=smoke, model_name=bench_gpu.DEFAULT_MODEL_NAME)
    gpu_memory_bytes = 79.1 * 2**30  # an H100's, as torch reports it
    measured = {"sd2-512-precomputed": gpu_report.Outcome("sd2-512-precomputed", "run", "", status="ok", result={
        "model_config": "sd2-base", "image_size": 512, "precomputed": True, "precomputed_format": "tokens",
        "global_batch_size": 512, "device_train_microbatch_size": 32, "world_size": 1, "use_ema": True,
        "compile": False, "fsdp": "none", "weight_casts": "step", "norm_precision": "autocast",
        "activation_checkpointing": False})}
    rows = [row for row in gpu_report.ROWS if row.blocks_of or row.compare_with in measured]
    if not smoke:  # Flux.1-schnell's node planned on the meta device takes minutes here: its tiny model's
        rows = [dataclasses.replace(row, blocks_of=dataclasses.replace(row.blocks_of, model_config="flux1-tiny",
                                                                       image_size=32))
                if row.blocks_of else row for row in rows]
    compiles = "--compile" in gpu_report.blocks_options()
    for row in rows:
        command, notes = gpu_report.blocks_command(row, measured, args, gpu_memory_bytes)
        assert command[1] == str(ROOT / "bench" / "blocks.py") and command[-1] == "--json"
        parsed = blocks.build_parser().parse_args(command[2:])  # blocks.py takes every flag as given
        if row.blocks_of:
            assert parsed.model_config == "flux1-tiny"
            assert parsed.fp8 == row.blocks_of.fp8 and parsed.precomputed_format == "text_states"
            assert parsed.fsdp == ("none" if smoke else row.blocks_of.fsdp) and not parsed.use_ema
            if not smoke:  # the run bench_gpu.py launches on 8 of these GPUs: its checkpointing and microbatch
                node = bench_gpu.plan_row(row.name, row.blocks_of, 8, gpu_memory_bytes, tmp_path, 1, 0, False, "")
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
    compiled = {"sdxl-1024-compile": gpu_report.Outcome("sdxl-1024-compile", "run", "", status="ok",
                                                        result={"compile": True})}
    why = gpu_report.cannot_compare(gpu_report.ROWS[-1], compiled)
    assert why == (None if compiles else "blocks.py has no --compile to predict the compiled run sdxl-1024-compile")


def _outcome(name: str, kind: str, result: dict) -> gpu_report.Outcome:
    return gpu_report.Outcome(name, kind, "", status="ok", result=result)


def test_earlier_results_of_the_same_set_up_and_device_give_the_ratio(tmp_path):
    # The project's own results/: benchmark.py JSONs and blocks.py's JSON lines of earlier H100 runs.
    earlier = gpu_report.earlier_results(ROOT / "results", tmp_path)
    step = json.loads((ROOT / "results/h100-2026-11-26/sd2-pre-step.json").read_text())
    mine = _outcome("sd2-512-precomputed", "run", {**step, "images_per_sec": 2 * step["images_per_sec"],
                                                   "global_batch_size": 256})
    found, ratio = gpu_report.earlier_match(mine, earlier)
    assert found.path == "h100-2026-11-26/sd2-pre-step.json" and ratio == pytest.approx(2.0)
    assert "it had global_batch_size 512" in gpu_report.earlier_cells(mine, earlier)[0]
    # Compiled, it matches the compiled run of 2026-11-25 (which cast its weights per microbatch) and
    # nothing eager; on another device, nothing.
    compiled = _outcome("sd2-512-precomputed-compile", "run", {**step, "compile": True})
    found, ratio = gpu_report.earlier_match(compiled, earlier)
    earlier_compiled = json.loads((ROOT / "results/h100-2026-11-25/sd2-pre-compile.json").read_text())
    assert found.path == "h100-2026-11-25/sd2-pre-compile.json"
    assert ratio == pytest.approx(step["images_per_sec"] / earlier_compiled["images_per_sec"])
    assert "it had global_batch_size 256)" in gpu_report.earlier_cells(compiled, earlier)[0]
    assert gpu_report.earlier_match(_outcome("x", "run", {**step, "device": "NVIDIA A100-SXM4-80GB"}), earlier) is None
    assert gpu_report.earlier_match(_outcome("x", "run", {**step, "device_train_microbatch_size": 64}), earlier) is None
    # blocks.py's SD2 line (blocks2.jsonl) against the same set-up, at the same GPU count.
    line = next(r.result for r in earlier if r.path == "h100-2026-11-26/blocks2.jsonl"
                and r.result["model_config"] == "sd2-base")
    predicted = [{**p, "samples_per_sec_per_gpu": p["samples_per_sec_per_gpu"] / 2} for p in line["predicted"]]
    found, ratio = gpu_report.earlier_match(_outcome("blocks-sd2", "blocks", {**line, "predicted": predicted}), earlier)
    assert found.path == "h100-2026-11-26/blocks2.jsonl" and ratio == pytest.approx(0.5)
    # Flux.1's bf16 blocks: the JSON line at the end of the earlier run's log.
    log = gpu_report.last_json_line((ROOT / "results/h100-2026-11-26/flux-blocks-bf16.log").read_text())
    found, ratio = gpu_report.earlier_match(_outcome("flux-blocks-bf16", "blocks", log), earlier)
    assert found.path == "h100-2026-11-26/flux-blocks-bf16.log" and ratio == pytest.approx(1.0)
    compiled_blocks = _outcome("flux-blocks-bf16", "blocks", {**log, "compile": True})
    assert gpu_report.earlier_match(compiled_blocks, earlier) is None  # no earlier compiled blocks


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
    assert run.estimate_s < 3600 and blocks.estimate_s == gpu_report.FIRST_BLOCKS_SECONDS
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
    assert cells[6] == f"{result['memory_model']['predicted_bytes_at_microbatch'] / 2**30:.1f}" and cells[7] == "-"
    assert cells[9] == "1.00 (cpu-old/run.json; it had global_batch_size 8)"
    assert cells[10] == f"{result['images_per_sec'] / 1.0:.2f}"
    blocks_cells = [c.strip() for c in next(line for line in readme.splitlines()
                                            if line.startswith("| blocks-sd2 |")).split("|")[1:-1]]
    mine = predicted["predicted"][0]["samples_per_sec_per_gpu"]
    assert blocks_cells[3] == f"{mine:.2f} on 1 (none)"
    assert blocks_cells[4] == (f"{predicted['comparison']['measured_images_per_sec_per_device']:.2f}, "
                               f"{predicted['comparison']['ratio']:.2f}")
    assert blocks_cells[7] == "2.00 (cpu-old/blocks.log)" and blocks_cells[8] == f"{mine / 2.0:.2f}"
    summary = json.loads((out / "report.json").read_text())
    assert [r["earlier"]["path"] for r in summary["rows"]] == ["cpu-old/run.json", "cpu-old/blocks.log"]
    env = json.loads((out / "environment.json").read_text())
    assert env["device"] == "cpu (--smoke)" and env["versions"]["torch"] == torch.__version__.split("+")[0]
    assert "nvidia_smi" in env and env["load_average"] and env["command"].startswith("python bench/gpu_report.py")


def test_rows_are_the_issues_in_priority_order():
    # SD2 precomputed eager then compiled, SDXL 1024, SD2 online, Flux.1's blocks, then the two comparisons.
    kinds = [(row.setting and (row.setting.model_config, row.setting.precomputed, row.setting.compile))
             or (row.blocks_of and (row.blocks_of.model_config, row.blocks_of.fp8)) or row.compare_with
             for row in gpu_report.ROWS]
    assert kinds == [("sd2-base", True, False), ("sd2-base", True, True), ("sdxl-base", True, True),
                     ("sd2-base", False, False), ("flux1-schnell", "off"), ("flux1-schnell", gpu_report.FLUX_FP8),
                     "sd2-512-precomputed", "sdxl-1024-compile"]
    assert all(row.blocks_of.compile for row in gpu_report.ROWS if row.blocks_of)


def test_smoke_runs_benchmark_py_on_one_rank_and_says_its_compiled_rows_ran_eager(tmp_path):
    import bench_gpu

    row = gpu_report.ROWS[1]  # sd2-512-precomputed-compile
    planned = bench_gpu.plan_row(row.name, row.setting, 1, gpu_report.SMOKE_GPU_MEMORY_BYTES, tmp_path, 3, 1, True, "")
    command = gpu_report.one_rank(planned.command)
    # benchmark.py itself, with every flag of the launch (--compile among them), and no launcher before it.
    assert command[:2] == [planned.command[0], str(ROOT / "benchmark.py")] and "--compile" in command
    assert command[2:] == planned.command[planned.command.index(str(ROOT / "benchmark.py")) + 1:]
    assert gpu_report.row_env(row, smoke=True, pretrained=False)["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in gpu_report.row_env(row, smoke=False, pretrained=False)
    ran = gpu_report.Outcome(row.name, "run", "", status="ok", result={"compile": True, "compile_seconds": 0.0},
                             compiled_ran_eager=True)
    assert gpu_report.compile_cell(ran) == "eager (--smoke)"
    ran.compiled_ran_eager = False
    assert gpu_report.compile_cell(ran) == "0"
    ran.result = {"compile": False, "compile_seconds": 0.0}  # an eager run: nothing compiled, no figure
    assert gpu_report.compile_cell(ran) == "-"
