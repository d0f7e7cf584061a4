"""GPU throughput matrix: SD2 base at 512x512 with EMA, one `benchmark.py` run per setting.

    python bench/bench_gpu.py --out $OUT                      # the default matrix, about 8 minutes on one H100
    python bench/bench_gpu.py --out /tmp/b --quick            # two settings, a smoke test
    python bench/bench_gpu.py --out /tmp/b --only online-bf16-mb32 precomputed-bf16-compile-mb32

Each setting runs in its own process (a fresh CUDA context: peak memory and compile caches do
not leak between settings), writes `<out>/<name>.json` and `<out>/<name>.log`, and the table
of images/sec, MFU and peak memory is printed last and written to `<out>/table.md`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project root

# name -> extra benchmark.py flags. Every run: sd2-base, 512x512, --use_ema, synthetic data.
MATRIX: dict[str, list[str]] = {
    "online-bf16-mb16": ["--device_train_microbatch_size", "16"],
    "online-bf16-mb32": ["--device_train_microbatch_size", "32"],
    "online-bf16-mb32-cl": ["--device_train_microbatch_size", "32", "--channels_last"],
    "online-bf16-mb32-compile": ["--device_train_microbatch_size", "32", "--compile"],
    "precomputed-bf16-mb32": ["--precomputed", "--device_train_microbatch_size", "32"],
    "precomputed-bf16-mb64": ["--precomputed", "--device_train_microbatch_size", "64"],
    # Precomputed batches carry token ids by default (the text encoder runs); this one, text states.
    "precomputed-states-bf16-mb64": ["--precomputed", "--precomputed_format", "text_states",
                                     "--device_train_microbatch_size", "64"],
    "precomputed-bf16-mb64-cl": ["--precomputed", "--device_train_microbatch_size", "64", "--channels_last"],
    "precomputed-bf16-mb64-compile": ["--precomputed", "--device_train_microbatch_size", "64", "--compile"],
}
QUICK = ["online-bf16-mb16", "precomputed-bf16-mb32"]


def run_setting(name: str, flags: list[str], out: Path, batches: int, timeout_s: int) -> dict:
    micro = int(flags[flags.index("--device_train_microbatch_size") + 1])
    cmd = [sys.executable, str(ROOT / "benchmark.py"), "--use_synth_data", "--use_ema", "--image_size", "512",
           "--batch_size", str(2 * micro), "--max_duration", f"{batches}ba", "--warmup_batches", "5",
           "--num_workers", "8", "--log_interval", "5ba", "--results_json", str(out / f"{name}.json"), *flags]
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"name": name, "status": "ok" if code == 0 else f"failed ({code})", "wall_s": time.time() - start}
    if code == 0:
        result.update(json.loads((out / f"{name}.json").read_text()))
    print(f"{name}: {result['status']} in {result['wall_s']:.0f}s", flush=True)
    return result


def table(results: list[dict]) -> str:
    rows = ["| setting | images/s | MFU | peak memory GiB | data wait | final loss | status |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ok":
            rows.append(f"| {r['name']} | | | | | | {r['status']} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        rows.append(f"| {r['name']} | {r['images_per_sec']:.1f} | {mfu} | {r['peak_memory_bytes'] / 2**30:.1f} "
                    f"| {100 * r['data_wait_fraction']:.1f}% | {r['final_loss']:.4f} | ok |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for logs, JSON and the table")
    p.add_argument("--batches", type=int, default=25, help="batches per setting (5 are warm-up)")
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--only", nargs="+", default=None, help=f"settings to run, from {list(MATRIX)}")
    p.add_argument("--timeout_s", type=int, default=240, help="limit per setting, seconds")
    args = p.parse_args()
    names = args.only or (QUICK if args.quick else list(MATRIX))
    unknown = [n for n in names if n not in MATRIX]
    if unknown:
        p.error(f"--only: unknown settings {unknown}; choose from {list(MATRIX)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_setting(n, MATRIX[n], args.out, args.batches, args.timeout_s) for n in names]

    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    header = (f"{device}, torch {torch.__version__}, Python {platform.python_version()}, "
              f"{datetime.date.today().isoformat()}; SD2 base 512x512, EMA on, synthetic data, "
              f"global batch = 2 x microbatch, {args.batches} batches (5 warm-up)")
    text = header + "\n\n" + table(results) + "\n"
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print("\n" + text)


if __name__ == "__main__":
    main()
