"""What bench/gpu_report.py writes and how it tells it: each row's outcome, the environment, the earlier
result of the same set-up and device below --results_root (benchmark.py results JSON and blocks.py
JSON lines), and README.md and report.json, rewritten after every row.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from gpu.plan import ROOT
from gpu.rows import ROWS, ReportRow
from t2ibench.core import files
from t2ibench.costs.results import implausible_rate

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


# -- the environment -----------------------------------------------------------------------------------

def environment(args: argparse.Namespace, argv: list[str], pretrained: bool) -> dict:
    """The machine and the stack the report ran on, its command, commit, load and budget."""
    import torch

    from t2ibench.commands import stack

    return {
        "device": "cpu (--smoke)" if args.smoke else torch.cuda.get_device_name(0),
        "gpus": args.gpus,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": stack.versions(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/gpu_report.py", *argv]),
        "torch_version": torch.__version__,
        "gpus_visible": torch.cuda.device_count(),
        "nvidia_smi": nvidia_smi(),
        "torchao": package_version("torchao"),
        "commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),  # the machine's load as the report started (1, 5, 15 min)
        "budget_s": args.budget_s,
        "sd2_encoders": "pretrained" if pretrained else "random (offline)",
    }


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
    if "device" in result and isinstance(result.get("images_per_sec"), (int, float)):
        # A rate no run measures (-5, 5e-324, 1e308: cost_results.implausible_rate) is no earlier figure.
        gpus = result.get("world_size") if isinstance(result.get("world_size"), int) else 1
        return None if implausible_rate(result["images_per_sec"], gpus) else "run"
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


def predicted_cells(name: str, figure: float | None, predicted: dict[str, dict]) -> str:
    """The row's prediction made before it ran (bench/gpu/predict.py) and the measurement over it: two cells."""
    p = predicted.get(name) or {}
    before = p.get("images_per_sec") or p.get("samples_per_sec_per_gpu")
    if not before:
        return "| - | - "
    return f"| {before:.1f} | {f'{figure / before:.2f}' if figure else '-'} "


def run_table(outcomes: list[Outcome], earlier: list[Earlier], predicted: dict[str, dict] | None = None) -> list[str]:
    by_name = {o.name: o for o in outcomes}
    predicted = predicted or {}
    lines = ["| row | set-up | status | images/s | predicted before | measured / predicted | MFU "
             "| peak GiB allocated / reserved | counted GiB | compile s "
             "| in this report | earlier, same set-up and device | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for outcome in outcomes:
        row = next(r for r in ROWS if r.name == outcome.name)
        r = outcome.result or {}
        setup = outcome.what + (f"; ran {r['model_config']} at {r['image_size']}, microbatch "
                                f"{r['device_train_microbatch_size']}, global batch {r['global_batch_size']}, "
                                f"checkpointing {'on' if r.get('activation_checkpointing') else 'off'}"
                                + allocator_words(r) if r else "")
        if not outcome.ok:
            lines.append(f"| {outcome.name} | {setup} | {outcome.status} | {predicted_cells(outcome.name, None, predicted)}"
                         "| | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        counted = (r.get("memory_model") or {}).get("predicted_bytes_at_microbatch")
        earlier_cell, ratio = earlier_cells(outcome, earlier)
        lines.append(f"| {outcome.name} | {setup}{''.join(f'; {n}' for n in outcome.notes)} | ok "
                     f"| {r['images_per_sec']:.1f}{per_device(r)} "
                     f"{predicted_cells(outcome.name, r.get('images_per_sec_per_device') or r['images_per_sec'], predicted)}"
                     f"| {mfu} | {gib(r.get('peak_memory_bytes'))} / "
                     f"{gib(r.get('peak_memory_reserved_bytes'))} | {gib(counted)} "
                     f"| {compile_cell(outcome)} | {versus(outcome, by_name, row)} | {earlier_cell} "
                     f"| {ratio} |")
    return lines


def per_device(r: dict) -> str:
    """A run on several devices: its images/s per device, after the total."""
    return f" ({r['images_per_sec_per_device']:.1f} per device)" if r.get("world_size", 1) > 1 else ""


def allocator_words(r: dict) -> str:
    """A run's CUDA allocator setting and its retries (what the memory model's reserve assumes none
    of: docs/speed.md, "The allocator's setting"); nothing for results without them."""
    if r.get("cuda_allocator_conf") is None:
        return ""
    return (f", allocator {r['cuda_allocator_conf'] or 'torch defaults'} ({r['cuda_allocator_conf_source']}), "
            f"{r.get('cuda_alloc_retries')} allocation retries"
            + (f", {r['cuda_memory_outside_torch_bytes'] / 2**30:.2f} GiB outside torch at the end"
               if r.get("cuda_memory_outside_torch_bytes") is not None else ""))


def blocks_table(outcomes: list[Outcome], earlier: list[Earlier], predicted: dict[str, dict] | None = None) -> list[str]:
    by_name = {o.name: o for o in outcomes}
    predicted = predicted or {}
    lines = ["| row | set-up | status | predicted samples/s per GPU | predicted before (from the H100) | this / "
             "before | measured run: images/s per GPU, predicted / "
             "measured | compile s | in this report | earlier, same set-up and device | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for outcome in outcomes:
        row = next(r for r in ROWS if r.name == outcome.name)
        r = outcome.result or {}
        setup = outcome.what + (f"; ran {r['model_config']} at {r['image_size']}, microbatch {r['microbatch']}, "
                                f"global batch {r['global_batch']}" if r else "")
        setup += "".join(f"; {note}" for note in outcome.notes)
        if not outcome.ok:
            lines.append(f"| {outcome.name} | {setup} | {outcome.status} | {predicted_cells(outcome.name, None, predicted)}"
                         "| | | | | | |")
            continue
        first = r["predicted"][0]
        compared = r.get("comparison")
        measured = (f"{compared['measured_images_per_sec_per_device']:.2f}, {compared['ratio']:.2f}" if compared
                    else "-")
        earlier_cell, ratio = earlier_cells(outcome, earlier)
        lines.append(f"| {outcome.name} | {setup} | ok | {first['samples_per_sec_per_gpu']:.2f} on {first['gpus']} "
                     f"({first['fsdp']}) {predicted_cells(outcome.name, first['samples_per_sec_per_gpu'], predicted)}"
                     f"| {measured} | {compile_cell(outcome)} "
                     f"| {versus(outcome, by_name, row)} | {earlier_cell} | {ratio} |")
    return lines


def source_of(predicted: dict[str, dict] | None) -> str:
    """Where the predictions beside the measurements came from."""
    paths = sorted({p["path"] for p in (predicted or {}).values() if p.get("path")})
    return ", ".join(f"`{p}`" for p in paths) if paths else "none for this GPU: `--predictions FILE`"


def write_readme(args: argparse.Namespace, info: dict, outcomes: list[Outcome], earlier: list[Earlier],
                 elapsed_s: float, predicted: dict[str, dict] | None = None) -> str:
    """README.md and report.json of the rows so far (rewritten after each row: a report cut short still
    tells what ran)."""
    versions = info["versions"]
    smi = info.get("nvidia_smi") or {}
    stack = ", ".join(f"{name} {versions.get(key)}" for name, key in (
        ("Composer", "mosaicml"), ("Streaming", "mosaicml-streaming"), ("diffusers", "diffusers"),
        ("transformers", "transformers")))
    finished = sum(o.wall_s is not None for o in outcomes)
    node = f"{args.gpus} x " if args.gpus > 1 else ""
    text = [f"# GPU report: {node}{info['device']}, {info['date_utc'][:10]}", "",
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
                 f"Synthetic data, amp_bf16, {args.batches} batches of which {args.warmup_batches} warm-up, on "
                 f"{args.gpus} {'rank' if args.smoke else 'GPU'}{'s' if args.gpus > 1 else ''}; microbatch from the "
                 "memory model. "
                 "MFU counts the encoders' forward passes where they run. Peak memory: CUDA's max allocated (on a "
                 "CPU, the process's peak RSS); counted: the memory model's prediction at the row's microbatch. "
                 "Ratios: this row's images/s over the other's (all devices together). Predicted before: the row's "
                 "images/s per GPU predicted from the H100's measurements before this run (" + source_of(predicted)
                 + "; docs/gpu-runs.md, \"Devices\"), and the measurement over it.", "",
                 *run_table(runs, earlier, predicted), ""]
    if blocks:
        text += ["## Blocks (bench/blocks.py: predicted, not measured)", "",
                 "Each distinct block timed on this device, the step composed and a node predicted; the "
                 "comparison rows predict a training row above and divide by its measurement. Ratios: predicted "
                 "samples/s per GPU over the other's; predicted before: the same figure scaled from the H100's "
                 f"blocks before this run ({source_of(predicted)}).", "", *blocks_table(blocks, earlier, predicted), ""]
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
