"""A CPU run's intra-op thread count in its checkpoints, and a run that resumes from one computing with
the same count (t2ibench.cpu_threads.resume): the count is chosen from the machine's load of the
moment, and another count would sum the step's floats in another order. Logs nothing."""
from __future__ import annotations

from typing import Any

from composer.core import Callback

from t2ibench import cpu_threads
from t2ibench.cpu_threads import CpuThreads


class KeepCpuThreadsOnResume(Callback):
    """Holds the count this run computes with (`threads`, None on a GPU), for its results."""

    def __init__(self, threads: CpuThreads | None, ranks_on_node: int) -> None:
        self.threads, self.ranks_on_node = threads, ranks_on_node

    def state_dict(self) -> dict[str, Any]:
        return {"threads": self.threads.threads, "rule": self.threads.rule} if self.threads else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Composer loads the checkpoint while the Trainer is built, before any step. A GPU run, or a
        # checkpoint a GPU run saved, has no count.
        if self.threads is None or "threads" not in state:
            return
        resumed = cpu_threads.resume(CpuThreads(int(state["threads"]), str(state["rule"])), self.ranks_on_node)
        if resumed is not None:
            self.threads = resumed
