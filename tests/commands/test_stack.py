"""The two installs: requirements-host-torch.txt against requirements.txt (read, nothing installed), and
`python -m t2ibench.commands.stack` on the installed stack and on a torchvision injected from outside."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from t2ibench.commands import stack
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
    return subprocess.run([sys.executable, "-m", "t2ibench.commands.stack"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
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
    assert message.startswith(f"t2ibench.commands.stack: error: torchvision {other} is not the release built for torch ")
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


# -----------------------------------------------------------------------------------------------
# The pins: `pip install --no-deps` installs what it is told, so mismatched versions arrive this way.
# Each case puts fake distributions (and packages) first on PYTHONPATH, as pip would have left them.
# -----------------------------------------------------------------------------------------------

def fake_dist(folder: Path, name: str, version: str | None) -> Path:
    """A distribution's metadata folder as pip writes it (without the files), `version` None: no Version field."""
    info = folder / f"{name.replace('-', '_')}-{version or '0'}.dist-info"
    info.mkdir(parents=True)
    fields = ["Metadata-Version: 2.1", f"Name: {name}"] + ([f"Version: {version}"] if version is not None else [])
    (info / "METADATA").write_text("\n".join(fields) + "\n")
    return info


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The check failed with one error line per problem, no traceback; those lines, prefix removed."""
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert all(line.startswith("t2ibench.commands.stack: error: ") for line in lines), lines
    return [line.removeprefix("t2ibench.commands.stack: error: ") for line in lines]


def test_each_version_that_is_not_the_pinned_one_is_one_line(tmp_path):
    file = stack.pins_file(stack.parse_version(torch.__version__))  # requirements.txt beside its own torch
    pinned = pins(file)
    for name, version in (("mosaicml", "0.20.0"), ("diffusers", "0.20.0"), ("mosaicml-streaming", "0.99.0")):
        fake_dist(tmp_path, name, version)
    lines = error_lines(run_stack(tmp_path))
    assert sorted(lines) == sorted(
        f"{name} {version} is installed where {file.name} pins {pinned[name]}: pip install --no-deps {name}=={pinned[name]}"
        for name, version in (("mosaicml", "0.20.0"), ("diffusers", "0.20.0"), ("mosaicml-streaming", "0.99.0")))


def test_beside_another_torch_every_pin_of_the_host_torch_file_is_compared(tmp_path):
    """A torch that is not requirements.txt's (2.7.0) came with requirements-host-torch.txt and --no-deps:
    each of its pins is compared, dependencies of dependencies too (here the ones this environment's own
    install resolved differently, and one made wrong)."""
    import importlib.metadata

    fake_dist(tmp_path, "torch", "2.14.1")
    fake_dist(tmp_path, "torchvision", "0.29.1")
    fake_dist(tmp_path, "aiohappyeyeballs", "0.0.1")  # pinned only in the host-torch file (via aiohttp)
    host = pins(ROOT / "requirements-host-torch.txt")
    differ = {"aiohappyeyeballs"}
    for name, version in host.items():
        try:
            if importlib.metadata.version(name) != version:
                differ.add(name)
        except importlib.metadata.PackageNotFoundError:
            differ.add(name)
    lines = error_lines(run_stack(tmp_path))
    assert {re.sub(r"[-_.]+", "-", line.split(" ")[0]).lower() for line in lines} == differ
    assert all("requirements-host-torch.txt pins " in line for line in lines), lines
    assert "aiohappyeyeballs 0.0.1 is installed where requirements-host-torch.txt pins " in "\n".join(lines)


@pytest.mark.parametrize("name", ["diffusers", "torch", "torchvision"])
@pytest.mark.parametrize("version, expected", [
    (None, "{name} is installed without a version in its metadata ({where})"),
    ("2.x", "{name} has '2.x' as its version, which is not a version ({where})"),
])
def test_metadata_without_a_version_or_with_an_invalid_one_is_named_as_such(tmp_path, name, version, expected):
    where = fake_dist(tmp_path, name, version)
    line, = error_lines(run_stack(tmp_path))
    assert line.startswith(expected.format(name=name, where=where) + ": reinstall it: ")
    pin = pins(ROOT / "requirements.txt").get(name)
    assert line.endswith(f"pip install --force-reinstall --no-deps {name}=={pin}" if pin else stack.INSTALL_HINT)


@pytest.mark.parametrize("package, imported", [("transformers", "transformers"), ("coolname", "composer")])
@pytest.mark.slow
def test_an_import_that_fails_names_the_package_it_failed_in(tmp_path, package, imported):
    """A broken package, at the pinned version: named, not the module that imported it (coolname is
    imported by Composer alone)."""
    import importlib.metadata

    version = importlib.metadata.version(package)
    fake_dist(tmp_path, package, version)
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text('raise RuntimeError("broken on purpose")\n')
    line, = error_lines(run_stack(tmp_path))
    assert line.startswith(f"import {imported} failed in {package} {version} (RuntimeError: broken on purpose): ")
