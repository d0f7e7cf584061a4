"""The node predicted from one device: each repeated block of the denoiser timed, the full step composed,
the sharded-training traffic added, samples/s per GPU predicted for a node.

    python bench/blocks.py --model_config flux1-schnell --precomputed --microbatch 8 --compile --fp8 tensorwise  # a GPU
    python benchmark.py --model_config flux1-tiny --precomputed --use_synth_data --batch_size 8 --image_size 64 \\
        --max_duration 40ba --warmup_batches 10 --num_workers 0 --results_json run.json                # CPU check:
    python bench/blocks.py --model_config flux1-tiny --precomputed --image_size 64 --global_batch 8 --microbatch 8 \\
        --gpus 1 --num_workers 0 --compare_results_json run.json --json                                # the run, predicted
    python bench/blocks.py --model_config flux1-schnell --precomputed --activation_checkpointing --fsdp shard_grad_op \\
        --microbatch 64 --gpus 8 --measured_json results/h100-2026-11-26/blocks2.jsonl           # again, no GPU
    python bench/blocks.py --model_config flux1-schnell --precomputed --activation_checkpointing --fsdp shard_grad_op \
        --microbatch 64 --gpus 8 --measured_json results/h100-2026-11-26/blocks2.jsonl --device h200  # on an H200
    python bench/blocks.py --model_config sdxl-base --precomputed --precomputed_format text_states --use_ema \\
        --activation_checkpointing --global_batch 64 --microbatch 32 --gpus 1 --count_memory            # each part's memory

A model that fits no single GPU (Flux.1-schnell: about 190 GB of training state) cannot be run on the
one GPU a user has, but each of its blocks can. On the visible device (CUDA, else CPU), set up as
benchmark.py sets it up (t2ibench.commands.runtime: cuDNN's autotuner on a GPU, threads on a CPU), this builds,
times and frees one part at a time (so the device holds one part, never the model): the forward and
backward of one microbatch through one of each distinct repeated block of the denoiser (the family's
FSDP units, `ModelFamily.fsdp_blocks`: Flux.1's double-stream and single-stream blocks; one block per
resolution level of SD2's and SDXL's UNets), with the inputs the full model hands it (shapes and
dtypes read off the step on the meta device; fresh each time, as a block's input gradient is handed
on, not summed), under the run's precision, norms, `--fp8` (t2ibench.train.fp8), weights (FSDP's gathered
bf16 copy; one GPU's bf16 copies cast once per step, t2ibench.train.weight_casts) and
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
    traffic = the bytes the run sends per GPU per step (t2ibench.train.parallel.traffic_bytes_per_gpu, which
              gpu_setup's choice of set-up weighs too; ring collectives, each GPU sending (G-1)/G of
              the buffer): DDP one fp32 all-reduce of the gradients per step (2x); under Composer
              0.32.1's FSDP2 every microbatch gathers the weights again and reduce-scatters its
              gradients in fp32: full_shard two all-gathers of the weights in the autocast dtype
              (forward, backward; the root unit's one), shard_grad_op one (kept from forward to
              backward). One microbatch per step (microbatch = per-GPU batch) sends each once: the
              Flux.1 set-up of docs/flux.md
    predicted samples/s per GPU = (B/G) / (compute + traffic / --link_gbps)   (not overlapped; the JSON's)
                                = (B/G) / max(compute, traffic / --link_gbps)  (fully overlapped)

`--link_gbps` is in gigabytes per second per direction per GPU (default: the predicted GPU's link in
t2ibench.core.devices, NVLink 4 on an H100, 450); a multi-node figure takes the slower inter-node rate.
`--device NAME` predicts another GPU of t2ibench.core.devices from a saved measurement (`--measured_json`): each
part's time scaled by the roofline of its counted work (docs/gpu-runs.md, "Devices"), its memory and link. The prediction is labelled **predicted**: it
assumes a node of the device it ran on and times nothing of a node (no collective, no straggler).
`--compile` compiles each part as benchmark.py's `--compile` compiles the run (t2ibench.train.compiling with
the family's `compile_blocks`: the blocks inside each block timed, the encoders' layers in the rest);
each part first runs once untimed to compile, and its compile seconds are reported apart from its timed
runs. `--fp8` needs `--compile`, by benchmark.py's rule and in its words (t2ibench.train.fp8.check_compiled).
`--compare_results_json` reads a benchmark.py run of the same set-up (refused, before any timing,
when any setting that changes the step differs, `--compile` included, its device is not this one, it
trained aspect-ratio buckets, which blocks.py does not time, or benchmark.py did not write it) and
prints the ratio of the prediction for its device count to its measured images/s per device.
`--measured_json FILE` times nothing: it reads a line blocks.py wrote with `--json` (a .jsonl, or a log
ending in it), the first whose measured settings are this run's (`--compile` among them; a line older than
the flag timed the eager parts), and predicts again from its times for other `--gpus`, `--fsdp`,
`--global_batch` or `--link_gbps`, on any machine; a `--microbatch` that is a whole multiple of the
measured one scales its times (per-image time held). `--count_memory` times nothing: it counts each part's memory on the meta device for a CUDA GPU (t2ibench.memory) beside a
one-GPU run's fixed bytes. `--json` ends with one line: the measured times, the composition and
`predicted` (a list of {gpus, samples_per_sec_per_gpu}).

Its parts, one job each: block_times/parts.py (the set-up, the blocks and the rest built as parts),
block_times/timing.py (each part timed or counted), block_times/harness.py (the Trainer around the model),
block_times/files.py (the saved lines and the run compared); here the flags, the composition and the report.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project root: run as python bench/NAME.py

from block_times.files import compared_run, measured_lines, saved_measurement, saved_parts  # noqa: E402
from block_times.harness import harness_seconds_per_step, run_settings  # noqa: E402
from block_times.parts import Setup, device_name, meta_model, mode_for  # noqa: E402
from block_times.timing import count_memory, count_work, measure, measure_updates, unique_setups  # noqa: E402
from gpu.rows import GLOBAL_BATCH, MLPERF_FLUX_GLOBAL_BATCH  # noqa: E402
from t2ibench.core import devices, errors  # noqa: E402
from t2ibench.commands import flags  # noqa: E402
from t2ibench.train import fp8  # noqa: E402
from t2ibench import memory  # noqa: E402
from t2ibench.datasets import precomputed  # noqa: E402
from t2ibench.core.cli import (BATCH_SIZE, GPU_COUNT, IMAGE_SIZE, MAX_REPEATS, NON_NEGATIVE_INT, POSITIVE_FLOAT,  # noqa: E402
                          REPEATS, SEED, WARMUP_REPEATS, Parser, Range, check_workers)
from t2ibench.core.errors import fail  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, family_of  # noqa: E402
from t2ibench.train.norms import NORM_PRECISIONS  # noqa: E402
from t2ibench.commands.gpu_setup import LAUNCH_SECONDS  # noqa: E402
from t2ibench.train.parallel import FSDP_CHOICES, resolve_mode, traffic_bytes_per_gpu  # noqa: E402
from t2ibench.train.precision import PRECISION_CHOICES, resolve_precision  # noqa: E402
from t2ibench.datasets.precomputed import TEXT_FORMATS  # noqa: E402
from t2ibench.costs.scale import MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU  # noqa: E402
from t2ibench.train.weight_casts import WEIGHT_CAST_CHOICES, resolve_weight_casts, weight_casts_problem  # noqa: E402

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
                        "(t2ibench.train.compiling); each part's compile seconds are reported apart from its timed runs; "
                        "needed by --fp8")
    g.add_argument("--use_ema", action="store_true", help="add the EMA update per step (MLPerf's Flux.1 runs none)")
    g.add_argument("--fsdp", type=str, default="auto", choices=FSDP_CHOICES,
                   help="sharding on several GPUs, as benchmark.py's (auto: full_shard for Flux.1, else DDP)")
    g.add_argument("--num_workers", type=NON_NEGATIVE_INT, default=8, help="loader processes of the harness, as benchmark.py's")
    g = p.add_argument_group("the node and the measurement")
    g.add_argument("--gpus", type=GPU_COUNT, nargs="+", default=[8, 16], help="GPU counts to predict for")
    g.add_argument("--device", type=str, default=None, choices=devices.DEVICE_CHOICES,
                   help="the GPU to predict (t2ibench.core.devices' table): with --measured_json, the measured times "
                        "scaled to it by the roofline rule (docs/gpu-runs.md, \"Devices\"), its memory for the "
                        "microbatch, its link for --link_gbps; default: the visible GPU, else the measurement's")
    g.add_argument("--link_gbps", type=POSITIVE_FLOAT, default=None,
                   help="gigabytes (not bits) per second per direction per GPU for the collectives (default: the "
                        "predicted GPU's link in t2ibench.core.devices, an H100's NVLink 4 where none is known: 450)")
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
    target, measured_on = predicted_device(parsed, lines, on_gpu)
    # --count_memory counts for a CUDA GPU (--device's, this one, or an H100's memory) whatever runs it.
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
        # FSDP gathers its own bf16 copy of each unit: t2ibench.train.weight_casts' copies are for one device.
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
            gpu_memory_bytes = (target or devices.reference()).cuda_memory_bytes
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
                                 "setups": setups, "target": target, "measured_on": measured_on,
                                 "link_gbps": parsed.link_gbps or (target or devices.reference()).link_gb_per_sec})
    # A saved line stands for the resolved settings only, so it is chosen once they are.
    args = argparse.Namespace(**{**vars(args), "saved": saved_measurement(args, lines) if lines else None})
    # The compared run is checked against the resolved settings, so it is added to them last.
    return argparse.Namespace(**{**vars(args), "compared": compared_run(args) if args.compare_results_json else None})


def predicted_device(parsed: argparse.Namespace, lines: list[dict] | None,
                     on_gpu: bool) -> tuple[devices.Device | None, devices.Device | None]:
    """(the GPU predicted, the GPU the times were measured on; None: a CPU, or a GPU outside the table).
    --device predicts another GPU than the one timed only from a saved measurement (--measured_json) of a
    GPU the table has; timing here, it must name the visible GPU."""
    if lines is not None:
        name = lines[0]["device"]
        measured_on = devices.recognise(name) if on_gpu else None
        if parsed.device and measured_on is None:
            fail(f"--device {parsed.device}: the measurement of --measured_json {parsed.measured_json} ran on {name}, "
                 f"which t2ibench.core.devices' table lacks, so its times cannot be scaled; drop --device")
        return (devices.get(parsed.device) if parsed.device else measured_on), measured_on
    here = devices.visible() if torch.cuda.is_available() else None
    if parsed.device and not parsed.count_memory and (here is None or here.key != parsed.device):
        fail(f"--device {parsed.device}: timing runs on {'this ' + here.label if here else 'the CPU'}; predict "
             f"another GPU from a saved measurement (--measured_json FILE --device {parsed.device}), or count its "
             "memory with --count_memory")
    return (devices.get(parsed.device) if parsed.device else here), here


def scaled_to_device(args: argparse.Namespace, measured: dict[str, dict],
                     updates: dict[str, float]) -> tuple[dict[str, dict], dict[str, float]]:
    """The measured times on --device (docs/gpu-runs.md, "Devices"): each part's time less its launches
    (eager parts: its counted kernels at gpu_setup.LAUNCH_SECONDS, held) scaled by the roofline of its work,
    counted on the meta device, on the measured GPU against --device; the per-parameter updates, which only
    move memory, by the ratio of the two GPUs' HBM bandwidth."""
    source, target = args.measured_on, args.target
    scaled = {}
    for setup in unique_setups(args):
        work = count_work(args, setup)
        times = measured[setup.label]

        def on_target(seconds: float, label: str) -> float:
            ops, launches = work[label]
            return devices.scaled_seconds(seconds, source, target, ops,
                                          fixed_seconds=0.0 if args.compile else launches * LAUNCH_SECONDS)

        blocks = [{**b, "seconds": on_target(b["seconds"], b["name"]), "peak_memory_bytes": None,
                   "compile_seconds": None} for b in times["blocks"]]
        rest = on_target(times["rest_seconds"], "the rest")
        scaled[setup.label] = {**times, "blocks": blocks, "rest_seconds": rest, "rest_peak_memory_bytes": None,
                               "rest_compile_seconds": None,
                               "composed_microbatch_seconds": rest + sum(b["count"] * b["seconds"] for b in blocks)}
    bandwidth = source.hbm_bytes_per_sec / target.hbm_bytes_per_sec
    return scaled, {key: value * bandwidth for key, value in updates.items()}


# -- the composition, the report -------------------------------------------------------------------

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
    if result.get("predicted_device"):
        lines[0] = lines[0][:-1] + (f", each part scaled to an {result['predicted_device']} by the roofline of its "
                                    "counted work (docs/gpu-runs.md, \"Devices\"; never measured there):")
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
            if args.target is not None and args.target.key != args.measured_on.key:
                measured, updates = scaled_to_device(args, measured, updates)
        else:
            from t2ibench.commands.runtime import Runtime

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
            "predicted_device": (args.target.label if args.target and args.measured_on
                                 and args.target.key != args.measured_on.key else None),
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
