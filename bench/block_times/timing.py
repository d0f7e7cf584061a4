"""bench/blocks.py's timing: each part of the step built, run and timed one at a time on the device (so
the device holds one part, never the model), with its peak memory and its compile seconds, or counted
on the meta device (--count_memory); the per-step updates timed per parameter.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import statistics
import sys
import time
from typing import Any, Callable

import torch

from block_times.parts import OPTIMIZER_PROBE_PARAMS, Setup, adamw_step, block_calls, block_step, checkpointing, ema_step, groups, meta_model, meta_rest, rest_step, rows, weight_casts_step
from t2ibench import memory
from t2ibench.train.compiling import compile_seconds
from t2ibench.memory.kernels import KernelCounter
from t2ibench.train.weight_casts import resolve_weight_casts


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class Part:
    """One part of the step: `make_meta` makes its meta-device pieces (no device memory), `build` its
    step on the device from them."""

    make_meta: Callable[[], Any]
    build: Callable[[Any], Callable[[], None]]


def time_part(part: Part, args: argparse.Namespace, compiled: bool = False) -> dict[str, Any]:
    """Build a part, run it --warmup times, time --repeats runs (the median), and free it, so that the
    device holds one part at a time. On a GPU also its peak memory (the allocator's, from its build on).
    A `compiled` part (--compile) first runs once more, untimed, to compile its blocks' forward and
    backward graphs: the seconds torch spends compiling them (t2ibench.train.compiling's timers, None where
    torch keeps none) are reported apart; dynamo's caches are emptied after the part, with the part."""
    device = args.device
    pieces = part.make_meta()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step = part.build(pieces)
    compiling = None
    if compiled:
        before = compile_seconds()
        step()
        after = compile_seconds()
        compiling = after - before if before is not None and after is not None else None
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del step, pieces
    if compiled:
        torch._dynamo.reset()  # its caches hold guards on the part's modules: they go with the part
    if device == "cuda":
        # What a reference cycle still holds of the part goes before the next part is built (a second
        # here, minutes of GPU timing around it), and the allocator's cache with it.
        gc.collect()
        torch.cuda.empty_cache()
    return {"seconds": statistics.median(times), "peak_memory_bytes": peak, "compile_seconds": compiling}


def count_part(part: Part) -> int:
    """Bytes a part needs at its peak on the meta device, counted by t2ibench.memory: built (weights,
    the gradients of accumulation's steady state, copies, inputs) and run once."""
    pieces = part.make_meta()
    with memory.LiveBytes() as live:
        part.build(pieces)()
        return live.peak_bytes


def step_parts(args: argparse.Namespace, setup: Setup, device: str) -> tuple[dict[str, list[str]], dict[str, Part]]:
    """The distinct blocks (label -> the names of the blocks like it), and the parts of the step on
    `device` ("meta" to count them): the block of each label, and the rest (the model with every block a
    stand-in), each taken from one meta model with the run's checkpointing on (the layers a block holds
    that the model checkpoints carry it along; `wrap` is the model's function for a block it
    checkpoints whole) and, to be counted, float8 as the memory model converts it."""
    calls = block_calls(args, setup)
    model = meta_model(args, False)
    if args.fp8 != "off" and device == "meta":
        memory.use_float8(model, args.fp8, rows(args), memory.autocast_dtype(args.precision), args.device_type)
    wrap = checkpointing(args, model, device)
    modules = dict(model.denoiser.named_modules())
    members = groups(model.denoiser, args.model_config)
    built = {label: Part(functools.partial(copy.deepcopy, modules[names[0]]),
                         lambda part, name=names[0]: block_step(args, setup, name, calls, part, wrap, device))
             for label, names in members.items()}
    built["the rest"] = Part(functools.partial(meta_rest, model, calls, args.model_config),
                             lambda rest: rest_step(args, setup, rest, device))
    return members, built


def update_parts(args: argparse.Namespace) -> dict[str, Part]:
    """The per-step updates the run makes, each timed over OPTIMIZER_PROBE_PARAMS parameters."""
    probes = {"adamw": adamw_step}
    if args.use_ema:
        probes["ema"] = ema_step
    if any(setup.weight_casts == "step" for setup in args.setups.values()):
        probes["weight_casts"] = weight_casts_step
    return {name: Part(lambda: None, lambda _, make=make: make(args)) for name, make in probes.items()}


def measure(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    """Every block and the rest timed on the device with the weights as `setup` holds them."""
    members, built = step_parts(args, setup, args.device)
    timed = {}
    for label, part in built.items():
        print(f"  {label}...", file=sys.stderr, flush=True)
        timed[label] = time_part(part, args, compiled=args.compile)
    blocks = [{"name": label, "count": len(names), **timed[label]} for label, names in members.items()]
    rest = timed["the rest"]["seconds"]
    return {"blocks": blocks, "rest_seconds": rest, "rest_peak_memory_bytes": timed["the rest"]["peak_memory_bytes"],
            "rest_compile_seconds": timed["the rest"]["compile_seconds"],
            "composed_microbatch_seconds": rest + sum(b["count"] * b["seconds"] for b in blocks)}


def measure_updates(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per parameter of AdamW, the EMA and one GPU's weight casts (0 where the run has none)."""
    timed = {name: time_part(part, args)["seconds"] / OPTIMIZER_PROBE_PARAMS
             for name, part in update_parts(args).items()}
    return {"adamw_seconds_per_param": timed["adamw"], "ema_seconds_per_param": timed.get("ema", 0.0),
            "weight_casts_seconds_per_param": timed.get("weight_casts", 0.0)}


def count_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Each part's counted peak bytes on the meta device for a CUDA GPU, per set-up, beside the fixed
    bytes of a one-GPU run of these settings (weights, gradients, AdamW, EMA, copies: what benchmark.py
    holds before any activation)."""
    one_gpu = Setup(False, resolve_weight_casts(args.weight_casts, on_gpu=True, precision=args.precision,
                                                world_size=1))
    run_fixed = memory.fixed_bytes(args.model_config, precision=args.precision, precomputed=args.precomputed,
                                   precomputed_format=args.text_format, use_ema=args.use_ema, fsdp="none",
                                   num_gpus=1, weight_casts=one_gpu.weight_casts)
    counted = {}
    for setup in unique_setups(args):
        _, built = step_parts(args, setup, "meta")
        counted[setup.label] = {label: count_part(part) for label, part in built.items()}
    largest = max(n for per_part in counted.values() for n in per_part.values())
    return {"parts_bytes": counted, "largest_part_bytes": largest,
            "one_gpu_run_fixed_bytes": sum(run_fixed.values()), "one_gpu_run_fixed_breakdown": run_fixed}


def unique_setups(args: argparse.Namespace) -> list[Setup]:
    return sorted(set(args.setups.values()), key=lambda s: (s.sharded, s.weight_casts))


# count_work's counts by the settings they depend on: a prediction for several GPUs counts each set-up once.
_WORK: dict[tuple, dict] = {}


def count_work(args: argparse.Namespace, setup: Setup) -> dict[str, tuple[list[tuple[float, float, bool]], int]]:
    """Each part's work on the meta device (per op its FLOPs, bytes and float8: t2ibench.memory.kernels.op_work) and
    its kernel launches, for the rule that scales its measured time to another GPU (t2ibench.core.devices)."""
    key = (setup, args.device_type, args.microbatch, *(getattr(args, name) for name in (
        "model_config", "image_size", "precision", "norm_precision", "precomputed", "text_format",
        "activation_checkpointing", "fp8", "use_ema")))
    if key not in _WORK:
        _WORK[key] = _counted_work(args, setup)
    return _WORK[key]


def _counted_work(args: argparse.Namespace, setup: Setup) -> dict[str, tuple[list[tuple[float, float, bool]], int]]:
    _, built = step_parts(args, setup, "meta")
    counted = {}
    for label, part in built.items():
        step = part.build(part.make_meta())
        counter = KernelCounter(work=True)
        with counter:
            step()
        counted[label] = (counter.work, sum(counter.kernels.values()))
    return counted
