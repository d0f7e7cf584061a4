"""Per-batch time of the learning proof's training run on a CPU, and what changes it.

    python bench/cpu_speed.py --batches 1500 --settings default          # does a long run slow down?
    python bench/cpu_speed.py --batches 200 --repeats 3 --settings single foreach fused single-ftz

The run is bench/learns.py's (tiny model, 64px shapes, batch 16, lr 2e-3 with 50 warm-up batches,
caption dropout 0.1, one loader worker), through benchmark.main in a fresh process per run, with a
callback that records the wall time of every batch. Settings, alternated run by run (the machine
is shared: medians over runs, and ratios against the first setting):

    default      AdamW as benchmark.py builds it (--fused_adamw auto)
    single       torch's own CPU choice: the single-tensor loop (foreach=False, fused=False)
    foreach      the multi-tensor (foreach) implementation
    fused        the fused kernel (--fused_adamw on)
    <any>-ftz    the same with torch.set_flush_denormal(True): denormal floats read and written as 0

It prints, per setting, the median seconds per batch in windows of --window batches (a slow-down
over the run shows as rising windows) and over the whole run after the first window.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from t2ibench.core import errors  # noqa: E402
from t2ibench.core.cli import POSITIVE_INT, REPEATS, Parser  # noqa: E402
from t2ibench.core.errors import fail  # noqa: E402
from t2ibench.core.locations import check_output, normalise  # noqa: E402

OPTIMIZERS = {"default": None, "single": dict(foreach=False, fused=False), "foreach": dict(foreach=True),
              "fused": dict(fused=True)}


def child(args: argparse.Namespace) -> None:
    """One training run in this process; prints the per-batch seconds as JSON."""
    import torch
    from composer.core import Callback

    import benchmark

    setting = args.child
    optimizer, ftz = setting.removesuffix("-ftz"), setting.endswith("-ftz")
    if ftz:
        torch.set_flush_denormal(True)
    if OPTIMIZERS[optimizer] is not None:
        chosen, original = OPTIMIZERS[optimizer], torch.optim.AdamW

        def adamw(params, **kwargs):  # benchmark.py's AdamW with this setting's implementation
            kwargs.pop("fused", None)
            return original(params, **kwargs, **chosen)

        benchmark.torch.optim.AdamW = adamw

    class Clock(Callback):
        def __init__(self):
            self.last, self.seconds = None, []

        def batch_start(self, state, logger) -> None:
            if self.last is None:
                self.last = time.perf_counter()

        def batch_end(self, state, logger) -> None:
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

    clock = Clock()
    benchmark.main(["--model_config", "tiny", "--remote", args.shards, "--local", args.cache, "--image_size", "64",
                    "--batch_size", "16", "--max_duration", f"{args.batches}ba", "--lr", "2e-3",
                    "--lr_warmup_batches", str(min(50, args.batches - 1)), "--caption_drop_prob", "0.1", "--num_workers", "1",
                    "--log_interval", f"{args.batches}ba", "--warmup_batches", "1", "--loss_bins", "0"],
                   extra_callbacks=[clock])
    print(json.dumps({"setting": setting, "seconds": clock.seconds}), flush=True)


def make_shards(work: Path) -> Path:
    """bench/learns.py's default pictures (2 captions x 48), converted as it converts them."""
    import convert
    from learns import write_shapes

    write_shapes(work / "pictures", ["a red square", "a blue circle"], 48, 64, 17)
    convert.main([str(work / "pictures"), "--out", str(work / "mds"), "--workers", "1", "--no_progress"])
    return work / "mds"


def build_parser() -> Parser:
    p = Parser("cpu_speed.py", description=__doc__)
    p.add_argument("--batches", type=POSITIVE_INT, default=1500, help="training batches per run")
    p.add_argument("--repeats", type=REPEATS, default=1, help="runs per setting, alternated")
    p.add_argument("--window", type=POSITIVE_INT, default=100, help="batches per reported window")
    p.add_argument("--settings", nargs="+", default=["default"],
                   choices=[f"{o}{f}" for o in OPTIMIZERS for f in ("", "-ftz")], help="see above")
    p.add_argument("--json", default=None, help="also write every run's per-batch seconds here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shards", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.child:
        child(args)
        return {}
    with errors.command("cpu_speed.py"):  # --json probed now, not after the runs
        json_file = None if args.json is None else normalise("--json", args.json, ())  # file:///path is /path
        problem = check_output("--json", json_file, folder=False)
        if problem:
            fail(problem)
    work = Path(tempfile.mkdtemp(prefix="cpu-speed-"))
    shards = make_shards(work)
    runs: dict[str, list[list[float]]] = {s: [] for s in args.settings}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for r in range(args.repeats):
        for setting in args.settings:
            cmd = [sys.executable, __file__, "--child", setting, "--shards", str(shards),
                   "--cache", str(work / f"cache-{setting}-{r}"), "--batches", str(args.batches)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"cpu_speed.py: error: run {setting} failed: {done.stderr[-2000:]}")
            seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
            runs[setting].append(seconds)
            print(f"run {r + 1} {setting}: median {statistics.median(seconds[args.window:] or seconds):.3f} s/batch",
                  flush=True)
    report = {}
    first = args.settings[0]
    for setting, each in runs.items():
        windows = [statistics.median(statistics.median(s[i:i + args.window]) for s in each)
                   for i in range(0, args.batches, args.window)]
        whole = statistics.median(statistics.median(s[args.window:] or s) for s in each)
        report[setting] = {"s_per_batch": whole, "windows": windows}
        ratio = whole / report[first]["s_per_batch"]
        print(f"{setting:12s} {whole:.3f} s/batch (x{ratio:.2f} of {first}); per {args.window} batches: "
              + " ".join(f"{w:.3f}" for w in windows))
    if json_file:
        Path(json_file).write_text(json.dumps({"runs": runs, "report": report}) + "\n")
    return report


if __name__ == "__main__":
    main()
