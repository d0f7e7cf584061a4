"""bench/bench_gpu.py without a GPU: the plan for an 8 x 80 GB node (every row's microbatch from the memory
model, for every family), the timeout that ends a launch's whole process group, and the refusal when
the pretrained parts would be fetched by every rank."""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

import bench_gpu
from t2ibench import memory
from t2ibench.gpu_setup import choose_setup

SD2_ROWS = [name for name, setting in bench_gpu.MATRIX.items() if setting.model_config == "sd2-base"]


def _flags(command: list[str]) -> dict[str, str | bool]:
    """A command's flags and values (True for a switch); a flag given twice keeps its last value, as argparse does."""
    values = [*command[1:], "--"]  # what follows each item
    return {item: True if following.startswith("--") else following
            for item, following in zip(command, values) if item.startswith("--")}


def _check_planned(rows: list[dict], printed: str) -> None:
    """Every row of a dry run on 8 x 79.1 GiB: its global batch (2048; Flux.1: MLPerf's 512), EMA as the row
    says, and the memory model's microbatch for its own settings."""
    for row in rows:
        setting = bench_gpu.MATRIX[row["name"]]
        command = row["command"]
        flag = _flags(command)
        assert command[command.index("-n") + 1] == "8" and flag["--batch_size"] == str(setting.global_batch)
        assert ("--use_ema" in flag) is setting.use_ema
        assert (flag["--model_config"], int(flag["--image_size"])) == (setting.model_config, setting.resolution)
        micro = int(flag["--device_train_microbatch_size"])
        # Checkpointing as benchmark.py resolves the row's flag on this node (auto: the rule's choice).
        options = dict(norm_precision=setting.norm_precision, precomputed=setting.precomputed,
                       precomputed_format=setting.text_format, fsdp=setting.fsdp, num_gpus=8,
                       use_ema=setting.use_ema)
        setup = choose_setup(setting.model_config, setting.resolution, 79.1 * 2**30, setting.global_batch // 8,
                             activation_checkpointing=setting.activation_checkpointing, **options)
        checkpointing = setup.activation_checkpointing
        assert row["activation_checkpointing"] is checkpointing is row["plan"]["activation_checkpointing"]
        assert row["plan"]["activation_checkpointing_reason"] == setup.reason
        # The memory model's largest microbatch for the row's own settings (halved where the row says).
        plan = memory.plan(setting.model_config, setting.resolution, 79.1 * 2**30,
                           per_device_batch=setting.global_batch // 8,
                           activation_checkpointing=setup.activation_checkpointing, **options)
        assert plan["microbatch"] >= 1, row["name"]  # every row fits the GPU
        assert micro == plan["microbatch"] // setting.microbatch_divisor and (setting.global_batch // 8) % micro == 0
        assert memory.predicted_bytes(plan, micro) <= 79.1 * 2**30
        assert flag["--fsdp"] == setting.fsdp  # the run shards as the plan counted
        # The row's flag as the row sets it; a row that leaves it out takes benchmark.py's auto, whose
        # choice with this microbatch (on only when it does not fit without) is the planned one.
        assert flag.get("--activation_checkpointing", "auto") == setting.activation_checkpointing
        if setting.activation_checkpointing == "auto":
            assert choose_setup(setting.model_config, setting.resolution, 79.1 * 2**30, setting.global_batch // 8,
                                microbatch=micro, **options).activation_checkpointing is setup.activation_checkpointing
        assert ("--model_name" in flag) is setting.needs_pretrained
        assert shlex.join(command) in printed  # the full command, as a shell would run it
        assert row["estimated_seconds"] > bench_gpu.STARTUP_SECONDS


def test_dry_run_plans_every_sd2_row_of_an_8_x_80gb_node_at_batch_2048(tmp_path, capsys):
    out = tmp_path / "matrix"
    rows = bench_gpu.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--out", str(out),
                           "--only", *SD2_ROWS])
    printed = capsys.readouterr().out
    assert not out.exists()  # nothing run, nothing written
    assert [r["name"] for r in rows] == SD2_ROWS
    assert "estimated time: about" in printed
    _check_planned(rows, printed)
    online = {r["name"]: r["microbatch"] for r in rows}
    assert online["online-bf16"] == online["precomputed-bf16"]  # the same UNet activations (no doubling)


def test_dry_run_plans_flux_sharded_from_the_memory_model(tmp_path, capsys):
    # Flux.1-schnell's 11.9B parameters only train sharded; checkpointing its blocks fits more images.
    names = ["flux-precomputed-states-bf16-fsdp-nockpt", "flux-precomputed-states-bf16-fsdp-ckpt",
             "flux-precomputed-states-bf16-fsdp"]
    rows = bench_gpu.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--only", *names])
    _check_planned(rows, capsys.readouterr().out)
    plain, checkpointed, default = rows
    assert checkpointed["microbatch"] > plain["microbatch"]
    assert checkpointed["activation_checkpointing"] and not plain["activation_checkpointing"]
    assert plain["microbatch"] == 8 and checkpointed["microbatch"] == 64
    # The default row (docs/flux.md): shard_grad_op with checkpointing, the per-GPU batch (512 / 8) in one
    # microbatch, so each step gathers the weights once and reduce-scatters once.
    assert _flags(default["command"])["--fsdp"] == "shard_grad_op" and default["activation_checkpointing"]
    assert default["microbatch"] == 64 and default["plan"]["fsdp"] == "shard_grad_op"


def test_fp8_goes_to_every_row_and_into_its_memory_plan(capsys):
    # MLPerf's set-up with float8 on 8 x 80 GB: the command takes --fp8 and --compile, the microbatch is
    # counted with float8.
    name = "flux-precomputed-states-bf16-fsdp-nockpt"
    (row,) = bench_gpu.main(["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--only", name,
                             "--fp8", "tensorwise"])
    assert _flags(row["command"])["--fp8"] == "tensorwise" and row["plan"]["fp8"] == "tensorwise"
    assert "--compile" in row["command"]  # benchmark.py refuses float8 without it
    plain = memory.plan("flux1-schnell", 256, 79.1 * 2**30, precomputed=True, fsdp="full_shard", use_ema=False,
                        per_device_batch=64)
    # Tensorwise keeps each Linear's float8 weight for backward: more bytes per microbatch than bf16.
    assert row["plan"]["activation_bytes_per_microbatch"] > plain["activation_bytes_per_microbatch"]
    assert 1 <= row["microbatch"] <= plain["microbatch"]


def test_every_row_runs_as_planned_and_smoke_runs_each_familys_tiny_model():
    # Commands are made from the same settings as the plan: check each row's flags without counting.
    for name, setting in bench_gpu.MATRIX.items():
        flag = _flags(["launcher", *setting.flags()])
        assert flag["--fsdp"] == setting.fsdp and flag["--model_config"] == setting.model_config
        assert ("--precomputed_format" in flag) is setting.precomputed
        if setting.precomputed:
            assert flag["--precomputed_format"] == setting.text_format
        # --model_name is SD2's: the rows of other families must need no pretrained part.
        assert setting.model_config == "sd2-base" or not setting.needs_pretrained, name
        smoke = _flags(["launcher", *setting.flags(), *bench_gpu.smoke_flags(setting, gpus=1)])
        assert smoke["--model_config"] == bench_gpu.SMOKE_CONFIGS[setting.model_config]
        assert smoke["--fsdp"] == "none"  # one CPU rank: nothing to shard over
@pytest.mark.multirank
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU check is what stops it here")
def test_rows_without_frozen_parts_need_no_pretrained_parts(tmp_path):
    # Rows on stored text states run no VAE or text encoder: no refusal for them (the missing GPU stops it).
    with pytest.raises(SystemExit) as stop:
        bench_gpu.main(["--out", str(tmp_path / "matrix"), "--model_name", str(tmp_path / "no-such-model"),
                        "--only", "flux-precomputed-states-bf16-fsdp"])
    assert str(stop.value).startswith("bench_gpu.py: error: no CUDA GPU visible")
