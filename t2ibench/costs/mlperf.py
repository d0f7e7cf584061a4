"""MLPerf Training's own files, read from the installed `mlperf-logging` package (MLCommons' code that
reviews every submission): the benchmark a model family is scored as, the compliance ruleset the logs
are written for, and the reference convergence points (RCPs) by round and global batch. What the
project follows of MLPerf's rules and what not: docs/mlperf.md.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

USAGE = "training"
# The ruleset benchmark.py's logs are written for: MLPerf Training v5.1, the first round with Flux.1
# (`compliance_checker/training_5.1.0/closed_flux1.yaml`).
RULESET = "5.1.0"
# The benchmark name a family's runs are logged as (`submission_benchmark`); a family MLPerf has no
# benchmark for is logged under its own name, which the compliance checker refuses.
BENCHMARKS = {"flux": "flux1", "sd2": "stable_diffusion"}
FLUX_BENCHMARK = BENCHMARKS["flux"]
# Where a run's RCPs are kept in the package: rcp_checker/training_<round>/rcps_<benchmark>.json.
RCP_FILE = re.compile(rf"{USAGE}_(\d+)\.(\d+)\.(\d+)$")
REFERENCE_RUNS_DROPPED = 1  # at each end, of a batch's reference runs (rcp_checker: 4 for unet3d only)


def benchmark_of(family_name: str) -> str:
    """MLPerf's name of a family's benchmark (`submission_benchmark`), or the family's own name."""
    return BENCHMARKS.get(family_name, family_name)


def _rcp_folder() -> Path:
    spec = importlib.util.find_spec("mlperf_logging.rcp_checker")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("mlperf-logging is not installed: pip install -r requirements.txt")
    return Path(spec.origin).parent


def rcp_rounds(benchmark: str = FLUX_BENCHMARK) -> list[str]:
    """The rounds whose RCP file for `benchmark` the installed package holds, oldest first ("6.1.0")."""
    rounds = []
    for folder in _rcp_folder().iterdir():
        match = RCP_FILE.match(folder.name)
        if match and (folder / f"rcps_{benchmark}.json").is_file():
            rounds.append(tuple(int(part) for part in match.groups()))
    return [".".join(map(str, r)) for r in sorted(rounds)]


def newest_rcp_round(benchmark: str = FLUX_BENCHMARK) -> str:
    """The newest round with RCPs for `benchmark` (cost.py's default)."""
    rounds = rcp_rounds(benchmark)
    if not rounds:
        raise FileNotFoundError(f"the installed mlperf-logging has no RCP file for {benchmark}")
    return rounds[-1]


@functools.lru_cache(maxsize=None)
def reference_samples_to_target(round_: str, benchmark: str = FLUX_BENCHMARK) -> dict[int, int]:
    """{global batch: samples to the target} of a round's RCP file, as MLCommons' rcp_checker computes
    its 'RCP Mean' (compute_rcp_stats: the reference runs' olympic mean, the fastest and the slowest
    dropped), rounded to a sample. Computed here from the file rather than by rcp_checker's RCP_Checker,
    whose module imports scipy.stats (9 s on the 2-core VM, for one mean); tests/test_mlperf.py checks
    the two agree."""
    path = _rcp_folder() / f"{USAGE}_{round_}" / f"rcps_{benchmark}.json"
    if not path.is_file():
        raise FileNotFoundError(f"the installed mlperf-logging has no {round_} RCP file for {benchmark} "
                                f"(rounds with one: {', '.join(rcp_rounds(benchmark)) or 'none'})")
    references: dict[int, int] = {}
    for record in json.loads(path.read_text()).values():
        runs = sorted(record["samples to converge"])[REFERENCE_RUNS_DROPPED:-REFERENCE_RUNS_DROPPED]
        references[int(record["BS"])] = round(sum(runs) / len(runs))
    return dict(sorted(references.items()))


def round_label(round_: str) -> str:
    """A round as MLPerf names it: '6.1.0' -> 'v6.1'."""
    return "v" + ".".join(round_.split(".")[:2])


def rcp_verdict(folder: str | Path, round_: str, benchmark: str, global_batch_size: int) -> dict:
    """rcp_checker's verdict on the result_*.txt of `folder` (pruned RCPs, as the package checker runs it),
    or why it was not run: the RCPs list no run at this batch."""
    listed = reference_samples_to_target(round_, benchmark) if benchmark in BENCHMARKS.values() else {}
    if global_batch_size not in listed:
        return {"checked": False, "round": round_,
                "why": f"the {round_} RCPs of {benchmark} list global batches {sorted(listed) or 'none'}, "
                       f"not this result's {global_batch_size}"}
    from mlperf_logging.rcp_checker import rcp_checker

    passed, message, normalisation = rcp_checker.check_directory(
        str(folder), USAGE, round_, False, False, rcp_pass="pruned_rcps")
    return {"checked": True, "round": round_, "passed": bool(passed), "message": message,
            "score_normalisation": float(normalisation),
            "reference_samples_to_target": listed[global_batch_size]}
