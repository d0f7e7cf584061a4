"""Intra-op threads for a training run on the CPU: the cores this process may use, shared among the
ranks of this node, less the cores other programs keep busy and one per loader worker; the user's
OMP_NUM_THREADS (or a count set in-process) wins, and a run resuming from a checkpoint takes the
count of the run it resumes (`resume`). Measured: docs/speed.md, "CPU threads"."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# How long the CPUs' busy time is sampled before the count is chosen. /proc/stat counts in ticks of
# 10 ms, so 0.1 s tells a busy core (about 10 ticks) from an idle one (0 or 1) on each CPU.
LOAD_SAMPLE_SECONDS = 0.1
USER_THREADS_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch takes its default from these
# What the count was before this module chose one, and what it last chose: any other count was set
# in-process by the caller (torch.set_num_threads), and is kept.
THREADS_AT_IMPORT = torch.get_num_threads()
_chosen: list[int] = []
RESUMED = "as the run it resumes: "  # how a resumed run's rule begins, before the rule that first chose the count


@dataclass(frozen=True)
class CpuThreads:
    threads: int  # intra-op threads this process computes with
    rule: str  # why, in words (the summary's set-up line, the results JSON's `cpu_threads_rule`)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), capped by a cgroup CPU quota (a container's
    `--cpus`), which leaves the affinity at every CPU of the host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period the cgroup allows (cgroup v2 `cpu.max`, else v1's CFS quota), or None."""
    v2 = Path("/sys/fs/cgroup/cpu.max")
    try:
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def busy_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) ticks of `cpus` since boot, from /proc/stat; None where it cannot be read.
    Steal (the hypervisor running someone else) counts as busy; guest time is already in user."""
    busy = total = 0
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, *fields = line.split() or [""]
        if not name[3:].isdigit() or not name.startswith("cpu") or int(name[3:]) not in cpus:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return (busy, total) if total else None


def cores_busy_elsewhere(seconds: float = LOAD_SAMPLE_SECONDS) -> int:
    """How many of this process's CPUs other programs kept busy over the next `seconds` (rounded;
    this process's own CPU time left out); 0 where /proc/stat cannot be read."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    before, own_before = busy_ticks(cpus), time.process_time()
    time.sleep(seconds)
    after, own_after = busy_ticks(cpus), time.process_time()
    if before is None or after is None or after[1] == before[1]:
        return 0
    ticks_per_cpu = (after[1] - before[1]) / len(cpus)
    busy_cpus = (after[0] - before[0]) / ticks_per_cpu - (own_after - own_before) / seconds
    return max(0, round(busy_cpus))


def user_choice() -> str | None:
    """The user's thread count, in words, where they set one: a variable torch reads, or
    torch.set_num_threads called before the run (in-process)."""
    for variable in USER_THREADS_VARIABLES:
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    current = torch.get_num_threads()
    if current != THREADS_AT_IMPORT and current not in _chosen[-1:]:
        return "torch.set_num_threads before the run"
    return None


def choose(num_workers: int, ranks_on_node: int) -> CpuThreads:
    """Set this process's intra-op threads for a CPU run, and say why.

    max(1, cores for this rank - loader workers), where the cores for a rank are the usable cores less
    those busy elsewhere, shared among the node's ranks. torch's default is one thread per core: on a
    machine whose cores other work also uses, OpenMP's threads wait at every op's barrier for the one
    the scheduler took off its core, and a tiny model's step ran 32x slower (docs/speed.md). Loader
    workers are single-threaded (PyTorch's DataLoader sets one thread in each) and get a core each.
    Ranks sample the load at the same moment, each asleep while it samples, so they do not count
    each other."""
    user = user_choice()
    if user:
        return CpuThreads(torch.get_num_threads(), f"{user}, the user's")
    cores, busy = usable_cores(), cores_busy_elsewhere()
    per_rank = max(0, cores - busy) // max(1, ranks_on_node)
    threads = max(1, per_rank - num_workers)
    torch.set_num_threads(threads)
    _chosen.append(threads)
    shared = f" / {ranks_on_node} ranks" if ranks_on_node > 1 else ""
    return CpuThreads(threads, f"{cores} cores, {busy} busy elsewhere{shared}, {num_workers} loader workers")


def resume(recorded: CpuThreads, ranks_on_node: int) -> CpuThreads | None:
    """The count a run resuming from a checkpoint computes with: the count of the run that saved it,
    `recorded`, set here. The thread count changes the order of a CPU op's partial sums, so the same
    count keeps the resumed weights those of the uninterrupted run, whatever load the machine has now.
    None (this run's count stays) where the user chose this run's count, or where `recorded` is more
    than the cores this machine has for a rank (another machine: its own rule)."""
    if user_choice() is not None or recorded.threads > max(1, usable_cores() // max(1, ranks_on_node)):
        return None
    torch.set_num_threads(recorded.threads)
    _chosen.append(recorded.threads)
    return CpuThreads(recorded.threads, recorded.rule if recorded.rule.startswith(RESUMED)
                      else RESUMED + recorded.rule)
