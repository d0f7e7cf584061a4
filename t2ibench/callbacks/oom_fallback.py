"""A run whose first batches run out of GPU memory goes on at half the microbatch, and says so.

The memory model plans the microbatch with headroom (t2ibench.memory.HEADROOM_FRACTION), but a count
can be wrong for a set-up never measured. Composer has the search this needs: with
`state.auto_microbatching` on, an OOM in a batch is caught before the optimizer steps, the batch's
partial state cleared and the batch retried at half the microbatch. This callback turns that search on
for the first `batches` batches of the process (and for the batch after the EMA's average starts, the
first step that holds its fp32 copy) and off after them, because while it is on Composer all-reduces an
OOM flag after every microbatch's forward and reads it on the host: a host sync per microbatch that a
measured step must not pay. The steps that run out of memory are the first ones (the AdamW state is
allocated by the first step; every later step has the same shapes, or a bucketed run's largest, which
the plan counts).

Composer 0.32.1's search has a second path, for allocation retries (the allocator emptied its cache to
go on) in two batches running: it halves the microbatch and runs the batch again after its
`optimizer.step()` already ran (`Trainer._train_batch`: `_update_num_consecutive_thrashes`, then
`continue`; `_clear_incomplete_train_states` rolls nothing back), so the batch's samples train twice and
AdamW steps twice. Here that path never fires (`never_rerun_a_stepped_batch`): the retries are counted
per batch by this callback, and two batches running with retries halve the microbatch from the next
batch on, the finished batch left as it is.

Only where Composer's search serves: one rank without FSDP (`serves`). Under DDP an OOM in one rank's
backward leaves the other ranks in the gradient all-reduce, which Composer's flag cannot reach; its
FSDP search installs hooks when the model is wrapped. There an OOM stops the run with one line
naming the flag to lower (benchmark.py's `user_error`).
"""
from __future__ import annotations

from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


def serves(world_size: int, sharded: bool) -> bool:
    """Whether a run can fall back: one rank, not sharded by FSDP (see the module's docstring)."""
    return world_size == 1 and not sharded


ALLOC_RETRIES_KEY = "num_alloc_retries"  # torch.cuda.memory_stats(): times the allocator freed its cache and retried
OUT_OF_MEMORY, ALLOC_RETRIES = "out of memory", "allocation retries"  # a fallback's cause, as the results record it


def never_rerun_a_stepped_batch() -> None:
    """Keep Composer's count of batches running with allocation retries under 2 (once per process), so
    that its search never runs a batch again after the optimizer stepped (see the module's docstring).
    The count's all-reduce still runs: every rank takes the same path."""
    import composer.trainer.trainer as trainer

    original = trainer._update_num_consecutive_thrashes
    if getattr(original, "capped", False):
        return

    def count(state: State, num_consecutive_thrashes: int, num_alloc_retries: int) -> int:
        return min(original(state, num_consecutive_thrashes, num_alloc_retries), 1)

    count.capped = True
    trainer._update_num_consecutive_thrashes = count


def alloc_retries() -> int | None:
    """The CUDA allocator's retries so far in this process (None without CUDA): a host read, no sync."""
    import torch

    return torch.cuda.memory_stats().get(ALLOC_RETRIES_KEY, 0) if torch.cuda.is_available() else None


class HalveMicrobatchOnOom(Callback):
    """Composer's OOM search on for the first `batches` batches this process trains, and for the batch
    after `average` (the EMA) starts; the microbatch halved for the next batches after allocation
    retries in two batches running; each change of the microbatch recorded (`fallbacks`) and printed."""

    def __init__(self, batches: int, average: Any = None):
        self.batches = max(1, batches)
        self.average = average  # ema.EMA or None: its first update allocates an fp32 copy of the weights
        self.planned: int | None = None  # the microbatch the run started with
        self.fallbacks: list[dict[str, Any]] = []  # {"batch", "from", "to", "cause"}, in order
        self._trained = 0  # batches this process trained (a resumed run searches again)
        self._search_until = self.batches  # the search is on while fewer batches than this were trained
        self._current: int | None = None
        self._average_started = False
        self._retries_at_start: int | None = None  # the allocator's count at this batch's start
        self._retried_before = False  # whether the previous batch had allocation retries

    def fit_start(self, state: State, logger: Logger) -> None:
        never_rerun_a_stepped_batch()
        self.planned = self._current = int(state.device_train_microbatch_size)
        # A resumed run whose average had started holds its copy from the first batch on.
        self._average_started = bool(getattr(self.average, "initialized", False))
        state.auto_microbatching = True

    def batch_start(self, state: State, logger: Logger) -> None:
        # Once per batch (Composer's retries of a batch run BEFORE_TRAIN_BATCH again, not this): the
        # retries of set-up count toward no batch, those of a batch's attempts toward that batch.
        self._retries_at_start = alloc_retries() if state.auto_microbatching else None

    def batch_end(self, state: State, logger: Logger) -> None:
        self._trained += 1
        batch = int(state.timestamp.batch)
        now = int(state.device_train_microbatch_size)
        out_of_memory = now != self._current  # Composer's search caught an OOM and retried the batch at `now`
        if out_of_memory:
            self._record(batch, now, OUT_OF_MEMORY, f"out of GPU memory at microbatch {self._current} in batch "
                                                    f"{batch}: went on at microbatch {now}")
        retries = alloc_retries() if self._retries_at_start is not None else None
        # As Composer counts them: a batch that ran out of memory (retrying on the way) starts the count afresh.
        retried = not out_of_memory and retries is not None and retries > self._retries_at_start
        if retried and self._retried_before and now > 1:
            # Composer halves on this too, by running the finished batch again; here the next batch is smaller.
            smaller = now // 2
            state.device_train_microbatch_size = smaller
            self._record(batch + 1, smaller, ALLOC_RETRIES,
                         f"allocation retries (the GPU memory nearly full) in batches {batch - 1} and {batch} at "
                         f"microbatch {now}: batch {batch + 1} on at microbatch {smaller}")
            retried = False  # the next batch runs at the new size: two batches running count from it
        self._retried_before = retried
        if not self._average_started and getattr(self.average, "initialized", False):
            self._average_started = True  # the first step with the average's copy resident is searched too
            self._search_until = max(self._search_until, self._trained + 1)
        state.auto_microbatching = self._trained < self._search_until

    def _record(self, batch: int, to: int, cause: str, line: str) -> None:
        self.fallbacks.append({"batch": batch, "from": self._current, "to": to, "cause": cause})
        self._current = to
        if dist.get_global_rank() == 0:
            searched = "Composer's OOM search" if cause == OUT_OF_MEMORY else "the OOM search's count of retries"
            print(f"{line} ({searched}, on for the first {self.batches} batches; recorded as "
                  "microbatch_fallbacks in the results)", flush=True)

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
