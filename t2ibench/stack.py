"""The installed stack: which torch this runs on, and whether the packages beside it can work with it,
read from package metadata before importing anything (one line to fix, not a traceback).

    python -m t2ibench.stack
"""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

from packaging.version import Version

# Distributions a run imports (torch's own and the pinned stack's direct parts), then optional ones.
REQUIRED = ("torch", "torchvision", "mosaicml", "mosaicml-streaming", "diffusers", "transformers",
            "huggingface-hub")
OPTIONAL = ("xformers",)
# The modules `benchmark.py` imports from them; `import composer` also imports torchvision.
MODULES = ("torch", "torchvision", "composer", "streaming", "diffusers", "transformers")
OLDEST_TORCH = Version("2.7")  # the oldest torch this project is tested on (requirements.txt's 2.7.0)
INSTALL_HINT = ("pip install -r requirements.txt, or, beside a torch already installed, "
                "pip install --no-deps -r requirements-host-torch.txt")


def versions() -> dict[str, str | None]:
    """Installed version of each required and optional distribution (None: not installed)."""
    found = {}
    for name in (*REQUIRED, *OPTIONAL):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def torchvision_release_for(torch_version: Version) -> tuple[int, int] | None:
    """(major, minor) of the torchvision released with a torch 2.x: 0.(x + 15), as for every torch 2
    release so far (2.7: 0.22, 2.14: 0.29). Its metadata is looser (torchvision 0.29.1 declares
    torch>=2.14.0) while its compiled ops are built against one torch release."""
    return (0, torch_version.minor + 15) if torch_version.major == 2 else None


def problems(found: dict[str, str | None]) -> list[str]:
    """What keeps this stack from running, one line each, from metadata alone (nothing imported)."""
    missing = [name for name in REQUIRED if found[name] is None]
    if "torch" in missing:
        return [f"torch is not installed: {INSTALL_HINT}"]
    out = []
    torch_version = Version(found["torch"])
    if torch_version.release < OLDEST_TORCH.release:
        out.append(f"torch {found['torch']} is older than {OLDEST_TORCH}, the oldest this project is tested on: "
                   f"{INSTALL_HINT}")
    if found["torchvision"] is None:
        out.append(f"torchvision is not installed (Composer imports it): install the torchvision built for "
                   f"torch {found['torch']}, from the same index as that torch")
    elif (paired := torchvision_release_for(torch_version)) and Version(found["torchvision"]).release[:2] != paired:
        out.append(f"torchvision {found['torchvision']} is not the release built for torch {found['torch']} "
                   f"(torchvision {paired[0]}.{paired[1]}): install that one, from the same index as that torch")
    out += [f"{name} is not installed: {INSTALL_HINT}" for name in missing if name != "torchvision"]
    return out


def describe(found: dict[str, str | None]) -> str:
    """One line: the torch this runs on (its CUDA, if any), then the pinned stack's versions."""
    import torch

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build"
    devices = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU visible"
    rest = ", ".join(f"{name} {version}" for name, version in found.items() if version and name != "torch")
    return f"torch {found['torch']} ({cuda}, {devices}), {rest}, python {platform.python_version()}"


def main() -> int:
    found = versions()
    errors = problems(found)
    for problem in errors:
        print(f"t2ibench.stack: error: {problem}", file=sys.stderr)
    if errors:
        return 1
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as error:  # an ImportError, or an OSError from a shared library (a CUDA mismatch)
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            print(f"t2ibench.stack: error: import {module} failed ({first_line}): {INSTALL_HINT}", file=sys.stderr)
            return 1
    print(f"stack: {describe(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
