"""bench/bench_gpu.py without a GPU: the plan for an 8 x 80 GB node, the timeout that ends a launch's
whole process group, and the refusal when the pretrained parts would be fetched by every rank."""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_gpu  # noqa: E402
import gpu_memory  # noqa: E402

sys.path.remove(str(ROOT / "bench"))  # bench/memory.py must not shadow anything imported later


def test_dry_run_plans_every_row_of_an_8_x_80gb_node_at_batch_2048(tmp_path, capsys):
    out = tmp_path / "matrix"
    rows = bench_gpu.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert not out.exists()  # nothing run, nothing written
    assert [r["name"] for r in rows] == list(bench_gpu.MATRIX)
    assert "estimated time: about" in printed
    for row in rows:
        setting = bench_gpu.MATRIX[row["name"]]
        command = row["command"]
        flag = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}
        assert command[command.index("-n") + 1] == "8" and flag["--batch_size"] == "2048"
        micro = int(flag["--device_train_microbatch_size"])
        # The memory model's largest microbatch for the row's own settings (halved where the row says).
        plan = gpu_memory.plan("sd2-base", 512, 79.1 * 2**30, norm_precision=setting.norm_precision,
                               precomputed=setting.precomputed, precomputed_format=setting.precomputed_format,
                               fsdp=setting.fsdp, num_gpus=8, per_device_batch=256)
        assert micro == plan["microbatch"] // setting.microbatch_divisor and 256 % micro == 0
        assert gpu_memory.predicted_bytes(plan, micro) <= 79.1 * 2**30
        assert ("--fsdp" in flag) is (setting.fsdp != "none")
        assert shlex.join(command) in printed  # the full command, as a shell would run it
        assert row["estimated_seconds"] > bench_gpu.STARTUP_SECONDS
    online = {r["name"]: r["microbatch"] for r in rows}
    assert online["online-bf16"] == online["precomputed-bf16"]  # the same UNet activations (no doubling)


def test_timeout_ends_the_launchers_whole_process_group(tmp_path):
    # A fake launcher that starts a rank, which starts a worker: all sleep and record their pids.
    pids, script = tmp_path / "pids", tmp_path / "spawn.py"
    script.write_text("import os, subprocess, sys, time\n"
                      "open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
                      "if int(sys.argv[2]) > 0:\n"
                      "    subprocess.Popen([sys.executable, __file__, sys.argv[1], str(int(sys.argv[2]) - 1)])\n"
                      "time.sleep(600)\n")
    command = [sys.executable, str(script), str(pids), "2"]
    start = time.monotonic()
    code = bench_gpu.run_command(command, tmp_path / "log.txt", timeout_s=10)  # all three started by then
    assert code == "timeout" and time.monotonic() - start < 60
    recorded = [int(line) for line in pids.read_text().split()]
    assert len(recorded) == 3  # launcher, rank, worker
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in recorded):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in recorded), recorded
    assert "timeout after 10 s" in (tmp_path / "log.txt").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) holds nothing: count it as ended.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_refuses_in_one_line_when_every_rank_would_fetch_the_encoders(tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench_gpu.main(["--out", str(tmp_path / "matrix"), "--model_name", str(tmp_path / "no-such-model")])
    message = str(stop.value)
    assert message.startswith("bench_gpu.py: error: pretrained VAE and text encoder") and "\n" not in message
    assert "--allow_random_encoders" in message and not (tmp_path / "matrix").exists()
