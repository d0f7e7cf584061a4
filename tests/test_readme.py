"""Every command of the README and of docs/ that runs on a CPU is run here, as written, and the flag
reference is the commands' own --help, so the documentation cannot go stale.

A fenced `bash` block that follows the line `<!-- cpu-test -->` in README.md or docs/*.md is one
test: its lines run in order, stopping at the first that fails, in a fresh copy of the repository (so
relative paths such as `results/` or `photos/` land there, not in the checkout), offline. A plain
`python ...` line runs in a fork of the test process (tests/preloaded.py: the stack is imported once, not
once a line), any other line under `bash -euo pipefail`. The one exception is the install step of the
quick start (`pip install -r requirements.txt && `): the suite already runs on the installed
requirements, and CI installs them with the same file first.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flag_reference import COMMANDS, reference
from tests import preloaded
from tests.helpers import INTERPRETER_BIN, ROOT

MARKER = "<!-- cpu-test -->"
INSTALL = "pip install -r requirements.txt && "
BLOCK = re.compile(re.escape(MARKER) + r"\s*\n```bash\n(.*?)```", re.DOTALL)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def cpu_blocks() -> list[tuple[str, str]]:
    """(document, block) of every block marked for the CPU."""
    return [(path.name, block) for path in DOCS for block in BLOCK.findall(path.read_text())]


def test_the_documents_mark_their_cpu_commands():
    readme = BLOCK.findall((ROOT / "README.md").read_text())
    assert readme and readme[0].startswith(INSTALL), "the README's first command installs and runs the benchmark"
    marked = {name for name, _ in cpu_blocks()}
    assert {"data.md", "recipe.md"} <= marked, "the CPU walk-through and the tiny recipe carry the marker"


def test_readme_first_screen_is_a_door():
    text = (ROOT / "README.md").read_text()
    first_screen = text.split("\n## Measured results", 1)[0]
    assert len(first_screen.splitlines()) <= 65
    assert "composer benchmark.py --use_ema --use_synth_data" in first_screen and "--remote" in first_screen
    for doc in ("gpu-runs", "data", "scale", "cost", "recipe", "launch", "speed", "errors", "flags", "design"):
        assert f"(docs/{doc}.md)" in first_screen and (ROOT / "docs" / f"{doc}.md").is_file()


def commands_in(block: str) -> int:
    """How many processes a block starts: its `python` and `composer` commands, comments left out."""
    lines = [line.split("#", 1)[0] for line in block.splitlines()]
    return sum(len(re.findall(r"(?:^|[\s|&;(])(?:python|composer)\s", line)) for line in lines)


def cpu_block_params() -> list:
    """Every CPU block as a test case; a block of several commands launches several processes: multirank."""
    return [pytest.param(document, block, id=f"{document}-{block.replace(INSTALL, '').split()[1][:40]}",
                         marks=[pytest.mark.multirank] if commands_in(block) > 1 else [])
            for document, block in cpu_blocks()]


SHELL_SYNTAX = re.compile(r"[|&;<>$`(){}*?]")


def block_commands(block: str) -> list[list[str] | str]:
    """The block's lines in order: a plain `python ...` line as its argv (run by this interpreter), any other
    line (shell syntax, another program) as text for bash."""
    commands: list[list[str] | str] = []
    for line in block.replace(INSTALL, "").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        code = line.split(" #", 1)[0]
        plain = words[0] == "python" and not SHELL_SYNTAX.search(code.replace(words[-1], "") if words[1:2] == ["-c"]
                                                                 else code)
        commands.append([sys.executable, *words[1:]] if plain else line)
    return commands


@pytest.mark.parametrize("document, block", cpu_block_params())
def test_documented_cpu_command_runs(document: str, block: str, tmp_path: Path):
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "results",
                                                              "wandb", "*.egg-info"))
    # `composer` in a block is this interpreter's (its folder first on PATH), as `python` is.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(work),
           "PATH": os.pathsep.join([INTERPRETER_BIN, os.environ["PATH"]])}
    # Line by line, in order, stopping at the first that fails (as `bash -e` would): a `python` line in a fork of
    # this process, which has imported the stack already (tests/preloaded.py), anything else under bash.
    for command in block_commands(block):
        if isinstance(command, str):
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=work, env=env,
                                    capture_output=True, text=True, timeout=600)
        else:
            result = preloaded.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600,
                                   path_copies_loaded_code=True)
        assert result.returncode == 0, f"{document} block failed at:\n{command}\n--- stdout\n" \
                                       f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_flag_reference_is_the_commands_help():
    # docs/flags.md is generated from each command's --help (scripts/flag_reference.py): any flag
    # added, removed or re-described without regenerating it fails here.
    current = reference()
    assert (ROOT / "docs" / "flags.md").read_text() == current, \
        "docs/flags.md differs from the commands' --help: run python scripts/flag_reference.py"
    for script in COMMANDS:
        assert f"## `{script}`" in current


def test_docs_describe_every_flag():
    # The reference lists them all; the prose of docs/ must at least name each one somewhere too.
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9_]+)", reference(), re.MULTILINE)) - {"--help"}
    prose = "\n".join(p.read_text() for p in DOCS if p.name != "flags.md")
    missing = sorted(flag for flag in flags if f"`{flag}" not in prose and f"{flag}`" not in prose
                     and f"{flag} " not in prose)
    assert not missing, f"flags no document describes: {missing}"


# Where a document or a docstring writes under results/ (the path follows one of these) and where it reads.
RESULTS_PATH = re.compile(r"(?<![\w-])results/[\w./*-]*[\w*]")
WRITES = re.compile(r"(?:--results_json|--out|--plot|--csv|--markdown|--json|tee|tee -a|mkdir -p|>)\s+$")


def test_every_results_path_the_documents_read_is_in_the_repository_or_written_before():
    # A document names a record of results/ (a link, a command's input) only if the repository has it,
    # or if a command earlier in the same text writes it (bench/blocks.py's docstring once compared
    # with results/flux-tiny-cpu.json, which nothing wrote and the repository does not hold).
    texts = [*DOCS, ROOT / "CONTRIBUTING.md", *sorted(ROOT.glob("*.py")),
             *(path for folder in ("bench", "scripts", "t2ibench") for path in sorted((ROOT / folder).rglob("*.py")))]
    missing = []
    for path in texts:
        text, written = path.read_text(), []
        for match in RESULTS_PATH.finditer(text):
            name = match.group().rstrip(".")
            if WRITES.search(text[max(0, match.start() - 20):match.start()]):
                written.append(name)
            elif not list(ROOT.glob(name)) and not any(fnmatch.fnmatch(w, name) for w in written):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing

