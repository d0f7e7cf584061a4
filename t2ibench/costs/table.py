"""The time-and-cost table of cost.py, one `Row` per GPU count, and its outputs: the terminal table,
CSV, Markdown and the plot of days and dollars against GPUs."""
from __future__ import annotations

import csv
import os
import textwrap
from dataclasses import dataclass

from t2ibench.core.files import atomic_file


@dataclass
class Row:
    """One line of the table. days in days, gpu_hours in GPU-hours, cost_usd in US dollars."""
    num_gpus: int
    images_per_sec: float
    days: float
    gpu_hours: float
    cost_usd: float
    source: str  # "measured", "predicted", or "MLPerf v5.1 <GPU> (published elsewhere)" for reference rows



TITLE_CHARACTERS = 100  # characters a line of the plot's title: its 12-inch width holds about 110
COLUMNS = ("GPUs", "images/s", "days", "GPU-hours", "cost ($)", "source")
COST_IN_THOUSANDS_FROM_USD = 10_000  # the plot's cost axis in thousands of dollars from this cost on
# The days column of a table priced to a quality target (the caption above it names the target).
COLUMNS_TO_TARGET = ("GPUs", "images/s", "days to target", "GPU-hours", "cost ($)", "source")


def format_cells(row: Row) -> list[str]:
    """The printed form of one row: days to 2 decimals, hours and dollars to the unit."""
    return [f"{row.num_gpus}", f"{row.images_per_sec:,.1f}", f"{row.days:,.2f}",
            f"{row.gpu_hours:,.0f}", f"{row.cost_usd:,.0f}", row.source]


def format_table(rows: list[Row], to_target: bool = False) -> str:
    """Plain-text table, numbers right-aligned, for the terminal; `to_target`: the days are to a target."""
    cells = [list(COLUMNS_TO_TARGET if to_target else COLUMNS)] + [format_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = []
    for line in cells:
        numbers = [c.rjust(w) for c, w in zip(line[:-1], widths)]
        lines.append("  ".join(numbers + [line[-1].ljust(widths[-1])]).rstrip())
    return "\n".join(lines)


def write_csv(rows: list[Row], path: str, aspect_buckets: str = "square",
              largest_bucket_share: float | None = None, samples: float | None = None, trained_to: str = "") -> None:
    """Machine-readable table: unformatted numbers, one row per GPU count. The measured and predicted
    rows carry the images they are for: `aspect_buckets` ("square", or the bucket list) and the share
    of the images trained in the largest bucket; the reference rows (MLPerf's) train square images.
    Every row carries the samples it prices and what they reach (`trained_to`: "MLPerf's target
    (validation loss <= 0.586)", empty for a fixed number of samples)."""
    with atomic_file(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_gpus", "images_per_sec", "days", "gpu_hours", "cost_usd", "source", "aspect_buckets",
                    "largest_bucket_share", "samples", "trained_to"])
        for r in rows:
            ours = r.source in ("measured", "predicted")
            share = "" if largest_bucket_share is None or not ours else f"{largest_bucket_share:.4f}"
            w.writerow([r.num_gpus, f"{r.images_per_sec:.2f}", f"{r.days:.4f}", f"{r.gpu_hours:.1f}",
                        f"{r.cost_usd:.2f}", r.source, aspect_buckets if ours else "square", share,
                        "" if samples is None else f"{samples:.0f}", trained_to])


def write_markdown(rows: list[Row], path: str, caption: str, to_target: bool = False) -> None:
    """Markdown table (same cells as the terminal table) followed by its assumptions."""
    columns = COLUMNS_TO_TARGET if to_target else COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * (len(columns) - 1) + "---|"]
    lines += ["| " + " | ".join(format_cells(r)) + " |" for r in rows]
    with atomic_file(path, "w") as f:
        f.write("\n".join(lines) + f"\n\n{caption}\n")


def plot(rows: list[Row], path: str, title: str, to_target: bool = False) -> None:
    """Two panels against GPU count (log2 axis): days to train (log axis) and cost in dollars, to the
    target the title names where `to_target`. Measured rows are filled markers, predicted ones hollow
    markers on a dashed line."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    gpus = [r.num_gpus for r in rows]
    predicted = [i for i, r in enumerate(rows) if r.source == "predicted"]
    measured = [i for i, r in enumerate(rows) if r.source == "measured"]
    fig, (ax_days, ax_cost) = plt.subplots(1, 2, figsize=(12, 4.8))
    reached = " to the target" if to_target else ""
    # A run to a target costs hundreds of dollars where the 2023 run cost a hundred thousand: the unit follows.
    thousands = max(r.cost_usd for r in rows) >= COST_IN_THOUSANDS_FROM_USD
    usd_per_unit = 1000 if thousands else 1
    panels = [(ax_days, [r.days for r in rows], f"days to train{reached}",
               lambda v: f"{v:,.1f} d" if v >= 1 else f"{v * 24:,.1f} h"),
              (ax_cost, [r.cost_usd / usd_per_unit for r in rows],
               f"cost{reached} ({'thousand ' if thousands else ''}US$)",
               lambda v: f"${v:,.0f}k" if thousands else f"${v:,.0f}")]
    for ax, ys, ylabel, label in panels:
        # solid between two measurements, dashed wherever a prediction is involved
        for i in range(len(rows) - 1):
            both = rows[i].source == rows[i + 1].source == "measured"
            ax.plot(gpus[i:i + 2], ys[i:i + 2], color="C0", lw=1.2, ls="-" if both else "--")
        ax.plot([gpus[i] for i in measured], [ys[i] for i in measured], ls="none", marker="o",
                color="C0")
        ax.plot([gpus[i] for i in predicted], [ys[i] for i in predicted], ls="none", marker="o",
                color="C0", mfc="white")
        handles = [Line2D([], [], color="C0", marker="o", ls="-", label="measured")]
        if predicted:
            handles.append(Line2D([], [], color="C0", marker="o", mfc="white", ls="--",
                                  label="predicted"))
        ax.legend(handles=handles)
        for x, y in zip(gpus, ys):
            ax.annotate(label(y), (x, y), textcoords="offset points", xytext=(5, 6), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("number of GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlim(min(gpus) / 1.4, max(gpus) * 1.4)  # room for the labels at both ends
    ax_days.set_yscale("log")
    ax_days.set_ylim(min(r.days for r in rows) / 1.5, max(r.days for r in rows) * 1.5)
    ax_days.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_days.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_days.yaxis.set_minor_formatter(NullFormatter())
    ax_days.set_title(f"days to train{reached} (log scale)", fontsize=10)
    ax_cost.set_ylim(bottom=0, top=max(r.cost_usd for r in rows) / usd_per_unit * 1.15)
    ax_cost.set_title(f"cost of the run{reached}", fontsize=10)
    # A longer title (a bucketed run's names its list) is wrapped rather than cut at the figure's edges.
    fig.suptitle(textwrap.fill(title, TITLE_CHARACTERS))
    fig.tight_layout()
    try:
        with atomic_file(path, "wb") as f:  # the format from the name's suffix, as savefig(path) takes it
            fig.savefig(f, dpi=120, format=os.path.splitext(path)[1][1:].lower())
    finally:
        plt.close(fig)
