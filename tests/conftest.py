"""Fixtures several test files use (plain helpers are in tests/helpers.py)."""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pickle
import subprocess
from pathlib import Path
from typing import Callable

# A CPU run takes the machine's cores for its intra-op threads (t2ibench.train.cpu_threads' rule, shared among
# a node's ranks): beside the suite's other worker that oversubscribes the cores, a step many times
# slower. And the thread count changes a step's float sums: runs a test compares bit for bit (one set-up
# against another, across machines) keep one count. The user's count wins over the rule, so the suite,
# and every command it starts, sets one; the tests of the rule itself remove it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Offline, as every test is, before huggingface_hub reads it at its import: the commands the tests start run
# in forks of this process (tests/preloaded.py), which see what this process imported with.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Inductor starts a pool of compile processes (a new interpreter importing torch, and its forks) in every
# process that imports it, for Triton's kernels alone: a CPU's C++ kernels compile on threads whatever this
# says. The suite's compiling processes (workers, forked runs and their ranks) started one each, 1.35% of the
# suite's CPU samples (py-spy, 2026-11-29), compiling nothing.
os.environ.setdefault("TORCH_WARM_POOL", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import preloaded
from tests.helpers import free_port

# pytest.ini gives every test `timeout` seconds (pytest-timeout: a hang fails that test, not the whole run);
# a test that launches ranks gets MULTIRANK_TIMEOUT_S: its module's fixture (charged to the first test
# that asks for it) supervises launches of up to LAUNCH_TIMEOUT_S each, and beside the other worker's
# tests a two-rank launch takes 2-4 minutes on 2 cores. A test may set its own with @pytest.mark.timeout.
MULTIRANK_TIMEOUT_S = 900
# `-n auto` (pytest.ini): one worker per core, at most this many (each holds torch and a model, and a
# multirank test starts two more processes).
MAX_TEST_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_WORKERS))


# The files that take longest (pytest --durations summed per file, a full run of 2026-11-29 with the commands
# forked, tests/preloaded.py), longest first: each file runs on one worker, and a long one handed out last
# leaves the other worker idle while it runs (the first two-worker run took 19.4 min, test_fsdp.py starting in
# its last two minutes). Files not listed follow, those with a multirank test first. test_shared_memory.py goes
# first of all: its in-process test makes Streaming scan about a thousand shared-memory names, which once hit
# the 20,000-descriptor limit (EMFILE) late in a worker, before `streaming_shared_memory_closed` closed each
# file's segments.
SLOW_FILES = ("test_shared_memory.py", "test_gpu_report.py", "test_bucket_runs.py", "test_gpu_setup.py", "test_fp8.py",
              "test_sdxl_runs.py", "test_blocks.py", "test_compile.py", "test_resume.py", "test_gpu_path.py",
              "test_benchmark.py", "test_weight_casts.py", "test_fsdp.py", "test_image_metrics.py", "test_readme.py",
              "test_memory.py", "test_bad_input.py", "test_oom_fallback.py", "test_index_scale.py", "test_flux_runs.py",
              "test_stack.py", "test_recipe.py", "test_input_classes.py", "test_throughput.py", "test_validation.py",
              "test_bucket_flops.py", "test_time_to_target.py", "test_input_faults.py", "test_latents.py",
              "test_data.py", "test_mlperf.py", "test_bench_scripts.py")


def pytest_unconfigure(config) -> None:
    """Save coverage.py's data in an xdist worker, which leaves without running Python's exit handlers,
    where coverage.py saves it (`coverage run -m pytest`: .coveragerc measures subprocesses)."""
    try:
        import coverage
    except ImportError:
        return
    measuring = coverage.Coverage.current()
    if measuring is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        measuring.stop()
        measuring.save()


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("multirank"):
            item.add_marker(pytest.mark.slow)  # the quick suite (-m "not slow") leaves out every launch
            if not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(MULTIRANK_TIMEOUT_S))
    launching = {item.path.name for item in items if item.get_closest_marker("multirank")}

    def start(item) -> int:
        name = item.path.name
        if name in SLOW_FILES:
            return SLOW_FILES.index(name)
        return len(SLOW_FILES) + (0 if name in launching else 1)

    items.sort(key=start)  # stable: a file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def counted_once_per_session(tmp_path_factory):
    """Work the session's tests and commands would repeat, done once: the CPU's name and the meta-device counts.

    Composer's Trainer asks py-cpuinfo for the CPU's name each time one is built, to log it, and py-cpuinfo
    reads it in a new interpreter it starts (1.3 s a Trainer; the suite builds hundreds): asked once here, and
    the forked commands (tests/preloaded.py) inherit the answer.

    The counts on the meta device (each family's FLOPs per image, the memory model's activations, a step's
    kernels) take seconds each, a minute at real size, and depend on their arguments alone. Their lru_caches
    last one process: each worker counted again what the other had, and a forked command (benchmark.py's FLOPs:
    3 s of a 5.5 s tiny run) counted in a copy whose cache died with it. Each count is kept in a folder of the
    session, shared by the workers and the forks; the first to ask makes it, with the project's own code.
    """
    import cpuinfo

    from t2ibench import families
    from t2ibench.memory import kernels, planning

    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info()
    # A worker's temporary folder is gw0, gw1, ... in one folder of the session; without xdist, the session's own.
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session = session.parent
    folder = session / "counts"
    folder.mkdir(exist_ok=True)
    counts = [(planning, "_count_activations", "planning"), (kernels, "count_step_kernels", "kernels"),
              *((family, "flops_per_image", type(family).__name__) for family in families.FAMILIES)]
    for owner, name, label in counts:
        setattr(owner, name, _kept(getattr(owner, name), f"{label}.{name}", folder))
    yield
    for owner, name, _ in counts:
        if isinstance(owner, families.ModelFamily):
            delattr(owner, name)  # the class's method again
        else:
            setattr(owner, name, getattr(owner, name).__wrapped__)


def _kept(count: Callable, name: str, folder: Path) -> Callable:
    """`count`, reading a result made before in the session from `folder` or making it and keeping it there
    (written whole, then renamed: a reader never sees half of one). A count that raises keeps nothing."""
    @functools.wraps(count)
    def kept(*args, **kwargs):
        key = repr((name, args, sorted(kwargs.items())))
        path = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pickle"
        try:
            return pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            result = count(*args, **kwargs)
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_bytes(pickle.dumps(result))
            os.replace(partial, path)
            return result
    return kept


@pytest.fixture(scope="module", autouse=True)
def streaming_shared_memory_closed():
    """Close the shared memory a test file's in-process Streaming datasets opened, at the end of the file.

    Streaming registers each segment's cleanup with atexit, which holds the segment (two descriptors:
    its own and its mmap's) until the process exits, whether the dataset is still referenced or not; an
    xdist worker exits at the end of the suite, so a worker that had run the streaming files once held
    15,430 of its 20,000 descriptors. A segment whose buffer a live array still views cannot close
    (BufferError) and stays as before.
    """
    from streaming.base.shared import memory

    opened = []
    original = memory.SharedMemory.__init__

    @functools.wraps(original)
    def recorded(self, *args, **kwargs):
        original(self, *args, **kwargs)
        opened.append(self)

    memory.SharedMemory.__init__ = recorded
    try:
        yield
    finally:
        memory.SharedMemory.__init__ = original
        for segment in opened:
            try:
                segment.cleanup()
            except BufferError:
                continue
            atexit.unregister(segment.cleanup)


@pytest.fixture
def preloaded_commands(monkeypatch):
    """The Python commands that a command run in this process starts (gpu_report.py's rows, time_to_target.py's
    runs, a benchmark's timed runs) run in forks of this process, which has imported the stack already
    (tests/preloaded.py), instead of importing it again each."""
    monkeypatch.setattr(subprocess, "Popen", preloaded.PreloadedPopen)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: their tensors are too small to share among
    threads, and on a shared, oversubscribed CPU OpenMP's waiting threads made a tiny step 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def s3_endpoint():
    """The URL of an S3 server (moto) on loopback, one per test module; skips where boto3 is not installed."""
    pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def compiling_with(monkeypatch, backend: str):
    """Make every `Module.compile` of the test use `backend`, dynamo's caches emptied before and after, so
    that a test's graph count is not lowered by graphs an earlier test compiled for blocks of the same shapes."""
    monkeypatch.setattr(torch.nn.Module, "compile", functools.partialmethod(torch.nn.Module.compile, backend=backend))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch):
    """`--compile` tracing with dynamo and AOT autograd but without inductor's code generation (the
    aot_eager backend, as tests/fault_run.py's --compile_backend): on two busy cores inductor compiles
    C++ for minutes."""
    yield from compiling_with(monkeypatch, "aot_eager")


@pytest.fixture
def dynamo_eager(monkeypatch):
    """`--compile` with dynamo's graphs run as they are (the eager backend), the cheapest compiled path:
    what a test checks of the graphs' contents (the float8 layers in them, their count) needs no AOT
    autograd, which takes 2.3x the time (tiny at 64 px in float8: 14 s against 33 s a run)."""
    yield from compiling_with(monkeypatch, "eager")
