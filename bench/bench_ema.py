"""Memory and update time of EMA: this repository's `ema.EMA` against `composer.algorithms.EMA`.

The model is the real `t2ibench.train.model.DiffusionModel` (UNet trainable; VAE and text encoder frozen, as in
training) built from `--model_config` shapes. Weights are random: the model is built on the meta
device and materialized with uniform values, which is much faster than the modules' own init and
does not change what an EMA costs. Both algorithms are driven the way Composer's Engine drives
them, through `match`/`apply` on a real Composer `State`: `INIT`, `FIT_START`, then `BATCH_END`
once per batch with the batch counter advanced. The first `BATCH_END` (where both initialize their
copy) is timed apart from the updates ("init"). What Composer 0.32's EMA does there: it copies the
trainable parameters and every buffer of the model (the frozen VAE's and text encoder's included;
their frozen parameters are not copied) once at `INIT` and again at the start of averaging,
replacing the first copy, so two copies exist for a moment; each update then makes temporaries
tensor by tensor (`ema * s`, `p * (1 - s)`, their sum) for parameters and buffers alike.

Each algorithm runs in its own subprocess, one after the other, so memory figures do not mix:
  * held: bytes of the tensors the algorithm keeps (our shadow; Composer's parameter + buffer copies)
  * RSS delta (CPU): process resident memory after initialization minus before the algorithm existed
  * peak extra: highest RSS (sampled every 2 ms) above the pre-algorithm RSS, during init / updates
On CUDA the same figures come from torch.cuda.memory_allocated / max_memory_allocated.
Update time is measured twice: alone, in those processes, and interleaved, in a third process that
holds both EMAs and alternates their updates, so that both see the same machine (on a shared CPU,
runs minutes apart can see very different load). `--no_interleaved` skips that run; it needs memory
for the model plus both copies (about 12-16 GB for sd2-base in fp32).

Usage: python bench/bench_ema.py [--model_config sd2-base|tiny] [--device cpu|cuda] [--updates N]
                           [--dtype float32|bfloat16] [--threads N] [--no_interleaved] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

from t2ibench.core.cli import POSITIVE_INT, REPEATS, Parser  # noqa: E402
from t2ibench.core.locations import check_output, normalise  # noqa: E402

VARIANTS = ("ours", "composer")


def build_model(model_config: str, device: str, dtype: torch.dtype):
    """`DiffusionModel` with random weights; trainable UNet in `dtype`, frozen parts in fp32."""
    from t2ibench.families import MODEL_CONFIGS
    from t2ibench.train.model import DiffusionModel
    family = MODEL_CONFIGS[model_config]
    parts = family.meta_parts(model_config)
    unet, vae, text_encoder = parts.denoiser, parts.vae, parts.text_encoder
    g = torch.Generator(device="cpu").manual_seed(0)
    for module in (unet, vae, text_encoder):
        module.to_empty(device=device)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                if t.is_floating_point():
                    # every element written (to_empty leaves pages untouched, which would hide them from RSS)
                    t.copy_(torch.empty(t.shape).uniform_(-0.05, 0.05, generator=g))
                else:  # CLIP's position_ids
                    t.copy_(torch.arange(t.shape[-1]).expand_as(t))
    unet.to(dtype)
    return DiffusionModel(family, parts)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS seen while the block runs, sampled every 2 ms by a thread."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def held_bytes(variant: str, algo) -> int:
    if variant == "ours":
        return algo.shadow_nbytes
    ema = algo.ema_model
    tensors = list(ema.named_parameters_dict.values()) + list(ema.named_buffers_dict.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def make_algorithm(variant: str):
    if variant == "ours":
        from ema import EMA
        return EMA(half_life="1000ba")
    from composer.algorithms import EMA as ComposerEMA
    return ComposerEMA(half_life="1000ba")


class Driver:
    """Runs algorithms on a Composer State as the Engine would: match, then apply."""

    def __init__(self, model, device: str, max_batches: int):
        from composer.core import State
        from composer.devices import DeviceCPU, DeviceGPU
        from composer.loggers import Logger
        self.state = State(model=model, rank_zero_seed=0, run_name="bench-ema", max_duration=f"{max_batches}ba",
                           device=DeviceGPU() if device == "cuda" else DeviceCPU())
        self.logger = Logger(self.state)
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, algo, event) -> float:
        """Seconds that `algo` spends on `event` (match included), the device synchronized."""
        self.sync()
        t0 = time.perf_counter()
        if algo.match(event, self.state):
            algo.apply(event, self.state, self.logger)
        self.sync()
        return time.perf_counter() - t0

    def next_batch(self) -> None:
        self.state.timestamp = self.state.timestamp.to_next_batch(samples=1)

    def start(self, algo) -> float:
        """INIT, FIT_START and the first BATCH_END (where both EMAs make their copy)."""
        from composer.core import Event
        seconds = self.run(algo, Event.INIT) + self.run(algo, Event.FIT_START)
        self.next_batch()
        return seconds + self.run(algo, Event.BATCH_END)


def worker(variant: str, model_config: str, device: str, dtype: torch.dtype, updates: int) -> dict:
    """Memory (and, for `both`, interleaved update times) of one variant, in a fresh process."""
    from composer.core import Event
    model = build_model(model_config, device, dtype)
    driver = Driver(model, device, updates + 10)
    result = dict(variant=variant, model_config=model_config, device=device, dtype=str(dtype).split(".")[-1],
                  trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                  total_params=sum(p.numel() for p in model.parameters()), updates=updates,
                  threads=torch.get_num_threads())
    if variant == "both":
        # Both EMAs on one model, updates alternating (and alternating which goes first), so that
        # both see the same machine: on a shared CPU, runs minutes apart do not.
        algos = {v: make_algorithm(v) for v in VARIANTS}
        for v, algo in algos.items():
            driver.start(algo)
        times = {v: [] for v in VARIANTS}
        for i in range(updates):
            driver.next_batch()
            for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
                times[v].append(driver.run(algos[v], Event.BATCH_END))
        result.update({f"{v}_update_median_s": statistics.median(t) for v, t in times.items()})
        result.update({f"{v}_update_min_s": min(t) for v, t in times.items()})
        result["loadavg"] = os.getloadavg()[0]
        return result

    gc.collect()
    if driver.cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = rss_bytes()
    algo = make_algorithm(variant)
    with PeakRSS() as init_peak:
        init_s = driver.start(algo)
    gc.collect()
    after_init_rss = rss_bytes()
    if driver.cuda:
        after_init, init_peak_cuda = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    with PeakRSS() as update_peak:
        for _ in range(updates):
            driver.next_batch()
            times.append(driver.run(algo, Event.BATCH_END))
    result.update(held_bytes=held_bytes(variant, algo), init_s=init_s, update_median_s=statistics.median(times),
                  loadavg=os.getloadavg()[0])
    if driver.cuda:
        result.update(added_bytes=after_init - base, init_peak_extra=init_peak_cuda - base,
                      update_peak_extra=torch.cuda.max_memory_allocated() - base)
    else:
        result.update(added_bytes=after_init_rss - base_rss, init_peak_extra=init_peak.peak - base_rss,
                      update_peak_extra=update_peak.peak - base_rss)
    return result


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


def print_table(rows: list[dict], both: dict | None) -> None:
    r0 = rows[0]
    loads = ", ".join(f"{r['loadavg']:.1f}" for r in rows + ([both] if both else []))
    print(f"\nEMA on DiffusionModel({r0['model_config']}), device={r0['device']}: trainable (UNet) "
          f"{r0['trainable_params'] / 1e6:.1f}M of {r0['total_params'] / 1e6:.1f}M parameters ({r0['dtype']}); "
          f"{r0['updates']} updates; {r0['threads']} threads; 1-min load average after each run: {loads}")
    mem = "RSS" if r0["device"] == "cpu" else "CUDA alloc"
    header = ["EMA", "held", "B/param", f"{mem} added", "B/param", "peak extra: init", "peak extra: updates",
              "init s", "update s alone", "update s interleaved"]
    lines = [header]
    for r in rows:
        n = r["trainable_params"]
        inter = f"{both[r['variant'] + '_update_median_s']:.4f}" if both else "-"
        lines.append([
            "ema.EMA (this repo)" if r["variant"] == "ours" else "composer.algorithms.EMA",
            gb(r["held_bytes"]), f"{r['held_bytes'] / n:.2f}", gb(r["added_bytes"]), f"{r['added_bytes'] / n:.2f}",
            gb(r["init_peak_extra"]), gb(r["update_peak_extra"]), f"{r['init_s']:.3f}",
            f"{r['update_median_s']:.4f}", inter,
        ])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    for i, row in enumerate(lines):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("(update times are medians; 'interleaved' alternates the two EMAs' updates in one process)")
    if both:
        ratio = both["composer_update_median_s"] / both["ours_update_median_s"]
        print(f"update speed-up (interleaved medians): {ratio:.1f}x")


def build_parser() -> Parser:
    parser = Parser("bench_ema.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model_config", default="sd2-base", choices=["sd2-base", "tiny"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--updates", type=REPEATS, default=None, help="updates timed (default 10, tiny 50)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype the UNet's parameters train in")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: ours,composer")
    parser.add_argument("--threads", type=POSITIVE_INT, default=None, help="torch.set_num_threads in the workers (CPU)")
    parser.add_argument("--no_interleaved", action="store_true",
                        help="skip the run that alternates both EMAs in one process (it holds both copies)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    updates = args.updates or (50 if args.model_config == "tiny" else 10)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args._worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        row = worker(args._worker, args.model_config, args.device, getattr(torch, args.dtype), updates)
        print("RESULT " + json.dumps(row), flush=True)
        return
    if args.json:  # probed before the timed runs, as every output is
        args = argparse.Namespace(**{**vars(args), "json": normalise("--json", args.json, ())})
        problem = check_output("--json", args.json, folder=False)
        if problem:
            parser.error(problem)
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"--variants: unknown '{variant}', choose from {VARIANTS}")
    if not args.no_interleaved and set(variants) == set(VARIANTS):
        variants.append("both")
    rows, both = [], None
    for variant in variants:  # one process at a time: each builds its own model
        cmd = [sys.executable, os.path.abspath(__file__), "--_worker", variant, "--model_config", args.model_config,
               "--device", args.device, "--updates", str(updates), "--dtype", args.dtype]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            sys.exit(f"{variant} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        row = json.loads(found[-1][len("RESULT "):])
        if variant == "both":
            both = row
        else:
            rows.append(row)
        print(f"{variant}: done", file=sys.stderr, flush=True)
    print_table(rows, both)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isolated": rows, "interleaved": both}, f, indent=1)

if __name__ == "__main__":
    main()
