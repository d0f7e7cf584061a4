"""What several test files use: the tiny runs' flags, commands run as subprocesses, launches of two ranks
through Composer's launcher that a test kills and resumes, and small datasets written by MDSWriter."""
from __future__ import annotations

import fcntl
import importlib.util
import io
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image

from tests import preloaded

ROOT = Path(__file__).resolve().parents[1]

# The tiny SD2 model on 32x32 images, 4 a batch: the base of most runs here.
TINY_MODEL = ["--model_config", "tiny", "--batch_size", "4", "--image_size", "32"]
# ... on synthetic data, loaded in the training process (no loader workers to start).
TINY_SYNTH = [*TINY_MODEL, "--use_synth_data", "--num_workers", "0"]
# Two batches, the first left out of the throughput: the shortest run that measures something.
TINY_2BA = [*TINY_SYNTH, "--max_duration", "2ba", "--warmup_batches", "1"]
# Two batches of real data (add --local or --remote).
REAL_2BA = [*TINY_MODEL, "--max_duration", "2ba", "--num_workers", "0"]
# Two ranks of 2 images, compared across a kill and a resume: 12 samples make an epoch of 3 batches, so
# runs cross epochs (the sampler reshuffles) and resume mid-epoch; --use_ema puts the EMA in the checkpoints.
TINY_RANKS = [*TINY_SYNTH, "--num_synthetic_samples", "12", "--use_ema", "--seed", "17", "--warmup_batches", "1",
              "--log_interval", "1ba"]

LAUNCH_TIMEOUT_S = 420  # any one launch of two ranks; a healthy one takes about a minute on two busy cores


def free_port() -> int:
    """A TCP port on loopback that nothing listens on (for a launcher's rendezvous or a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The folder of the interpreter running the tests, first on a command's PATH: a script a test runs that
# calls `python` or `composer` (scripts/slurm.sbatch, a documented command) gets this environment's, even
# when its venv is not activated or another environment's `composer` comes first on the user's PATH.
INTERPRETER_BIN = os.path.dirname(sys.executable)


def offline_env(**extra: str) -> dict[str, str]:
    """This environment for a command of the repository: offline, no W&B, the repository importable, this
    interpreter's folder first on PATH."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    search = os.pathsep.join(filter(None, [INTERPRETER_BIN, os.environ.get("PATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path, "PATH": search,
            **extra}


def rank_env(**extra: str) -> dict[str, str]:
    # OMP_NUM_THREADS=1: two ranks on a two-core machine; with a thread per core each, a step is ~10x slower.
    return offline_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def composer_launcher(ranks: int = 2) -> list[str]:
    """Composer's launcher for `ranks` processes on this machine, on a port of their own, run by the
    interpreter running the tests (whose ranks it starts with the same one), not by whichever `composer`
    comes first on PATH."""
    return [sys.executable, "-m", "composer.cli.launcher", "-n", str(ranks), "--master_port", str(free_port())]


def two_ranks(script: str, *args: str) -> list[str]:
    """`python -m composer.cli.launcher -n 2 ROOT/script args...`."""
    return [*composer_launcher(2), str(ROOT / script), *args]


def run_cli(args: list[str], launcher: list[str] | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """benchmark.py's command line, in a subprocess (in this Python, or under `launcher`)."""
    cmd = [*(launcher or [sys.executable]), str(ROOT / "benchmark.py"), *args]
    return preloaded.run(cmd, cwd=ROOT, env=env or offline_env(), capture_output=True, text=True, timeout=timeout)


def error_of(main: Callable, argv: list[str], prog: str | None = None) -> str:
    """The one-line error a command's `main` stops with; `prog` names the command (default: main's module)."""
    prog = prog or f"{main.__module__}.py"
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    message = str(exit_info.value.code)
    assert message.startswith(f"{prog}: error: ") and "\n" not in message, message
    return message


def bench_script(name: str) -> ModuleType:
    """bench/NAME.py imported by path, as bench_NAME (bench/memory.py is not t2ibench.memory)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


# -----------------------------------------------------------------------------------------------
# Launches that a test watches, kills and resumes.
# -----------------------------------------------------------------------------------------------

@dataclass
class Launch:
    """A command (launcher and ranks) in its own session, so the whole process tree can be killed."""

    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=rank_env)
    timeout_s: float = LAUNCH_TIMEOUT_S
    proc: subprocess.Popen | None = None
    started: float = 0.0

    def start(self) -> "Launch":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = preloaded.PreloadedPopen(self.cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.started = time.monotonic()
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_time(self) -> None:
        if self.running() and time.monotonic() - self.started > self.timeout_s:
            self.kill()
            raise TimeoutError(f"{' '.join(self.cmd)} ran over {self.timeout_s}s\n{self.tail()}")

    def kill(self) -> None:
        if self.running():
            kill_group(self.proc.pid)  # the launcher and every rank, no chance to clean up
            self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, chars: int = 6000) -> str:
        return self.output()[-chars:]


def kill_group(pgid: int, timeout_s: float = 60) -> None:
    """SIGKILL process group `pgid` and return once none of its threads runs on: a killed rank closes its files
    (and so releases its output folder's lock) as its last thread exits, after the signal, and a run restarted at
    once (a forked one starts within a second) would find the folder still held."""
    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(state != "Z" for state in group_states(pgid)):
        time.sleep(0.05)


def group_states(pgid: int) -> list[str]:
    """The state letter (/proc/PID/task/TID/stat) of every thread of every process in group `pgid`; an exited one
    is "Z". Every thread, not the process alone: a killed process's first thread shows "Z" while another (one
    writing a checkpoint, say) is still exiting, and the files they share stay open until the last one has."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) != pgid:
            continue
        for task in stat.parent.glob("task/[0-9]*/stat"):
            try:
                states.append(task.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):  # a thread gone meanwhile
                continue
    return states


# A step of `supervise`: polled until it returns the next launch to start (then it is done).
Step = Callable[[], "Launch | None"]


def supervise(launches: list[Launch], *steps: Step, poll_s: float = 0.2) -> None:
    """Start `launches`, poll the steps until each has started its launch, and wait until every launch has
    exited; a launch over its time fails the test. Whatever happens, nothing is left running."""
    pending = list(steps)
    try:
        for launch in launches:
            launch.start()
        while pending or any(launch.running() for launch in launches):
            for step in list(pending):
                started = step()
                if started is not None:
                    launches.append(started.start())
                    pending.remove(step)
            for launch in launches:
                launch.check_time()
            time.sleep(poll_s)
    finally:
        for launch in launches:
            launch.kill()


def latest(folder: Path) -> str | None:
    """The checkpoint rank 0's `latest` link names, if any."""
    try:
        return os.readlink(folder / "latest-rank0.pt")
    except OSError:
        return None


def kill_at(launch: Launch, folder: Path, checkpoint: str, then: Callable[[], Launch]) -> Step:
    """A step: SIGKILL `launch` once `checkpoint` is the latest in `folder`, then start `then()`."""
    def step() -> Launch | None:
        if latest(folder) == checkpoint:
            launch.kill()
            wait_until_unlocked(folder)
            return then()
        if not launch.running():
            pytest.fail(f"the run to kill exited ({launch.proc.returncode}) before writing {checkpoint}:\n"
                        f"{launch.tail()}")
        return None
    return step


def wait_until_unlocked(folder: Path, timeout_s: float = 60) -> None:
    """Return once no process holds `folder`'s output lock (t2ibench's --save_folder flock), as a user would wait for
    a killed job to be gone before starting it again; fail naming the holders after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{folder} still locked {timeout_s:.0f} s after the kill, held by {holders(folder)}")
                time.sleep(0.05)
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
    finally:
        os.close(fd)


def holders(folder: Path) -> list[str]:
    """'PID command' of every process with a descriptor open on `folder`."""
    found = []
    for link in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(link) == str(folder):
                pid = link.parent.parent.name
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid} {command[:200]}")
        except OSError:
            continue
    return sorted(set(found))


def kill_and_resume(launch: Callable[[str, str], Launch], killed_folder: Path, kill_after: str,
                    *others: Launch) -> dict[str, Launch]:
    """The sequence every resume test runs: `launch(name, save folder name)` for "reference" and "killed" side by
    side (with `others`), the killed one SIGKILLed, launcher and ranks, once `kill_after` is the latest checkpoint
    in `killed_folder`, then `launch("resumed", "killed")` (its --autoresume finds that checkpoint). Started from
    the main thread, so that each launch is a fork of this process (tests/preloaded.py). Returns the three
    launches once every launch has exited."""
    runs = {"reference": launch("reference", "reference"), "killed": launch("killed", "killed")}

    def resume() -> Launch:
        runs["resumed"] = launch("resumed", "killed")
        return runs["resumed"]

    supervise([runs["reference"], runs["killed"], *others], kill_at(runs["killed"], killed_folder, kill_after, resume))
    return runs


def after_exit(launch: Launch, then: Callable[[], Launch]) -> Step:
    """A step: start `then()` once `launch` has exited."""
    return lambda: None if launch.running() else then()


# -----------------------------------------------------------------------------------------------
# Writers killed with SIGKILL at a chosen point (a preempted job): nothing of theirs runs after it.
# -----------------------------------------------------------------------------------------------

def kill_at_call(on: str, match: str, nth: int = 1) -> None:
    """Make this process SIGKILL itself at the `nth` call of os.`on` (makedirs or replace) whose first
    argument contains `match`, before the call does anything: a kill -9 at that point of the real code."""
    original = getattr(os, on)
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        if match in os.fspath(args[0]):
            calls += 1
            if calls == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(os, on, wrapper)


def killed_in_child(write: Callable[[], object], on: str, match: str, nth: int = 1) -> None:
    """Run `write` (file work only: no torch computation after a fork) in a forked child of this process
    that SIGKILLs itself as kill_at_call says; fails the test if the child was not killed there."""
    pid = os.fork()
    if pid == 0:
        try:
            kill_at_call(on, match, nth)
            write()
        finally:
            os._exit(3)  # not killed: the point was never reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the writer was not killed ({status})"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def ema_state(checkpoint: dict) -> dict:
    algorithms = dict(checkpoint["state"]["algorithms"])  # [(class name, state dict), ...]
    return algorithms["EMA"]


def assert_tensors_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different keys"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


# -----------------------------------------------------------------------------------------------
# Small datasets.
# -----------------------------------------------------------------------------------------------

def jpeg(seed: int, size: int = 24) -> bytes:
    """A JPEG of random pixels, size x size."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def write_images(out: Path, count: int, compression: str | None = None, size_limit: int = 1 << 26) -> Path:
    """Image-caption shards with the columns convert.py writes, "photo {i}" captioning jpeg(i)."""
    from streaming import MDSWriter
    with MDSWriter(out=str(out), columns={"jpg": "bytes", "caption": "str", "key": "str"}, compression=compression,
                   hashes=["xxh64"], size_limit=size_limit) as writer:
        for i in range(count):
            writer.write({"jpg": jpeg(i), "caption": f"photo {i}", "key": str(i)})
    return out


def write_latents(out: Path, count: int = 8, text_dim: int = 64) -> Path:
    """Precomputed shards of random 4x4x4 latents and text states, in the format t2ibench/datasets/precomputed.py defines."""
    from streaming import MDSWriter

    from t2ibench.datasets import precomputed
    columns = precomputed.mds_columns(latent_channels=4, latent_size=4, text_dim=text_dim, text_states=True)
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(out), columns=columns) as writer:
        for i in range(count):
            writer.write({"index": i, "latent_mean": rng.standard_normal((4, 4, 4)).astype(np.float16),
                          "latent_logvar": rng.standard_normal((4, 4, 4)).astype(np.float16),
                          "text_states": rng.standard_normal((77, text_dim)).astype(np.float16), "caption": "x"})
    return out


# Photos of mixed aspect ratios, as people's folders hold them: (name, stored width, stored height, EXIF
# orientation). A panorama, a line of 3000 x 1 pixels and its tall twin, a phone portrait stored sideways
# with its rotation tag, landscapes, portraits and squares.
MIXED_ASPECT_PHOTOS = (
    ("panorama", 300, 100, None), ("line", 3000, 1, None), ("column", 1, 3000, None), ("phone", 120, 90, 6),
    ("landscape", 120, 80, None), ("portrait", 80, 120, None), ("square", 100, 100, None), ("tall", 60, 150, None),
)


def photo(seed: int, width: int, height: int, orientation: int | None = None) -> bytes:
    """A smooth JPEG (compresses like a photo) of width x height as stored, with an EXIF orientation tag if given."""
    grid = np.random.default_rng(seed).integers(0, 256, (3, 4, 3), dtype=np.uint8)
    image = Image.fromarray(grid).resize((width, height), Image.Resampling.BICUBIC)
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90, exif=exif.tobytes())
    return buffer.getvalue()


def mixed_aspect_folder(folder: Path, count: int) -> Path:
    """`count` captioned photos cycling through MIXED_ASPECT_PHOTOS, as convert.py reads a folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        name, width, height, orientation = MIXED_ASPECT_PHOTOS[i % len(MIXED_ASPECT_PHOTOS)]
        (folder / f"{i:03d}-{name}.jpg").write_bytes(photo(i, width, height, orientation))
        (folder / f"{i:03d}-{name}.txt").write_text(f"a {name} photo number {i}")
    return folder


def mlperf_ruleset_copy(folder: Path, target: float, evaluation_frequency: int) -> dict[str, str]:
    """An environment whose `mlperf_logging` is a copy of the installed package in `folder` in which
    exactly two values of Flux.1's closed rules (training_5.1.0/closed_flux1.yaml) are a run's: the
    eval_accuracy target (`<= 0.586`) and `evaluation_frequency` (`== 262144`). MLCommons' compliance
    checker and scorer find their rulesets beside their own module, so a copy of the package is the way
    their own commands read a changed ruleset; everything else in it is the installed package as it is."""
    import shutil

    installed = Path(importlib.util.find_spec("mlperf_logging").origin).parent
    copy = folder / "mlperf_logging"
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"))
    rules = copy / "compliance_checker" / "training_5.1.0" / "closed_flux1.yaml"
    text = rules.read_text()
    for mlperfs, runs in (("v['value'] <= 0.586", f"v['value'] <= {target!r}"),
                          ("v['value'] == 262144", f"v['value'] == {evaluation_frequency}")):
        assert text.count(mlperfs) == 1, f"{rules.name} no longer holds {mlperfs!r} once"
        text = text.replace(mlperfs, runs)
    rules.write_text(text)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
