"""The installed stack: which torch this runs on, and whether the packages beside it are the pinned ones
and can work with it, read from package metadata before importing anything (one line per package to
fix, not a traceback); then each package a run imports, on its own.

    python -m t2ibench.commands.stack
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# Distributions a run imports (torch's own and the pinned stack's direct parts), then optional ones.
REQUIRED = ("torch", "torchvision", "mosaicml", "mosaicml-streaming", "diffusers", "transformers",
            "huggingface-hub")
OPTIONAL = ("xformers",)
# The modules `benchmark.py` imports from them, each after those it imports itself (`import composer`
# also imports torchvision and transformers), so a broken one is found by its own import.
MODULES = ("torch", "torchvision", "transformers", "diffusers", "streaming", "composer")
OLDEST_TORCH = Version("2.7")  # the oldest torch this project is tested on (requirements.txt's 2.7.0)
INSTALL_HINT = ("pip install -r requirements.txt, or, beside a torch already installed, "
                "pip install --no-deps -r requirements-host-torch.txt")
# The two installs (README) and their pins. `pip install -r requirements.txt` installs torch 2.7.0
# (Composer 0.32.1 declares torch<2.7.1; 2.7 is the oldest tested) and pins only the direct stack: pip
# resolves the rest, which may differ from the day requirements-host-torch.txt was written. Beside any
# other torch the stack came from requirements-host-torch.txt with --no-deps, where every package is
# pinned and nothing else keeps it in line. A host whose torch is 2.7.0 is checked against requirements.txt.
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PINS = ROOT / "requirements.txt"
HOST_TORCH_PINS = ROOT / "requirements-host-torch.txt"
DEFAULT_TORCH = Version("2.7.0")


@dataclass(frozen=True)
class Found:
    """One distribution as its installed metadata describes it."""

    installed: bool
    version: str | None = None  # the metadata's Version (None: not installed, or no Version field)
    where: str | None = None  # its metadata folder, named when the metadata itself is wrong

    def parsed(self) -> Version | None:
        return parse_version(self.version)


def find(name: str) -> Found:
    """The installed distribution `name` (the first on sys.path, as importlib finds it)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return Found(False)
    where = getattr(dist, "_path", None)  # PathDistribution's folder; other finders may not have one
    return Found(True, dist.metadata.get("Version") or None, str(where) if where is not None else None)


def versions() -> dict[str, str | None]:
    """Installed version of each required and optional distribution (None: not installed, or no version)."""
    return {name: find(name).version for name in (*REQUIRED, *OPTIONAL)}


def reinstall(name: str, pin: str | None) -> str:
    """The command that puts back one pinned package (--no-deps: it replaces nothing else)."""
    return f"pip install --force-reinstall --no-deps {name}=={pin}" if pin else INSTALL_HINT


def metadata_problem(name: str, found: Found, pin: str | None = None) -> str | None:
    """What is wrong with an installed distribution's own metadata (no version, or one pip could not
    have written), or None; a distribution that is not installed is no metadata problem."""
    where = f" ({found.where})" if found.where else ""
    if found.installed and found.version is None:
        return f"{name} is installed without a version in its metadata{where}: reinstall it: {reinstall(name, pin)}"
    if found.installed and found.parsed() is None:
        return (f"{name} has {found.version!r} as its version, which is not a version{where}: reinstall it: "
                f"{reinstall(name, pin)}")
    return None


def torchvision_release_for(torch_version: Version) -> tuple[int, int] | None:
    """(major, minor) of the torchvision released with a torch 2.x: 0.(x + 15), as for every torch 2
    release so far (2.7: 0.22, 2.14: 0.29). Its metadata is looser (torchvision 0.29.1 declares
    torch>=2.14.0) while its compiled ops are built against one torch release."""
    return (0, torch_version.minor + 15) if torch_version.major == 2 else None


def parse_version(version: str | None) -> Version | None:
    """`version` parsed; None when there is none or it is not a version (metadata_problem says which)."""
    try:
        return Version(version) if version else None
    except InvalidVersion:
        return None


def problems(found: dict[str, str | None], unreadable: frozenset[str] = frozenset()) -> list[str]:
    """What keeps this stack from running, one line each, from metadata alone (nothing imported): a
    missing package, a torch older than OLDEST_TORCH, a torchvision of another release. Packages in
    `unreadable` are installed with metadata that gives no version (metadata_problem names them) and
    are not judged here."""
    missing = [name for name in REQUIRED if found[name] is None and name not in unreadable]
    if "torch" in missing:
        return [f"torch is not installed: {INSTALL_HINT}"]
    out = []
    torch_version, vision = parse_version(found["torch"]), parse_version(found["torchvision"])
    if torch_version is not None and torch_version.release < OLDEST_TORCH.release:
        out.append(f"torch {found['torch']} is older than {OLDEST_TORCH}, the oldest this project is tested on: "
                   f"{INSTALL_HINT}")
    if "torchvision" in missing:
        out.append(f"torchvision is not installed (Composer imports it): install the torchvision built for "
                   f"torch {found['torch']}, from the same index as that torch")
    elif torch_version is not None and vision is not None and (paired := torchvision_release_for(torch_version)) \
            and vision.release[:2] != paired:
        out.append(f"torchvision {found['torchvision']} is not the release built for torch {found['torch']} "
                   f"(torchvision {paired[0]}.{paired[1]}): install that one, from the same index as that torch")
    out += [f"{name} is not installed: {INSTALL_HINT}" for name in missing if name != "torchvision"]
    return out


def pins_file(torch_version: Version | None) -> Path:
    """The file whose pins this stack must match: the host-torch file beside any torch but requirements.txt's
    own; requirements.txt there, and when the torch's version cannot be read (its pins are in both files)."""
    if torch_version is None or torch_version.release == DEFAULT_TORCH.release:
        return DEFAULT_PINS
    return HOST_TORCH_PINS


def read_pins(path: Path) -> dict[str, tuple[str, Requirement]]:
    """Canonical name -> (the name as written, the requirement) of each line of a requirements file
    that applies here (its environment marker, if any, holds)."""
    pins = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement as error:  # the repository's own file: a bug, not the user's
            raise ValueError(f"{path.name}, line {number}: {error}") from None
        if requirement.marker is None or requirement.marker.evaluate():
            pins[canonicalize_name(requirement.name)] = (requirement.name, requirement)
    return pins


def exact_pin(requirement: Requirement) -> str | None:
    """The version of an `==` pin, None for any other requirement."""
    specs = list(requirement.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def pin_problems(file_name: str, pins: dict[str, tuple[str, Requirement]], skip: set[str]) -> list[str]:
    """One line for each package pinned in `file_name` (its `pins`) that is not installed at a version the
    pin allows; canonical names in `skip` (already reported) are left out."""
    out = []
    for canonical, (name, requirement) in pins.items():
        if canonical in skip:
            continue
        found, pin = find(name), exact_pin(requirement)
        wanted = f"{file_name} pins {pin}" if pin else f"{file_name} needs {requirement.specifier}"
        fix = f"pip install --no-deps {name}=={pin}" if pin else f"pip install --no-deps '{name}{requirement.specifier}'"
        problem = metadata_problem(name, found, pin)
        if problem:
            out.append(problem)
        elif not found.installed:
            out.append(f"{name} is not installed ({wanted}): {fix}")
        elif not requirement.specifier.contains(found.parsed(), prereleases=True):
            out.append(f"{name} {found.version} is installed where {wanted}: {fix}")
    return out


def _path_roots() -> list[str]:
    """The folders on sys.path that hold installed packages, longest first (site-packages lies inside
    the standard library's folder, which is left out)."""
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")}
    roots = {os.path.realpath(entry or ".") for entry in sys.path} - stdlib
    return sorted((root for root in roots if os.path.isdir(root)), key=len, reverse=True)


def failing_package(error: BaseException, module: str) -> str:
    """The top-level package an import failed in: the innermost frame of `error` (or the file a
    SyntaxError points at) that lies in an installed package, not in the standard library; else the
    module a ModuleNotFoundError could not find; else `module` itself."""
    files = [error.filename] if isinstance(error, SyntaxError) and error.filename else []
    files += [frame.filename for frame in reversed(traceback.extract_tb(error.__traceback__))]
    roots = _path_roots()
    for file in files:
        if not os.path.isabs(file):  # "<frozen importlib._bootstrap>" and the like
            continue
        real = os.path.realpath(file)
        root = next((root for root in roots if real.startswith(root + os.sep)), None)
        if root is not None:
            top = real[len(root) + 1:].split(os.sep)[0].removesuffix(".py")
            if top.isidentifier():
                return top
    if isinstance(error, ModuleNotFoundError) and error.name:
        return error.name.split(".")[0]
    return module


def import_problem(module: str, pins: dict[str, tuple[str, Requirement]]) -> str | None:
    """One line naming the package an `import module` failed in, and how to put it back; None if it imports."""
    try:
        importlib.import_module(module)
        return None
    except Exception as error:  # an ImportError, or an OSError from a shared library (a CUDA mismatch)
        detail = f"{type(error).__name__}: {str(error).splitlines()[0]}" if str(error) else type(error).__name__
        package = failing_package(error, module)
        dist = (importlib.metadata.packages_distributions().get(package) or [package])[0]
        version = find(dist).version
        pinned = pins.get(canonicalize_name(dist))
        pin = exact_pin(pinned[1]) if pinned else None
        where = f"{dist} {version}" if version else package
        fix = f"reinstall it: {reinstall(dist, pin)}" if pin else INSTALL_HINT
        return f"import {module} failed in {where} ({detail}): {fix}"


def describe(found: dict[str, str | None], pins: Path) -> str:
    """One line: the torch this runs on (its CUDA, if any), then the pinned stack's versions."""
    import torch

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build"
    devices = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU visible"
    rest = ", ".join(f"{name} {version}" for name, version in found.items() if version and name != "torch")
    return f"torch {found['torch']} ({cuda}, {devices}), {rest}, python {platform.python_version()}; pins of {pins.name} met"


def main() -> int:
    installed = {name: find(name) for name in (*REQUIRED, *OPTIONAL)}
    if not installed["torch"].installed:  # which pins apply depends on the torch
        print(f"t2ibench.commands.stack: error: torch is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 1
    pins_path = pins_file(installed["torch"].parsed())
    pins = read_pins(pins_path)
    errors = [problem for name, item in installed.items()
              if (problem := metadata_problem(name, item, exact_pin(pins[canonicalize_name(name)][1])
                                              if canonicalize_name(name) in pins else None))]
    unreadable = frozenset(name for name, item in installed.items() if item.installed and item.parsed() is None)
    found = {name: item.version for name, item in installed.items()}
    errors += problems(found, unreadable)
    reported = {canonicalize_name(name) for name in REQUIRED if name in unreadable or not installed[name].installed}
    errors += pin_problems(pins_path.name, pins, reported)
    for problem in errors:
        print(f"t2ibench.commands.stack: error: {problem}", file=sys.stderr)
    if errors:
        return 1
    for module in MODULES:
        problem = import_problem(module, pins)
        if problem:
            print(f"t2ibench.commands.stack: error: {problem}", file=sys.stderr)
            return 1
    print(f"stack: {describe(found, pins_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
