"""bench/gpu_report.py's predictions: each row of the report on a GPU before any figure of it exists there
(`--dry_run --device NAME --predictions FILE`), from this project's H100 measurements (`BASES`) by the rule
of t2ibench.core.devices (a roofline of the counted work, launches held), Flux.1's time and cost to MLPerf's
target through cost.py, and the predictions read back beside the next measurement (`read_predictions`).
The rule and what each figure rests on: docs/gpu-runs.md, "Devices".
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path

from gpu.plan import ROOT, blocks_flags, plan_row
from gpu.rows import MLPERF_FLUX_GLOBAL_BATCH, NODE_GPUS, ROWS
from t2ibench.core import devices, files
from t2ibench.commands.gpu_setup import LAUNCH_SECONDS
from t2ibench.train.weight_casts import resolve_weight_casts


@dataclass(frozen=True)
class Basis:
    """The H100 measurement a row's prediction scales: a benchmark.py results JSON, or blocks.py's line."""

    path: str  # from the project root
    differs: str  # how the measured set-up differs from the row's ("" where it is the row's own)


BASES = {
    "sd2-512-precomputed": Basis("results/h100-2026-11-27/report/sd2-512-precomputed.json", ""),
    "sd2-512-precomputed-compile": Basis(
        "results/h100-2026-11-25/sd2-pre-compile.json",
        "compiled whole (torch.compile of the model, the --compile of 2026-11-25) and weights cast per microbatch; the "
        "row compiles block by block with weights cast once per step, never measured on any GPU"),
    "sdxl-1024-compile": Basis(
        "results/h100-2026-11-27/sdxl-auto-eager-headroom.json",
        "eager: SDXL compiled block by block was never measured on any GPU, so compilation's gain is not predicted "
        "(the prediction is the eager step's)"),
    "sd2-512-online": Basis("results/h100-2026-11-26/sd2-online-step.json", ""),
    "flux-blocks-bf16": Basis("results/h100-2026-11-26/blocks2.jsonl",
                              "blocks timed eager (the row compiles them); checkpointing on, microbatch 32"),
    "flux-blocks-fp8": Basis("results/h100-2026-11-26/blocks2.jsonl",
                             "the bf16 blocks, eager; float8 compiled was never measured on any GPU: each block's "
                             "time scaled again by the roofline of its float8 work against its bf16 work"),
    "blocks-sd2": Basis("results/h100-2026-11-26/blocks2.jsonl", ""),
}
# Rows with no H100 measurement to scale: why.
NO_BASIS = {"blocks-sdxl": "no H100 blocks.py line of SDXL (its blocks ran out of memory in blocks.py, "
                           "results/h100-2026-11-26)"}
# Flux.1 to MLPerf's target: (GPUs, global batch). 64 GPUs take MLPerf's 2048 (its 512-GPU entries' batch),
# which gives each GPU 32 images, the measured microbatch; 8 take the report's 512.
FLUX_COST_NODES = ((8, MLPERF_FLUX_GLOBAL_BATCH), (64, 2048))
FLUX_BLOCKS_ROW = "flux-blocks-bf16"


@functools.lru_cache(maxsize=None)
def counted(model_config: str, image_size: int, microbatch: int, per_device_batch: int, norm_precision: str,
            precomputed: bool, text_format: str | None, checkpointing: bool, weight_casts: str, use_ema: bool):
    """The step's kernels and work per image (t2ibench.memory.kernels with `work`), counted on the meta device."""
    from t2ibench.memory import kernels

    step = kernels.count_step_kernels(model_config, image_size, microbatch, per_device_batch, precision="amp_bf16",
                                      norm_precision=norm_precision, precomputed=precomputed,
                                      precomputed_format=text_format, activation_checkpointing=checkpointing,
                                      weight_casts=weight_casts, use_ema=use_ema, work=True)
    return sum(step.per_image().values()), step.work_per_image()


def training_prediction(name: str, run, device: devices.Device) -> dict:
    """A one-GPU training row on `device`: the H100's measured seconds per image scaled by the roofline of
    the row's step as `auto` plans it there against the measured step's, the launches held (eager bases;
    a compiled base's launches are inductor's, not counted, and its whole time scales)."""
    basis = BASES[name]
    measured = json.loads((ROOT / basis.path).read_text())
    ref = devices.reference()
    eager = not measured.get("compile")
    text_format = measured.get("precomputed_format") if measured.get("precomputed") else None
    source_launches, source_work = counted(
        measured["model_config"], measured["image_size"], measured["device_train_microbatch_size"],
        measured["global_batch_size"] // measured["world_size"], measured.get("norm_precision") or "autocast",
        bool(measured.get("precomputed")), text_format, bool(measured.get("activation_checkpointing")),
        measured.get("weight_casts") or "microbatch", bool(measured.get("use_ema")))
    setting = run.setting
    casts = resolve_weight_casts(setting.weight_casts, on_gpu=True, precision="amp_bf16", world_size=1)
    target_launches, target_work = counted(
        setting.model_config, setting.resolution, run.microbatch, run.batch_size, setting.norm_precision,
        setting.precomputed, setting.text_format, run.activation_checkpointing, casts, setting.use_ema)
    seconds = devices.scaled_seconds(1 / measured["images_per_sec"], ref, device, source_work, target_work,
                                     source_launches * LAUNCH_SECONDS if eager else 0.0,
                                     target_launches * LAUNCH_SECONDS if eager else 0.0)
    flops, num_bytes = (sum(w[i] for w in target_work) for i in (0, 1))
    return {"kind": "run", "images_per_sec": 1 / seconds, "microbatch": run.microbatch,
            "activation_checkpointing": run.activation_checkpointing,
            "predicted_bytes": run.plan.get("predicted_bytes_at_microbatch"),
            "reason": run.plan.get("activation_checkpointing_reason"),
            "rests_on": {"measured": basis.path, "measured_images_per_sec": measured["images_per_sec"],
                         "measured_device": measured["device"], "measured_microbatch":
                             measured["device_train_microbatch_size"], "differs": basis.differs,
                         "flops_per_image": flops, "bytes_per_image": num_bytes,
                         "launches_per_image": target_launches, "launches_held": eager,
                         "roofline_seconds_per_image_reference": devices.roofline_seconds(source_work, ref),
                         "roofline_seconds_per_image": devices.roofline_seconds(target_work, device)}}


def blocks_prediction(name: str, row, args: argparse.Namespace, device: devices.Device, gpu_memory_bytes: float,
                      gpus_batches: tuple[tuple[int, int], ...] = ((NODE_GPUS, MLPERF_FLUX_GLOBAL_BATCH),)) -> dict:
    """A blocks row on `device`: blocks.py --measured_json on the H100's line with --device, for each
    (GPUs, global batch); a float8 row's block times scaled again by float8's roofline against bf16's."""
    import blocks
    from block_times.timing import count_work, unique_setups

    basis = BASES[name]
    if row.compare_with:  # blocks.py's prediction of the training row, at that row's plan on `device`
        compared = next(r for r in ROWS if r.name == row.compare_with)
        run = plan_row(compared.name, compared.setting, 1, gpu_memory_bytes, args.out, 1, 0, False, args.model_name,
                       device)
        setting, checkpointing, microbatch, nodes = (compared.setting, run.activation_checkpointing, run.microbatch,
                                                     ((1, run.batch_size),))
    else:
        node = plan_row(name, row.blocks_of, NODE_GPUS, gpu_memory_bytes, args.out, 1, 0, False, args.model_name,
                        device)
        setting, checkpointing, microbatch, nodes = row.blocks_of, node.activation_checkpointing, node.microbatch, \
            gpus_batches
    # The line's set-up: eager bf16, and on one GPU weights cast per microbatch (the SD2 line timed no copies).
    one_gpu = dataclasses.replace(setting, weight_casts="microbatch") if row.compare_with else setting
    flags, _ = blocks_flags(dataclasses.replace(one_gpu, compile=False, fp8="off"), checkpointing)
    predicted = []
    for gpus, global_batch in nodes:
        per_gpu = global_batch // gpus
        batch_flags = list(flags)
        batch_flags[batch_flags.index("--global_batch") + 1] = str(global_batch)
        argv = [*batch_flags, "--measured_json", str(ROOT / basis.path), "--device", device.key, "--gpus", str(gpus),
                "--microbatch", str(max(32, min(microbatch, per_gpu) // 32 * 32)), "--json"]
        with contextlib.redirect_stdout(io.StringIO()):
            result = blocks.main(argv)
        first = result["predicted"][0]
        figure = first["samples_per_sec_per_gpu"]
        if setting.fp8 != "off":  # float8's roofline against bf16's, block by block, on `device`
            fp8_args = blocks.validate(blocks.build_parser().parse_args(
                [*batch_flags, "--fp8", setting.fp8, "--compile", "--count_memory", "--gpus", str(gpus),
                 "--microbatch", argv[argv.index("--microbatch") + 1]]))
            bf16_args = blocks.validate(blocks.build_parser().parse_args(
                [*batch_flags, "--count_memory", "--gpus", str(gpus), "--microbatch",
                 argv[argv.index("--microbatch") + 1]]))
            (setup,) = unique_setups(bf16_args)
            fp8_work, bf16_work = count_work(fp8_args, setup), count_work(bf16_args, setup)
            times = result["measured"][setup.label]
            saved = 0.0
            for b in times["blocks"]:
                plain = bf16_work[b["name"]][0]
                fast = devices.roofline_seconds(as_float8(plain, fp8_work[b["name"]][0]), device)
                saved += b["count"] * b["seconds"] * (1 - fast / devices.roofline_seconds(plain, device))
            step = first["step_seconds"] - first["accumulation"] * saved
            figure = first["per_gpu_batch"] / step
        predicted.append({"gpus": gpus, "global_batch": global_batch, "microbatch": result["microbatch"],
                          "fsdp": first["fsdp"], "samples_per_sec_per_gpu": figure,
                          "comm_seconds": first["comm_seconds"], "step_seconds": first["per_gpu_batch"] / figure})
    return {"kind": "blocks", "samples_per_sec_per_gpu": predicted[0]["samples_per_sec_per_gpu"],
            "activation_checkpointing": checkpointing, "predicted": predicted,
            "rests_on": {"measured": basis.path, "measured_device": devices.reference().label,
                         "differs": basis.differs, "rule": "each block's and the rest's time scaled by the roofline "
                         "of its counted work; AdamW and the EMA by HBM bandwidth; the harness held"}}


def as_float8(bf16_work: list, fp8_work: list) -> list:
    """The bf16 block's work with the matmuls torchao runs in float8 at the fp8 peak: each bf16 op whose FLOPs
    equal those of a float8 matmul of the float8 count (`_scaled_mm`), taken once each. The amax, scale and
    cast ops float8 adds are left out: compiled (as benchmark.py runs float8), inductor fuses them into the
    ops around them; counted eager, they cost more than float8 saves (the H100's eager float8 ran 2.4x slower,
    results/h100-2026-11-26). The operands' bytes are bf16's (float8's are half): a bound from above."""
    scaled = collections.Counter(flops for flops, _, fp8 in fp8_work if fp8)
    converted = []
    for flops, num_bytes, _ in bf16_work:
        fp8 = bool(flops) and scaled[flops] > 0
        if fp8:
            scaled[flops] -= 1
        converted.append((flops, num_bytes, fp8))
    return converted


def flux_cost(device: devices.Device, blocks: dict) -> list[dict]:
    """Flux.1's days and dollars to MLPerf's target on each node of FLUX_COST_NODES, through cost.py."""
    import cost

    priced = []
    for node in blocks["predicted"]:
        rate = node["samples_per_sec_per_gpu"] * node["gpus"]
        with contextlib.redirect_stdout(io.StringIO()):
            rows = cost.main(["--model_config", "flux1-schnell", "--gpus", str(node["gpus"]), "--images_per_sec",
                              f"{rate:.4f}", "--num_gpus", str(node["gpus"]), "--mlperf_batch",
                              str(node["global_batch"]), "--device", device.key])
        row = next(r for r in rows if r.num_gpus == node["gpus"] and r.source == "measured")
        priced.append({"gpus": node["gpus"], "global_batch": node["global_batch"], "samples_per_sec": rate,
                       "days": row.days, "gpu_hours": row.gpu_hours, "cost_usd": row.cost_usd})
    return priced


def predict_rows(args: argparse.Namespace, planned: list[dict], gpu_memory_bytes: float) -> dict:
    """Every row of `planned` (the dry run's) predicted on --device, printed and written to --predictions."""
    device = args.gpu_device
    rows = {}
    for plan in planned:
        name = plan["name"]
        row = next(r for r in ROWS if r.name == name)
        if name not in BASES:
            rows[name] = {"kind": "run" if row.setting else "blocks", "not_predicted": NO_BASIS.get(
                name, "no H100 measurement of this set-up")}
        else:
            try:
                if row.setting:
                    run = plan_row(name, row.setting, 1, gpu_memory_bytes, args.out, args.batches,
                                   args.warmup_batches, False, args.model_name, device)
                    rows[name] = training_prediction(name, run, device)
                else:
                    nodes = FLUX_COST_NODES if name == FLUX_BLOCKS_ROW else ((NODE_GPUS, MLPERF_FLUX_GLOBAL_BATCH),)
                    rows[name] = blocks_prediction(name, row, args, device, gpu_memory_bytes, nodes)
            except SystemExit as refused:  # blocks.py's one-line refusal of the saved line: the row says why
                rows[name] = {"kind": "run" if row.setting else "blocks", "not_predicted": str(refused.code)}
        print(f"  {name}: {describe(rows[name])}", flush=True)
    result = {"device": device.key, "label": device.label, "never_measured_here": not device.measured,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu_memory_bytes": gpu_memory_bytes, "device_table": {k: v for k, v in vars(device).items()},
              "rows": rows}
    if FLUX_BLOCKS_ROW in rows and "predicted" in rows[FLUX_BLOCKS_ROW]:
        result["flux_to_mlperf_target"] = flux_cost(device, rows[FLUX_BLOCKS_ROW])
        for node in result["flux_to_mlperf_target"]:
            print(f"  Flux.1 to MLPerf's target on {node['gpus']} x {device.label} (global batch "
                  f"{node['global_batch']}): {node['samples_per_sec']:,.0f} samples/s, {node['days']:.2f} days, "
                  f"{node['gpu_hours']:,.0f} GPU-hours, ${node['cost_usd']:,.0f} (cost.py)", flush=True)
    files.write_text(args.predictions, json.dumps(result, indent=2) + "\n")
    print(f"predictions for the {device.label} written to {args.predictions} (predicted, never measured on it)",
          flush=True)
    return result


def describe(prediction: dict) -> str:
    """A row's prediction in a line: its figure and what it rests on."""
    if "not_predicted" in prediction:
        return f"not predicted: {prediction['not_predicted']}"
    on = prediction["rests_on"]
    differs = f"; {on['differs']}" if on["differs"] else ""
    if prediction["kind"] == "run":
        memory = f", counted {prediction['predicted_bytes'] / 2**30:.1f} GiB" if prediction["predicted_bytes"] else ""
        return (f"predicted {prediction['images_per_sec']:.1f} images/s at microbatch {prediction['microbatch']}, "
                f"checkpointing {'on' if prediction['activation_checkpointing'] else 'off'}{memory}; from "
                f"{on['measured_images_per_sec']:.1f} on the {on['measured_device']} ({on['measured']}, microbatch "
                f"{on['measured_microbatch']}){differs}; counted {on['flops_per_image'] / 1e12:.2f} TFLOP, "
                f"{on['bytes_per_image'] / 1e9:.1f} GB and {on['launches_per_image']:,.0f} launches per image "
                f"({'held' if on['launches_held'] else 'not counted: compiled'})")
    nodes = "; ".join(f"{n['samples_per_sec_per_gpu']:.2f} per GPU on {n['gpus']} ({n['fsdp']}, global batch "
                      f"{n['global_batch']}, microbatch {n['microbatch']})" for n in prediction["predicted"])
    return f"predicted {nodes} samples/s; from {on['measured']}{differs}"


def read_predictions(path: Path | None, device: devices.Device | None, results_root: Path) -> dict[str, dict]:
    """The rows' predictions for this GPU: --predictions, else the newest results/predicted-*-<date>/<device>.json
    (by its folder's date) of the visible GPU; {} where there is none."""
    if path is None and device is not None:
        found = sorted(results_root.glob(f"predicted-*/{device.key}.json"), key=lambda p: p.parent.name[-10:])
        path = found[-1] if found else None
    if path is None:
        return {}
    rows = json.loads(Path(path).read_text())["rows"]
    shown = Path(path).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    return {name: {**prediction, "path": str(shown)} for name, prediction in rows.items()}
