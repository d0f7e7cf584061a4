"""The data commands' process pools (convert.py, sort_buckets.py): workers that SIGTERM ends at once."""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import signal
import sys
import threading


def default_sigterm() -> None:
    """A pool worker's start: SIGTERM's default action (exit at once). Importing Composer (data.py does)
    installs a handler that raises SystemExit instead."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def worker_pool(processes: int) -> multiprocessing.pool.Pool:
    """A pool of `processes` workers (forked on Linux, spawned elsewhere) that SIGTERM ends at once.

    The initializer alone left a window: a worker forked with Composer's handler and terminated before its
    initializer ran (Pool.terminate() right after a failure, the worker still starting; under coverage's fork
    hook that takes seconds) had the signal caught by the handler's C half, and Python then dropped it, the
    handler being SIG_DFL by the time it looked. The worker lived on, waiting for a task, and terminate()
    waited for it forever. So the default action is set in this process around the fork too; the initializer
    covers the workers the pool starts later, from its own thread."""
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        return context.Pool(processes, initializer=default_sigterm)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return context.Pool(processes, initializer=default_sigterm)
    finally:
        if previous is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, previous)
