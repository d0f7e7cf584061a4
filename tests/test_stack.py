"""The two installs: requirements-host-torch.txt against requirements.txt (read, nothing installed), and
`python -m t2ibench.stack` on the installed stack and on a torchvision injected from outside."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from t2ibench import stack
from tests.helpers import ROOT

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s#]+)")


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line (names normalised as pip compares them)."""
    out = {}
    for line in path.read_text().splitlines():
        if match := PIN.match(line.strip()):
            out[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(3)
    return out


def test_host_torch_requirements_pin_the_stack_and_nothing_of_torchs():
    default, host = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-host-torch.txt")
    # Every line of the host file is a pin (a range would let pip pick something never tested).
    lines = [line for line in (ROOT / "requirements-host-torch.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(lines) == len(host)
    # The default install's own pins, at the same versions: the file is regenerated when one changes
    # (scripts/host_torch_requirements.py).
    assert {name: host.get(name) for name in default} == default
    # Nothing that belongs to the host's torch build: a CUDA 12 library beside a CUDA 13 torch breaks
    # `import torch` (undefined symbol: ncclCommResume).
    assert not [name for name in host if name in {"torch", "torchvision", "triton"}
                or name.startswith(("nvidia-", "cuda-"))]


def test_newest_torch_pin_is_one_exact_torch():
    lines = [line for line in (ROOT / "requirements-newest-torch.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(lines) == 1 and re.fullmatch(r"torch==2\.\d+\.\d+", lines[0]), lines


def run_stack(extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ}
    if extra_path is not None:  # first on the path: its metadata is what importlib.metadata finds
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "t2ibench.stack"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_stack_reports_the_torch_it_runs_on():
    done = run_stack()
    assert done.returncode == 0, done.stderr
    line, = done.stdout.splitlines()
    assert line.startswith(f"stack: torch {torch.__version__.split('+')[0]} (")
    assert f"torchvision {stack.versions()['torchvision']}" in line and "mosaicml 0.32.1" in line


def test_a_torchvision_built_for_another_torch_is_named_in_one_line(tmp_path):
    # A torchvision distribution of another release, found before the installed one.
    other = f"0.{torch.__version__.split('.')[1]}.0"  # torch 2.x's own would be 0.(x + 15)
    info = tmp_path / f"torchvision-{other}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchvision\nVersion: {other}\nRequires-Dist: torch\n")
    done = run_stack(tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    message, = done.stderr.splitlines()
    assert message.startswith(f"t2ibench.stack: error: torchvision {other} is not the release built for torch ")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("found,expected", [
    ({"torchvision": None}, "torchvision is not installed (Composer imports it): install the torchvision built for torch 2.14.1"),
    ({"torch": "2.6.0", "torchvision": "0.21.0"}, "torch 2.6.0 is older than 2.7"),
    ({"torch": None}, "torch is not installed: pip install -r requirements.txt"),
    ({"diffusers": None}, "diffusers is not installed: pip install -r requirements.txt, or, beside a torch"),
])
def test_each_problem_is_one_line_naming_the_package(found, expected):
    installed = {name: "1.0" for name in (*stack.REQUIRED, *stack.OPTIONAL)}
    installed.update(torch="2.14.1", torchvision="0.29.1")
    assert stack.problems(installed) == []
    problems = stack.problems({**installed, **found})
    assert len(problems) == 1 and problems[0].startswith(expected), problems
