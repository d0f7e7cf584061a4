"""Fixtures several test files use (plain helpers are in tests/helpers.py)."""
from __future__ import annotations

import functools
import os

# A CPU run picks its intra-op threads from the cores other programs leave free (t2ibench.cpu_threads),
# and the thread count changes a step's float sums: runs a test compares bit for bit (resumed against
# uninterrupted, one set-up against another) must not differ by the machine's load of the moment. The
# user's count wins over that rule, so the suite, and every command it starts, sets one; the test of
# the rule itself removes it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import free_port


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


@pytest.fixture
def aot_eager(monkeypatch):
    """`--compile` tracing with dynamo and AOT autograd but without inductor's code generation (the
    aot_eager backend, as tests/fault_run.py's --compile_backend): on two busy cores inductor compiles
    C++ for minutes. Dynamo's caches are emptied before and after, so that a test's graph count is not
    lowered by graphs an earlier test compiled for blocks of the same shapes."""
    monkeypatch.setattr(torch.nn.Module, "compile",
                        functools.partialmethod(torch.nn.Module.compile, backend="aot_eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
