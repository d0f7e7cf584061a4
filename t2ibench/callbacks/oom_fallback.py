"""A run whose first batches run out of GPU memory goes on at half the microbatch, and says so.

The memory model plans the microbatch with headroom (t2ibench.memory.HEADROOM_FRACTION), but a count
can be wrong for a set-up never measured. Composer has the search this needs: with
`state.auto_microbatching` on, an OOM in a batch (or allocation retries in two batches running) is
caught, the batch's partial state cleared and the batch retried at half the microbatch. This callback
turns that search on for the first `batches` batches of the process and off after them, because
while it is on Composer all-reduces an OOM flag after every microbatch's forward and reads it on the
host: a host sync per microbatch that a measured step must not pay. The steps that run out of memory
are the first ones (the AdamW and EMA state is allocated by the first step; every later step has the
same shapes, or a bucketed run's largest, which the plan counts).

Only where Composer's search serves: one rank without FSDP (`serves`). Under DDP an OOM in one rank's
backward leaves the other ranks in the gradient all-reduce, which Composer's flag cannot reach; its
FSDP search installs hooks when the model is wrapped. There an OOM stops the run with one line
naming the flag to lower (benchmark.py's `user_error`).
"""
from __future__ import annotations

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


def serves(world_size: int, sharded: bool) -> bool:
    """Whether a run can fall back: one rank, not sharded by FSDP (see the module's docstring)."""
    return world_size == 1 and not sharded


class HalveMicrobatchOnOom(Callback):
    """Composer's OOM search on for the first `batches` batches this process trains; each change of
    the microbatch recorded (`fallbacks`) and printed."""

    def __init__(self, batches: int):
        self.batches = max(1, batches)
        self.planned: int | None = None  # the microbatch the run started with
        self.fallbacks: list[dict[str, int]] = []  # {"batch", "from", "to"}, in order
        self._trained = 0  # batches this process trained (a resumed run searches again)
        self._current: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self.planned = self._current = int(state.device_train_microbatch_size)
        state.auto_microbatching = True

    def batch_end(self, state: State, logger: Logger) -> None:
        self._trained += 1
        now = int(state.device_train_microbatch_size)
        if now != self._current:
            batch = int(state.timestamp.batch)
            self.fallbacks.append({"batch": batch, "from": self._current, "to": now})
            if dist.get_global_rank() == 0:
                print(f"out of GPU memory (or allocation retries in two batches running) at microbatch "
                      f"{self._current} in batch {batch}: went on at microbatch "
                      f"{now} (Composer's OOM search, on for the first {self.batches} batches; recorded as "
                      "microbatch_fallbacks in the results)", flush=True)
            self._current = now
        if self._trained >= self.batches:
            state.auto_microbatching = False

    def fit_end(self, state: State, logger: Logger) -> None:
        state.auto_microbatching = False

    def summary(self) -> dict:
        """The results' keys: the microbatch planned and each fallback."""
        return {"device_train_microbatch_size_planned": self.planned, "microbatch_fallbacks": self.fallbacks}


def oom_line(error: BaseException) -> str | None:
    """One line for a run that ran out of GPU memory where no fallback could help (several ranks,
    after the first batches, or at microbatch 1); None for other errors."""
    import torch

    text = str(error)
    if not (isinstance(error, torch.OutOfMemoryError) or "CUDA out of memory" in text
            or "out of memory or excessive memory allocation retries" in text):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return (f"out of GPU memory ({first}): pass a smaller --device_train_microbatch_size or "
            "--activation_checkpointing on, or a smaller --batch_size at microbatch 1 (docs/gpu-runs.md, the memory model)")
