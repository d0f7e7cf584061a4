"""Running a row of bench/gpu_report.py: its command in a process group of its own, ended whole past its
timeout; its environment (offline unless it runs SD2's pretrained parts and has them; --smoke's compiled
rows eager); a training row's results JSON with the memory model's plan beside the measurement, and a
blocks row's last JSON line.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
from pathlib import Path

from gpu.plan import ROOT, PlannedRun
from gpu.rows import ReportRow
from t2ibench.core import files

TERMINATE_GRACE_SECONDS = 30
# --smoke runs its compiled rows eager: inductor's C++ code generation for even the tiny models' blocks takes
# tens of minutes on a 2-core CPU (sdxl-tiny block by block: 2,429 s; docs/speed.md), far past the smoke's
# minutes. The --compile flags still go through every command, so the compiled rows' code paths run.
SMOKE_ENV = {"TORCH_COMPILE_DISABLE": "1"}


def run_command(command: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> int | str:
    """Run `command` in its own session, output to `log_path`; past `timeout_s` end its whole process
    group (SIGTERM, then SIGKILL after TERMINATE_GRACE_SECONDS) and return "timeout".

    subprocess.run(timeout=) kills only the process it started: Composer's launcher. Its ranks
    (plain Popen children, in the launcher's process group) would live on holding the GPUs, and
    every later row would measure a shared or full GPU. A new session makes the launcher the leader
    of a group that holds the ranks and their loader workers.
    """
    with open(log_path, "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.write(f"\ngpu_report.py: timeout after {timeout_s:.0f} s: ending the launch's process group\n")
            log.flush()
            return_code: int | str = "timeout"
        except BaseException:  # Ctrl-C: the launch must not outlive the report either
            return_code = "interrupted"
            _end_group(process)
            raise
        _end_group(process)
        return return_code


def _end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the launch's process group, SIGKILL to what is left of it after the grace period."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the whole group is gone already
    try:
        process.wait(timeout=TERMINATE_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # ranks or workers that outlived the launcher
    except ProcessLookupError:
        pass
    process.wait()


def row_env(row: ReportRow, smoke: bool, pretrained: bool) -> dict:
    """A row's environment: HF_HUB_OFFLINE=1 unless it runs SD2's pretrained parts and has them, so that no
    rank tries the hub (the run builds random parts instead); on --smoke, torch.compile off (SMOKE_ENV): the
    compiled rows run eager, and the README's compile column says so."""
    env = {**os.environ}
    if not pretrained or not (row.setting and row.setting.needs_pretrained):
        env["HF_HUB_OFFLINE"] = "1"
    return {**env, **SMOKE_ENV} if smoke else env


def run_training(planned: PlannedRun, out: Path, timeout_s: float, env: dict) -> tuple[str, dict | None]:
    """benchmark.py's launch of a planned row under `timeout_s`: its status, and its results JSON with the
    memory model's plan beside the measurement (written back, for cost.py and later reports)."""
    log_path = out / "logs" / f"{planned.name}.log"
    files.write_text(log_path, shlex.join(planned.command) + "\n")
    code = run_command(planned.command, log_path, timeout_s, env)
    path = out / f"{planned.name}.json"
    result = json.loads(path.read_text()) if path.is_file() else None
    why = diverged(result)
    if why:  # stopped on a non-finite loss or gradient norm: a failure, never a measurement
        return f"diverged: {why}, see logs/{planned.name}.log", None
    if code != 0 or result is None:
        return f"failed ({code}), see logs/{planned.name}.log", None
    if planned.plan:
        result["memory_model"] = planned.plan
        files.write_text(path, json.dumps(result, indent=2) + "\n")
    return "ok", result


def diverged(result: dict | None) -> str | None:
    """Why a training row's results are those of a diverged run (benchmark.py's `diverged` record, or a
    non-finite loss or gradient norm in a file written before runs stopped on one), or None."""
    if not result:
        return None
    if result.get("diverged"):
        return (f"at batch {result.get('diverged_at_batch')} ({result.get('diverged_on')})"
                if result.get("diverged_at_batch") is not None else str(result["diverged"]))
    for key in ("final_loss", "grad_norm"):
        value = result.get(key)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return f"{key} {value}"
    return None


def run_blocks(row: ReportRow, command: list[str], out: Path, timeout_s: float, env: dict) -> tuple[str, dict | None]:
    """blocks.py in its own process group under `timeout_s`; its last JSON line is kept as the row's JSON."""
    log_path = out / "logs" / f"{row.name}.log"
    files.write_text(log_path, shlex.join(command) + "\n")
    code = run_command(command, log_path, timeout_s, env)
    if code != 0:
        return f"failed ({code}), see logs/{row.name}.log", None
    result = last_json_line(log_path.read_text(errors="replace"))
    if result is None:
        return f"failed (no JSON line), see logs/{row.name}.log", None
    files.write_text(out / f"{row.name}.json", json.dumps(result, indent=2) + "\n")
    return "ok", result


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return None


def pretrained_available(model_name: str) -> bool:
    """Whether the VAE and text encoder of `model_name` load without the network: a local diffusers
    folder, or a hub id whose configs and weights are in the local Hugging Face cache."""
    if Path(model_name).is_dir():
        return all(Path(model_name, part, "config.json").is_file() for part in ("vae", "text_encoder"))
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        try:
            return isinstance(try_to_load_from_cache(model_name, filename), str)
        except ValueError:  # not a hub id either (HFValidationError): a path that does not exist
            return False

    return all(cached(f"{part}/config.json") and any(cached(f"{part}/{weights}") for weights in (
        "diffusion_pytorch_model.safetensors", "model.safetensors", "diffusion_pytorch_model.bin", "pytorch_model.bin"))
        for part in ("vae", "text_encoder"))
