"""Each row of bench/gpu_report.py planned for the node it runs on: a training row's checkpointing and
microbatch (as benchmark.py's `auto` resolves them, from the memory model) and its launch of benchmark.py
through Composer's launcher; a blocks row's bench/blocks.py command for the set-up it times or the run it
predicts; --smoke's tiny set-ups in their place.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpu.rows import NODE_GPUS, SMOKE_MICROBATCH, ReportRow, Setting, smoke_flags, smoke_setting
from t2ibench.commands.gpu_setup import from_flag

ROOT = Path(__file__).resolve().parents[2]  # the project root
# --smoke: blocks.py's timings cut to the least that runs every part.
SMOKE_BLOCKS_FLAGS = ["--num_workers", "0", "--warmup", "1", "--repeats", "2", "--harness_batches", "2"]


@dataclass
class PlannedRun:
    """A setting planned for a node: its command and what the memory model predicts."""

    name: str
    setting: Setting
    microbatch: int
    batch_size: int
    command: list[str]
    plan: dict = field(default_factory=dict)
    activation_checkpointing: bool = False  # as the run resolves the row's flag on this node


def plan_options(setting: Setting, gpus: int, on_gpu: bool = True) -> dict:
    """The memory model's options for a row's step (t2ibench.memory.plan, gpu_setup.choose_setup) but
    checkpointing, which the node decides."""
    from t2ibench.train.weight_casts import resolve_weight_casts

    return dict(norm_precision=setting.norm_precision, precomputed=setting.precomputed,
                precomputed_format=setting.text_format, fsdp=setting.fsdp, num_gpus=gpus,
                use_ema=setting.use_ema, fp8=setting.fp8,
                weight_casts=resolve_weight_casts(setting.weight_casts, on_gpu=on_gpu, precision="amp_bf16",
                                                  world_size=gpus))


def plan_row(name: str, setting: Setting, gpus: int, gpu_memory_bytes: float, out: Path, batches: int,
             warmup: int, smoke: bool, model_name: str, device=None) -> PlannedRun:
    """The row's set-up (checkpointing as benchmark.py's flag resolves it on this node, and the memory
    model's largest microbatch for it) and its full command: through Composer's launcher on `gpus`
    ranks, or on --smoke's one rank benchmark.py alone. `device` (t2ibench.core.devices.Device, None: an H100's
    rates): the GPU whose launch cost and link `auto` weighs, as benchmark.py's run on it weighs them."""
    from t2ibench import memory
    from t2ibench.commands.gpu_setup import choose_setup

    per_device = setting.global_batch // gpus
    plan = {}
    checkpointing = from_flag(setting.activation_checkpointing)[0]  # --smoke runs on a CPU
    if smoke:  # the tiny model's step, counted as it runs here (the report's counted column)
        tiny = smoke_setting(setting, gpus)
        microbatch, batch_size = SMOKE_MICROBATCH, tiny.global_batch
        plan = memory.plan(tiny.model_config, tiny.resolution, gpu_memory_bytes, activation_checkpointing=checkpointing,
                           **plan_options(tiny, gpus, on_gpu=False))
        plan = {**plan, "microbatch": microbatch, "predicted_bytes_at_microbatch": memory.predicted_bytes(plan, microbatch)}
    else:
        options = plan_options(setting, gpus)
        # Microbatches are powers of two: the largest one at most the per-GPU batch caps them.
        setup = choose_setup(setting.model_config, setting.resolution, gpu_memory_bytes,
                             1 << (per_device.bit_length() - 1),
                             activation_checkpointing=setting.activation_checkpointing, device=device, **options)
        checkpointing = setup.activation_checkpointing
        plan = memory.plan(setting.model_config, setting.resolution, gpu_memory_bytes,
                           activation_checkpointing=checkpointing, **options)
        microbatch = max(1, min(plan["microbatch"], per_device) // setting.microbatch_divisor)
        # The row's global batch when the GPU count divides it; else the largest per-device multiple of
        # the microbatch below it.
        batch_size = gpus * max(microbatch, per_device // microbatch * microbatch)
        plan = {**plan, "microbatch": microbatch, "activation_checkpointing_reason": setup.reason,
                "predicted_bytes_at_microbatch": memory.predicted_bytes(plan, microbatch)}
    # --smoke's one CPU rank runs benchmark.py itself: Composer's launcher is an interpreter of its own
    # importing torch and Composer, seconds of CPU time per row of a smoke run of a few minutes.
    launcher = [sys.executable] if smoke and gpus == 1 else [sys.executable, "-m", "composer.cli.launcher",
                                                              "-n", str(gpus)]
    # Only rows whose step runs a frozen part look it up (--model_name is SD2's); the others build none.
    pretrained = ["--model_name", model_name] if setting.needs_pretrained else []
    command = [*launcher, str(ROOT / "benchmark.py"), "--use_synth_data", *(["--use_ema"] if setting.use_ema else []),
               "--precision", "amp_bf16",
               "--batch_size", str(batch_size), "--device_train_microbatch_size", str(microbatch),
               "--max_duration", f"{batches}ba", "--warmup_batches", str(warmup), "--num_workers", "8",
               "--log_interval", "5ba", *pretrained, "--results_json", str(out / f"{name}.json"), *setting.flags(),
               *(smoke_flags(setting, gpus) if smoke else [])]  # later flags win: --smoke's override
    return PlannedRun(name, setting, microbatch, batch_size, command, plan, checkpointing)


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


def blocks_command(row: ReportRow, args: argparse.Namespace, gpu_memory_bytes: float,
                   measured: dict | None = None) -> tuple[list[str], list[str]]:
    """blocks.py's command for a blocks row, and its notes; a comparison row's from `measured`, the results
    of the run it predicts."""
    if row.compare_with:  # the measured run's own set-up, at its microbatch and device count
        flags, notes = blocks_flags(setting_of(measured), bool(measured.get("activation_checkpointing")))
        flags += ["--microbatch", str(measured["device_train_microbatch_size"]), "--gpus", str(measured["world_size"]),
                  "--compare_results_json", str(args.out / f"{row.compare_with}.json")]
    elif args.smoke:  # one CPU rank, where checkpointing's `auto` is off
        tiny = smoke_setting(row.blocks_of, 1)
        flags, notes = blocks_flags(tiny, from_flag(tiny.activation_checkpointing)[0])
        flags += ["--microbatch", str(SMOKE_MICROBATCH), "--gpus", "1"]
    else:  # the run of its set-up on a node of these GPUs: its checkpointing and microbatch
        node = plan_row(row.name, row.blocks_of, NODE_GPUS, gpu_memory_bytes, args.out, 1, 0, False,
                        args.model_name, args.gpu_device)
        flags, notes = blocks_flags(row.blocks_of, node.activation_checkpointing)
        flags += ["--microbatch", str(node.microbatch), "--gpus", str(NODE_GPUS)]
    return [sys.executable, str(ROOT / "bench" / "blocks.py"), *flags, *(SMOKE_BLOCKS_FLAGS if args.smoke else []),
            "--json"], notes


def run_setting(row: ReportRow, smoke: bool, gpus: int = 1) -> Setting:
    """The set-up a training row runs: its own, or on --smoke its family's tiny model with checkpointing as
    its CPU run resolves the flag (`auto`: off), so that its estimate counts the step it runs, once."""
    if not smoke:
        return row.setting
    tiny = smoke_setting(row.setting, gpus)
    return dataclasses.replace(tiny, activation_checkpointing="on" if from_flag(tiny.activation_checkpointing)[0]
                               else "off")
