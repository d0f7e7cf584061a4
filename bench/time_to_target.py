"""MLPerf's score of time to target in one command: N runs of one set-up, each with its own seed, each
trained by benchmark.py until the validation loss reaches a target (--eval_target); the score drops
the fastest and the slowest run and averages the rest.

    OMP_NUM_THREADS=1 python bench/time_to_target.py --runs 10 --out /tmp/ttt   # the CPU default: ~1 min a run
    python bench/time_to_target.py --runs 3 --out /tmp/ttt3 --target 1.25        # a nearer target
    python bench/time_to_target.py --runs 10 --nproc 8 --target 0.586 --out runs/flux -- \\
        @my-flux-setup.args --eval_interval 512ba --max_duration 40000ba           # your set-up, on 8 GPUs

The CPU default (no flags after `--`) trains flux1-tiny on precomputed latents (MLPerf's Flux.1 set-up
in miniature) of 64 px captioned shapes drawn here (bench/learns.py's pictures), 256 to train and 64
held out, batch 16, to the validation loss DEFAULT_TARGET, evaluated every 25 batches; why that
target: docs/flux.md, "Time to target: MLPerf's score". With flags after `--` they are the set-up
instead (data, model, --eval_interval, --max_duration...): the script adds --seed, --eval_target,
--results_json and --mlperf_log.

Each run is a process of its own (Composer's launcher with --nproc), its results JSON, log, MLPerf log
and curve in OUT/runs/; the MLPerf logs of the finished runs are also OUT/mlperf/result_0.txt ..., the
folder MLCommons' scorer reads (result_summarizer's compute_score; the call that scores them is
`mlperf_score_command` in the record, docs/mlperf.md). A run that fails (a diverged run
exits 1) counts as not converged and the campaign goes on; a second failure ends it, the result
invalid. OUT/time_to_target.json holds every run's time_to_target_s, the score (score_s, by the
scorer's rule), the spread, the runs that did not converge, whether the result is valid by MLPerf's
rule and, at a global batch MLPerf's reference convergence points list, rcp_checker's verdict;
OUT/time_to_target.png draws every run's curve. Run again with the same flags, a campaign that was
killed goes on in the same --out, its finished runs kept.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from t2ibench.core import errors  # noqa: E402
from t2ibench.core.cli import POSITIVE_FLOAT, POSITIVE_INT, REPEATS, SEED, Parser  # noqa: E402
from t2ibench.core.errors import fail  # noqa: E402
from t2ibench.eval.eval_curve import Curve, plot  # noqa: E402
from t2ibench.core.files import hold_output, write_text  # noqa: E402
from t2ibench.core.locations import check_output, normalise  # noqa: E402
from t2ibench.costs.mlperf import RULESET, USAGE, newest_rcp_round, rcp_verdict  # noqa: E402

# The CPU default's target, from two calibration runs of 1,200 batches on a 2-core VM at one thread:
# flux1-tiny passes 1.20 near 4,500 samples (280 batches of 16) whatever the seed, while its curve still
# falls, and flattens near 1.07 by 15,000; 10 runs to it: results/cpu-2026-11-27/time-to-target (every
# seed between 4,000 and 4,800 samples). DEFAULT_MAX_BATCHES leaves a seed twice that.
DEFAULT_TARGET = 1.20
DEFAULT_MAX_BATCHES = 600
DEFAULT_EVAL_INTERVAL_BATCHES = 25  # 400 samples: about 11 evaluations before the target
CAPTIONS = ("a red square", "a blue circle", "a green triangle", "a yellow star")
TRAIN_PER_CAPTION, HELD_OUT_PER_CAPTION = 64, 16  # 256 pictures to train, 64 held out (8 per fixed timestep)
IMAGE_SIZE = 64
WARMUP_BATCHES = 50  # bench/learns.py's learning-rate warm-up (at most a tenth of a shorter run)
ENCODERS_SEED = 17  # the random encoders latents.py encodes with (the runs' --seed varies the rest)
# MLPerf Flux.1's AdamW, decay and clipping (recipes/flux1-mlperf.args): the CPU default's runs follow its
# closed division's rules but for the target and the evaluation interval, so MLCommons' checker and scorer
# take their logs with only those two values changed (docs/mlperf.md). Seeds 1 and 2 reach 1.20 at 4,400
# and 4,800 samples with them, as they did with torch's betas and no clipping.
MLPERF_OPTIMIZER = ["--adamw_beta1", "0.9", "--adamw_beta2", "0.95", "--adamw_eps", "1e-8", "--weight_decay", "0.1",
                    "--grad_clip_norm", "1.0"]
FLAGS_OF_THE_SCRIPT = ("--seed", "--eval_target", "--results_json", "--mlperf_log")  # set per run here
MLPERF_RUNS = 10  # a result is 10 runs (Flux.1), at most MLPERF_NOT_CONVERGED_ALLOWED of them not converged
MLPERF_NOT_CONVERGED_ALLOWED = 1
# MLCommons' scorer on a folder of result_*.txt (argv: folder, benchmark, ruleset), printing its per-run
# minutes and its olympic average (below the benchmark's required runs its command prints the runs' mean
# instead, as score_s is): the function `python -m mlperf_logging.result_summarizer.compute_score`
# calls, which that command (mlperf-logging 4.1.60 to 4.1.68) unpacks into 4 of its 5 values and stops.
SCORER = ("import json, sys; from mlperf_logging.result_summarizer import result_summarizer as r; "
          "tracked, _, score, _, _ = r._compute_strong_score_standalone(sys.argv[2], None, False, sys.argv[1], "
          "'training', sys.argv[3], return_full_scores=True); print(json.dumps([list(tracked.values()), score]))")
PLAN_FILE = "campaign.json"  # the campaign's flags, written first: the same flags again continue it
MLPERF_FOLDER = "mlperf"  # result_0.txt ...: the finished runs' MLPerf logs, as MLCommons' scorer reads them


def build_parser() -> Parser:
    p = Parser("time_to_target.py", description=__doc__)
    p.add_argument("--runs", type=REPEATS, default=MLPERF_RUNS, help="runs of the set-up, one seed each")
    p.add_argument("--out", required=True, help="folder for the data, every run's files and the score (new or empty)")
    p.add_argument("--target", type=POSITIVE_FLOAT, default=DEFAULT_TARGET,
                   help="the validation loss each run trains to (benchmark.py --eval_target)")
    p.add_argument("--first_seed", type=SEED, default=1, help="run i trains with --seed first_seed + i")
    p.add_argument("--nproc", type=POSITIVE_INT, default=1,
                   help="ranks per run, through Composer's launcher (1: a plain process)")
    p.add_argument("--max_batches", type=POSITIVE_INT, default=None,
                   help=f"the CPU default's cap on a run (default {DEFAULT_MAX_BATCHES}); "
                        "your set-up's is its --max_duration")
    p.add_argument("--eval_interval_batches", type=POSITIVE_INT, default=None,
                   help=f"the CPU default's evaluation interval (default {DEFAULT_EVAL_INTERVAL_BATCHES})")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's flags, and the set-up's after `--` (as `setup`; empty: the CPU default)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, setup = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    return argparse.Namespace(**vars(build_parser().parse_args(own)), setup=setup)


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """Mistakes found before any data is drawn or run started; the flags in a new namespace."""
    out = normalise("--out", parsed.out, ())
    problem = check_output("--out", out, folder=True)
    if problem:
        fail(problem)
    if Path(out).is_dir() and any(Path(out).iterdir()):
        check_continued(Path(out), parsed)
    for flag in FLAGS_OF_THE_SCRIPT:
        if any(arg == flag or arg.startswith(flag + "=") for arg in parsed.setup):
            fail(f"{flag} after -- is the script's to set for each run: leave it out (--first_seed, --target)")
    if parsed.setup:
        if not any(arg == "--eval_interval" or arg.startswith("--eval_interval=") for arg in parsed.setup):
            fail("the set-up after -- needs --eval_interval (how often each run evaluates, e.g. 512ba)")
        for flag in ("max_batches", "eval_interval_batches"):
            if getattr(parsed, flag) is not None:
                fail(f"--{flag} sets the CPU default's run; with a set-up after -- give --max_duration or "
                     "--eval_interval there")
    resolved = {"out": out, "max_batches": parsed.max_batches or DEFAULT_MAX_BATCHES,
                "eval_interval_batches": parsed.eval_interval_batches or DEFAULT_EVAL_INTERVAL_BATCHES}
    return argparse.Namespace(**{**vars(parsed), **resolved})


def campaign(args: argparse.Namespace) -> dict:
    """The flags that make a campaign: the same ones again continue it in its --out."""
    return {key: getattr(args, key) for key in ("runs", "target", "first_seed", "nproc", "max_batches",
                                                "eval_interval_batches", "setup")}


def check_continued(out: Path, parsed: argparse.Namespace) -> None:
    """A non-empty --out is a campaign of this script with the same flags (continued), or refused."""
    plan = out / PLAN_FILE
    if not plan.is_file():
        fail(f"--out {out} is not empty and holds no campaign of this script ({PLAN_FILE}): give a new folder "
             "(the script writes data, runs and a score there)")
    try:
        earlier = json.loads(plan.read_text())["flags"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        fail(f"--out {out}: {PLAN_FILE} is not this script's record ({type(error).__name__}): give a new folder")
    now = json.loads(json.dumps(campaign(parsed)))  # as the record holds them (tuples as lists)
    differing = [f"--{key} {earlier.get(key)!r} there, {value!r} now" for key, value in now.items()
                 if earlier.get(key) != value]
    if differing:
        fail(f"--out {out} holds a campaign of other flags ({'; '.join(differing)}): give its flags again to "
             "continue it, or a new folder")


def cpu_default_setup(data: Path, args: argparse.Namespace) -> list[str]:
    """Draw, convert and encode the CPU default's pictures into `data` (seconds); benchmark.py's flags."""
    draw_cpu_default_data(data)
    return cpu_default_flags(data, args)


def draw_cpu_default_data(data: Path) -> None:
    """The CPU default's pictures drawn, converted and encoded into `data`."""
    import convert
    import latents
    from learns import run, write_shapes

    folders = {"train": (TRAIN_PER_CAPTION, 1), "held_out": (HELD_OUT_PER_CAPTION, 2)}  # another seed: unseen pictures
    for name, (per_caption, seed) in folders.items():
        write_shapes(data / f"{name}-pictures", list(CAPTIONS), per_caption, IMAGE_SIZE, seed)
        run(convert.main, [str(data / f"{name}-pictures"), "--out", str(data / f"{name}-mds"), "--workers", "1",
                           "--no_progress"], "convert.py")
        run(latents.main, ["--model_config", "flux1-tiny", "--local", str(data / f"{name}-mds"),
                           "--out", str(data / f"{name}-latents"), "--image_size", str(IMAGE_SIZE),
                           "--seed", str(ENCODERS_SEED), "--num_workers", "0", "--store_text_states", "--no_progress"],
            "latents.py")


def cpu_default_flags(data: Path, args: argparse.Namespace) -> list[str]:
    """benchmark.py's flags of the CPU default on the data in `data`."""
    return ["--model_config", "flux1-tiny", "--precomputed", "--local", str(data / "train-latents"),
            "--eval_local", str(data / "held_out-latents"), "--image_size", str(IMAGE_SIZE), "--batch_size", "16",
            "--lr", "2e-3", "--lr_warmup_batches", str(min(WARMUP_BATCHES, args.max_batches // 10)),
            "--num_workers", "0", "--warmup_batches", "1",
            "--max_duration", f"{args.max_batches}ba", "--eval_interval", f"{args.eval_interval_batches}ba",
            "--log_interval", "50ba", *MLPERF_OPTIMIZER]


def one_run(setup: list[str], seed: int, target: float, runs: Path, nproc: int) -> dict:
    """benchmark.py with `setup` for one seed, in a process of its own (its output in runs/seed-S.log):
    its results, with the wall seconds of the whole process. A run that fails (exit non-zero: a
    diverged one, a crash) is a run that did not converge, with `failed` saying how."""
    results, log, mlperf_log = (runs / f"seed-{seed}{suffix}" for suffix in (".json", ".log", ".mlperf.log"))
    launcher = ([sys.executable, "-m", "composer.cli.launcher", "-n", str(nproc)] if nproc > 1 else [sys.executable])
    cmd = [*launcher, str(ROOT / "benchmark.py"), *setup, "--seed", str(seed), "--eval_target", repr(target),
           "--results_json", str(results), "--mlperf_log", str(mlperf_log)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for stale in (results, mlperf_log):  # a killed campaign's run of this seed, started again
        stale.unlink(missing_ok=True)
    started = time.perf_counter()
    with open(log, "w") as output:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - started
    if done.returncode == 0 and results.is_file():
        return {**json.loads(results.read_text()), "seed": seed, "wall_s": wall_s, "failed": None}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    record = json.loads(results.read_text()) if results.is_file() else {}  # a diverged run's record, if written
    return {**record, "seed": seed, "wall_s": wall_s, "converged": False, "time_to_target_s": None,
            "samples_to_target": None, "training_seconds_to_target": None,
            "failed": f"exit {done.returncode}: {lines[-1] if lines else 'no output'} (whole output: {log})"}


def mlperf_score(times_s: list[float | None], required_runs: int = MLPERF_RUNS) -> dict:
    """MLPerf's score of runs' times to target (None: did not converge), by the rule of MLCommons' scorer
    (result_summarizer): with the benchmark's required runs or more, drop the fastest and the slowest (a
    run that did not converge counts as the slowest), mean of the rest, invalid past one such run; with
    fewer, the scorer skips that rule: the mean of all of them (no score if one did not converge)."""
    converged = sorted(t for t in times_s if t is not None)
    failed = len(times_s) - len(converged)
    valid = failed <= MLPERF_NOT_CONVERGED_ALLOWED
    ordered = converged + [math.inf] * failed
    if len(times_s) >= required_runs:
        kept = ordered[1:-1]
        rule = f"the fastest and the slowest of {len(times_s)} runs dropped, the mean of the other {len(times_s) - 2}"
    else:
        kept, rule = ordered, (f"fewer than MLPerf's {required_runs} runs: nothing dropped (as MLCommons' scorer), "
                               f"the mean of all {len(times_s)}")
    score = statistics.fmean(kept) if kept and all(math.isfinite(t) for t in kept) else None
    spread = None
    if len(converged) > 1:
        stdev = statistics.stdev(converged)
        spread = {"min": converged[0], "max": converged[-1], "stdev": stdev,
                  "relative_stdev": stdev / statistics.fmean(converged)}
    if len(times_s) != MLPERF_RUNS:
        verdict = f"not an MLPerf result: it is {MLPERF_RUNS} runs, this is {len(times_s)}"
    else:
        verdict = "valid by MLPerf's rule" if valid else "invalid by MLPerf's rule"
    return {"score_s": score, "score_rule": rule, "kept_s": [t for t in kept if math.isfinite(t)],
            "spread_s": spread, "not_converged": failed, "valid": valid,
            "mlperf_result": valid and len(times_s) == MLPERF_RUNS,
            "validity": f"{verdict} (at most {MLPERF_NOT_CONVERGED_ALLOWED} of {MLPERF_RUNS} may not converge; "
                        f"{failed} did not)"}


def machine() -> dict:
    """What the runs ran on, as the results folders record it."""
    import torch
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def main(argv: list[str] | None = None) -> dict:
    parsed = parse_args(argv)
    with errors.command("time_to_target.py"):
        args = validate(parsed)
        out = Path(args.out)
        with hold_output("--out", out):
            return measure(args, out, argv)


def prepare(args: argparse.Namespace, out: Path) -> list[str]:
    """The campaign's record (PLAN_FILE) and its set-up's flags: the CPU default's data drawn once (again
    when a killed campaign left it half drawn: the folder is the script's own)."""
    plan = out / PLAN_FILE
    ready = plan.is_file() and json.loads(plan.read_text()).get("data_ready", False)
    if not plan.is_file():
        write_text(plan, json.dumps({"flags": campaign(args), "data_ready": bool(args.setup)}, indent=2) + "\n")
    if args.setup:
        return args.setup
    data = out / "data"
    if not ready:
        if data.exists():
            shutil.rmtree(data)
        draw_cpu_default_data(data)
        write_text(plan, json.dumps({"flags": campaign(args), "data_ready": True}, indent=2) + "\n")
    return cpu_default_flags(data, args)


def run_all(args: argparse.Namespace, setup: list[str], seeds: list[int], runs_folder: Path,
            mlperf_folder: Path) -> list[dict]:
    """Every seed's run, those a killed campaign finished kept (runs/seed-S.outcome.json); each finished
    run's MLPerf log copied to mlperf/result_I.txt. A second failed run ends the campaign in one line."""
    results = []
    for number, seed in enumerate(seeds, 1):
        outcome = runs_folder / f"seed-{seed}.outcome.json"
        kept = outcome.is_file()
        r = json.loads(outcome.read_text()) if kept else one_run(setup, seed, args.target, runs_folder, args.nproc)
        if not kept:
            log = runs_folder / f"seed-{seed}.mlperf.log"
            if log.is_file():  # the folder MLCommons' scorer reads: result_<i>.txt, i from 0
                write_text(mlperf_folder / f"result_{number - 1}.txt", log.read_text())
            write_text(outcome, json.dumps(r, indent=2) + "\n")  # last: the run counts as finished
        results.append(r)
        if r["failed"]:
            said = f"failed, counted as not converged: {r['failed']}"
        elif r["converged"]:
            said = (f"reached {args.target} at {r['samples_to_target']:,} samples, "
                    f"time to target {r['time_to_target_s']:.1f} s")
        else:
            said = f"did not reach {args.target} in {r['eval_history'][-1]['samples_trained']:,} samples"
        print(f"run {number}/{args.runs} (seed {seed}): {said} ({r['wall_s']:.0f} s in all"
              f"{', kept from the campaign this one continues' if kept else ''})", flush=True)
        failed = [f"seed {x['seed']}" for x in results if x["failed"]]
        if len(failed) > MLPERF_NOT_CONVERGED_ALLOWED and number < len(seeds):
            fail(f"the runs of {' and '.join(failed)} failed: the result is invalid by MLPerf's rule (at most "
                 f"{MLPERF_NOT_CONVERGED_ALLOWED} of {MLPERF_RUNS} may not converge), so the campaign stops; "
                 f"their output is in {runs_folder}")
    return results


def required_runs(benchmark: str) -> int:
    """The runs a result of `benchmark` needs, from MLCommons' table (MLPERF_RUNS for one it lacks)."""
    from mlperf_logging.benchmark_meta import get_result_file_counts
    return get_result_file_counts(USAGE).get(benchmark, MLPERF_RUNS)


def measure(args: argparse.Namespace, out: Path, argv: list[str] | None) -> dict:
    """Draw the data (CPU default), run every seed, score and draw; the score's record."""
    from t2ibench.costs.mlperf import benchmark_of
    from t2ibench.families import family_of

    runs_folder, mlperf_folder = out / "runs", out / MLPERF_FOLDER
    runs_folder.mkdir(parents=True, exist_ok=True)
    mlperf_folder.mkdir(parents=True, exist_ok=True)
    setup = prepare(args, out)
    seeds = [args.first_seed + i for i in range(args.runs)]
    results = run_all(args, setup, seeds, runs_folder, mlperf_folder)
    trained = next((r for r in results if "model_config" in r), results[0])
    benchmark = benchmark_of(family_of(trained["model_config"]).name) if "model_config" in trained else None
    times = [r["time_to_target_s"] for r in results]
    score = mlperf_score(times, required_runs(benchmark) if benchmark else MLPERF_RUNS)
    samples = [r["samples_to_target"] for r in results if r["converged"]]
    rcp_round = newest_rcp_round()
    rcp = (rcp_verdict(mlperf_folder, rcp_round, benchmark, trained["global_batch_size"]) if benchmark else
           {"checked": False, "why": "no run trained"})
    record = {
        "runs": args.runs, "seeds": seeds, "target": args.target, "cpu_default": not args.setup, "setup": setup,
        "nproc": args.nproc, "time_to_target_s": times, **score,
        "score_min": score["score_s"] / 60 if score["score_s"] is not None else None,
        "samples_to_target": [r["samples_to_target"] for r in results],
        "samples_to_target_mean": statistics.fmean(samples) if samples else None,
        "training_seconds_to_target": [r["training_seconds_to_target"] for r in results],
        "eval_seconds": [r.get("eval_seconds") for r in results],
        "converged": [r["converged"] for r in results], "failed": [r["failed"] for r in results],
        "wall_s": [r["wall_s"] for r in results],
        "model_config": trained.get("model_config"), "global_batch_size": trained.get("global_batch_size"),
        "world_size": trained.get("world_size"), "device": trained.get("device"),
        "mlperf_benchmark": benchmark, "mlperf_logs": MLPERF_FOLDER,
        "mlperf_score_command": f"python -c \"{SCORER}\" {MLPERF_FOLDER} {benchmark} {RULESET}",
        "rcp_check": rcp,
        "command": " ".join(["python", "bench/time_to_target.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "results": [str(Path("runs") / f"seed-{seed}.json") for seed in seeds], "curves": "time_to_target.png",
    }
    write_text(out / "time_to_target.json", json.dumps(record, indent=2) + "\n")
    curves = [Curve(f"seed {seed}" + (f" ({r['time_to_target_s']:.0f} s)" if r["converged"] else " (not converged)"),
                    r["eval_history"], r["eval_target_reached"]) for seed, r in zip(seeds, results)
              if r.get("eval_history")]
    score_words = f"score {score['score_s']:.1f} s" if score["score_s"] is not None else "no score"
    plot(curves, args.target, str(out / "time_to_target.png"),
         f"{record['model_config']}, global batch {record['global_batch_size']}, {record['world_size']} x "
         f"{record['device']}: {args.runs} runs to {args.target:g}, {score_words} ({score['score_rule']})")
    print(f"time to target {args.target}: {score_words} ({score['score_rule']}); "
          + (f"spread {score['spread_s']['min']:.1f} to {score['spread_s']['max']:.1f} s, "
             f"stdev {100 * score['spread_s']['relative_stdev']:.1f}% of the mean; " if score["spread_s"] else "")
          + f"{score['validity']}")
    print(f"MLPerf logs: {mlperf_folder} (score them: {record['mlperf_score_command']}, from {out}); "
          + (f"rcp_checker ({rcp['round']} RCPs): {'passed' if rcp['passed'] else 'failed'}, {rcp['message']}"
             if rcp["checked"] else f"rcp_checker not run: {rcp['why']}"))
    print(f"written: {out / 'time_to_target.json'}, {out / 'time_to_target.png'}")
    return record


if __name__ == "__main__":
    main()
