"""Write requirements-host-torch.txt: the pinned stack of requirements.txt without torch, for a host
whose torch is already installed.

    python scripts/host_torch_requirements.py        # after changing a pin in requirements.txt

`pip install -r requirements.txt` resolves Composer 0.32.1's `torch<2.7.1` and installs torch 2.7.0
over whatever torch a GPU host has. The other path, `pip install --no-deps -r
requirements-host-torch.txt`, needs every package that install brings, each pinned, and none of
torch's own stack. This asks pip what requirements.txt resolves to (`pip install --dry-run
--ignore-installed --report`, which reads the package index but installs nothing) and walks the
dependency graph from the pinned packages without entering torch or torchvision, so the file holds
exactly what the project and its pinned stack need besides them. Packages that torch also needs
(filelock, fsspec, jinja2, sympy, ...) are kept: the stack reaches them on its own. The CUDA
libraries (`nvidia-*`, `cuda-*`) and triton are reached only through torch; they belong to the
host's torch build (CUDA 12 libraries beside a CUDA 13 torch break `import torch`), and the script
stops if the stack ever reaches one on its own. torchvision is left out too: Composer imports it,
but it is built for one torch release and CUDA, so it is installed to match the host's torch
(`t2ibench/commands/stack.py` checks the pair).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "requirements.txt"
OUTPUT = ROOT / "requirements-host-torch.txt"
# What the host's torch brings or must match: never installed by the no-deps file.
TORCH_STACK = {"torch", "torchvision", "triton"}
TORCH_LIBRARY_PREFIXES = ("nvidia-", "cuda-")
HEADER = """\
# The pinned stack of requirements.txt for a host whose torch (>= 2.7) is already installed:
#     pip install --no-deps -r requirements-host-torch.txt && python -m t2ibench.commands.stack
# --no-deps keeps pip from resolving Composer 0.32.1's torch<2.7.1 pin, which would replace the host's
# torch. Every package the default install brings is here, pinned, except torch, torchvision, triton and
# the CUDA libraries (nvidia-*, cuda-*), which are the host torch's own. Composer imports torchvision:
# install the torchvision built for your torch if the host lacks it (a torch container has it).
# Tested in CI (.ci/run) with the torch of requirements-newest-torch.txt; docs/gpu-runs.md#newer-torch.
# Written by scripts/host_torch_requirements.py from requirements.txt; do not edit by hand.
"""


def resolve() -> dict:
    """pip's installation report for requirements.txt in a clean environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-r", str(PINNED)], check=True)
        return json.loads(report.read_text())


def needed(report: dict) -> dict[str, tuple[str, set[str]]]:
    """Name -> (version, the packages that need it), reached from the pinned packages without going
    through the torch stack."""
    environment = report["environment"]
    packages = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}

    def requirements_of(name: str, extras: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
        out = []
        for spec in packages[name]["metadata"].get("requires_dist") or []:
            requirement = Requirement(spec)
            if requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": extra})
                                                 for extra in ("", *extras)):
                out.append((canonicalize_name(requirement.name), tuple(sorted(requirement.extras))))
        return out

    stack = [(canonicalize_name(item["metadata"]["name"]), tuple(sorted(item.get("requested_extras") or ())))
             for item in report["install"] if item.get("requested")]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    needed_by: dict[str, set[str]] = {name: {"requirements.txt"} for name, _ in stack}
    while stack:
        name, extras = stack.pop()
        if (name, extras) in seen or name in TORCH_STACK:
            continue
        if name.startswith(TORCH_LIBRARY_PREFIXES):
            raise SystemExit(f"{name} is needed by {sorted(needed_by[name])} outside torch: decide by hand")
        seen.add((name, extras))
        for dependency, dependency_extras in requirements_of(name, extras):
            needed_by.setdefault(dependency, set()).add(name)
            stack.append((dependency, dependency_extras))
    return {name: (packages[name]["metadata"]["version"], needed_by[name]) for name, _ in seen}


def main() -> None:
    lines = [HEADER]
    for name, (version, parents) in sorted(needed(resolve()).items()):
        lines.append(f"{name}=={version}  # via {', '.join(sorted(parents))}\n")
    OUTPUT.write_text("".join(lines))
    print(f"wrote {OUTPUT.name}: {len(lines) - 1} packages")


if __name__ == "__main__":
    main()
