"""The node predicted from one device: each repeated block of the denoiser timed, the full step composed,
the sharded-training traffic added, samples/s per GPU predicted for a node.

    python bench/blocks.py --model_config flux1-schnell --precomputed --microbatch 8 --compile --fp8 tensorwise  # a GPU
    python benchmark.py --model_config flux1-tiny --precomputed --use_synth_data --batch_size 8 --image_size 64 \\
        --max_duration 40ba --warmup_batches 10 --num_workers 0 --results_json run.json                # CPU check:
    python bench/blocks.py --model_config flux1-tiny --precomputed --image_size 64 --global_batch 8 --microbatch 8 \\
        --gpus 1 --num_workers 0 --compare_results_json run.json --json                                # the run, predicted
    python bench/blocks.py --model_config flux1-schnell --precomputed --activation_checkpointing --fsdp shard_grad_op \\
        --microbatch 64 --gpus 8 --measured_json results/h100-2026-11-26/blocks2.jsonl           # again, no GPU
    python bench/blocks.py --model_config sdxl-base --precomputed --precomputed_format text_states --use_ema \\
        --activation_checkpointing --global_batch 64 --microbatch 32 --gpus 1 --count_memory            # each part's memory

A model that fits no single GPU (Flux.1-schnell: about 190 GB of training state) cannot be run on the
one GPU a user has, but each of its blocks can. On the visible device (CUDA, else CPU), set up as
benchmark.py sets it up (t2ibench.runtime: cuDNN's autotuner on a GPU, threads on a CPU), this builds,
times and frees one part at a time (so the device holds one part, never the model): the forward and
backward of one microbatch through one of each distinct repeated block of the denoiser (the family's
FSDP units, `ModelFamily.fsdp_blocks`: Flux.1's double-stream and single-stream blocks; one block per
resolution level of SD2's and SDXL's UNets), with the inputs the full model hands it (shapes and
dtypes read off the step on the meta device; fresh each time, as a block's input gradient is handed
on, not summed), under the run's precision, norms, `--fp8` (t2ibench.fp8), weights (FSDP's gathered
bf16 copy; one GPU's bf16 copies cast once per step, t2ibench.weight_casts) and
`--activation_checkpointing` (diffusers' gradient checkpointing, as benchmark.py turns it on: each
layer the model checkpoints, recomputed in backward). Each part's time is the median of `--repeats`
after `--warmup` runs. "The rest" is the training model's step with every block replaced by a stand-in
of zero cost (its outputs' shapes out, zeros back): embedders, final layer, noising, loss, and the
frozen encoders where they run. The optimizer (AdamW as benchmark.py runs it), the EMA update
(`--use_ema`) and one GPU's weight casts per step are timed per parameter, and the harness (Composer's
Trainer, the run's loader and the throughput callback, around a model of one parameter) per step at
the run's per-device batch and microbatch.

The step of the full model, per GPU of `G`, per-GPU batch `B/G` in microbatches of `m`:

    compute = (B/G / m) x (rest + sum over blocks of count x block)
              + params per GPU x (AdamW + EMA [+ weight casts, one GPU]) + harness
    traffic = the bytes the run sends per GPU per step (t2ibench.parallel.traffic_bytes_per_gpu, which
              gpu_setup's choice of set-up weighs too; ring collectives, each GPU sending (G-1)/G of
              the buffer): DDP one fp32 all-reduce of the gradients per step (2x); under Composer
              0.32.1's FSDP2 every microbatch gathers the weights again and reduce-scatters its
              gradients in fp32: full_shard two all-gathers of the weights in the autocast dtype
              (forward, backward; the root unit's one), shard_grad_op one (kept from forward to
              backward). One microbatch per step (microbatch = per-GPU batch) sends each once: the
              Flux.1 set-up of docs/flux.md
    predicted samples/s per GPU = (B/G) / (compute + traffic / --link_gbps)   (not overlapped; the JSON's)
                                = (B/G) / max(compute, traffic / --link_gbps)  (fully overlapped)

`--link_gbps` is in gigabytes per second per direction per GPU (default: NVLink 4 on an H100, 450);
a multi-node figure takes the slower inter-node rate. The prediction is labelled **predicted**: it
assumes a node of the device it ran on and times nothing of a node (no collective, no straggler).
`--compile` compiles each part as benchmark.py's `--compile` compiles the run (t2ibench.compiling with
the family's `compile_blocks`: the blocks inside each block timed, the encoders' layers in the rest);
each part first runs once untimed to compile, and its compile seconds are reported apart from its timed
runs. `--fp8` needs `--compile`, by benchmark.py's rule and in its words (t2ibench.fp8.check_compiled).
`--compare_results_json` reads a benchmark.py run of the same set-up (refused, before any timing,
when any setting that changes the step differs, `--compile` included, or its device is not this one)
and prints the ratio of the prediction for its device count to its measured images/s per device.
`--measured_json FILE` times nothing: it reads a line blocks.py wrote with `--json` (a .jsonl, or a log
ending in it), the first whose measured settings are this run's (`--compile` among them; a line older than
the flag timed the eager parts), and predicts again from its times for other `--gpus`, `--fsdp`,
`--global_batch` or `--link_gbps`, on any machine; a `--microbatch` that is a whole multiple of the
measured one scales its times (per-image time held). `--count_memory` times nothing: it counts each part's memory on the meta device for a CUDA GPU (t2ibench.memory) beside a
one-GPU run's fixed bytes. `--json` ends with one line: the measured times, the composition and
`predicted` (a list of {gpus, samples_per_sec_per_gpu}).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project root: run as python bench/NAME.py

from bench_gpu import GLOBAL_BATCH, MLPERF_FLUX_GLOBAL_BATCH  # noqa: E402
from t2ibench import checks, errors, flags, fp8, memory, precomputed  # noqa: E402
from t2ibench.cli import (BATCH_SIZE, GPU_COUNT, IMAGE_SIZE, MAX_REPEATS, NON_NEGATIVE_INT, POSITIVE_FLOAT,  # noqa: E402
                          REPEATS, SEED, WARMUP_REPEATS, Parser, Range, check_workers)
from t2ibench.compiling import compile_blocks, compile_seconds, compile_step_parts  # noqa: E402
from t2ibench.errors import fail  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, family_of  # noqa: E402
from t2ibench.norms import NORM_PRECISIONS, set_norm_precision  # noqa: E402
from t2ibench.parallel import (FSDP_CHOICES, NVLINK4_GB_PER_SEC, resolve_mode,  # noqa: E402
                               traffic_bytes_per_gpu)
from t2ibench.precision import PRECISION_CHOICES, resolve_precision  # noqa: E402
from t2ibench.precomputed import TEXT_FORMATS  # noqa: E402
from t2ibench.scale import MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU  # noqa: E402
from t2ibench.weight_casts import (WEIGHT_CAST_CHOICES, CastWeightsOncePerStep, resolve_weight_casts,  # noqa: E402
                                   weight_casts_problem)

OPTIMIZER_PROBE_PARAMS = 2**22  # at least this many parameters per optimizer, EMA and weight-cast timing (4M)
# fp16 is left out: fp8 refuses it and MLPerf's reference runs bf16.
PRECISIONS = tuple(p for p in PRECISION_CHOICES if p != "amp_fp16")
# The harness needs one batch after its warm-up to time.
HARNESS_BATCHES = Range(int, 2, MAX_REPEATS)


def build_parser() -> Parser:
    p = Parser("blocks.py", description=__doc__)
    g = p.add_argument_group("the run predicted (benchmark.py's flags)")
    g.add_argument("--model_config", type=str, default="flux1-schnell", choices=sorted(MODEL_CONFIGS),
                   help="the model")
    g.add_argument("--image_size", type=IMAGE_SIZE, default=None, help="pixels (default: the family's: 256 for Flux.1)")
    g.add_argument("--global_batch", type=BATCH_SIZE, default=None,
                   help=f"images per step over all GPUs (default: MLPerf's {MLPERF_FLUX_GLOBAL_BATCH} for Flux.1, "
                        f"{GLOBAL_BATCH} otherwise)")
    g.add_argument("--microbatch", type=BATCH_SIZE, default=None,
                   help="images per GPU per forward/backward (default: on a GPU the memory model's largest that "
                        "fits its memory at every --gpus count and divides the per-GPU batch of the largest; on a "
                        "CPU 8, or that batch when smaller)")
    g.add_argument("--precision", type=str, default="auto", choices=PRECISIONS, help="auto: amp_bf16 on a GPU, fp32 on CPU")
    g.add_argument("--norm_precision", type=str, default="autocast", choices=NORM_PRECISIONS, help="as benchmark.py's")
    g.add_argument("--precomputed", action="store_true", help="precomputed latents (no VAE in the step)")
    g.add_argument("--precomputed_format", type=str, default=None, choices=TEXT_FORMATS,
                   help="with --precomputed: token ids or text states (default: the family's, text states for Flux.1)")
    g.add_argument("--activation_checkpointing", action="store_true",
                   help="recompute in backward what diffusers' gradient checkpointing recomputes (benchmark.py's flag)")
    g.add_argument("--weight_casts", type=str, default="auto", choices=WEIGHT_CAST_CHOICES,
                   help="as benchmark.py's, for the one-GPU prediction (several GPUs cast per microbatch); auto: "
                        "step on a CUDA device under amp_bf16, else microbatch")
    flags.add_fp8(g)
    g.add_argument("--compile", action="store_true",
                   help="compile each part's blocks as benchmark.py's --compile compiles the run's "
                        "(t2ibench.compiling); each part's compile seconds are reported apart from its timed runs; "
                        "needed by --fp8")
    g.add_argument("--use_ema", action="store_true", help="add the EMA update per step (MLPerf's Flux.1 runs none)")
    g.add_argument("--fsdp", type=str, default="auto", choices=FSDP_CHOICES,
                   help="sharding on several GPUs, as benchmark.py's (auto: full_shard for Flux.1, else DDP)")
    g.add_argument("--num_workers", type=NON_NEGATIVE_INT, default=8, help="loader processes of the harness, as benchmark.py's")
    g = p.add_argument_group("the node and the measurement")
    g.add_argument("--gpus", type=GPU_COUNT, nargs="+", default=[8, 16], help="GPU counts to predict for")
    g.add_argument("--link_gbps", type=POSITIVE_FLOAT, default=NVLINK4_GB_PER_SEC,
                   help="gigabytes (not bits) per second per direction per GPU for the collectives")
    g.add_argument("--warmup", type=WARMUP_REPEATS, default=3, help="untimed runs of each part first")
    g.add_argument("--repeats", type=REPEATS, default=10, help="timed runs of each part (the median is taken)")
    g.add_argument("--harness_batches", type=HARNESS_BATCHES, default=12, help="batches the harness is timed over")
    g.add_argument("--seed", type=SEED, default=17, help="seeds the random weights and inputs")
    g.add_argument("--compare_results_json", type=str, default=None,
                   help="a benchmark.py --results_json of the same set-up on this device: print the prediction "
                        "against it (checked before any timing)")
    g.add_argument("--measured_json", type=str, default=None,
                   help="time nothing: predict from a line blocks.py wrote with --json (a .jsonl or a log ending "
                        "in it; the line whose measured set-up is this one's), on any machine")
    g.add_argument("--count_memory", action="store_true",
                   help="time nothing: count each part's memory on the meta device for a CUDA GPU, beside a "
                        "one-GPU run's fixed bytes")
    g.add_argument("--json", action="store_true", help="end with one line of JSON")
    return p


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a run holds the weights its blocks compute with: replicated (DDP, or one GPU) or sharded
    (FSDP: gathered in the autocast dtype), and cast by autocast in every microbatch or once per step
    into bf16 copies (t2ibench.weight_casts)."""

    sharded: bool
    weight_casts: str  # "microbatch" or "step"

    @property
    def label(self) -> str:
        return "sharded" if self.sharded else "replicated" if self.weight_casts == "microbatch" else "cast_per_step"

    def describe(self) -> str:
        return {"sharded": "sharded (FSDP: gathered in the autocast dtype)", "replicated": "replicated",
                "cast_per_step": "replicated, cast once per step into bf16 copies"}[self.label]

    def low_precision_weights(self, precision: str) -> bool:
        """The forward computes with weights in the autocast dtype (FSDP's gathered copy, the bf16 copies)."""
        return precision != "fp32" and (self.sharded or self.weight_casts == "step")


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """The flags with every default resolved and what the prediction derives from them (device,
    text_format, setups, compared), in a new namespace: the parsed one is left as it was parsed."""
    family = family_of(parsed.model_config)
    image_size = parsed.image_size or family.default_image_size(parsed.model_config)
    multiple = family.latent_downsample * family.patch_size
    if image_size % multiple:
        fail(f"--image_size {image_size} must be a multiple of {multiple} for {parsed.model_config}")
    too_many = check_workers("--num_workers", parsed.num_workers)
    if too_many:
        fail(too_many)
    if parsed.measured_json and (parsed.count_memory or parsed.compare_results_json):
        fail("--measured_json predicts from a saved measurement: give --count_memory or --compare_results_json "
             "in a run without it")
    lines = measured_lines(parsed.measured_json) if parsed.measured_json else None
    on_gpu = torch.cuda.is_available()
    if lines is not None:  # the device the measurement ran on, not this machine's
        on_gpu = lines[0]["device"] != "cpu"
    # --count_memory counts for a CUDA GPU (this one, or an H100's memory) whatever runs it.
    gpu_step = on_gpu or parsed.count_memory
    precision = resolve_precision(parsed.precision, gpu_step)
    fp8.check(parsed.fp8, precision)
    if parsed.precomputed_format and not parsed.precomputed:
        fail("--precomputed_format needs --precomputed")
    if parsed.count_memory and parsed.compare_results_json:
        fail("--count_memory times nothing: compare with --compare_results_json in a run without it")
    text_format = precomputed.batch_text_format(family, parsed.precomputed, parsed.precomputed_format)
    global_batch = parsed.global_batch or (MLPERF_FLUX_GLOBAL_BATCH if family.name == "flux" else GLOBAL_BATCH)
    for gpus in parsed.gpus:
        if global_batch % gpus:
            fail(f"--global_batch {global_batch} is not a multiple of --gpus {gpus}: every GPU takes the same "
                 "number of images; pick a batch all --gpus counts divide")
    setups = {}
    for gpus in parsed.gpus:
        problem = weight_casts_problem(parsed.weight_casts, precision=precision, world_size=gpus)
        if problem:
            fail(f"{problem} (or predict for --gpus 1 alone)")
        sharded = resolve_mode(parsed.fsdp, family.parallelism, gpus) != "none"
        casts = resolve_weight_casts(parsed.weight_casts, on_gpu=gpu_step, precision=precision, world_size=gpus)
        # FSDP gathers its own bf16 copy of each unit: t2ibench.weight_casts' copies are for one device.
        setups[gpus] = Setup(sharded, "microbatch" if sharded else casts)
    # benchmark.py's rule, for every set-up predicted: float8 compiled, rowwise on bf16 weights.
    fp8.check_compiled(parsed.fp8, parsed.compile, fp32_weights_under_autocast=precision != "fp32" and any(
        not setup.low_precision_weights(precision) for setup in setups.values()),
        sharded_under_autocast=precision != "fp32" and any(setup.sharded for setup in setups.values()))
    microbatch = parsed.microbatch
    if microbatch is None and lines is not None:
        microbatch = lines[0]["microbatch"]  # the first line's: the one measured, when it is this set-up
    if microbatch is None:
        per_gpu = global_batch // max(parsed.gpus)  # a microbatch that divides every count's per-GPU batch
        if gpu_step:  # the largest that fits at every count (fewer GPUs shard less: more fixed bytes each)
            gpu_memory_bytes = (torch.cuda.get_device_properties(0).total_memory if on_gpu
                                else memory.GPU_MEMORY_GIB["H100 80GB"] * memory.GIB)
            microbatch = max(1, min(memory.plan(
                parsed.model_config, image_size, gpu_memory_bytes, precision=precision,
                norm_precision=parsed.norm_precision, precomputed=parsed.precomputed, precomputed_format=text_format,
                use_ema=parsed.use_ema, fsdp=resolve_mode(parsed.fsdp, family.parallelism, gpus), num_gpus=gpus,
                per_device_batch=per_gpu, activation_checkpointing=parsed.activation_checkpointing,
                weight_casts=setups[gpus].weight_casts, fp8=parsed.fp8)["microbatch"] for gpus in parsed.gpus))
        else:
            microbatch = min(8, per_gpu)
    for gpus in parsed.gpus:
        if (global_batch // gpus) % microbatch:
            fail(f"--global_batch {global_batch} over --gpus {gpus} is {global_batch // gpus} per GPU, "
                 f"which --microbatch {microbatch} does not divide; pick a batch all --gpus counts divide")
    args = argparse.Namespace(**{**vars(parsed), "image_size": image_size, "device": "cuda" if on_gpu else "cpu",
                                 "device_type": "cuda" if gpu_step else "cpu", "precision": precision,
                                 "text_format": text_format, "global_batch": global_batch, "microbatch": microbatch,
                                 "setups": setups})
    # A saved line stands for the resolved settings only, so it is chosen once they are.
    args = argparse.Namespace(**{**vars(args), "saved": saved_measurement(args, lines) if lines else None})
    # The compared run is checked against the resolved settings, so it is added to them last.
    return argparse.Namespace(**{**vars(args), "compared": compared_run(args) if args.compare_results_json else None})


def mode_for(args: argparse.Namespace, gpus: int) -> str:
    """The sharding of a run on `gpus` GPUs (`--fsdp auto` resolved as benchmark.py resolves it)."""
    return resolve_mode(args.fsdp, family_of(args.model_config).parallelism, gpus)


def device_name(device: str) -> str:
    """The device as benchmark.py's results JSON names it ("device")."""
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# -- a saved measurement: the prediction again, without a device ----------------------------------

# What a saved line's times depend on (blocks.py's JSON keys, and this prediction's value of each):
# a line stands for a set-up only when all agree. The sharding, the GPU counts, the global batch
# and the link rate are the composition's, not the measurement's, and may change.
def measured_set_up(args: argparse.Namespace) -> dict[str, Any]:
    return {"model_config": args.model_config, "image_size": args.image_size, "precision": args.precision,
            "norm_precision": args.norm_precision, "precomputed": args.precomputed,
            "precomputed_format": args.text_format, "activation_checkpointing": args.activation_checkpointing,
            "fp8": args.fp8, "compile": args.compile, "use_ema": args.use_ema}


# Lines written before blocks.py had --compile timed the eager parts.
ABSENT_IN_OLDER_LINES = {"compile": False}


def measured_lines(path: str) -> list[dict[str, Any]]:
    """The lines of `path` that blocks.py wrote with --json (a JSON object holding `measured`), in
    order: a .jsonl of several, or a log that ends with one. Refused in one line when there is none."""
    where = f"--measured_json {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        fail(f"{where}: cannot be read ({getattr(error, 'strerror', None) or error}); give a file holding a line "
             "blocks.py wrote with --json")
    lines = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue  # a log's other lines
        if (isinstance(value, dict) and isinstance(value.get("measured"), dict)
                and isinstance(value.get("device"), str) and not BATCH_SIZE.problem(value.get("microbatch"))
                and isinstance(value.get("microbatch"), int)):
            lines.append(value)
    if not lines:
        fail(f"{where}: holds no line blocks.py wrote with --json (a JSON object with measured, device and "
             "microbatch); give blocks.py's --json output")
    return lines


def saved_measurement(args: argparse.Namespace, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The first line of --measured_json whose measured set-up is this prediction's: the same settings
    that change a block's time, weights held as every --gpus count holds them, and a microbatch that
    --microbatch is a whole multiple of (its times scaled by that multiple: the per-image time of the
    measured microbatch held, a bound from above where a larger microbatch runs no slower per image).
    Refused in one line, naming what the lines differ in, when none is."""
    wanted, labels = measured_set_up(args), {setup.label for setup in args.setups.values()}
    reasons = []
    for number, line in enumerate(lines, 1):
        theirs = {key: line.get(key, ABSENT_IN_OLDER_LINES.get(key)) for key in wanted}
        differs = [f"{key} {json.dumps(theirs[key])} (this prediction's {json.dumps(value)})"
                   for key, value in wanted.items() if theirs[key] != value or type(theirs[key]) is not type(value)]
        missing = sorted(labels - set(line["measured"]))
        if missing:
            differs.append(f"no times for weights {', '.join(missing)} (it measured "
                           f"{', '.join(sorted(line['measured']))}: predict for --gpus counts that hold them so)")
        if args.microbatch % line["microbatch"]:
            differs.append(f"microbatch {line['microbatch']}, which --microbatch {args.microbatch} is no multiple of")
        if not differs:
            return {"path": args.measured_json, "line": line, "scale": args.microbatch // line["microbatch"]}
        reasons.append(f"line {number}: {differs[0]}")
    fail(f"--measured_json {args.measured_json}: no line measured this set-up ({'; '.join(reasons[:3])}); "
         "predict with the flags it was measured with")


def saved_parts(args: argparse.Namespace) -> tuple[dict[str, dict], dict[str, float], float, int]:
    """From --measured_json's line: each weights' times per microbatch (scaled to --microbatch), the
    per-parameter updates, the harness per image, and the denoiser's parameters."""
    line, scale = args.saved["line"], args.saved["scale"]
    measured = {}
    for label in {setup.label for setup in args.setups.values()}:
        times = line["measured"][label]
        measured[label] = {
            "blocks": [{**b, "seconds": scale * b["seconds"],
                        # a peak measured at another microbatch is not this one's
                        "peak_memory_bytes": b.get("peak_memory_bytes") if scale == 1 else None,
                        # nor is its compile (lines written before --compile have none)
                        "compile_seconds": b.get("compile_seconds") if scale == 1 else None}
                       for b in times["blocks"]],
            "rest_seconds": scale * times["rest_seconds"],
            "rest_peak_memory_bytes": times.get("rest_peak_memory_bytes") if scale == 1 else None,
            "rest_compile_seconds": times.get("rest_compile_seconds") if scale == 1 else None,
            "composed_microbatch_seconds": scale * times["composed_microbatch_seconds"]}
    # Lines written before `per_parameter` (7e20acc) keep the updates beside the times.
    per_parameter = line.get("per_parameter") or next(iter(line["measured"].values()))
    updates = {key: float(per_parameter.get(key, 0.0)) for key in
               ("adamw_seconds_per_param", "ema_seconds_per_param", "weight_casts_seconds_per_param")}
    if any(s.weight_casts == "step" for s in args.setups.values()) and not updates["weight_casts_seconds_per_param"]:
        fail(f"--measured_json {args.measured_json}: the line has no weight casts' time; predict for sharded "
             "--gpus counts, or measure with --weight_casts step")
    harness_per_image = line["harness_seconds_per_step"] / line["harness_per_device_batch"]
    return measured, updates, harness_per_image, int(line["denoiser_params"])


# -- the run compared: its set-up must be this prediction's -----------------------------------------

def compared_run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark.py results JSON of --compare_results_json, refused in one line (before any timing)
    unless it holds a finite positive measured rate, ran on this device, on one of the --gpus counts,
    and with the set-up this prediction times in every setting that changes the step."""
    path = args.compare_results_json
    where = f"--compare_results_json {path}"
    try:
        measured = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        fail(f"{where}: cannot be read ({getattr(error, 'strerror', None) or error}); give a benchmark.py "
             "--results_json file")
    except ValueError as error:
        fail(f"{where}: not JSON ({error}); give a benchmark.py --results_json file")
    if not isinstance(measured, dict):
        fail(f"{where}: not a benchmark.py results JSON (a {type(measured).__name__}, not an object)")
    rate = measured.get("images_per_sec_per_device")
    if POSITIVE_FLOAT.problem(rate):
        fail(f"{where}: images_per_sec_per_device is {json.dumps(rate)}, not a finite positive number "
             "(a run that measured nothing, or not a benchmark.py results JSON)")
    world_size = measured.get("world_size")
    if GPU_COUNT.problem(world_size) or not isinstance(world_size, int):
        fail(f"{where}: world_size is {json.dumps(world_size)}, not a device count ({GPU_COUNT.describe()})")
    if world_size not in args.gpus:
        fail(f"{where}: the run had {world_size} device(s), which --gpus {' '.join(map(str, args.gpus))} "
             f"does not predict; add {world_size} to --gpus")
    ours = device_name(args.device)
    if measured.get("device") != ours:
        fail(f"{where}: the run's device is {json.dumps(measured.get('device'))}, this prediction's is "
             f"{json.dumps(ours)}; predict on the device the run measured")
    for key, (wanted, how) in run_setup(args, world_size).items():
        if key not in measured:
            fail(f"{where}: it has no {key} (written by another version of benchmark.py?); rerun it with this one")
        theirs = measured[key]
        if key == "fsdp" and isinstance(theirs, str):  # written as given: compared as its run resolved it
            theirs = resolve_mode(theirs, family_of(args.model_config).parallelism, world_size)
        if type(theirs) is not type(wanted) or theirs != wanted:
            fail(f"{where}: its {key} is {json.dumps(theirs)}, this prediction's is {json.dumps(wanted)}; {how}")
    return measured


def run_setup(args: argparse.Namespace, gpus: int) -> dict[str, tuple[Any, str]]:
    """Every setting of a benchmark.py results JSON that changes the step, as a run on `gpus` GPUs of
    this prediction's set-up writes it, with what to do when the compared run's differs."""
    def same(flag: str) -> str:
        return f"predict with the run's setting ({flag})"

    def eager(flag: str) -> str:
        return f"blocks.py times the eager step: compare with a run without {flag}"

    amp = args.precision in ("amp_bf16", "amp_fp16")
    return {
        "model_config": (args.model_config, same("--model_config")),
        "image_size": (args.image_size, same("--image_size")),
        "global_batch_size": (args.global_batch, same("--global_batch")),
        "device_train_microbatch_size": (args.microbatch, same("--microbatch")),
        "precision": (args.precision, same("--precision")),
        "norm_precision": (args.norm_precision if amp else None, same("--norm_precision")),
        "precomputed": (args.precomputed, same("--precomputed")),
        "precomputed_format": (args.text_format, same("--precomputed_format")),
        "use_ema": (args.use_ema, same("--use_ema")),
        "activation_checkpointing": (args.activation_checkpointing, same("--activation_checkpointing")),
        "weight_casts": (args.setups[gpus].weight_casts, same("--weight_casts")),
        "fp8": (args.fp8, same("--fp8")),
        "fsdp": (mode_for(args, gpus), same("--fsdp")),
        "fused_adamw": (args.device == "cuda", "blocks.py times AdamW as benchmark.py's default runs it (fused on "
                                               "a GPU): compare with a run of --fused_adamw auto"),
        "compile": (args.compile, same("--compile")),
        "channels_last": (False, eager("--channels_last")),
        "xformers": (False, eager("--xformers")),
        # The harness loads synthetic batches: a run's own data adds its loader's cost.
        "data": ("synthetic", "blocks.py's harness loads synthetic batches: compare with a --use_synth_data run"),
    }


# -- the step on the meta device: where the blocks are and what they see --------------------------

def meta_model(args: argparse.Namespace, low_precision: bool) -> Any:
    """The training model on the meta device; `low_precision`: the denoiser's weights in the autocast
    dtype, as the forward sees them under FSDP or weight copies."""
    dtype = memory.autocast_dtype(args.precision)
    return memory.build_meta_model(args.model_config, precomputed=args.precomputed,
                                   precomputed_format=args.text_format, frozen_dtype=dtype,
                                   denoiser_dtype=dtype if low_precision else None)


def autocast_policy(args: argparse.Namespace) -> memory.AutocastPolicy:
    policy = memory.CUDA_AUTOCAST if args.device_type == "cuda" else memory.probe_cpu_autocast()
    return policy.with_norms(args.norm_precision)


@dataclasses.dataclass
class BlockCalls:
    """What one meta-device step shows of the blocks, by name: inputs (args, kwargs), outputs, and the
    blocks the model's own gradient checkpointing wraps whole (Flux.1's; a UNet checkpoints the layers
    inside its levels)."""

    inputs: dict[str, tuple]
    outputs: dict[str, Any]
    wrapped: set[str]


def block_calls(args: argparse.Namespace, setup: Setup) -> BlockCalls:
    """Each block's inputs and outputs in one meta-device step at --microbatch, under the device's
    autocast rules, and (with --activation_checkpointing) which blocks the denoiser checkpoints whole."""
    model = meta_model(args, setup.low_precision_weights(args.precision))
    dtype = memory.autocast_dtype(args.precision)
    if args.fp8 != "off":
        memory.use_float8(model, args.fp8, rows(args), dtype, args.device_type)
    names = block_names(model.denoiser, args.model_config)
    checkpointed: set[int] = set()
    if args.activation_checkpointing:
        def record(module: Any, *call_args: Any) -> Any:  # what the model hands its checkpoint function
            checkpointed.add(id(module))
            return module(*call_args)
        model.denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=record)
    inputs, outputs = {}, {}
    handles = []
    for name, block in names.items():
        handles.append(block.register_forward_pre_hook(
            lambda module, a, k, name=name: inputs.__setitem__(name, (a, k)), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda module, a, out, name=name: outputs.__setitem__(name, out)))
    # With autograd on: what requires grad at a block's inputs (its backward computes their gradients).
    with memory.AutocastRules(autocast_policy(args), dtype, args.device_type), torch.random.fork_rng(devices=[]):
        model(memory.meta_batch(model, args.model_config, args.image_size, args.microbatch))
    for handle in handles:
        handle.remove()
    return BlockCalls(inputs, outputs, {name for name, block in names.items() if id(block) in checkpointed})


def block_names(denoiser: torch.nn.Module, model_config: str) -> dict[str, torch.nn.Module]:
    """The family's blocks (its FSDP units) by their names in the denoiser, in order."""
    blocks = {id(b) for b in family_of(model_config).fsdp_blocks(denoiser)}
    return {name: module for name, module in denoiser.named_modules() if id(module) in blocks}


def rows(args: argparse.Namespace) -> dict[str, int]:
    return memory.linear_rows_per_sample(args.model_config, args.image_size, args.text_format)


def groups(denoiser: torch.nn.Module, model_config: str) -> dict[str, list[str]]:
    """Blocks of one structure (class and parameter shapes) together: 'transformer_blocks.*' -> names."""
    by_structure: dict[tuple, list[str]] = {}
    for name, block in block_names(denoiser, model_config).items():
        key = (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
        by_structure.setdefault(key, []).append(name)
    labelled = {}
    for names in by_structure.values():
        prefixes = {name.rsplit(".", 1)[0] for name in names}
        label = f"{prefixes.pop()}.*" if len(names) > 1 and len(prefixes) == 1 else names[0]
        labelled[label] = names
    return labelled


# -- the parts, each built on a device ("meta" to count its memory) -----------------------------------

def checkpointing(args: argparse.Namespace, model: Any, device: str) -> Callable[..., Any] | None:
    """Turn on the denoiser's gradient checkpointing as the run does (--activation_checkpointing) and
    return the function the model wraps a checkpointed module with. On a device: diffusers' own, as
    benchmark.py calls `enable_gradient_checkpointing()`; on the meta device the memory model's, which
    recomputes under its autocast rules."""
    if not args.activation_checkpointing:
        return None
    if device == "meta":
        memory.use_checkpointing(model, autocast_policy(args), memory.autocast_dtype(args.precision),
                                 args.device_type)
    else:
        model.denoiser.enable_gradient_checkpointing()
    return next(m._gradient_checkpointing_func for m in model.denoiser.modules()
                if getattr(m, "gradient_checkpointing", False))


def materialize(module: torch.nn.Module, device: str, seed: int) -> torch.nn.Module:
    """A meta-device module on `device` with random weights (timing does not depend on their values)."""
    module = module.to_empty(device=device)
    if device == "meta":
        return module
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=generator)
        for b in module.buffers():
            b.zero_()
    return module


def real_tensors(tree: Any, device: str, seed: int) -> Any:
    """Tensors of the meta tensors' shapes and dtypes on `device` (floats random, the rest zeros); the
    floats that required grad in the step require it here too."""
    generator = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)

    def make(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            x = torch.randn(t.shape, device=device, generator=generator).to(t.dtype)
            return x.requires_grad_(t.requires_grad)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return tree_map_only(torch.Tensor, make, tree)


def autocast(args: argparse.Namespace, device: str) -> Any:
    """The run's autocast: torch's on a device, the memory model's rules on the meta device."""
    dtype = memory.autocast_dtype(args.precision)
    if device == "meta":
        return memory.AutocastRules(autocast_policy(args), dtype, args.device_type)
    return torch.autocast(device, dtype=dtype, enabled=dtype is not None)


def prepare(module: torch.nn.Module, args: argparse.Namespace, setup: Setup, prefix: str, device: str
            ) -> CastWeightsOncePerStep | None:
    """The run's settings on a materialized part (names in the denoiser under `prefix`): the norms and
    float8 as benchmark.py sets them (on the meta device the autocast rules and the meta model carry
    both), FSDP's bf16 weights, or the one GPU's bf16 copies (returned: begun, their step running)."""
    if setup.sharded and args.precision == "amp_bf16":
        module.to(torch.bfloat16)
    if device != "meta":
        if args.precision == "amp_bf16":
            set_norm_precision(module, args.norm_precision)
        if args.fp8 != "off":
            sub = {name[len(prefix):]: n for name, n in rows(args).items() if name.startswith(prefix)}
            fp8.convert(module, args.fp8, sub)
    if setup.weight_casts == "step" and args.precision == "amp_bf16":
        casts = CastWeightsOncePerStep(module)
        casts.begin_step()  # the microbatches of a step compute with the copies; timed per step apart
        return casts
    return None


def steady_gradients(module: torch.nn.Module) -> None:
    """Gradient accumulation's steady state: the gradients exist and backward adds into them."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def block_step(args: argparse.Namespace, setup: Setup, name: str, calls: BlockCalls, part: torch.nn.Module,
               wrap: Callable[..., Any] | None, device: str) -> Callable[[], None]:
    """One forward and backward of the block `name` (built from the meta `part`) on its recorded inputs."""
    block = materialize(part, device, args.seed)
    casts = prepare(block, args, setup, name + ".", device)
    if args.compile and device != "meta":  # the block's own compiled blocks, as the run compiles the denoiser's
        compile_blocks([block], family_of(args.model_config).compile_blocks)
    block.train()
    block_args, block_kwargs = real_tensors(calls.inputs[name], device, args.seed)
    leaves = [t for t in tree_flatten((block_args, block_kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outputs = [t for t in tree_flatten(calls.outputs[name])[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    grads = real_tensors([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outputs], device, args.seed + 1)
    steady_gradients(block)
    # The model checkpoints this block whole (Flux.1): wrap it as the model's forward does.
    call = functools.partial(wrap, block) if name in calls.wrapped and wrap is not None else block

    def step() -> None:
        for leaf in leaves:  # the gradient of a block's input is handed on in the run, not summed into
            leaf.grad = None
        with autocast(args, device):
            out = call(*block_args, **block_kwargs)
        torch.autograd.backward([t for t in tree_flatten(out)[0]
                                 if isinstance(t, torch.Tensor) and t.is_floating_point()], grads)

    step.casts = casts  # kept alive with the step
    return step


class StandIn(torch.autograd.Function):
    """A block of zero cost: outputs of the recorded shapes (zeros), zero gradients to its inputs."""

    @staticmethod
    def forward(ctx, shapes: list, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.inputs = [(t.shape, t.dtype) for t in inputs]
        return tuple(torch.zeros(shape, dtype=dtype, device=inputs[0].device) for shape, dtype in shapes)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        return (None, *(torch.zeros(shape, dtype=dtype, device=grads[0].device) for shape, dtype in ctx.inputs))


class StandInBlock(torch.nn.Module):
    """In place of a block: its recorded outputs, at no cost. What the parent reads of the block
    (a UNet asks its up blocks for `resnets` and `has_cross_attention`) comes from the original, kept on
    the meta device and not registered (never materialized)."""

    def __init__(self, output: Any, original: torch.nn.Module):
        super().__init__()
        leaves, self.spec = tree_flatten(output)
        self.shapes = [(t.shape, t.dtype) for t in leaves]
        object.__setattr__(self, "original", original)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return tree_unflatten(list(StandIn.apply(self.shapes, *inputs)), self.spec)


def meta_rest(model: Any, calls: BlockCalls, model_config: str) -> Any:
    """A copy of the meta `model` with every block a stand-in."""
    model = copy.deepcopy(model)
    for name, block in block_names(model.denoiser, model_config).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.denoiser.get_submodule(parent), attr, StandInBlock(calls.outputs[name], block))
    return model


def rest_step(args: argparse.Namespace, setup: Setup, model: Any, device: str) -> Callable[[], None]:
    """The training model's step (built from the meta `model` of stand-ins): the parts not repeated."""
    model = materialize(model, device, args.seed)
    casts = prepare(model.denoiser, args, setup, "", device)
    if args.precision == "amp_bf16" and device != "meta":
        set_norm_precision(model, args.norm_precision)  # the frozen encoders' norms too, as benchmark.py's
    if args.compile and device != "meta":  # the stand-ins hold no block: what the run compiles outside them
        compile_step_parts(model, family_of(args.model_config).compile_blocks)
    model.train()
    batch = memory.meta_batch(model, args.model_config, args.image_size, args.microbatch, device=device)
    steady_gradients(model.denoiser)

    def step() -> None:
        with autocast(args, device):
            loss = model.loss(model(batch), batch)
        loss.backward()

    step.casts = casts
    return step


def adamw_step(args: argparse.Namespace) -> Callable[[], None]:
    """AdamW's step (fused on a GPU, as benchmark.py's auto) over OPTIMIZER_PROBE_PARAMS fp32 parameters."""
    params = probe_params(args)
    for p in params:
        p.grad = torch.zeros_like(p)
    return torch.optim.AdamW(params, lr=1e-4, fused=args.device == "cuda").step


def ema_step(args: argparse.Namespace) -> Callable[[], None]:
    """The EMA's lerp (ema.py's update) over OPTIMIZER_PROBE_PARAMS fp32 parameters."""
    params = probe_params(args)
    shadow = [torch.zeros_like(p) for p in params]

    def ema() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(shadow, params, 1e-3)
    return ema


def weight_casts_step(args: argparse.Namespace) -> Callable[[], None]:
    """One step's weight casts as t2ibench.weight_casts runs them over OPTIMIZER_PROBE_PARAMS fp32
    parameters: the bf16 copies refreshed, and the copies' gradients (the backward's, here a buffer
    handed over without a kernel) made the fp32 weights' for the optimizer, whose zero_grad drops them."""
    module = torch.nn.Module()
    for i, p in enumerate(probe_params(args)):
        module.register_parameter(f"p{i}", p)
    casts = CastWeightsOncePerStep(module)
    casts.begin_step()
    backward_grads = [torch.zeros_like(copy) for copy in module.parameters()]
    casts.end_step()

    def step() -> None:
        casts.begin_step()
        for copy, grad in zip(module.parameters(), backward_grads):
            copy.grad = grad
        casts.end_step()
        for master in module.parameters():
            master.grad = None
    return step


def probe_params(args: argparse.Namespace) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(OPTIMIZER_PROBE_PARAMS // 4, device=args.device)) for _ in range(4)]


# -- timing: one part at a time ----------------------------------------------------------------------

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
    backward graphs: the seconds torch spends compiling them (t2ibench.compiling's timers, None where
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


# -- the harness, the composition, the report -------------------------------------------------------

def run_settings(args: argparse.Namespace, per_device_batch: int) -> tuple[argparse.Namespace, Any]:
    """benchmark.py's flags and settings for a one-device run of this prediction's set-up and batch (what
    the harness runs, and what sets the process up as benchmark.py's runtime does). Only what the
    loader and the runtime read is resolved: benchmark.py's full validation would refuse flux1-schnell
    on one GPU, and no model is built from them."""
    import benchmark

    warmup = min(3, args.harness_batches - 1)
    argv = ["--model_config", args.model_config, "--use_synth_data", "--batch_size", str(per_device_batch),
            "--image_size", str(args.image_size), "--device_train_microbatch_size", str(args.microbatch),
            "--num_workers", str(args.num_workers), "--precision", args.precision, "--seed", str(args.seed),
            "--max_duration", f"{args.harness_batches}ba", "--warmup_batches", str(warmup),
            "--weight_casts", args.setups[args.gpus[0]].weight_casts, "--norm_precision", args.norm_precision]
    if args.precomputed:
        argv += ["--precomputed", "--precomputed_format", args.text_format]
    run_args = benchmark.parse_args(argv)
    return run_args, checks.resolve(run_args)


def harness_seconds_per_step(args: argparse.Namespace, per_device_batch: int) -> float:
    """Seconds per step of what benchmark.py runs around the model: Composer's Trainer (events,
    microbatch split, batch to device, AdamW on one parameter), the run's own loader (synthetic data of
    the run's format, --num_workers) and the throughput callback, timed over --harness_batches with a
    model of one parameter."""
    import benchmark
    from composer import Trainer
    from composer.models import ComposerModel

    from t2ibench.callbacks.throughput import Pauses, Throughput
    from t2ibench.runtime import Runtime

    class OneParameter(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def forward(self, batch: dict) -> torch.Tensor:
            return self.weight * 1.0

        def loss(self, outputs: torch.Tensor, batch: dict) -> torch.Tensor:
            return outputs

    run_args, settings = run_settings(args, per_device_batch)
    run = Runtime.start(settings)
    loader = benchmark.build_data(settings, run).loader
    model = OneParameter()
    throughput = Throughput(run_args.warmup_batches, 0.0, None, Pauses(), 0.0)
    trainer = Trainer(model=model, train_dataloader=loader, optimizers=torch.optim.AdamW(model.parameters()),
                      max_duration=run_args.max_duration, device_train_microbatch_size=args.microbatch,
                      callbacks=[throughput], precision=run.trainer_precision, progress_bar=False,
                      log_to_console=False, seed=args.seed)
    trainer.fit()
    summary = throughput.summary
    trainer.close()
    return summary["measured_seconds"] / summary["measured_batches"]


def compose(args: argparse.Namespace, measured: dict[str, dict], updates: dict[str, float],
            harness_per_image: float, params: int, root_params: int) -> list[dict[str, Any]]:
    """The predicted step and samples/s per GPU for each --gpus."""
    rows = []
    for gpus in args.gpus:
        mode, setup = mode_for(args, gpus), args.setups[gpus]
        times = measured[setup.label]
        per_gpu = args.global_batch // gpus
        accumulation = per_gpu // args.microbatch
        params_per_gpu = params / gpus if mode != "none" else params
        optimizer = params_per_gpu * (updates["adamw_seconds_per_param"] + updates["ema_seconds_per_param"])
        casts = params * updates["weight_casts_seconds_per_param"] if setup.weight_casts == "step" else 0.0
        harness = harness_per_image * per_gpu
        compute = accumulation * times["composed_microbatch_seconds"] + optimizer + casts + harness
        once, per_microbatch = traffic_bytes_per_gpu(mode, gpus, params, root_params, args.precision)
        traffic = once + accumulation * per_microbatch
        comm = traffic / (args.link_gbps * 1e9)
        rows.append({"gpus": gpus, "fsdp": mode, "weights": setup.label, "weight_casts": setup.weight_casts,
                     "per_gpu_batch": per_gpu, "accumulation": accumulation, "optimizer_seconds": optimizer,
                     "weight_casts_seconds": casts, "harness_seconds": harness, "compute_seconds": compute,
                     "traffic_bytes_per_step_once": once, "traffic_bytes_per_microbatch": per_microbatch,
                     "traffic_bytes_per_gpu": traffic, "comm_seconds": comm, "step_seconds": compute + comm,
                     "samples_per_sec_per_gpu": per_gpu / (compute + comm),
                     "samples_per_sec_per_gpu_overlapped": per_gpu / max(compute, comm)})
    return rows


def compare(args: argparse.Namespace, predicted: list[dict]) -> dict[str, Any]:
    """The prediction for the compared run's device count against its measured images/s per device."""
    measured = args.compared
    row = next(r for r in predicted if r["gpus"] == measured["world_size"])
    ratio = row["samples_per_sec_per_gpu"] / measured["images_per_sec_per_device"]
    return {"results_json": args.compare_results_json, "gpus": row["gpus"], "device": measured["device"],
            "measured_images_per_sec_per_device": measured["images_per_sec_per_device"],
            "predicted_samples_per_sec_per_gpu": row["samples_per_sec_per_gpu"], "ratio": ratio,
            "within_25_percent": abs(ratio - 1) <= 0.25}


def total_compile_seconds(measured: dict[str, dict]) -> float | None:
    """Seconds compiling every part timed (--compile), outside every timed run; None where torch keeps no
    compile timers."""
    seconds = [b["compile_seconds"] for times in measured.values() for b in times["blocks"]]
    seconds += [times["rest_compile_seconds"] for times in measured.values()]
    return None if None in seconds else sum(seconds)


def gib(n: float) -> str:
    return f"{n / memory.GIB:.2f} GiB"


def header(result: dict[str, Any]) -> str:
    return (f"{result['model_config']} at {result['image_size']}x{result['image_size']}, {result['precision']}, "
            f"fp8 {result['fp8']}{', compiled' if result['compile'] else ''}"
            f"{', activation checkpointing' if result['activation_checkpointing'] else ''}, "
            f"microbatch {result['microbatch']}, global batch {result['global_batch']}")


def compiled_in(seconds: float | None) -> str:
    """A part's compile seconds for the report (--compile), after its timed figure."""
    return f"  (compiled in {seconds:.1f} s)" if seconds is not None else "  (compile seconds unknown)"


def report(result: dict[str, Any]) -> str:
    saved = f", read from {result['measured_json']}" if result.get("measured_json") else ""
    scaled = (f", scaled from the measured microbatch {result['measured_microbatch']} (its per-image time held)"
              if result.get("measured_microbatch", result["microbatch"]) != result["microbatch"] else "")
    first = "after one untimed run that compiles it and " if result["compile"] else "after "
    lines = [f"{header(result)}; measured on {result['device']} (median of {result['repeats']} {first}"
             f"{result['warmup']} warm-up, one part at a time{saved}), per microbatch{scaled}:"]
    for label, times in result["measured"].items():
        lines.append(f"  weights {label}:")
        for b in times["blocks"]:
            peak = f"  (peak {gib(b['peak_memory_bytes'])})" if b["peak_memory_bytes"] is not None else ""
            built = compiled_in(b["compile_seconds"]) if result["compile"] else ""
            lines.append(f"    {b['name']:<34} x{b['count']:<3} {1e3 * b['seconds']:10.2f} ms forward + backward"
                         f"{peak}{built}")
        built = compiled_in(times["rest_compile_seconds"]) if result["compile"] else ""
        rest = f"{1e3 * times['rest_seconds']:10.2f} ms"
        lines.append(f"    {'the rest (embedders, final layer, loss)':<38} {rest}{built}")
        lines.append(f"    {'composed: the full model':<38} {1e3 * times['composed_microbatch_seconds']:10.2f} ms")
    if result["compile"]:
        total = result["compile_seconds"]
        lines.append(f"  compiling: {f'{total:.1f} s' if total is not None else 'unknown seconds'} over the parts, "
                     "none of it in the times above")
    u = result["per_parameter"]
    lines.append(f"  per parameter and step: AdamW {1e9 * u['adamw_seconds_per_param']:.2f} ns, EMA "
                 f"{1e9 * u['ema_seconds_per_param']:.2f} ns, weight casts {1e9 * u['weight_casts_seconds_per_param']:.2f} ns")
    lines.append(f"  harness (Trainer, loader, callbacks): {1e3 * result['harness_seconds_per_step']:.1f} ms per step of "
                 f"{result['harness_per_device_batch']} images")
    lines.append(f"predicted (not measured) samples/s per GPU, links at {result['link_gbps']:g} GB/s per direction:")
    lines.append("  GPUs  sharding       batch/GPU  microbatches  compute s  traffic GB/GPU  comm s   predicted  "
                 "overlapped")
    for r in result["predicted"]:
        lines.append(f"  {r['gpus']:<5} {r['fsdp']:<14} {r['per_gpu_batch']:<10} {r['accumulation']:<13} "
                     f"{r['compute_seconds']:<10.3f} {r['traffic_bytes_per_gpu'] / 1e9:<15.2f} {r['comm_seconds']:<8.3f} "
                     f"{r['samples_per_sec_per_gpu']:<10.3g} {r['samples_per_sec_per_gpu_overlapped']:.3g}")
    for gpu, per_gpu in result["reference"].items():
        lines.append(f"  reference: MLPerf Training v5.1, {gpu}, MXFP8 (published, not measured here): {per_gpu:g}")
    if result["comparison"]:
        c = result["comparison"]
        lines.append(f"against {c['results_json']} ({c['gpus']} x {c['device']}): measured "
                     f"{c['measured_images_per_sec_per_device']:.2f} images/s per device, predicted "
                     f"{c['predicted_samples_per_sec_per_gpu']:.2f}: ratio {c['ratio']:.3f} "
                     f"({'within' if c['within_25_percent'] else 'outside'} 25%)")
    return "\n".join(lines)


def memory_report(result: dict[str, Any]) -> str:
    counted = result["counted_memory"]
    lines = [f"{header(result)}; each part's memory counted on the meta device for a CUDA GPU (not measured):"]
    for label, per_part in counted["parts_bytes"].items():
        lines.append(f"  weights {label}:")
        lines += [f"    {name:<38} {gib(n):>12}" for name, n in per_part.items()]
    ratio = counted["largest_part_bytes"] / counted["one_gpu_run_fixed_bytes"]
    lines.append(f"largest part {gib(counted['largest_part_bytes'])}: {ratio:.2f} of the "
                 f"{gib(counted['one_gpu_run_fixed_bytes'])} a one-GPU run of these settings holds before any "
                 "activation (weights, gradients, AdamW, EMA, copies)")
    return "\n".join(lines)


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"model_config": args.model_config, "image_size": args.image_size, "precision": args.precision,
            "norm_precision": args.norm_precision, "precomputed": args.precomputed,
            "precomputed_format": args.text_format, "activation_checkpointing": args.activation_checkpointing,
            "weight_casts": args.weight_casts, "fp8": args.fp8, "compile": args.compile, "use_ema": args.use_ema,
            "microbatch": args.microbatch,
            "global_batch": args.global_batch, "gpus": args.gpus}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with errors.command("blocks.py"):
        args = validate(build_parser().parse_args(argv))
        if args.count_memory:
            result = {**settings_of(args), "counted_memory": count_memory(args)}
            print(memory_report(result), flush=True)
            if args.json:
                print(json.dumps(result), flush=True)
            return result
        per_device = args.global_batch // args.gpus[0]
        if args.saved:
            measured, updates, harness_per_image, params = saved_parts(args)
            line = args.saved["line"]
            device, warmup, repeats = line["device"], line["warmup"], line["repeats"]
        else:
            from t2ibench.runtime import Runtime

            # The process as benchmark.py sets it up before its first step (cuDNN's autotuner on a GPU, the
            # threads of a CPU rank, the seeds), so every part is timed as the run computes it.
            Runtime.start(run_settings(args, per_device)[1])
            measured = {}
            for setup in unique_setups(args):
                print(f"timing the parts of {args.model_config} on {args.device}, one at a time, weights "
                      f"{setup.describe()}:", file=sys.stderr, flush=True)
                measured[setup.label] = measure(args, setup)
            updates = measure_updates(args)
            harness_per_image = harness_seconds_per_step(args, per_device) / per_device
            params = sum(p.numel() for p in meta_model(args, False).denoiser.parameters())
            device, warmup, repeats = device_name(args.device), args.warmup, args.repeats
        root_params = memory.fsdp_unit_params(args.model_config)["root"]
        predicted = compose(args, measured, updates, harness_per_image, params, root_params)
        result = {
            **settings_of(args), "link_gbps": args.link_gbps, "device": device,
            "warmup": warmup, "repeats": repeats, "denoiser_params": params, "root_unit_params": root_params,
            "measured": measured, "compile_seconds": total_compile_seconds(measured) if args.compile else None,
            "per_parameter": updates,
            "harness_seconds_per_step": harness_per_image * per_device, "harness_per_device_batch": per_device,
            "measured_json": args.measured_json,
            "measured_microbatch": args.saved["line"]["microbatch"] if args.saved else args.microbatch,
            "predicted": predicted,
            "reference": MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU if family_of(args.model_config).name == "flux" else {},
            "comparison": compare(args, predicted) if args.compared else None,
        }
        print(report(result), flush=True)
        if args.json:
            print(json.dumps(result), flush=True)
        return result


if __name__ == "__main__":
    main()
