"""GPU throughput matrix: SD2 base at 512x512 with EMA (or Flux.1-schnell at 256x256), one `benchmark.py` run per setting.

    python bench/bench_gpu.py --out results/h100x8              # every setting, all visible GPUs
    python bench/bench_gpu.py --out results/h100x8-flux --flux  # Flux.1-schnell, MLPerf's set-up (needs FSDP)
    python bench/bench_gpu.py --out /tmp/b --quick              # two settings
    python bench/bench_gpu.py --out /tmp/b --gpus 1 --only online-bf16-mb32 precomputed-bf16-mb64-compile
    python bench/bench_gpu.py --out /tmp/b --smoke              # no GPU: the tiny model on CPU, to check the tool

It needs only the project's requirements. Each setting runs in its own launch (`composer -n GPUS
benchmark.py ...`: a fresh CUDA context, so peak memory and compile caches do not leak between
settings) with the global batch = GPUS x 2 x microbatch, and leaves in `--out`:

    <setting>.json     benchmark.py's results (images/s, MFU, memory, device, versions...); cost.py
                       reads it directly: python cost.py OUT/<setting>.json
    logs/<setting>.log the launch's full output, command first
    table.md           the table of all settings, under a line with device, versions and date
    environment.json   device, GPU count, library versions, date, the command line
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project root

# name -> extra benchmark.py flags. Every run: sd2-base, 512x512, --use_ema, synthetic data, bf16.
MATRIX: dict[str, list[str]] = {
    "online-bf16-mb16": ["--device_train_microbatch_size", "16"],
    "online-bf16-mb32": ["--device_train_microbatch_size", "32"],
    "online-bf16-mb32-cl": ["--device_train_microbatch_size", "32", "--channels_last"],
    "online-bf16-mb32-compile": ["--device_train_microbatch_size", "32", "--compile"],
    "online-bf16-mb32-compile-cl": ["--device_train_microbatch_size", "32", "--compile", "--channels_last"],
    "precomputed-bf16-mb32": ["--precomputed", "--device_train_microbatch_size", "32"],
    "precomputed-bf16-mb64": ["--precomputed", "--device_train_microbatch_size", "64"],
    # Precomputed batches carry token ids by default (the text encoder runs); this one, text states.
    "precomputed-states-bf16-mb64": ["--precomputed", "--precomputed_format", "text_states",
                                     "--device_train_microbatch_size", "64"],
    "precomputed-bf16-mb64-cl": ["--precomputed", "--device_train_microbatch_size", "64", "--channels_last"],
    "precomputed-bf16-mb64-compile": ["--precomputed", "--device_train_microbatch_size", "64", "--compile"],
}
QUICK = ["online-bf16-mb16", "precomputed-bf16-mb32"]
# --flux: Flux.1-schnell as MLPerf Training v5.1 runs it: 256x256, latents and T5/CLIP states
# precomputed (synthetic here, in that format), global batch 512 (NVIDIA's 16-GPU entries; its
# 512-GPU ones use 2048), no EMA. Microbatches from the memory arithmetic in docs/flux.md.
FLUX_MATRIX: dict[str, list[str]] = {
    "flux-precomputed-bf16-mb4": ["--device_train_microbatch_size", "4"],
    "flux-precomputed-bf16-mb8": ["--device_train_microbatch_size", "8"],
    "flux-precomputed-bf16-mb8-ac": ["--device_train_microbatch_size", "8", "--activation_checkpointing"],
    "flux-precomputed-bf16-mb16-ac": ["--device_train_microbatch_size", "16", "--activation_checkpointing"],
    "flux-online-bf16-mb4": ["--device_train_microbatch_size", "4", "--online"],
}
FLUX_QUICK = ["flux-precomputed-bf16-mb8", "flux-precomputed-bf16-mb8-ac"]
FLUX_GLOBAL_BATCH = 512
# --smoke: the same settings on the tiny model at 32x32 on CPU, microbatches scaled down.
SMOKE = ["--model_config", "tiny", "--image_size", "32", "--num_workers", "0"]
FLUX_SMOKE = ["--model_config", "flux1-tiny", "--image_size", "32", "--num_workers", "0"]
PACKAGES = ("torch", "mosaicml", "mosaicml-streaming", "diffusers", "transformers", "xformers")


def fail(message: str) -> None:
    raise SystemExit(f"bench_gpu.py: error: {message}")


def run_setting(name: str, flags: list[str], out: Path, gpus: int, batches: int, warmup: int, timeout_s: int,
                smoke: bool) -> dict:
    flags = list(flags)
    flux = name.startswith("flux")
    at = flags.index("--device_train_microbatch_size") + 1
    if smoke:
        flags[at] = str(max(1, int(flags[at]) // 8 if flux else int(flags[at]) // 16))
        flags += FLUX_SMOKE if flux else SMOKE
    micro = int(flags[at])
    if flux:
        online = "--online" in flags
        flags = [f for f in flags if f != "--online"]
        global_batch = gpus * 2 * micro if smoke else FLUX_GLOBAL_BATCH
        model = ["--model_config", "flux1-schnell", "--image_size", "256", *([] if online else ["--precomputed"])]
    else:
        global_batch = gpus * 2 * micro
        model = ["--use_ema", "--image_size", "512"]
    launcher = [sys.executable, "-m", "composer.cli.launcher", "-n", str(gpus)]
    cmd = [*launcher, str(ROOT / "benchmark.py"), "--use_synth_data", *model,
           "--precision", "amp_bf16", "--batch_size", str(global_batch), "--max_duration", f"{batches}ba",
           "--warmup_batches", str(warmup), "--num_workers", "8", "--log_interval", "5ba",
           "--results_json", str(out / f"{name}.json"), *flags]  # later flags win: --smoke's override
    start = time.time()
    log_path = out / "logs" / f"{name}.log"
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"name": name, "status": "ok" if code == 0 else f"failed ({code}), see logs/{name}.log",
              "wall_s": time.time() - start}
    if code == 0:
        result.update(json.loads((out / f"{name}.json").read_text()))
    print(f"{name}: {result['status']} in {result['wall_s']:.0f}s", flush=True)
    return result


def table(results: list[dict]) -> str:
    rows = ["| setting | images/s | per GPU | MFU | peak memory GiB (reserved) | data wait | final loss | status |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["status"].startswith("ok"):
            rows.append(f"| {r['name']} | | | | | | | {r['status']} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        reserved = f" ({r['peak_memory_reserved_bytes'] / 2**30:.1f})" if r.get("peak_memory_reserved_bytes") else ""
        wait = f"{100 * r['data_wait_fraction']:.1f}%" if r.get("data_wait_fraction") is not None else "n/a"
        rows.append(f"| {r['name']} | {r['images_per_sec']:.1f} | {r['images_per_sec_per_device']:.1f} | {mfu} "
                    f"| {r['peak_memory_bytes'] / 2**30:.1f}{reserved} | {wait} | {r['final_loss']:.4f} | ok |")
    return "\n".join(rows)


def environment(gpus: int, smoke: bool, argv: list[str]) -> dict:
    import torch

    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "device": "cpu (--smoke)" if smoke else torch.cuda.get_device_name(0),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": versions,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results folder (JSON per setting, logs, table)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per setting (default: all visible)")
    p.add_argument("--batches", type=int, default=25, help="batches per setting, warm-up included")
    p.add_argument("--warmup_batches", type=int, default=5, help="batches left out of the measurement")
    p.add_argument("--quick", action="store_true", help=f"only {QUICK} (with --flux: {FLUX_QUICK})")
    p.add_argument("--flux", action="store_true",
                   help=f"the Flux.1-schnell settings (256x256, global batch {FLUX_GLOBAL_BATCH}) instead of SD2's")
    p.add_argument("--only", nargs="+", default=None, help=f"settings to run, from {list(MATRIX) + list(FLUX_MATRIX)}")
    p.add_argument("--timeout_s", type=int, default=900, help="limit per setting, seconds")
    p.add_argument("--smoke", action="store_true",
                   help="check the tool without a GPU: tiny model, 32x32, on CPU (figures mean nothing)")
    args = p.parse_args(argv)
    settings = {**MATRIX, **FLUX_MATRIX}
    if args.flux:
        names = args.only or (FLUX_QUICK if args.quick else list(FLUX_MATRIX))
    else:
        names = args.only or (QUICK if args.quick else list(MATRIX))
    unknown = [n for n in names if n not in settings]
    if unknown:
        fail(f"--only: unknown settings {unknown}; choose from {list(settings)}")
    if args.batches <= args.warmup_batches:
        fail(f"--batches {args.batches} must exceed --warmup_batches {args.warmup_batches}")

    import torch

    visible = torch.cuda.device_count()
    if not args.smoke and visible == 0:
        fail("no CUDA GPU visible (torch.cuda.device_count() is 0): run it on a GPU node, or pass --smoke to "
             "check the tool on CPU")
    gpus = args.gpus or (visible if not args.smoke else 1)
    if not args.smoke and gpus > visible:
        fail(f"--gpus {gpus}: only {visible} visible")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    env = environment(gpus, args.smoke, argv)
    (args.out / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    results = [run_setting(n, settings[n], args.out, gpus, args.batches, args.warmup_batches, args.timeout_s, args.smoke)
               for n in names]

    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    if args.flux:
        what = (f"Flux.1-schnell {'(flux1-tiny, 32x32: --smoke) ' if args.smoke else '256x256 '}on synthetic data in "
                f"MLPerf's precomputed format (flux-online: encoders in the step), amp_bf16, global batch "
                f"{'= ' + str(gpus) + ' x 2 x microbatch' if args.smoke else FLUX_GLOBAL_BATCH}")
    else:
        what = (f"SD2 base {'(tiny, 32x32: --smoke) ' if args.smoke else '512x512 '}with EMA, synthetic data, "
                f"amp_bf16, global batch = {gpus} x 2 x microbatch")
    header = (f"{gpus} x {env['device']}, {versions}, Python {env['python']}, {env['date_utc']}; {what}, "
              f"{args.batches} batches ({args.warmup_batches} warm-up). Cost: python cost.py {args.out}/<setting>.json")
    text = header + "\n\n" + table(results) + "\n"
    (args.out / "table.md").write_text(text)
    print("\n" + text)
    return results


if __name__ == "__main__":
    main()
