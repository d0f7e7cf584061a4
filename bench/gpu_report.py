"""A GPU report in one command: on the one visible GPU, within a time budget, the rows that matter most,
highest first, each in a process of its own; it writes each row's results and log, the environment and
a README.md table beside the earlier results of the same device under results/.

    python bench/gpu_report.py --out results/h100-$(date +%F)     # ten minutes of one GPU: 8 of them spent
    python bench/gpu_report.py --out /tmp/report --budget_s 1800    # every row
    python bench/gpu_report.py --out /tmp/report --rows flux-blocks-bf16 flux-blocks-fp8
    python bench/gpu_report.py --out /tmp/report --smoke            # no GPU: the tiny models on CPU

The rows, the budget rule and the files: docs/gpu-runs.md, "Ten minutes of a GPU".
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project root
sys.path.insert(0, str(ROOT))

import bench_gpu  # noqa: E402
from bench_gpu import MATRIX, Setting  # noqa: E402
from t2ibench import errors, files  # noqa: E402
from t2ibench.cli import BUDGET_SECONDS, Parser  # noqa: E402
from t2ibench.errors import fail  # noqa: E402
from t2ibench.gpu_setup import from_flag  # noqa: E402  (imported here: the budget's clock starts after the imports)
from t2ibench.locations import check_output  # noqa: E402

DEFAULT_BUDGET_SECONDS = 480.0  # 8 of the ten minutes a GPU is often lent for: its start-up and the copy back
# Each training row: 5 batches, the first 2 left out of the measurement (compilation happens in the first),
# at a global batch that takes a few seconds per batch on an H100 (results/h100-2026-11-26: SD2 114.6
# images/s precomputed and 69.0 online, SDXL 14.8 with checkpointing).
BATCHES, WARMUP_BATCHES = 5, 2
SD2_PRECOMPUTED_BATCH, SD2_ONLINE_BATCH, SDXL_BATCH = 512, 256, 64
# bench_gpu.py's Flux.1 set-up (MLPerf's), whose blocks blocks.py times for a node of NODE_GPUS of this GPU;
# float8 in the recipe measured before.
FLUX_ROW, FLUX_FP8, NODE_GPUS = "flux-precomputed-states-bf16-fsdp", "tensorwise", 8
# --smoke: fewer and smaller batches, and blocks.py's timings cut to the least that runs every part.
SMOKE_BATCHES, SMOKE_WARMUP_BATCHES = 3, 1
SMOKE_BLOCKS_FLAGS = ["--num_workers", "0", "--warmup", "1", "--repeats", "2", "--harness_batches", "2"]
SMOKE_GPU_MEMORY_BYTES = 80 * 2**30  # the count's nominal device (a CPU has none); its microbatch is --smoke's
# --smoke runs its compiled rows eager: inductor's C++ code generation for even the tiny models' blocks takes
# tens of minutes on a 2-core CPU (sdxl-tiny block by block: 2,429 s; docs/speed.md), far past the smoke's
# minutes. The --compile flags still go through every command, so the compiled rows' code paths run.
SMOKE_ENV = {"TORCH_COMPILE_DISABLE": "1"}

# The budget rule (docs/gpu-runs.md): a row is started only if its estimate fits the time left. The
# estimate takes the largest start-up and compile seconds and the lowest FLOP/s of the rows run so far,
# and these first estimates before any row of the kind ran (each errs long on an H100).
FIRST_STARTUP_SECONDS = bench_gpu.STARTUP_SECONDS  # a launch up to its first batch, planning included
FIRST_COMPILE_SECONDS = 120.0  # regional compilation's targets on an H100: SD2 60 s, SDXL 90 s
FIRST_BLOCKS_SECONDS = 180.0  # a blocks row: the node's set-up planned, blocks timed (and compiled), the harness
CPU_FIRST_FLOPS_PER_SECOND = 1e8  # --smoke: the tiny UNet ran at 0.26 GFLOP/s on a loaded 2-core machine
# A row's own timeout: twice its estimate (at least a minute more), never past the budget; a row that
# hangs is ended with its process group and recorded, and the report goes on.
TIMEOUT_FACTOR, TIMEOUT_SLACK_SECONDS = 2.0, 60.0


@dataclass(frozen=True)
class ReportRow:
    """One row: a benchmark.py run of `setting` (bench_gpu.py's launch), blocks.py timing the blocks of
    `blocks_of`, or blocks.py predicting the run of row `compare_with` and compared with it."""

    name: str
    what: str
    setting: Setting | None = None
    blocks_of: Setting | None = None
    compare_with: str | None = None
    baseline: str | None = None  # the row of this report its figure is divided by, if any


ROWS = [
    ReportRow("sd2-512-precomputed", "SD2 base 512, precomputed latents and token ids, EMA, eager",
              setting=dataclasses.replace(MATRIX["precomputed-bf16"], global_batch=SD2_PRECOMPUTED_BATCH)),
    ReportRow("sd2-512-precomputed-compile", "the same, --compile",
              setting=dataclasses.replace(MATRIX["precomputed-bf16-compile"], global_batch=SD2_PRECOMPUTED_BATCH),
              baseline="sd2-512-precomputed"),
    ReportRow("sdxl-1024-compile", "SDXL base 1024, precomputed latents and text states, EMA, the defaults "
              "(checkpointing as auto picks it), --compile",
              setting=dataclasses.replace(MATRIX["sdxl-precomputed-states-bf16"], compile=True,
                                          global_batch=SDXL_BATCH)),
    ReportRow("sd2-512-online", "SD2 base 512, VAE and text encoder in the step, EMA, eager",
              setting=dataclasses.replace(MATRIX["online-bf16"], global_batch=SD2_ONLINE_BATCH)),
    ReportRow("flux-blocks-bf16", "Flux.1-schnell 256 blocks, bf16, compiled",
              blocks_of=dataclasses.replace(MATRIX[FLUX_ROW], compile=True)),
    ReportRow("flux-blocks-fp8", f"the same in float8 ({FLUX_FP8})",
              blocks_of=dataclasses.replace(MATRIX[FLUX_ROW], compile=True, fp8=FLUX_FP8), baseline="flux-blocks-bf16"),
    ReportRow("blocks-sd2", "blocks.py's prediction of sd2-512-precomputed", compare_with="sd2-512-precomputed"),
    ReportRow("blocks-sdxl", "blocks.py's prediction of sdxl-1024-compile", compare_with="sdxl-1024-compile"),
]
ROW_NAMES = [row.name for row in ROWS]

# A set-up, for finding the earlier result of the same one: a benchmark.py run's keys, and blocks.py's.
# Results written before a key existed lack it: they ran its default.
RUN_SETUP = ("device", "model_config", "image_size", "precomputed", "precomputed_format", "compile",
             "activation_checkpointing", "fp8", "use_ema", "fsdp", "world_size", "device_train_microbatch_size")
BLOCKS_SETUP = ("device", "model_config", "image_size", "precision", "precomputed", "precomputed_format", "compile",
                "activation_checkpointing", "fp8", "use_ema", "microbatch", "global_batch")
ABSENT_MEANS = {"compile": False, "activation_checkpointing": False, "fp8": "off", "fsdp": "none"}
# Differences the table names beside an earlier result of the same set-up (where both record the key).
SHOWN_DIFFERENCES = ("global_batch_size", "weight_casts", "norm_precision", "torch_version")
EARLIER_SUFFIXES = (".json", ".jsonl", ".log")  # blocks.py's JSON line is in the log its run left
EARLIER_MAX_BYTES = 16 * 2**20


@dataclass
class Outcome:
    """What became of a row, as the README and report.json tell it."""

    name: str
    kind: str  # run or blocks
    what: str
    status: str = "not started"
    estimate_s: float | None = None
    timeout_s: float | None = None
    wall_s: float | None = None
    result: dict | None = None  # the row's results JSON (benchmark.py's, or blocks.py's last line)
    notes: list[str] = field(default_factory=list)
    compiled_ran_eager: bool = False  # a compiled row that --smoke ran eager (SMOKE_ENV)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def build_parser() -> Parser:
    p = Parser("gpu_report.py", description=__doc__)
    p.add_argument("--out", type=Path, required=True,
                   help="a new or empty folder for the report (results/<device>-<date> to commit it)")
    p.add_argument("--budget_s", type=BUDGET_SECONDS,
                   default=DEFAULT_BUDGET_SECONDS, help="seconds for all rows; a row that the time left cannot "
                   "hold is not started")
    p.add_argument("--rows", nargs="+", choices=ROW_NAMES, default=None,
                   help="run only these rows (in the report's order; default: all, highest first)")
    p.add_argument("--results_root", type=Path, default=ROOT / "results",
                   help="earlier results (benchmark.py and blocks.py JSON, anywhere below it) to compare with; "
                   "default: the project's results/")
    p.add_argument("--model_name", default=bench_gpu.DEFAULT_MODEL_NAME,
                   help="SD2's pretrained VAE and text encoder, a local folder or a cached hub id; where neither, "
                        "the SD2 rows run random ones offline (throughput does not depend on the weights)")
    p.add_argument("--smoke", action="store_true",
                   help="check the tool without a GPU: the same rows on the tiny models, on CPU, compiled rows "
                        "eager (figures mean nothing)")
    return p


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """Every refusal before any row runs; the rows chosen, in the report's order."""
    out = parsed.out
    problem = check_output("--out", str(out), folder=True)
    if problem:
        fail(problem)
    if out.is_dir() and any(out.iterdir()):
        fail(f"--out {out} is not empty: give the report a new folder (it never mixes with what is there)")
    if not parsed.results_root.is_dir():
        fail(f"--results_root {parsed.results_root} is not a folder: name the folder of earlier results")
    chosen = parsed.rows or ROW_NAMES
    rows = [row for row in ROWS if row.name in chosen]
    for row in rows:
        if row.compare_with and row.compare_with not in chosen:
            fail(f"--rows {row.name} compares blocks.py with the run of row {row.compare_with}: add it to --rows")
    import torch

    if not parsed.smoke and torch.cuda.device_count() == 0:
        fail("no CUDA GPU visible (torch.cuda.device_count() is 0): run it on a GPU, or pass --smoke to check "
             "the tool on CPU")
    # Absolute: the rows run from the project root, and write there.
    return argparse.Namespace(**{**vars(parsed), "out": out.absolute()}, report_rows=rows)


# -- the rows' commands --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def blocks_options() -> frozenset[str]:
    """The flags bench/blocks.py has (so a set-up flag it lacks is dropped and said, not refused)."""
    import blocks

    return frozenset(option for action in blocks.build_parser()._actions for option in action.option_strings)


def blocks_flags(setting: Setting, checkpointing: bool) -> tuple[list[str], list[str]]:
    """blocks.py's flags for a benchmark.py set-up (its checkpointing as the run resolves it), and a note for
    each flag of it blocks.py lacks."""
    flags = ["--model_config", setting.model_config, "--image_size", str(setting.resolution),
             "--global_batch", str(setting.global_batch), "--precision", "amp_bf16", "--fsdp", setting.fsdp,
             "--norm_precision", setting.norm_precision]
    if setting.precomputed:
        flags += ["--precomputed", "--precomputed_format", setting.text_format]
    if setting.fp8 != "off":
        flags += ["--fp8", setting.fp8]
    wanted = {"--activation_checkpointing": checkpointing, "--use_ema": setting.use_ema, "--compile": setting.compile}
    flags += [flag for flag, on in wanted.items() if on and flag in blocks_options()]
    notes = [f"blocks.py has no {flag}: timed without it" for flag, on in wanted.items()
             if on and flag not in blocks_options()]
    if setting.weight_casts != "auto" and "--weight_casts" in blocks_options():
        flags += ["--weight_casts", setting.weight_casts]
    return flags, notes


def setting_of(result: dict) -> Setting:
    """The set-up a benchmark.py results JSON records."""
    return Setting(model_config=result["model_config"], image_size=result["image_size"],
                   precomputed=bool(result.get("precomputed")),
                   precomputed_format=result.get("precomputed_format") if result.get("precomputed") else None,
                   norm_precision=result.get("norm_precision") or "autocast", fsdp=result.get("fsdp") or "none",
                   activation_checkpointing="on" if result.get("activation_checkpointing") else "off",
                   compile=bool(result.get("compile")), global_batch=result["global_batch_size"],
                   use_ema=bool(result.get("use_ema")), weight_casts=result.get("weight_casts") or "auto",
                   fp8=result.get("fp8") or "off")


def blocks_command(row: ReportRow, outcomes: dict[str, Outcome], args: argparse.Namespace,
                   gpu_memory_bytes: float) -> tuple[list[str], list[str]]:
    """blocks.py's command for a blocks row, and its notes."""
    if row.compare_with:  # the measured run's own set-up, at its microbatch and device count
        measured = outcomes[row.compare_with].result
        flags, notes = blocks_flags(setting_of(measured), bool(measured.get("activation_checkpointing")))
        flags += ["--microbatch", str(measured["device_train_microbatch_size"]), "--gpus", str(measured["world_size"]),
                  "--compare_results_json", str(args.out / f"{row.compare_with}.json")]
    elif args.smoke:  # one CPU rank, where checkpointing's `auto` is off
        tiny = bench_gpu.smoke_setting(row.blocks_of, 1)
        flags, notes = blocks_flags(tiny, from_flag(tiny.activation_checkpointing)[0])
        flags += ["--microbatch", str(bench_gpu.SMOKE_MICROBATCH), "--gpus", "1"]
    else:  # the run bench_gpu.py would launch on a node of these GPUs: its checkpointing and microbatch
        node = bench_gpu.plan_row(row.name, row.blocks_of, NODE_GPUS, gpu_memory_bytes, args.out, 1, 0, False,
                                  args.model_name)
        flags, notes = blocks_flags(row.blocks_of, node.activation_checkpointing)
        flags += ["--microbatch", str(node.microbatch), "--gpus", str(NODE_GPUS)]
    return [sys.executable, str(ROOT / "bench" / "blocks.py"), *flags, *(SMOKE_BLOCKS_FLAGS if args.smoke else []),
            "--json"], notes


def run_setting(row: ReportRow, smoke: bool) -> Setting:
    """The set-up a training row runs: its own, or on --smoke its family's tiny model with checkpointing as
    its CPU run resolves the flag (`auto`: off), so that its estimate counts the step it runs, once."""
    if not smoke:
        return row.setting
    tiny = bench_gpu.smoke_setting(row.setting, 1)
    return dataclasses.replace(tiny, activation_checkpointing="on" if from_flag(tiny.activation_checkpointing)[0]
                               else "off")


# -- the budget rule -----------------------------------------------------------------------------------

@dataclass
class Estimator:
    """Each row's seconds, predicted from the rows before it (docs/gpu-runs.md, the budget rule)."""

    first_flops_per_second: float
    startup_s: list[float] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)
    flops_per_second: list[float] = field(default_factory=list)
    blocks_s: list[float] = field(default_factory=list)

    def fixed_seconds(self, setting: Setting) -> float:
        """A training row's seconds besides its batches: the launch's start-up, and its compilation."""
        startup = max(self.startup_s, default=FIRST_STARTUP_SECONDS)
        return startup + (max(self.compile_s, default=FIRST_COMPILE_SECONDS) if setting.compile else 0.0)

    def run_seconds(self, setting: Setting, batches: int) -> float:
        # Checkpointing left to `auto` is counted on: the longer estimate.
        flops = batches * setting.global_batch * flops_of(setting, setting.activation_checkpointing != "off")
        return self.fixed_seconds(setting) + flops / min(self.flops_per_second, default=self.first_flops_per_second)

    def blocks_seconds(self) -> float:
        return max(self.blocks_s, default=FIRST_BLOCKS_SECONDS)

    def observe_run(self, setting: Setting, batches: int, wall_s: float, result: dict) -> None:
        """Learn from a finished training row: the FLOP/s its batches ran at, and the rest of its wall time
        (start-up, and compilation: `compile_seconds` where the run reports it)."""
        per_batch = result["measured_seconds"] / max(1, result["measured_batches"])
        overhead = max(0.0, wall_s - batches * per_batch)
        checkpointing = bool(result.get("activation_checkpointing"))  # as the run resolved it
        self.flops_per_second.append(result["images_per_sec"] * flops_of(setting, checkpointing))
        if not setting.compile:
            self.startup_s.append(overhead)
        elif result.get("compile_seconds") is not None:
            self.compile_s.append(result["compile_seconds"])
            self.startup_s.append(max(0.0, overhead - result["compile_seconds"]))
        else:
            self.compile_s.append(max(0.0, overhead - max(self.startup_s, default=FIRST_STARTUP_SECONDS)))

    def observe_blocks(self, wall_s: float) -> None:
        self.blocks_s.append(wall_s)


def flops_of(setting: Setting, checkpointing: bool) -> float:
    """FLOPs one training image of a set-up costs (bench_gpu.py's count, on the meta device)."""
    return bench_gpu.flops_per_image(setting.model_config, setting.resolution, setting.precomputed,
                                     setting.text_format, checkpointing)


def row_timeout(estimate_s: float, left_s: float) -> float:
    return min(left_s, max(TIMEOUT_FACTOR * estimate_s, estimate_s + TIMEOUT_SLACK_SECONDS))


# -- running -------------------------------------------------------------------------------------------

def run_training(row: ReportRow, args: argparse.Namespace, ends_at: float, env: dict,
                 gpu_memory_bytes: float) -> dict:
    """bench_gpu.py's plan and launch of the row, ended at `ends_at` (time.monotonic) if still running:
    its microbatch from the memory model (on --smoke the tiny model's, counted by the memory model too);
    bench_gpu.run_row's record of it."""
    batches, warmup = (SMOKE_BATCHES, SMOKE_WARMUP_BATCHES) if args.smoke else (BATCHES, WARMUP_BATCHES)
    planned = bench_gpu.plan_row(row.name, row.setting, 1, gpu_memory_bytes, args.out, batches, warmup, args.smoke,
                                 args.model_name)
    if args.smoke:  # the count of the step as it runs here, so the table's counted column is filled
        from t2ibench import memory

        planned.command = one_rank(planned.command)

        tiny = run_setting(row, True)
        plan = memory.plan(tiny.model_config, tiny.resolution, SMOKE_GPU_MEMORY_BYTES,
                           activation_checkpointing=planned.activation_checkpointing,
                           **bench_gpu.plan_options(tiny, 1, on_gpu=False))
        planned.plan = {**plan, "microbatch": planned.microbatch,
                        "predicted_bytes_at_microbatch": memory.predicted_bytes(plan, planned.microbatch)}
    # The planning counted on the meta device is part of the row's time.
    return bench_gpu.run_row(planned, args.out, max(1.0, ends_at - time.monotonic()), env, announce=False)


def one_rank(command: list[str]) -> list[str]:
    """A one-rank launch without Composer's launcher: benchmark.py itself (--smoke's training rows run on one
    CPU rank, and the launcher is an interpreter of its own importing torch and Composer, seconds of CPU
    time per row of a smoke run of a few minutes)."""
    start = command.index("composer.cli.launcher") - 1  # [python, -m, composer.cli.launcher, -n, 1, script...]
    assert command[start + 2:start + 4] == ["-n", "1"], command
    return [*command[:start], *command[start + 4:]]


def run_blocks(row: ReportRow, command: list[str], out: Path, timeout_s: float, env: dict) -> tuple[str, dict | None]:
    """blocks.py in its own process group under `timeout_s`; its last JSON line is kept as the row's JSON."""
    log_path = out / "logs" / f"{row.name}.log"
    files.write_text(log_path, shlex.join(command) + "\n")
    code = bench_gpu.run_command(command, log_path, timeout_s, env)
    if code != 0:
        return f"failed ({code}), see logs/{row.name}.log", None
    result = last_json_line(log_path.read_text(errors="replace"))
    if result is None:
        return f"failed (no JSON line), see logs/{row.name}.log", None
    files.write_text(out / f"{row.name}.json", json.dumps(result, indent=2) + "\n")
    return "ok", result


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return None


def row_env(row: ReportRow, smoke: bool, pretrained: bool) -> dict:
    """A row's environment: offline unless it runs SD2's pretrained parts and has them; on --smoke, torch.compile
    off (SMOKE_ENV): the compiled rows run eager, and the README's compile column says so."""
    env = bench_gpu.launch_env(row.setting, pretrained) if row.setting else {**os.environ, "HF_HUB_OFFLINE": "1"}
    return {**env, **SMOKE_ENV} if smoke else env


def report(args: argparse.Namespace, argv: list[str]) -> list[Outcome]:
    import torch

    start = time.monotonic()
    deadline = start + args.budget_s
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    pretrained = not args.smoke and (not any(row.setting and row.setting.needs_pretrained for row in args.report_rows)
                                     or bench_gpu.pretrained_available(args.model_name))
    info = environment(args, argv, pretrained)
    files.write_text(out / "environment.json", json.dumps(info, indent=2) + "\n")
    earlier = earlier_results(args.results_root, out)
    gpu_memory_bytes = torch.cuda.get_device_properties(0).total_memory if not args.smoke else SMOKE_GPU_MEMORY_BYTES
    peak = bench_gpu.peak_tflops_of(info["device"]) or min(tflops for _, tflops in bench_gpu.PEAK_TFLOPS)
    estimator = Estimator(CPU_FIRST_FLOPS_PER_SECOND if args.smoke else bench_gpu.ASSUMED_MFU * peak * 1e12)
    batches = SMOKE_BATCHES if args.smoke else BATCHES
    print(f"gpu_report.py: {len(args.report_rows)} rows on {info['device']} within {args.budget_s:.0f} s"
          + ("" if pretrained or args.smoke else f"; SD2's encoders random (--model_name {args.model_name} is neither "
             "a local folder nor cached)"), flush=True)
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
        outcome.estimate_s = estimate(row, estimator, args.smoke, left)
        if outcome.estimate_s > left:
            outcome.status = f"skipped: estimated {outcome.estimate_s:.0f} s, {max(0.0, left):.0f} s left"
            print(f"{tag}: {outcome.status}", flush=True)
            write_readme(args, info, list(outcomes.values()), earlier, time.monotonic() - start)
            continue
        outcome.timeout_s = row_timeout(outcome.estimate_s, left)
        print(f"{tag}: starting, estimated {outcome.estimate_s:.0f} s (timeout {outcome.timeout_s:.0f} s), "
              f"{left:.0f} s of {args.budget_s:.0f} left", flush=True)
        began = time.monotonic()
        env = row_env(row, args.smoke, pretrained)
        if row.setting:
            result = run_training(row, args, began + outcome.timeout_s, env, gpu_memory_bytes)
            outcome.status = result["status"]
            outcome.wall_s = time.monotonic() - began
            if outcome.ok:
                outcome.result = json.loads((out / f"{row.name}.json").read_text())
                estimator.observe_run(run_setting(row, args.smoke), batches, outcome.wall_s, outcome.result)
        else:
            command, outcome.notes = blocks_command(row, outcomes, args, gpu_memory_bytes)
            # Planning the node's set-up on the meta device is part of the row's time.
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
        write_readme(args, info, list(outcomes.values()), earlier, time.monotonic() - start)
    text = write_readme(args, info, list(outcomes.values()), earlier, time.monotonic() - start)
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


def estimate(row: ReportRow, estimator: Estimator, smoke: bool, left_s: float) -> float:
    """The row's seconds by the budget rule; a training row whose start-up and compilation alone exceed
    the time left is refused without counting its FLOPs (seconds of meta-device work for a large model)."""
    if not row.setting:
        return estimator.blocks_seconds()
    setting = run_setting(row, smoke)
    fixed = estimator.fixed_seconds(setting)
    return fixed if fixed > left_s else estimator.run_seconds(setting, SMOKE_BATCHES if smoke else BATCHES)


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


# -- the environment -----------------------------------------------------------------------------------

def environment(args: argparse.Namespace, argv: list[str], pretrained: bool) -> dict:
    """bench_gpu.py's environment, with the driver, torchao, the commit, the load and the budget."""
    info = bench_gpu.environment(1, args.smoke, argv)
    import torch

    info["command"] = shlex.join(["python", "bench/gpu_report.py", *argv])
    info.update({
        "torch_version": torch.__version__,
        "gpus_visible": torch.cuda.device_count(),
        "nvidia_smi": nvidia_smi(),
        "torchao": package_version("torchao"),
        "commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),  # the machine's load as the report started (1, 5, 15 min)
        "budget_s": args.budget_s,
        "sd2_encoders": "pretrained" if pretrained else "random (offline)",
    })
    return info


def nvidia_smi() -> dict | None:
    """The GPU's name, memory and driver as nvidia-smi reports them (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    name, memory, driver = ([part.strip() for part in text.splitlines()[0].split(",")] + ["", "", ""])[:3]
    return {"name": name, "memory_total": memory, "driver_version": driver}


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's commit, with '+changes' when the working tree differs from it (None outside git)."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if changed else "")


# -- earlier results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Earlier:
    path: str  # relative to --results_root
    result: dict


def earlier_results(root: Path, out: Path) -> list[Earlier]:
    """Every benchmark.py and blocks.py result below `root` (whole JSON files, or JSON lines of .jsonl and
    .log files), outside `out`, in path order."""
    found = []
    out = out.resolve()
    for path in sorted(root.rglob("*")):
        if path.suffix not in EARLIER_SUFFIXES or not path.is_file() or out in path.resolve().parents:
            continue
        if path.stat().st_size > EARLIER_MAX_BYTES:
            continue
        text = path.read_text(errors="replace")
        try:
            items = [json.loads(text)]
        except ValueError:
            items = []
            for line in text.splitlines():
                if line.startswith("{"):
                    try:
                        items.append(json.loads(line))
                    except ValueError:
                        pass
        found += [Earlier(str(path.relative_to(root)), item) for item in items
                  if isinstance(item, dict) and kind_of(item) is not None]
    return found


def kind_of(result: dict) -> str | None:
    """run (benchmark.py's results), blocks (blocks.py's JSON line), or None."""
    if "model_config" not in result:
        return None
    if isinstance(result.get("images_per_sec"), (int, float)) and "device" in result:
        return "run"
    if isinstance(result.get("predicted"), list) and result["predicted"] and "measured" in result:
        return "blocks"
    return None


def setup_of(result: dict, kind: str) -> tuple:
    keys = RUN_SETUP if kind == "run" else BLOCKS_SETUP
    values = {key: result.get(key, ABSENT_MEANS.get(key)) for key in keys}
    if not values["precomputed"]:
        values["precomputed_format"] = None
    return tuple(values[key] for key in keys)


def figure_of(result: dict, kind: str, gpus: int | None = None) -> float | None:
    """A row's headline figure: images/s of a run; blocks.py's predicted samples/s per GPU (at `gpus`)."""
    if kind == "run":
        return result.get("images_per_sec")
    predicted = result.get("predicted") or []
    row = next((r for r in predicted if gpus is None or r.get("gpus") == gpus), None)
    return row.get("samples_per_sec_per_gpu") if row else None


def earlier_match(outcome: Outcome, earlier: list[Earlier]) -> tuple[Earlier, float] | None:
    """The newest earlier result of the same set-up and device (by path: folders are named by date), and
    this row's figure over its figure."""
    if not outcome.ok:
        return None
    mine = setup_of(outcome.result, outcome.kind)
    gpus = outcome.result["predicted"][0]["gpus"] if outcome.kind == "blocks" else None
    figure = figure_of(outcome.result, outcome.kind, gpus)
    for candidate in reversed(earlier):
        if kind_of(candidate.result) == outcome.kind and setup_of(candidate.result, outcome.kind) == mine:
            theirs = figure_of(candidate.result, outcome.kind, gpus)
            if theirs and figure is not None:
                return candidate, figure / theirs
    return None


# -- the README ----------------------------------------------------------------------------------------

def gib(nbytes: float | None) -> str:
    return f"{nbytes / 2**30:.1f}" if nbytes else "-"


def seconds(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "-"


def compile_cell(outcome: Outcome) -> str:
    """The compile seconds column: the row's (none for an eager row, whose run reports 0), or that --smoke ran
    the compiled row eager."""
    if outcome.compiled_ran_eager:
        return "eager (--smoke)"
    return seconds(outcome.result.get("compile_seconds")) if outcome.result.get("compile") else "-"


def versus(outcome: Outcome, outcomes: dict[str, Outcome], row: ReportRow) -> str:
    """This row's figure over its baseline row's, both of this report."""
    base = outcomes.get(row.baseline) if row.baseline else None
    if not (base and base.ok and outcome.ok):
        return "-"
    gpus = outcome.result["predicted"][0]["gpus"] if outcome.kind == "blocks" else None
    ours, theirs = figure_of(outcome.result, outcome.kind, gpus), figure_of(base.result, base.kind, gpus)
    return f"{ours / theirs:.2f}x {row.baseline}" if ours and theirs else "-"


def earlier_cells(outcome: Outcome, earlier: list[Earlier]) -> tuple[str, str]:
    match = earlier_match(outcome, earlier)
    if match is None:
        return "-", "-"
    found, ratio = match
    gpus = outcome.result["predicted"][0]["gpus"] if outcome.kind == "blocks" else None
    differs = [f"{key} {found.result[key]}" for key in SHOWN_DIFFERENCES
               if key in outcome.result and key in found.result and found.result[key] != outcome.result[key]]
    return (f"{figure_of(found.result, outcome.kind, gpus):.2f} ({found.path}"
            + (f"; it had {', '.join(differs)}" if differs else "") + ")", f"{ratio:.2f}")


def run_table(outcomes: list[Outcome], earlier: list[Earlier]) -> list[str]:
    by_name = {o.name: o for o in outcomes}
    lines = ["| row | set-up | status | images/s | MFU | peak GiB allocated / reserved | counted GiB | compile s "
             "| in this report | earlier, same set-up and device | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for outcome in outcomes:
        row = next(r for r in ROWS if r.name == outcome.name)
        r = outcome.result or {}
        setup = outcome.what + (f"; ran {r['model_config']} at {r['image_size']}, microbatch "
                                f"{r['device_train_microbatch_size']}, global batch {r['global_batch_size']}, "
                                f"checkpointing {'on' if r.get('activation_checkpointing') else 'off'}"
                                + allocator_words(r) if r else "")
        if not outcome.ok:
            lines.append(f"| {outcome.name} | {setup} | {outcome.status} | | | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        counted = (r.get("memory_model") or {}).get("predicted_bytes_at_microbatch")
        earlier_cell, ratio = earlier_cells(outcome, earlier)
        lines.append(f"| {outcome.name} | {setup}{''.join(f'; {n}' for n in outcome.notes)} | ok "
                     f"| {r['images_per_sec']:.1f} | {mfu} | {gib(r.get('peak_memory_bytes'))} / "
                     f"{gib(r.get('peak_memory_reserved_bytes'))} | {gib(counted)} "
                     f"| {compile_cell(outcome)} | {versus(outcome, by_name, row)} | {earlier_cell} "
                     f"| {ratio} |")
    return lines


def allocator_words(r: dict) -> str:
    """A run's CUDA allocator setting and its retries (what the memory model's reserve assumes none
    of: docs/speed.md, "The allocator's setting"); nothing for results without them."""
    if r.get("cuda_allocator_conf") is None:
        return ""
    return (f", allocator {r['cuda_allocator_conf'] or 'torch defaults'} ({r['cuda_allocator_conf_source']}), "
            f"{r.get('cuda_alloc_retries')} allocation retries"
            + (f", {r['cuda_memory_outside_torch_bytes'] / 2**30:.2f} GiB outside torch at the end"
               if r.get("cuda_memory_outside_torch_bytes") is not None else ""))


def blocks_table(outcomes: list[Outcome], earlier: list[Earlier]) -> list[str]:
    by_name = {o.name: o for o in outcomes}
    lines = ["| row | set-up | status | predicted samples/s per GPU | measured run: images/s per GPU, predicted / "
             "measured | compile s | in this report | earlier, same set-up and device | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for outcome in outcomes:
        row = next(r for r in ROWS if r.name == outcome.name)
        r = outcome.result or {}
        setup = outcome.what + (f"; ran {r['model_config']} at {r['image_size']}, microbatch {r['microbatch']}, "
                                f"global batch {r['global_batch']}" if r else "")
        setup += "".join(f"; {note}" for note in outcome.notes)
        if not outcome.ok:
            lines.append(f"| {outcome.name} | {setup} | {outcome.status} | | | | | | |")
            continue
        first = r["predicted"][0]
        compared = r.get("comparison")
        measured = (f"{compared['measured_images_per_sec_per_device']:.2f}, {compared['ratio']:.2f}" if compared
                    else "-")
        earlier_cell, ratio = earlier_cells(outcome, earlier)
        lines.append(f"| {outcome.name} | {setup} | ok | {first['samples_per_sec_per_gpu']:.2f} on {first['gpus']} "
                     f"({first['fsdp']}) | {measured} | {compile_cell(outcome)} "
                     f"| {versus(outcome, by_name, row)} | {earlier_cell} | {ratio} |")
    return lines


def write_readme(args: argparse.Namespace, info: dict, outcomes: list[Outcome], earlier: list[Earlier],
                 elapsed_s: float) -> str:
    """README.md and report.json of the rows so far (rewritten after each row: a report cut short still
    tells what ran)."""
    versions = info["versions"]
    smi = info.get("nvidia_smi") or {}
    stack = ", ".join(f"{name} {versions.get(key)}" for name, key in (
        ("Composer", "mosaicml"), ("Streaming", "mosaicml-streaming"), ("diffusers", "diffusers"),
        ("transformers", "transformers")))
    finished = sum(o.wall_s is not None for o in outcomes)
    text = [f"# GPU report: {info['device']}, {info['date_utc'][:10]}", "",
            f"`{info['command']}` at commit {info['commit'] or 'unknown'}: {finished} of {len(args.report_rows)} "
            f"rows run in {elapsed_s:.0f} s of a {args.budget_s:.0f} s budget.", "",
            f"Device: {info['device']}" + (f" (driver {smi['driver_version']}, {smi['memory_total']})"
                                           if smi.get("driver_version") else "")
            + f"; torch {info['torch_version']} (CUDA {info['cuda']}), {stack}, torchao {info['torchao']}, Python "
            f"{info['python']}; load average {info['load_average'][0]:.1f} on {info['cpu_count']} CPUs at the start; "
            f"SD2's encoders {info['sd2_encoders']}. Everything in `environment.json`.", ""]
    if args.smoke:
        text += ["**--smoke**: the tiny models (tiny, sdxl-tiny, flux1-tiny) at 32x32 on a CPU; the figures check the "
                 "tool and mean nothing. **The compiled rows ran eager** (TORCH_COMPILE_DISABLE=1, their compile "
                 "column says `eager (--smoke)`): inductor's C++ code generation takes tens of minutes on a small CPU.",
                 ""]
    runs = [o for o in outcomes if o.kind == "run"]
    blocks = [o for o in outcomes if o.kind == "blocks"]
    if runs:
        text += ["## Training runs (benchmark.py)", "",
                 f"Synthetic data, amp_bf16, {SMOKE_BATCHES if args.smoke else BATCHES} batches of which "
                 f"{SMOKE_WARMUP_BATCHES if args.smoke else WARMUP_BATCHES} warm-up; microbatch from the memory model. "
                 "MFU counts the encoders' forward passes where they run. Peak memory: CUDA's max allocated (on a "
                 "CPU, the process's peak RSS); counted: the memory model's prediction at the row's microbatch. "
                 "Ratios: this row's images/s over the other's.", "", *run_table(runs, earlier), ""]
    if blocks:
        text += ["## Blocks (bench/blocks.py: predicted, not measured)", "",
                 "Each distinct block timed on this device, the step composed and a node predicted; the "
                 "comparison rows predict a training row above and divide by its measurement. Ratios: predicted "
                 "samples/s per GPU over the other's.", "", *blocks_table(blocks, earlier), ""]
    text += ["Each row's results are `<row>.json`, its command and output `logs/<row>.log`; rows skipped or failed "
             "say why. Rerun some with `--rows NAME...` (docs/gpu-runs.md)."]
    readme = "\n".join(text) + "\n"
    files.write_text(args.out / "README.md", readme)
    summary = {"budget_s": args.budget_s, "elapsed_s": elapsed_s,
               "rows": [{**{k: v for k, v in dataclasses.asdict(o).items() if k != "result"},
                         "earlier": (lambda m: m and {"path": m[0].path, "ratio": m[1]})(earlier_match(o, earlier))}
                        for o in outcomes]}
    files.write_text(args.out / "report.json", json.dumps(summary, indent=2) + "\n")
    return readme


def main(argv: list[str] | None = None) -> list[Outcome]:
    argv = sys.argv[1:] if argv is None else argv
    with errors.command("gpu_report.py"):
        args = validate(build_parser().parse_args(argv))
        with files.hold_output("--out", args.out):
            return report(args, argv)


if __name__ == "__main__":
    main()
