"""The numeric precisions a run can train in, and what `--precision auto` means."""
from __future__ import annotations

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")  # what a step runs in, as Composer names them
PRECISION_CHOICES = ("auto", *PRECISIONS)  # --precision; auto: amp_bf16 on a GPU, fp32 on a CPU


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """--precision with "auto" made concrete: amp_bf16 on a GPU, fp32 on a CPU."""
    return precision if precision != "auto" else ("amp_bf16" if on_gpu else "fp32")
