"""The validation curve as a picture: validation loss against samples trained, each fixed timestep's
loss faint, the target as a line; one run's (beside benchmark.py's results JSON) or several runs'
(bench/time_to_target.py). What it shows: docs/metrics.md, "Time to target".
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from t2ibench.core.errors import fail
from t2ibench.core.files import atomic_file, write_error

CURVE_SUFFIX = "-eval.png"  # results.json -> results-eval.png
TITLE_CHARACTERS = 90  # characters a line of the title: the 9-inch figure holds about 100
FAINT_ALPHA = 0.3  # the per-timestep curves, behind the mean


@dataclass
class Curve:
    """One run's evaluations (`eval_history` of a results JSON) and its name in the legend."""

    label: str
    history: list[dict[str, Any]]
    reached: dict[str, Any] | None = None  # the evaluation that met the target, marked


def curve_path(results_json: str) -> str:
    """The picture beside a results JSON: its name without `.json`, then CURVE_SUFFIX."""
    stem = results_json[:-len(".json")] if results_json.lower().endswith(".json") else results_json
    return stem + CURVE_SUFFIX


def plot(curves: list[Curve], target: float | None, path: str, title: str,
         image_targets: tuple[float | None, float | None] = (None, None)) -> None:
    """Validation loss against samples trained, one line per run; with one run its 8 timesteps' losses
    faint behind it (with several they would hide the runs); the target as a dashed line. With one run
    scored by FID or CLIP score, a second panel below draws them (FID left axis, CLIP right), with
    `image_targets` (FID, CLIP) as dashed lines."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    scored = len(curves) == 1 and any(key in entry for entry in curves[0].history for key in ("fid", "clip_score"))
    fig, axes = plt.subplots(2 if scored else 1, 1, figsize=(9, 8 if scored else 5), sharex=True, squeeze=False)
    ax = axes[0][0]
    try:
        for index, curve in enumerate(curves):
            x = [entry["samples_trained"] for entry in curve.history]
            colour = f"C{index % 10}"
            if len(curves) == 1:
                per_timestep = [entry["per_timestep"] for entry in curve.history]
                for k in range(len(per_timestep[0]) if per_timestep else 0):
                    points = [(xi, row[k]) for xi, row in zip(x, per_timestep) if row[k] is not None]
                    ax.plot([p[0] for p in points], [p[1] for p in points], color="grey", alpha=FAINT_ALPHA, lw=0.8,
                            label="each of the 8 fixed timesteps" if k == 0 else None)
            ax.plot(x, [entry["loss"] for entry in curve.history], color=colour, lw=1.6, marker="o", ms=2.5,
                    label=curve.label)
            if curve.reached is not None:
                ax.plot([curve.reached["samples_trained"]], [curve.reached["loss"]], ls="none", marker="*", ms=11,
                        color=colour)
        if target is not None:
            ax.axhline(target, color="black", ls="--", lw=1, label=f"target {target:g}")
        if scored:
            _plot_scores(axes[1][0], curves[0].history, image_targets)
        bottom = axes[-1][0]
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # samples are whole
        bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        bottom.set_xlabel("samples trained (all ranks)")
        ax.set_ylabel("validation loss (8 fixed timesteps)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if len(curves) > 5 else 1)
        ax.set_title(textwrap.fill(title, TITLE_CHARACTERS), fontsize=10)
        fig.tight_layout()
        with atomic_file(path, "wb") as f:
            fig.savefig(f, dpi=120, format="png")
    finally:
        plt.close(fig)


def _plot_scores(ax: Any, history: list[dict[str, Any]], targets: tuple[float | None, float | None]) -> None:
    """FID (left axis) and CLIP score (right axis) of each evaluation, with their targets dashed."""
    for key, name, side, colour, target in (("fid", "FID", ax, "C3", targets[0]),
                                            ("clip_score", "CLIP score", None, "C2", targets[1])):
        points = [(entry["samples_trained"], entry[key]) for entry in history if key in entry]
        if not points:
            continue
        side = side or ax.twinx()
        side.plot([p[0] for p in points], [p[1] for p in points], color=colour, lw=1.6, marker="o", ms=2.5,
                  label=name)
        if target is not None:
            side.axhline(target, color=colour, ls="--", lw=1, label=f"{name} target {target:g}")
        side.set_ylabel(name, color=colour)
        side.legend(fontsize=8, loc="upper left" if key == "fid" else "upper right")
    ax.grid(True, alpha=0.3)


def write_run_curve(results_json: str, results: dict[str, Any]) -> str | None:
    """benchmark.py's picture beside its results JSON (rank 0, after the JSON), said in a line: the path,
    or None when the run evaluated nothing. A write that fails is one line: the results are already written."""
    history = results.get("eval_history")
    if not history:
        return None
    path = curve_path(results_json)
    reached = results.get("eval_target_reached")
    words = (f", target reached at {reached['samples_trained']:,} samples" if reached else
             ", target not reached" if results.get("converged") is False else "")
    title = (f"{results['model_config']} at {results['image_size']} px, global batch {results['global_batch_size']}, "
             f"{results['world_size']} x {results['device']}{words}")
    try:
        plot([Curve("validation loss (mean)", history, reached)], results.get("eval_target"), path, title,
             (results.get("fid_target"), results.get("clip_target")))
    except OSError as error:
        fail(write_error(f"the validation curve {path} (beside --results_json)", error)
             + f"; the results were written to {results_json}")
    print(f"validation curve drawn in {path}")
    return path
