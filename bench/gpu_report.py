"""The GPU driver: within a time budget, on the visible GPU (or a node of them), the rows that matter most,
highest first, or any rows of the GPU matrix, the whole matrix included, each in a process of its own; it
writes each row's results and log, the environment and a README.md table beside the earlier results of
the same device under results/.

    python bench/gpu_report.py --out results/h100-$(date +%F)     # ten minutes of one GPU: 8 of them spent
    python bench/gpu_report.py --out /tmp/report --budget_s 1800    # every row of the report
    python bench/gpu_report.py --out /tmp/report --rows flux-blocks-bf16 flux-blocks-fp8
    python bench/gpu_report.py --out /tmp/report --smoke            # no GPU: the tiny models on CPU
    python bench/gpu_report.py --out gpu-results --rows matrix --gpus 8 --budget_s 36000   # the matrix on a node
    python bench/gpu_report.py --dry_run --rows matrix --gpus 8 --gpu_memory_gib 79.1   # plan a node you are not on
    python bench/gpu_report.py --dry_run --device h200 --predictions h200.json  # plan and predict a GPU not here

Its parts, one job each: gpu/rows.py (the rows), gpu/plan.py (each row's command for the node),
gpu/budget.py (the budget rule), gpu/launch.py (running a row), gpu/record.py (the environment, earlier
results, README.md), gpu/predict.py (each row predicted from the H100's measurements). The rows, the budget
rule and the files: docs/gpu-runs.md, "Ten minutes of a GPU", "The GPU matrix" and "Devices".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project root
sys.path.insert(0, str(ROOT))

from gpu.budget import ASSUMED_MFU, CPU_FIRST_FLOPS_PER_SECOND, UNKNOWN_GPU_PEAK_TFLOPS, Estimator, row_timeout
from gpu.launch import pretrained_available, row_env, run_blocks, run_training  # noqa: E402
from gpu.plan import blocks_command, blocks_options, plan_row, run_setting  # noqa: E402
from gpu.predict import predict_rows, read_predictions  # noqa: E402
from gpu.record import Outcome, earlier_results, environment, write_readme  # noqa: E402
from gpu.rows import DEFAULT_MODEL_NAME, ROW_GROUPS, ROW_NAMES, ROWS, ReportRow  # noqa: E402
from t2ibench.core import devices, errors, files  # noqa: E402
from t2ibench.core.cli import (BUDGET_SECONDS, GPU_COUNT, GPU_MEMORY_GIB, NON_NEGATIVE_INT, POSITIVE_FLOAT,  # noqa: E402
                          POSITIVE_INT, Parser)
from t2ibench.core.errors import fail  # noqa: E402
from t2ibench.train.fp8 import FP8_MODES, MIN_CAPABILITY  # noqa: E402
from t2ibench.core.locations import check_output  # noqa: E402

DEFAULT_BUDGET_SECONDS = 480.0  # 8 of the ten minutes a GPU is often lent for: its start-up and the copy back
# Each training row: 5 batches, the first 2 left out of the measurement (compilation happens in the first);
# --smoke: fewer.
BATCHES, WARMUP_BATCHES = 5, 2
SMOKE_BATCHES, SMOKE_WARMUP_BATCHES = 3, 1
SMOKE_GPU_MEMORY_BYTES = 80 * 2**30  # the count's nominal device (a CPU has none); its microbatch is --smoke's
DRY_RUN_OUT = Path("gpu-report")  # where a dry run's commands would write, without --out


def build_parser() -> Parser:
    p = Parser("gpu_report.py", description=__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="a new or empty folder for the report (results/<device>-<date> to commit it); not needed "
                        "with --dry_run")
    p.add_argument("--budget_s", type=BUDGET_SECONDS,
                   default=DEFAULT_BUDGET_SECONDS, help="seconds for all rows; a row that the time left cannot "
                   "hold is not started")
    p.add_argument("--rows", nargs="+", choices=[*ROW_GROUPS, *ROW_NAMES], default=None, metavar="ROW",
                   help="run only these rows, in the report's order: rows by name (the report's "
                        f"{', '.join(ROW_GROUPS['report'])}; the matrix's {', '.join(ROW_GROUPS['matrix'])}), "
                        "or report (the default: the report's rows, highest first), matrix (the whole matrix), all")
    p.add_argument("--gpus", type=GPU_COUNT, default=1,
                   help="GPUs each training row runs on, through Composer's launcher (a blocks row times one); "
                        "with --smoke, CPU ranks")
    p.add_argument("--gpu_memory_gib", type=GPU_MEMORY_GIB, default=None,
                   help="memory of one GPU in GiB for the microbatches (default: the visible GPU's, as torch reports "
                        "it; an 80 GB A100/H100 reports 79.1)")
    p.add_argument("--device", default=None, choices=devices.DEVICE_CHOICES,
                   help="the GPU (t2ibench.core.devices' table): with --dry_run, the GPU to plan and predict, not here; "
                        "otherwise the visible GPU's must be it (default: the visible GPU, recognised by name, its "
                        "memory read from CUDA)")
    p.add_argument("--predictions", type=Path, default=None,
                   help="with --dry_run: write each row's prediction from the H100's measurements here (JSON); "
                        "otherwise: the predictions to put beside each measurement (default: the newest "
                        "results/predicted-*/<device>.json of this GPU, if any)")
    p.add_argument("--peak_tflops", type=POSITIVE_FLOAT, default=None,
                   help="peak bf16 TFLOP/s of one GPU for the first estimates (default: --device's or the visible "
                        f"GPU's in t2ibench.core.devices, else {UNKNOWN_GPU_PEAK_TFLOPS:g})")
    p.add_argument("--batches", type=POSITIVE_INT, default=None,
                   help=f"batches of each training row, warm-up included (default: {BATCHES}; --smoke {SMOKE_BATCHES})")
    p.add_argument("--warmup_batches", type=NON_NEGATIVE_INT, default=None,
                   help=f"batches left out of the measurement (default: {WARMUP_BATCHES}; --smoke "
                        f"{SMOKE_WARMUP_BATCHES})")
    p.add_argument("--fp8", default="off", choices=FP8_MODES,
                   help="float8 training of the denoiser's Linear layers in every training row, compiled "
                        "(benchmark.py's --fp8 --compile; needs compute capability 8.9: Ada, Hopper, Blackwell)")
    p.add_argument("--dry_run", action="store_true",
                   help="print each row's plan, command and estimate, and the total; run nothing (without a GPU, "
                        "give --gpu_memory_gib: the node to plan)")
    p.add_argument("--results_root", type=Path, default=ROOT / "results",
                   help="earlier results (benchmark.py and blocks.py JSON, anywhere below it) to compare with; "
                   "default: the project's results/")
    p.add_argument("--model_name", default=DEFAULT_MODEL_NAME,
                   help="SD2's pretrained VAE and text encoder, a local folder or a cached hub id; where neither, "
                        "the SD2 rows run random ones offline (throughput does not depend on the weights)")
    p.add_argument("--smoke", action="store_true",
                   help="check the tool without a GPU: the same rows on the tiny models, on CPU, compiled rows "
                        "eager (figures mean nothing)")
    return p


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """Every refusal before any row runs; the rows chosen, in the report's order, and the batches resolved."""
    out = parsed.out
    if out is None and not parsed.dry_run:
        fail("--out is required (a new or empty folder for the report), unless --dry_run")
    if out is not None:
        problem = check_output("--out", str(out), folder=True)
        if problem:
            fail(problem)
        if out.is_dir() and any(out.iterdir()):
            fail(f"--out {out} is not empty: give the report a new folder (it never mixes with what is there)")
    if not parsed.results_root.is_dir():
        fail(f"--results_root {parsed.results_root} is not a folder: name the folder of earlier results")
    chosen = {name for given in parsed.rows or ["report"] for name in ROW_GROUPS.get(given, [given])}
    rows = [row for row in ROWS if row.name in chosen]
    for row in rows:
        if row.compare_with and row.compare_with not in chosen:
            fail(f"--rows {row.name} compares blocks.py with the run of row {row.compare_with}: add it to --rows")
    batches = parsed.batches or (SMOKE_BATCHES if parsed.smoke else BATCHES)
    warmup = parsed.warmup_batches if parsed.warmup_batches is not None else (
        SMOKE_WARMUP_BATCHES if parsed.smoke else WARMUP_BATCHES)
    if batches <= warmup:
        fail(f"--batches {batches} must exceed --warmup_batches {warmup}: a row measures the batches after its "
             "warm-up")
    import torch

    visible = torch.cuda.device_count()
    on_cpu = parsed.smoke or parsed.dry_run  # runs nothing on a GPU
    if not on_cpu and visible == 0:
        fail("no CUDA GPU visible (torch.cuda.device_count() is 0): run it on a GPU, plan a node with --dry_run "
             "--gpus N --device NAME (or --gpu_memory_gib M), or pass --smoke to check the tool on CPU")
    if parsed.dry_run and not parsed.smoke and visible == 0 and parsed.gpu_memory_gib is None and not parsed.device:
        fail("--dry_run without a visible GPU needs --device NAME or --gpu_memory_gib (the node's GPUs to plan for)")
    gpu_device = None if parsed.smoke else devices.named_or_visible(parsed.device) if (
        parsed.device or visible) else None
    if parsed.device and not on_cpu and devices.visible().key != parsed.device:
        fail(f"--device {parsed.device}: the visible GPU is {torch.cuda.get_device_name(0)}; plan another GPU with "
             "--dry_run, or drop --device")
    if parsed.predictions is not None and not parsed.dry_run and not parsed.predictions.is_file():
        fail(f"--predictions {parsed.predictions} is not a file: name a predictions.json a dry run wrote")
    if parsed.predictions is not None and parsed.dry_run:
        problem = check_output("--predictions", str(parsed.predictions), folder=False)
        if problem:
            fail(problem)
        if gpu_device is None or not gpu_device.bf16_flops_per_sec:
            fail("--predictions with --dry_run predicts a GPU of t2ibench.core.devices' table: give --device NAME")
    if not on_cpu and parsed.gpus > visible:
        fail(f"--gpus {parsed.gpus}: only {visible} GPU(s) visible")
    if parsed.fp8 != "off" and not on_cpu and torch.cuda.get_device_capability() < MIN_CAPABILITY:
        fail(f"--fp8 {parsed.fp8}: {torch.cuda.get_device_name()} has no float8 tensor cores (compute capability "
             f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} and up: Ada, Hopper, Blackwell); drop --fp8")
    if parsed.fp8 != "off":  # float8 runs compiled: benchmark.py refuses it eager, slower than bf16
        rows = [dataclasses.replace(row, setting=dataclasses.replace(row.setting, fp8=parsed.fp8, compile=True))
                if row.setting else row for row in rows]
    # The predictions made for this GPU before: beside each measurement, and the estimates' rate. A dry run's
    # --predictions is what it writes: it reads the committed ones. They are bf16's: none for --fp8's rows.
    predicted = {} if parsed.smoke or parsed.fp8 != "off" else read_predictions(
        None if parsed.dry_run else parsed.predictions, gpu_device, ROOT / "results")
    # Absolute: the rows run from the project root, and write there.
    return argparse.Namespace(**{**vars(parsed), "out": (out or DRY_RUN_OUT).absolute(), "batches": batches,
                                 "warmup_batches": warmup}, report_rows=rows, gpu_device=gpu_device,
                              predicted=predicted)


def node_memory_bytes(args: argparse.Namespace) -> float:
    """The memory of one of the node's GPUs the microbatches are planned for."""
    if args.gpu_memory_gib is not None:
        return args.gpu_memory_gib * 2**30
    if args.smoke:
        return SMOKE_GPU_MEMORY_BYTES
    return args.gpu_device.cuda_memory_bytes  # --device's (the table's), or the visible GPU's as CUDA reports it


def first_estimator(args: argparse.Namespace) -> Estimator:
    """The budget rule before any row ran: its first FLOP/s, of all the row's GPUs together."""
    if args.smoke:
        return Estimator(CPU_FIRST_FLOPS_PER_SECOND)
    known = args.gpu_device.bf16_flops_per_sec / 1e12 if args.gpu_device and args.gpu_device.bf16_flops_per_sec \
        else None
    peak = args.peak_tflops or known or UNKNOWN_GPU_PEAK_TFLOPS
    return Estimator(ASSUMED_MFU * peak * 1e12 * args.gpus)


def estimate(row: ReportRow, estimator: Estimator, args: argparse.Namespace, left_s: float) -> float:
    """The row's seconds by the budget rule; a training row whose start-up and compilation alone exceed
    the time left is refused without counting its FLOPs (seconds of meta-device work for a large model)."""
    if not row.setting:
        return estimator.blocks_seconds()
    setting = run_setting(row, args.smoke, args.gpus)
    fixed = estimator.fixed_seconds(setting)
    if fixed > left_s:
        return fixed
    # A row predicted for this GPU (bench/gpu/predict.py, one GPU's images/s) runs its batches at its prediction,
    # closer than the first FLOP/s (an SD2 guess for every model); on several GPUs, the budget rule's own rate.
    ahead = args.predicted.get(row.name, {}).get("images_per_sec") if args.gpus == 1 else None
    if ahead:
        return fixed + args.batches * setting.global_batch / ahead
    return estimator.run_seconds(setting, args.batches)


# -- the report ----------------------------------------------------------------------------------------

def report(args: argparse.Namespace, argv: list[str]) -> list[Outcome]:
    start = time.monotonic()
    deadline = start + args.budget_s
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    pretrained = not args.smoke and (not any(row.setting and row.setting.needs_pretrained for row in args.report_rows)
                                     or pretrained_available(args.model_name))
    info = environment(args, argv, pretrained)
    files.write_text(out / "environment.json", json.dumps(info, indent=2) + "\n")
    earlier = earlier_results(args.results_root, out)
    gpu_memory_bytes = node_memory_bytes(args)
    estimator = first_estimator(args)
    predicted = args.predicted
    print(f"gpu_report.py: {len(args.report_rows)} rows on {args.gpus} x {info['device']} within "
          f"{args.budget_s:.0f} s" + ("" if pretrained or args.smoke else
                                      f"; SD2's encoders random (--model_name {args.model_name} is neither a local "
                                      "folder nor cached)"), flush=True)
    outcomes: dict[str, Outcome] = {}
    for number, row in enumerate(args.report_rows, 1):
        outcome = outcomes[row.name] = Outcome(row.name, "run" if row.setting else "blocks", row.what)
        tag = f"[{number}/{len(args.report_rows)}] {row.name}"
        why_not = cannot_compare(row, outcomes)
        if why_not:
            outcome.status = f"skipped: {why_not}"
            print(f"{tag}: {outcome.status}", flush=True)
            continue
        left = deadline - time.monotonic()
        outcome.estimate_s = estimate(row, estimator, args, left)
        if outcome.estimate_s > left:
            outcome.status = f"skipped: estimated {outcome.estimate_s:.0f} s, {max(0.0, left):.0f} s left"
            print(f"{tag}: {outcome.status}", flush=True)
            write_readme(args, info, list(outcomes.values()), earlier, time.monotonic() - start, predicted)
            continue
        outcome.timeout_s = row_timeout(outcome.estimate_s, left)
        print(f"{tag}: starting, estimated {outcome.estimate_s:.0f} s (timeout {outcome.timeout_s:.0f} s), "
              f"{left:.0f} s of {args.budget_s:.0f} left", flush=True)
        began = time.monotonic()
        env = row_env(row, args.smoke, pretrained)
        # Planning on the meta device (a training row's microbatch, a blocks row's node) is part of the row's time.
        if row.setting:
            planned = plan_row(row.name, row.setting, args.gpus, gpu_memory_bytes, out, args.batches,
                               args.warmup_batches, args.smoke, args.model_name, args.gpu_device)
            left_of_row = max(1.0, began + outcome.timeout_s - time.monotonic())
            outcome.status, outcome.result = run_training(planned, out, left_of_row, env)
            outcome.wall_s = time.monotonic() - began
            if outcome.ok:
                estimator.observe_run(run_setting(row, args.smoke, args.gpus), args.batches, outcome.wall_s,
                                      outcome.result)
        else:
            measured = outcomes[row.compare_with].result if row.compare_with else None
            command, outcome.notes = blocks_command(row, args, gpu_memory_bytes, measured)
            left_of_row = max(1.0, began + outcome.timeout_s - time.monotonic())
            outcome.status, outcome.result = run_blocks(row, command, out, left_of_row, env)
            outcome.wall_s = time.monotonic() - began
            if outcome.ok:
                estimator.observe_blocks(outcome.wall_s)
        if args.smoke and compiles(row, outcomes):
            outcome.compiled_ran_eager = True
            outcome.notes.append("--smoke: ran eager (TORCH_COMPILE_DISABLE=1)")
        figure = headline(outcome)
        print(f"{tag}: {outcome.status} in {outcome.wall_s:.0f} s{f', {figure}' if figure else ''}; "
              f"{max(0.0, deadline - time.monotonic()):.0f} s left", flush=True)
        write_readme(args, info, list(outcomes.values()), earlier, time.monotonic() - start, predicted)
    text = write_readme(args, info, list(outcomes.values()), earlier, time.monotonic() - start, predicted)
    print("\n" + text, flush=True)
    return list(outcomes.values())


def cannot_compare(row: ReportRow, outcomes: dict[str, Outcome]) -> str | None:
    """Why a comparison row cannot run (its measured run failed or was skipped, or was compiled and
    blocks.py cannot compile), or None."""
    if not row.compare_with:
        return None
    needed = outcomes[row.compare_with]
    if not needed.ok:
        return f"needs {row.compare_with}'s results ({needed.status.split(',')[0]})"
    if needed.result.get("compile") and "--compile" not in blocks_options():
        return f"blocks.py has no --compile to predict the compiled run {row.compare_with}"
    return None


def compiles(row: ReportRow, outcomes: dict[str, Outcome]) -> bool:
    """Whether the row's set-up is compiled (a comparison row's: its measured run's)."""
    if row.setting or row.blocks_of:
        return (row.setting or row.blocks_of).compile
    return bool(outcomes[row.compare_with].result.get("compile"))


def headline(outcome: Outcome) -> str:
    """The row's figure in a few words, for the progress line."""
    result = outcome.result
    if not outcome.ok or result is None:
        return ""
    if outcome.kind == "run":
        return f"{result['images_per_sec']:.1f} images/s"
    first = result["predicted"][0]
    return f"{first['samples_per_sec_per_gpu']:.2f} samples/s per GPU predicted for {first['gpus']}"


# -- the dry run ---------------------------------------------------------------------------------------

def dry_run(args: argparse.Namespace) -> list[dict]:
    """Each row's plan for the node (a training row's microbatch, checkpointing and why, predicted memory; a
    blocks row's command) and its estimate by the budget rule's first estimates, printed; nothing runs."""
    gpu_memory_bytes = node_memory_bytes(args)
    estimator = first_estimator(args)
    named = f" {args.gpu_device.label}" if args.gpu_device else ""
    print(f"{len(args.report_rows)} rows on {args.gpus}{named} GPU(s) of {gpu_memory_bytes / 2**30:.1f} GiB, "
          f"{args.batches} batches per training row ({args.warmup_batches} warm-up), each at its global batch by "
          "gradient accumulation; nothing runs (--dry_run)", flush=True)
    planned = []
    for row in args.report_rows:
        seconds = estimate(row, estimator, args, math.inf)
        if row.setting:
            run = plan_row(row.name, row.setting, args.gpus, gpu_memory_bytes, args.out, args.batches,
                           args.warmup_batches, args.smoke, args.model_name, args.gpu_device)
            predicted = run.plan.get("predicted_bytes_at_microbatch")
            print(f"  {row.name} ({run.setting.model_config} {run.setting.resolution}): microbatch {run.microbatch} "
                  f"x {run.batch_size // args.gpus // run.microbatch} per GPU per step, global batch {run.batch_size}, "
                  f"activation checkpointing {'on' if run.activation_checkpointing else 'off'}"
                  + (f", predicted {predicted / 2**30:.1f} GiB" if predicted else "")
                  + f", about {seconds / 60:.1f} min", flush=True)
            if run.plan.get("activation_checkpointing_reason"):
                print(f"    checkpointing: {run.plan['activation_checkpointing_reason']}", flush=True)
            print(f"    {shlex.join(run.command)}", flush=True)
            planned.append({"name": row.name, "model_config": run.setting.model_config,
                            "image_size": run.setting.resolution, "microbatch": run.microbatch,
                            "activation_checkpointing": run.activation_checkpointing, "batch_size": run.batch_size,
                            "command": run.command, "plan": run.plan, "estimated_seconds": seconds})
        elif row.compare_with:  # its command is made from the results of the run it predicts
            print(f"  {row.name}: {row.what}, once {row.compare_with} has run; about {seconds / 60:.1f} min",
                  flush=True)
            planned.append({"name": row.name, "command": None, "estimated_seconds": seconds})
        else:
            command, notes = blocks_command(row, args, gpu_memory_bytes)
            print(f"  {row.name}: {row.what}; about {seconds / 60:.1f} min{''.join(f'; {n}' for n in notes)}\n"
                  f"    {shlex.join(command)}", flush=True)
            planned.append({"name": row.name, "command": command, "estimated_seconds": seconds})
    total = sum(row["estimated_seconds"] for row in planned)
    ahead = [row.name for row in args.report_rows if row.name in args.predicted]
    print(f"estimated time: about {total / 60:.0f} minutes (the budget rule's first estimates: each launch's "
          f"start-up, its compilation, its batches at the first FLOP/s"
          + (f" or, for {', '.join(ahead)}, at its prediction for this GPU" if ahead else "")
          + "; docs/gpu-runs.md)", flush=True)
    held = budget_held(args, planned)
    print(f"--budget_s {args.budget_s:.0f}: " + ("every row fits" if len(held) == len(planned) else
          f"{len(held)} of {len(planned)} rows fit by these estimates, in the report's order: {', '.join(held) or 'none'}; "
          f"the others would be skipped (give them --rows in a window of their own)"), flush=True)
    if args.predictions is not None:  # each row predicted from the H100's measurements, and written
        predict_rows(args, planned, gpu_memory_bytes)
    return planned


def budget_held(args: argparse.Namespace, planned: list[dict]) -> list[str]:
    """The rows a run would start by these estimates, in order: each whose estimate the time left holds (a
    comparison row only after its run)."""
    left, held = args.budget_s, []
    for row, plan in zip(args.report_rows, planned):
        if plan["estimated_seconds"] <= left and (not row.compare_with or row.compare_with in held):
            held.append(row.name)
            left -= plan["estimated_seconds"]
    return held


def main(argv: list[str] | None = None) -> list[Outcome] | list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    with errors.command("gpu_report.py"):
        args = validate(build_parser().parse_args(argv))
        if args.dry_run:
            return dry_run(args)
        with files.hold_output("--out", args.out):
            return report(args, argv)


if __name__ == "__main__":
    main()
