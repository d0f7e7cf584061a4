"""Every README command that runs on a CPU is run here, as written, so the README cannot go stale.

A fenced `bash` block that follows the line `<!-- cpu-test -->` in README.md is one test: its lines
run in order under `bash -euo pipefail`, in a fresh copy of the repository (so relative paths such
as `results/` or `photos/` land there, not in the checkout), offline. The one exception is the
install step of the quick start (`pip install -r requirements.txt && `): the suite already runs
on the installed requirements, and CI installs them with the same file first.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- cpu-test -->"
INSTALL = "pip install -r requirements.txt && "
BLOCK = re.compile(re.escape(MARKER) + r"\s*\n```bash\n(.*?)```", re.DOTALL)


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_readme_marks_its_cpu_commands():
    blocks = readme_blocks()
    assert len(blocks) >= 2, "the quick start and the CPU walk-through carry the cpu-test marker"
    assert blocks[0].startswith(INSTALL), "the README's first command installs and runs the benchmark"


@pytest.mark.parametrize("block", readme_blocks(), ids=lambda b: b.replace(INSTALL, "").split()[1][:40])
def test_readme_command_runs(block: str, tmp_path: Path):
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "results",
                                                              "wandb", "*.egg-info"))
    script = block.replace(INSTALL, "").replace("python ", f"{sys.executable} ")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(work)}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"README block failed:\n{block}\n--- stdout\n{result.stdout[-3000:]}\n" \
                                   f"--- stderr\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("script", ["benchmark.py", "convert.py", "latents.py", "cost.py", "export.py"])
def test_readme_names_every_flag(script: str):
    # The flags a command accepts, from its own --help (in-process: the parser the command builds).
    sys.path.insert(0, str(ROOT))
    module = importlib.import_module(script.removesuffix(".py"))
    if hasattr(module, "build_parser"):
        text = module.build_parser().format_help()
    else:
        with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit):
            module.parse_args(["--help"])
        text = out.getvalue()
    options = text.split("options:", 1)[1]  # argparse's list, not flags named in the description
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9_]+)", options, re.MULTILINE)) - {"--help"}
    assert flags, text
    readme = (ROOT / "README.md").read_text()
    missing = sorted(flag for flag in flags if f"`{flag}" not in readme and f"{flag}`" not in readme
                     and f"{flag} " not in readme)
    assert not missing, f"{script} flags missing from README.md: {missing}"
