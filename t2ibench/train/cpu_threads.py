"""Intra-op threads for a training run on the CPU: a rule of the machine alone (the cores this process
may use, shared among the node's ranks, less one per loader worker), or the user's count
(`--cpu_threads`, else OMP_NUM_THREADS or a count set in-process). The machine's load is sampled only
to warn: the count never follows it, so one command computes the same sums in every run. A run
resuming from a checkpoint takes each rank's count of the run it resumes (`resume`). Measured:
docs/speed.md, "CPU threads"."""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from composer.utils import dist

# How long the CPUs' busy time is sampled for the busy-machine warning. /proc/stat counts in ticks of
# 10 ms, so 0.1 s tells a busy core (about 10 ticks) from an idle one (0 or 1) on each CPU.
LOAD_SAMPLE_SECONDS = 0.1
USER_THREADS_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch takes its default from these
# What the count was before this module chose one, and what it last chose: any other count was set
# in-process by the caller (torch.set_num_threads), and is kept.
THREADS_AT_IMPORT = torch.get_num_threads()
_chosen: list[int] = []
RESUMED = "as the run it resumes: "  # how a resumed run's rule begins, before the rule that first chose the count
FLAG = "--cpu_threads"


@dataclass(frozen=True)
class CpuThreads:
    threads: int  # intra-op threads this process computes with
    rule: str  # why, in words (the summary's set-up line, the results JSON's `cpu_threads_rule`)
    users: bool = False  # the user chose the count (the flag, a variable, in-process), not the machine's rule


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


def thread_count(value: str) -> int | None:
    """A thread variable's value as the count it asks for, or None where it asks for none: a positive
    whole number in ASCII digits (spaces around it allowed). libgomp and torch ignore 0, -1, 'abc' and
    an empty value (libgomp says "Invalid value" on stderr) and take every core."""
    text = value.strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else None


def ignored_variables() -> list[str]:
    """The thread variables set to a value that asks for no count (`thread_count`), as VARIABLE='value'."""
    return [f"{variable}={os.environ[variable]!r}" for variable in USER_THREADS_VARIABLES
            if variable in os.environ and thread_count(os.environ[variable]) is None]


def user_choice() -> str | None:
    """The user's thread count, in words, where they set one outside the flag: a variable torch reads,
    set to a count (`thread_count`), or torch.set_num_threads called before the run (in-process)."""
    for variable in USER_THREADS_VARIABLES:
        if thread_count(os.environ.get(variable, "")) is not None:
            return f"{variable}={os.environ[variable]}"
    current = torch.get_num_threads()
    if current != THREADS_AT_IMPORT and current not in _chosen[-1:]:
        return "torch.set_num_threads before the run"
    return None


def rule_threads(cores: int, ranks_on_node: int, num_workers: int) -> int:
    """The machine's rule: max(1, cores // ranks on this node - loader workers). Loader workers are
    single-threaded (PyTorch's DataLoader sets one thread in each) and get a core each. Ranks of one
    node find the same inputs, so they take the same count, in every run of the command."""
    return max(1, cores // max(1, ranks_on_node) - num_workers)


def by_rule(cores: int, busy: int, ranks_on_node: int, num_workers: int) -> tuple[CpuThreads, str | None]:
    """The count of a machine with `cores` usable cores, and the warning where other programs keep
    `busy` of them that the run needs (None where they leave enough). The count does not depend on
    `busy`: a count that followed the load changed a run's sums from one start to the next."""
    threads = rule_threads(cores, ranks_on_node, num_workers)
    shared = f" / {ranks_on_node} ranks" if ranks_on_node > 1 else ""
    chosen = CpuThreads(threads, f"{cores} cores{shared}, {num_workers} loader workers")
    ranks = max(1, ranks_on_node)
    needed = ranks * (threads + num_workers)
    if busy <= 0 or cores - busy >= needed:
        return chosen, None
    per_rank = f"{threads} threads and {num_workers} loader workers"
    per_rank += f" per rank, {ranks} ranks" if ranks > 1 else ""
    fewer = f"{FLAG} N takes fewer threads" if threads > 1 else "fewer --num_workers leave more cores"
    return chosen, (f"CPU threads: other programs kept {busy} of this machine's {cores} cores busy at the start, where "
                    f"this run uses {needed} ({per_rank}); the count is the machine's rule, not the load's (a count "
                    "that followed the load would change the run's sums from one start to the next), so the run may "
                    f"be many times slower than on an idle machine; {fewer} (docs/speed.md#cpu-threads)")


def warn(line: str) -> None:
    """One warning line per node (its local rank 0): the ranks of a node share its cores and flags."""
    if dist.get_local_rank() == 0:
        print(f"warning: {line}", file=sys.stderr, flush=True)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    _chosen.append(threads)  # ours, not the caller's (user_choice)


def flag_problem(requested: int | None, on_gpu: bool) -> str | None:
    """Why `--cpu_threads requested` cannot be used here (one line naming the flag), or None. Its type
    (a positive integer) is the parser's; more threads than this process's usable cores would each
    wait for a core."""
    if requested is None:
        return None
    if on_gpu:
        return (f"{FLAG} sets a CPU run's intra-op threads, and this run trains on a GPU, where benchmark.py sets "
                "none: drop the flag (OMP_NUM_THREADS limits the CPU threads of any run)")
    cores = usable_cores()
    if requested > cores:
        return f"{FLAG} {requested} is more than the {cores} cores this process may use: give at most {cores}"
    return None


def choose(num_workers: int, ranks_on_node: int, requested: int | None = None) -> CpuThreads:
    """Set this process's intra-op threads for a CPU run, and say why: `--cpu_threads` (`requested`),
    else OMP_NUM_THREADS / MKL_NUM_THREADS or a count set in-process, else the machine's rule
    (`by_rule`), with a warning (not another count) where other programs keep the cores busy.

    torch's default is one thread per core, and Composer's launcher leaves every rank at it, which
    oversubscribes the node's cores with several ranks or loader workers; on a machine whose cores other
    work also uses, OpenMP's threads wait at every op's barrier for the one the scheduler took off its
    core (docs/speed.md). Ranks sample the load at the same moment, each asleep while it samples, so
    they do not count each other."""
    if requested is not None:
        set_threads(requested)
        return CpuThreads(requested, f"{FLAG} {requested}, the user's", users=True)
    for ignored in ignored_variables():  # not the user's count: torch took none from it
        warn(f"{ignored} is no thread count (a positive whole number): torch ignores it, and so does this run, "
             f"which takes the machine's rule unless another count is set; set a count or unset it")
    user = user_choice()
    if user:
        return CpuThreads(torch.get_num_threads(), f"{user}, the user's", users=True)
    cores = usable_cores()
    chosen, warning = by_rule(cores, cores_busy_elsewhere(), ranks_on_node, num_workers)
    set_threads(chosen.threads)
    if warning:
        warn(warning)
    return chosen


def resume(recorded: CpuThreads, current: CpuThreads, ranks_on_node: int) -> CpuThreads:
    """The count a rank resuming from a checkpoint computes with: its own count in the run that saved
    it, `recorded`, set here, whatever this run would choose (`current`). The thread count changes the
    order of a CPU op's partial sums, so the same count keeps the resumed weights those of the
    uninterrupted run. Where the user asks for another count now, one warning line says the checkpoint's
    is kept. `current` stays only where `recorded` is more than the cores this machine has for a rank
    (another machine: its sums differ anyway, and oversubscribing is slow)."""
    if recorded.threads > max(1, usable_cores() // max(1, ranks_on_node)):
        return current
    set_threads(recorded.threads)
    if current.users and current.threads != recorded.threads:
        asked = current.rule.removesuffix(", the user's")
        warn(f"{asked} asks for {current.threads} CPU threads, and this rank computed with {recorded.threads} before "
             f"the checkpoint it resumes: it computes with {recorded.threads}, so that the resumed run sums as the "
             "uninterrupted one (a fresh run, not resumed, takes the new count)")
    return CpuThreads(recorded.threads, recorded.rule if recorded.rule.startswith(RESUMED) else RESUMED + recorded.rule)
