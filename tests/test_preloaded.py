"""tests/preloaded.py: a command run in a fork of the test process behaves as in a new interpreter (argv,
`__main__`, working directory, environment, streams, warnings, atexit, exit status), a fork is used only where
it may be, and the test process's own loader workers survive the fork; and tests/fork_server.py's stand-ins,
which a shell script starts by name, run their command as such a fork."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from tests import preloaded
from tests.fork_server import ForkServer
from tests.helpers import Launch

PROBE = """
import atexit, json, os, sys, warnings
atexit.register(lambda: print("atexit ran", file=sys.stderr))
warnings.warn("a warning the command shows")
print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                  "path0": sys.path[0], "forked": "torch" in sys.modules}))
if sys.argv[1] == "raise":
    raise ValueError("uncaught")
sys.exit(int(sys.argv[1]))
"""


def run_probe(runner, tmp_path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = runner([sys.executable, str(script), *args], cwd=tmp_path, env={**os.environ, "PROBE": "x", **env},
                  capture_output=True, text=True, timeout=120)
    return done, json.loads(done.stdout.splitlines()[0])


def test_a_forked_command_sees_and_ends_as_in_a_new_interpreter(tmp_path):
    for status in ("0", "3", "raise"):
        fresh, fresh_seen = run_probe(subprocess.run, tmp_path, status)
        forked, forked_seen = run_probe(preloaded.run, tmp_path, status)
        assert not fresh_seen.pop("forked") and forked_seen.pop("forked")  # the stack was imported: a fork
        assert forked_seen == fresh_seen and forked.returncode == fresh.returncode == (1 if status == "raise" else
                                                                                       int(status))
        for done in (fresh, forked):
            assert "UserWarning: a warning the command shows" in done.stderr
            assert done.stderr.rstrip().endswith("atexit ran")
            assert ("ValueError: uncaught" in done.stderr) is (status == "raise")


def test_an_environment_read_at_import_or_a_thread_get_a_new_interpreter(tmp_path):
    _, seen = run_probe(preloaded.run, tmp_path, "0", OMP_NUM_THREADS="7")
    assert not seen["forked"]
    assert preloaded.fresh_reason([sys.executable, "x.py"], {**os.environ, "HF_HUB_OFFLINE": "0"}, False)
    assert preloaded.fresh_reason([sys.executable, "-u", "x.py"], None, False)  # an option it does not parse
    assert preloaded.fresh_reason(["bash", "x.sh"], None, False)
    copy = tmp_path / "copy"
    (copy / "tests").mkdir(parents=True)  # a package this process imported, found first elsewhere
    why = preloaded.fresh_reason([sys.executable, "x.py"], {**os.environ, "PYTHONPATH": str(copy)}, False)
    assert why and "tests" in why
    assert preloaded.fresh_reason([sys.executable, "x.py"], {**os.environ}, False) is None


def test_once_autograd_runs_its_device_threads_commands_get_a_new_interpreter(tmp_path):
    # torch marks every fork of a process whose autograd started its device threads, and a backward there fails
    # (torch 2.14's FSDP2 starts them on a CPU). A thread named as autograd names them stands in, on any torch.
    named, release = threading.Event(), threading.Event()

    def autograd_like() -> None:
        ctypes.CDLL(None).prctl(15, b"pt_autograd_0", 0, 0, 0)  # 15: PR_SET_NAME, this thread's name
        named.set()
        release.wait()

    thread = threading.Thread(target=autograd_like, daemon=True)
    thread.start()
    named.wait()
    try:
        assert "autograd" in preloaded.fresh_reason([sys.executable, "x.py"], None, False)
        done, seen = run_probe(preloaded.run, tmp_path, "0")
        assert not seen["forked"] and done.returncode == 0
    finally:
        release.set()
        thread.join()
    assert preloaded.fresh_reason([sys.executable, "x.py"], None, False) is None


def test_the_test_processs_loader_workers_survive_a_forked_command(tmp_path):
    loader = iter(torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=1))
    first = next(loader)
    done, seen = run_probe(preloaded.run, tmp_path, "0")
    assert seen["forked"] and done.returncode == 0
    assert [first.tolist(), *[batch.tolist() for batch in loader]] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_stand_in_run_by_a_shell_script_is_a_fork_and_ends_as_its_command(tmp_path):
    # tests/fork_server.py: a script that starts `probe` by name gets the probe's output, working directory and
    # exit status, from a fork of this process; a script killed while it waits leaves nothing running.
    (tmp_path / "probe.py").write_text(PROBE)
    server = ForkServer(tmp_path, {"probe": [sys.executable, str(tmp_path / "probe.py")],
                                   "sleeper": [sys.executable, "-c", "import sys, time; print(sys.argv, flush=True); "
                                                                     "time.sleep(600)"]})
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "PROBE": "y"}
    try:
        script = Launch(["bash", "-c", "cd / && probe 3; echo status $?"], tmp_path / "probe.log", env=env).start()
        while script.running():
            server.poll()
            time.sleep(0.05)
        lines = script.output().splitlines()
        seen = json.loads(next(line for line in lines if line.startswith("{")))  # stderr is in the log too
        assert seen["forked"] and seen["cwd"] == "/" and seen["probe"] == "y" and seen["argv"][1:] == ["3"]
        assert lines[-1] == "status 3"
        assert not server.serving

        waiting = Launch(["bash", "-c", "sleeper a"], tmp_path / "sleeper.log", env=env).start()
        while not (tmp_path / "sleeper.log").read_text():
            server.poll()
            time.sleep(0.05)
        (command,) = [process for _, process in server.serving]
        waiting.kill()
        while server.serving:
            server.poll()
            time.sleep(0.05)
        assert command.poll() == -signal.SIGKILL
        assert (tmp_path / "sleeper.log").read_text() == "['-c', 'a']\n"
    finally:
        server.kill()
