"""bench/blocks.py's inputs besides its flags: a line it wrote before with --json (--measured_json: the
prediction again without a device) and a benchmark.py results JSON to compare with
(--compare_results_json), each refused in one line, before any timing, unless it stands for the
set-up this prediction times.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from block_times.parts import device_name, mode_for
from t2ibench.core.cli import BATCH_SIZE, GPU_COUNT, POSITIVE_FLOAT, read_text
from t2ibench.costs.results import implausible_rate
from t2ibench.core.errors import fail
from t2ibench.families import family_of
from t2ibench.train.parallel import resolve_mode

# Keys every benchmark.py results JSON holds (a file without one was written by something else).
RESULTS_KEYS = ("images_per_sec", "world_size", "global_batch_size", "device")


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
    text = read_text(path, where, "give a file holding a line blocks.py wrote with --json")
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
    unless it is one (not blocks.py's own line, nor a retried run's that measured nothing), trained square
    images (blocks.py times no aspect-ratio bucket), holds a finite positive measured rate, ran on this
    device, on one of the --gpus counts, and with the set-up this prediction times in every setting that
    changes the step."""
    path = args.compare_results_json
    where = f"--compare_results_json {path}"
    try:
        measured = json.loads(read_text(path, where, "give a benchmark.py --results_json file"))
    except ValueError as error:
        fail(f"{where}: not JSON ({error}); give a benchmark.py --results_json file")
    if not isinstance(measured, dict):
        fail(f"{where}: not a benchmark.py results JSON (a {type(measured).__name__}, not an object)")
    if isinstance(measured.get("measured"), dict) and isinstance(measured.get("predicted"), list):
        fail(f"{where}: a line blocks.py wrote with --json, not a benchmark.py results JSON; predict from it with "
             "--measured_json, or compare with the file a benchmark.py --results_json wrote")
    missing = [key for key in RESULTS_KEYS if key not in measured]
    if missing:
        fail(f"{where}: not a benchmark.py results JSON (it has no {', '.join(missing)}); give the file a "
             "benchmark.py --results_json wrote")
    if measured.get("already_complete"):
        fail(f"{where}: written by a retried --autoresume run that found its run complete, so it measured "
             "nothing; compare with the results of the run that trained")
    if measured.get("aspect_buckets") is not None:
        fail(f"{where}: the run trained aspect-ratio buckets ({bucketed(measured)}), and blocks.py times square "
             f"{args.image_size}x{args.image_size} images only; compare with a run without --aspect_buckets")
    rate = measured.get("images_per_sec_per_device")
    if POSITIVE_FLOAT.problem(rate):
        fail(f"{where}: images_per_sec_per_device is {json.dumps(rate)}, not a finite positive number "
             "(a run that measured nothing, or not a benchmark.py results JSON)")
    implausible = implausible_rate(rate)
    if implausible:
        fail(f"{where}: images_per_sec_per_device: {implausible}; give the results of a run that trained")
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


def bucketed(measured: dict[str, Any]) -> str:
    """A bucketed run's buckets as its results record them: the flag, the list and, on synthetic data,
    the weights its batches were drawn by (benchmark.py's keys)."""
    names = measured.get("bucket_list")
    listed = (f", {len(names)} buckets from {names[0]} to {names[-1]}"
              if isinstance(names, list) and names and all(isinstance(n, str) for n in names) else "")
    weights = measured.get("synthetic_bucket_weights")
    drawn = f", synthetic batches drawn by --synthetic_bucket_weights {weights}" if isinstance(weights, str) else ""
    return f"--aspect_buckets {measured['aspect_buckets']}{listed}{drawn}"
