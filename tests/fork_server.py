"""Stand-ins for console scripts (`composer`) that run their command as a fork of the test process.

tests/preloaded.py forks the `python ...` commands a test starts. A shell script the tests run starts its
commands by name instead (scripts/slurm.sbatch: `exec composer ...` in each srun task), and each would be a
new interpreter importing the stack, and so would the ranks it launches: the two-node job of
tests/test_resume.py took 58 s of CPU for its two batches, mostly imports. A stand-in put first on the
script's PATH is a small client (Python without site packages, importing nothing of the stack) that hands
its argv, environment, working directory and standard streams to a `ForkServer` of the test process over a
Unix socket, waits, and exits as the command did. The server runs each request with preloaded.PreloadedPopen
(a fork when a fork runs it as a new interpreter would, else the real interpreter), from the main thread, as
`supervise` polls it; a command whose client has died (its job killed) is killed with its session.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from tests import preloaded
from tests.helpers import kill_group

CLIENT = """#!{python} -S
# Stand-in for `{name}` (tests/fork_server.py): runs {prefix} ARGS... as a fork of the test process.
import json, os, signal, socket, sys

client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect({path!r})
request = json.dumps({{"argv": {prefix!r} + sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
socket.send_fds(client, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
reply = b""
while chunk := client.recv(64):
    reply += chunk
code = int(reply) if reply else 1  # no reply: the server went away
if code < 0:  # killed by a signal: so is this process, as the shell expects of the command
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class ForkServer:
    """Serves the stand-ins it writes into `bin_dir` (name -> the argv prefix each stands for). Used as a launch
    of `tests.helpers.supervise`: it serves while polled, runs while a command it started does."""

    def __init__(self, bin_dir: Path, commands: dict[str, list[str]]):
        self.path = bin_dir / "fork-server.sock"
        if len(os.fsencode(self.path)) > 100:  # a Unix socket's path holds at most 107 bytes
            self.path = Path(tempfile.mkdtemp(prefix="fork-server-", dir="/tmp")) / "sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen()
        self.listener.setblocking(False)
        self.serving: list[tuple[socket.socket, preloaded.PreloadedPopen]] = []
        for name, prefix in commands.items():
            script = bin_dir / name
            script.write_text(CLIENT.format(python=sys.executable, name=name, prefix=prefix, path=str(self.path)))
            script.chmod(0o755)

    def start(self) -> "ForkServer":
        return self

    def running(self) -> bool:
        self.poll()
        return bool(self.serving)

    def check_time(self) -> None:  # the commands' time is their caller's: the launch that runs the script
        self.poll()

    def poll(self) -> None:
        """Start what was asked since the last poll; answer each command that has exited."""
        while True:
            try:
                connection, _ = self.listener.accept()
            except BlockingIOError:
                break
            self.serving.append((connection, self._start(connection)))
        for entry in list(self.serving):
            connection, process = entry
            code = process.poll()
            if code is None and not self._client_gone(connection):
                continue
            if code is None:
                kill_group(process.pid)
                process.wait()
            else:
                try:
                    connection.sendall(str(code).encode())
                except OSError:
                    pass
            connection.close()
            self.serving.remove(entry)

    def _start(self, connection: socket.socket) -> preloaded.PreloadedPopen:
        connection.settimeout(30)
        data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
        while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
            chunk = connection.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"a stand-in's request ended early ({len(data)} bytes)")
            data += chunk
        request = json.loads(data[8:])
        try:
            process = preloaded.PreloadedPopen(request["argv"], cwd=request["cwd"], env=request["env"],
                                               stdin=fds[0], stdout=fds[1], stderr=fds[2], start_new_session=True)
        finally:
            for fd in fds:
                os.close(fd)
        connection.setblocking(False)
        return process

    @staticmethod
    def _client_gone(connection: socket.socket) -> bool:
        try:
            return connection.recv(1) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def kill(self) -> None:
        for connection, process in self.serving:
            if process.poll() is None:
                kill_group(process.pid)
                process.wait()
            connection.close()
        self.serving.clear()
        self.listener.close()
        self.path.unlink(missing_ok=True)
        if self.path.parent.name.startswith("fork-server-"):
            self.path.parent.rmdir()
