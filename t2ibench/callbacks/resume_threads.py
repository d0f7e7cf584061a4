"""A CPU run's intra-op thread count of every rank in its checkpoints, and a run that resumes from one
computing on each rank with that rank's count (t2ibench.train.cpu_threads.resume): another count would sum
the step's floats in another order. Logs nothing."""
from __future__ import annotations

from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.train import cpu_threads
from t2ibench.train.cpu_threads import CpuThreads


class KeepCpuThreadsOnResume(Callback):
    """Holds the count this rank computes with (`threads`, None on a GPU), for its results, and every
    rank's (`by_rank`, gathered at the start of training: rank 0 alone writes a checkpoint)."""

    def __init__(self, threads: CpuThreads | None, ranks_on_node: int) -> None:
        self.threads, self.ranks_on_node = threads, ranks_on_node
        self.by_rank: list[tuple[int, str]] = []  # (threads, rule) per global rank

    def fit_start(self, state: State, logger: Logger) -> None:
        # After the checkpoint's load (the Trainer loads it while it is built): a resumed rank's count.
        if self.threads is None:
            return
        self.by_rank = [(int(threads), str(rule)) for threads, rule in
                        dist.all_gather_object((self.threads.threads, self.threads.rule))]
        counts = sorted({threads for threads, _ in self.by_rank})
        if len(counts) > 1 and dist.get_global_rank() == 0:
            cpu_threads.warn(f"the ranks compute with different CPU thread counts ({', '.join(map(str, counts))}): each "
                             f"rank's count follows its node's cores; {cpu_threads.FLAG} N gives every rank the same")

    def state_dict(self) -> dict[str, Any]:
        if self.threads is None:
            return {}
        by_rank = self.by_rank or [(self.threads.threads, self.threads.rule)]
        # `threads` and `rule` (rank 0's) are what checkpoints before `by_rank` held.
        return {"threads": self.threads.threads, "rule": self.threads.rule, "by_rank": [list(r) for r in by_rank]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A GPU run has no count; the Trainer loads the checkpoint while it is built, before any step.
        saved = saved_count(state, dist.get_global_rank(), dist.get_world_size())
        if self.threads is not None and saved is not None:
            self.threads = cpu_threads.resume(saved, self.threads, self.ranks_on_node)


def saved_count(state: dict[str, Any], rank: int, world_size: int) -> CpuThreads | None:
    """Global rank `rank`'s count in a checkpoint's `state` of this callback, or None: a checkpoint a GPU
    run saved, or one of another number of ranks (each rank's share of the cores, and its sums, differ
    anyway). A checkpoint saved before `by_rank` holds rank 0's count, which every rank took then."""
    if "threads" not in state:
        return None
    by_rank = state.get("by_rank")
    if by_rank is not None and len(by_rank) != world_size:
        return None
    threads, rule = (state["threads"], state["rule"]) if by_rank is None else by_rank[rank]
    return CpuThreads(int(threads), str(rule))
