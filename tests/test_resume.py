"""Long runs survive: resume after SIGKILL, stop on a non-finite loss, launch on SLURM, mcloud.yaml.

Every training run here goes through Composer's launcher with two CPU ranks and the tiny model:

* a reference run that trains 8 batches without interruption, saving every 2;
* the same run (same seed) SIGKILLed, launcher and ranks together, right after its checkpoint at
  batch 4, then relaunched with --autoresume: its last checkpoint must equal the reference's
  bit for bit (UNet, EMA, optimizer, RNG), and so must the final loss;
* a run whose loss turns NaN at batch 3 on one rank: both ranks stop, the message names the batch
  and the last good checkpoint, nothing is saved for batch 3; relaunched with --autoresume it
  meets the NaN again and must name the checkpoint it resumed from;
* scripts/slurm.sbatch run as a job of 2 nodes x 1 process, with stand-ins for `srun` (one task
  per "node", SLURM_NODEID set) and `scontrol`: two Composer launchers on loopback, --world_size 2,
  --node_rank 0 and 1, sharing the save folder as nodes on a shared file system do. Its checkpoint
  at batch 2 must equal the reference's. The `composer` each task execs is a stand-in that runs
  Composer's launcher (`python -m composer.cli.launcher`, what the console script runs) as a fork of the
  test process (tests/fork_server.py): as new interpreters the two launchers and their ranks took 58 s of
  CPU, importing, for two batches.

The runs are started together by one module fixture (each spends most of its time importing, so
running them side by side roughly halves the wall time) and the tests check their results.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.fork_server import ForkServer
from tests.helpers import (INTERPRETER_BIN, ROOT, TINY_MODEL, TINY_RANKS, Launch, after_exit, assert_tensors_equal,
                           ema_state, free_port, kill_at, latest, load, rank_env, supervise, two_ranks, write_images)

RESUME_RUN = TINY_RANKS + ["--max_duration", "8ba", "--save_interval", "2ba", "--run_name", "resume-test",
                           "--autoresume"]
KILL_AFTER = "ep1-ba4-rank0.pt"  # the checkpoint after which the run is killed (batch 1 of epoch 1)
FINAL = "ep2-ba8-rank0.pt"
NAN_BATCH = 3  # the loss of this (1-based) batch is poisoned, on rank 1 only
NAN_RUN = TINY_RANKS + ["--max_duration", "5ba", "--save_interval", "1ba", "--run_name", "nan-test", "--autoresume",
                        "--nan_at_batch", str(NAN_BATCH), "--nan_rank", "1"]
# The sbatch script adds --use_ema --device_train_microbatch_size 4 --run_name --autoresume --save_folder;
# these come after and override (2 images per rank: microbatch 2, as the reference's automatic choice).
SLURM_RUN = TINY_RANKS + ["--max_duration", "2ba", "--save_interval", "2ba", "--device_train_microbatch_size", "2"]
SLURM_RUN_NAME = "slurm-test"

# Stand-ins for SLURM's commands, enough for scripts/slurm.sbatch on one machine.
FAKE_SRUN = """#!/bin/bash
# srun [--options...] command...: one task per "node", all here, with SLURM_NODEID set.
ntasks=1
while [[ $1 == --* ]]; do [[ $1 == --ntasks=* ]] && ntasks=${1#--ntasks=}; shift; done
pids=()
for ((i = 0; i < ntasks; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: the job's hosts, one per line (both "nodes" are this machine).
if [[ $1 == show && $2 == hostnames ]]; then printf '127.0.0.1\\nlocalhost\\n'; else echo "scontrol $*"; fi
"""


def slurm_job(tmp: Path) -> tuple[Launch, ForkServer]:
    """scripts/slurm.sbatch as job 4242 on 2 "nodes" of 1 process each, with fake srun/scontrol on PATH, and the
    server of the `composer` stand-in it finds first there (its launchers and ranks: forks of this process)."""
    bin_dir = tmp / "fake-slurm-bin"
    bin_dir.mkdir()
    server = ForkServer(bin_dir, {"composer": [sys.executable, "-m", "composer.cli.launcher"]})
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = rank_env(PATH=os.pathsep.join([str(bin_dir), INTERPRETER_BIN, os.environ["PATH"]]), SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                   SLURM_JOB_NODELIST="node[1-2]", SLURM_CPUS_ON_NODE="1", GPUS_PER_NODE="1",
                   MASTER_PORT=str(free_port()), RUN_NAME=SLURM_RUN_NAME, SAVE_FOLDER=str(tmp / "slurm"))
    args = SLURM_RUN + ["--results_json", str(tmp / "slurm.json")]
    return Launch(["bash", str(ROOT / "scripts" / "slurm.sbatch"), *args], tmp / "slurm.log", env=env), server


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every launch, kill and relaunch as planned, and return them once all have exited."""
    tmp = tmp_path_factory.mktemp("resume")
    ref_dir, killed_dir, nan_dir = tmp / "reference", tmp / "killed", tmp / "nan"

    def resume_run(folder: Path, name: str) -> Launch:
        args = RESUME_RUN + ["--save_folder", str(folder), "--results_json", str(tmp / f"{name}.json")]
        return Launch(two_ranks("benchmark.py", *args), tmp / f"{name}.log")

    def nan_run(name: str) -> Launch:
        args = NAN_RUN + ["--save_folder", str(nan_dir), "--report", str(tmp / name)]
        return Launch(two_ranks("tests/nan_run.py", *args), tmp / f"{name}.log")

    reference, killed = resume_run(ref_dir, "reference"), resume_run(killed_dir, "killed")
    nan_first, (slurm, composer_forks) = nan_run("nan-first"), slurm_job(tmp)
    found: dict = {}

    def resume() -> Launch:
        found["killed_at"] = sorted(p.name for p in killed_dir.iterdir())
        found["resumed"] = resume_run(killed_dir, "resumed")
        return found["resumed"]

    def nan_again() -> Launch:
        # What the first run left, to tell a resume from a fresh start that rewrites it all.
        found["nan_checkpoints"] = {p.name: p.stat().st_mtime_ns for p in nan_dir.glob("ep*.pt")}
        found["nan_again"] = nan_run("nan-again")
        return found["nan_again"]

    supervise([reference, killed, nan_first, slurm, composer_forks], kill_at(killed, killed_dir, KILL_AFTER, resume),
              after_exit(nan_first, nan_again))
    return dict(tmp=tmp, reference=reference, killed=killed, ref_dir=ref_dir, killed_dir=killed_dir,
                nan_first=nan_first, nan_dir=nan_dir, slurm=slurm, **found)


@pytest.mark.multirank
def test_killed_run_resumes_to_the_same_weights_ema_and_loss(runs):
    reference, killed, resumed = runs["reference"], runs["killed"], runs["resumed"]
    assert reference.proc.returncode == 0, reference.tail()
    assert killed.proc.returncode == -signal.SIGKILL, "the launcher should have died by SIGKILL"
    assert FINAL not in runs["killed_at"], f"the run was killed too late: {runs['killed_at']}"
    assert resumed.proc.returncode == 0, resumed.tail()

    # It resumed from batch 4 rather than starting over.
    out = resumed.output()
    assert "batch 5/8 " in out and "batch 1/8 " not in out, resumed.tail()

    ref, res = load(runs["ref_dir"] / FINAL), load(runs["killed_dir"] / FINAL)
    assert latest(runs["killed_dir"]) == FINAL
    for ckpt in (ref, res):
        time_ = ckpt["state"]["timestamp"]["Timestamp"]
        assert (time_["epoch"], time_["batch"], time_["batch_in_epoch"], time_["sample"]) == (2, 8, 2, 32)
    assert_tensors_equal(ref["state"]["model"], res["state"]["model"], "model weights")
    unet = [k for k in ref["state"]["model"] if k.startswith("unet.")]
    assert len(unet) > 100

    ema_ref, ema_res = ema_state(ref), ema_state(res)
    assert ema_ref["initialized"] and ema_res["initialized"]
    assert ema_ref["num_updates"] == ema_res["num_updates"] == 7  # copied at batch 1, averaged at 2..8
    assert_tensors_equal(ema_ref["shadow"], ema_res["shadow"], "EMA shadow")
    assert sorted(ema_ref["shadow"]) == sorted(unet)  # the UNet, and only the UNet
    # The average is not just the current weights (it really was carried through the restart).
    assert not all(torch.equal(ema_ref["shadow"][k], ref["state"]["model"][k]) for k in unet)

    opt_ref, opt_res = ref["state"]["optimizers"]["AdamW"], res["state"]["optimizers"]["AdamW"]
    assert opt_ref["state"].keys() == opt_res["state"].keys()
    for key in opt_ref["state"]:
        assert_tensors_equal(opt_ref["state"][key], opt_res["state"][key], f"AdamW state {key}")
    # Same random draws (noise, timesteps, VAE posterior samples) after the restart as without it.
    for rank in range(2):
        assert torch.equal(ref["rng"][rank]["torch"], res["rng"][rank]["torch"]), f"torch RNG of rank {rank}"

    final_ref = json.loads((runs["tmp"] / "reference.json").read_text())["final_loss"]
    final_res = json.loads((runs["tmp"] / "resumed.json").read_text())["final_loss"]
    assert final_ref == final_res and final_ref == final_ref  # exact (and not NaN)
    # The logged (all-reduced) losses of the batches after the restart match too.
    ref_losses, res_losses = logged_losses(reference.output()), logged_losses(out)
    assert set(res_losses) == {5, 6, 7, 8}, res_losses
    assert all(res_losses[b] == ref_losses[b] for b in res_losses), (ref_losses, res_losses)


@pytest.mark.multirank
def test_each_rank_resumes_with_its_own_cpu_thread_count(runs):
    # Rank 0 alone writes a checkpoint: it holds every rank's count (callbacks.resume_threads), and after
    # the kill each rank computed with its own saved count (the resumed rule says so, rank 1's included).
    users = "OMP_NUM_THREADS=1, the user's"  # the launches' environment (tests.helpers.rank_env)
    before = load(runs["killed_dir"] / KILL_AFTER)["state"]["callbacks"]["KeepCpuThreadsOnResume"]
    after = load(runs["killed_dir"] / FINAL)["state"]["callbacks"]["KeepCpuThreadsOnResume"]
    assert before["by_rank"] == [[1, users], [1, users]], before
    assert after["by_rank"] == [[1, "as the run it resumes: " + users]] * 2, after


def logged_losses(console: str) -> dict[int, str]:
    """{batch: loss as printed} from the progress lines of rank 0 (console.ConsoleProgress)."""
    return {int(batch): loss for batch, loss in re.findall(r"^batch (\d+)/\d+ .*\| loss (\S+) \|", console, re.MULTILINE)}


def rank_reports(folder: Path) -> dict[int, list[str]]:
    """What each rank of a tests/nan_run.py launch wrote with --report."""
    return {int(p.stem[4:]): p.read_text().splitlines() for p in sorted(folder.glob("rank*.txt"))}


def assert_stopped_at_nan_batch(launch: Launch, report: Path, good: Path) -> None:
    """Non-zero exit; every rank stopped with a message naming the batch and the last good checkpoint."""
    assert launch.proc.returncode not in (0, None), launch.tail()
    shown = [line for line in launch.output().splitlines() if "NonFiniteLossError: non-finite loss" in line]
    assert shown, f"no stop message in the launcher's output:\n{launch.tail()}"
    reports = rank_reports(report)
    assert sorted(reports) == [0, 1], reports
    assert reports[1][0] == f"poisoned the loss of batch {NAN_BATCH}" and len(reports[0]) == 1, reports
    stops = [lines[-1] for lines in reports.values()] + shown
    for message in stops:
        assert f"non-finite loss at batch {NAN_BATCH} (ba{NAN_BATCH})" in message, message
        assert f"last good checkpoint: {good}" in message, message
    # Nothing was written for the NaN batch, and `latest` still points at the good checkpoint.
    assert latest(good.parent) == good.name
    assert not list(good.parent.glob(f"*-ba{NAN_BATCH}-*")), sorted(p.name for p in good.parent.iterdir())


@pytest.mark.multirank
def test_nan_loss_stops_every_rank_naming_the_batch_and_last_good_checkpoint(runs):
    folder = runs["nan_dir"]
    good = folder / f"ep0-ba{NAN_BATCH - 1}-rank0.pt"
    assert_stopped_at_nan_batch(runs["nan_first"], runs["tmp"] / "nan-first", good)
    assert sorted(runs["nan_checkpoints"]) == ["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt"]
    checkpoint = load(good)
    assert all(torch.isfinite(t).all() for t in checkpoint["state"]["model"].values())
    assert all(torch.isfinite(t).all() for t in ema_state(checkpoint)["shadow"].values())


@pytest.mark.multirank
def test_nan_after_autoresume_names_the_checkpoint_it_resumed_from(runs):
    folder, again = runs["nan_dir"], runs["nan_again"]
    good = folder / f"ep0-ba{NAN_BATCH - 1}-rank0.pt"
    assert_stopped_at_nan_batch(again, runs["tmp"] / "nan-again", good)
    # It resumed from the good checkpoint: it neither trained batch 1 again nor rewrote a checkpoint.
    assert "batch 1/5 " not in again.output(), again.tail()
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("ep*.pt")} == runs["nan_checkpoints"]


@pytest.mark.multirank
def test_slurm_script_launches_two_nodes_that_compute_what_one_node_does(runs):
    slurm = runs["slurm"]
    out = slurm.output()
    assert slurm.proc.returncode == 0, slurm.tail()
    assert "job 4242 (restart 0): 2 nodes x 1 GPUs, master 127.0.0.1:" in out, out[:2000]
    # The job ran the stand-in's fork of Composer's launcher: what the console script a user's job finds (this
    # environment's, scripts/slurm.sbatch's `composer`) runs.
    console_script = (Path(INTERPRETER_BIN) / "composer").read_text()
    assert "from composer.cli.launcher import main" in console_script and "main()" in console_script
    result = json.loads((runs["tmp"] / "slurm.json").read_text())
    assert result["world_size"] == 2 and result["use_ema"] and result["device_train_microbatch_size"] == 2
    folder = runs["tmp"] / "slurm" / SLURM_RUN_NAME  # SAVE_FOLDER/RUN_NAME, where a requeued job resumes from
    assert latest(folder) == "ep0-ba2-rank0.pt"
    ours, reference = load(folder / "ep0-ba2-rank0.pt"), load(runs["ref_dir"] / "ep0-ba2-rank0.pt")
    assert ours["state"]["run_name"] == SLURM_RUN_NAME
    assert_tensors_equal(reference["state"]["model"], ours["state"]["model"], "model weights")
    assert_tensors_equal(ema_state(reference)["shadow"], ema_state(ours)["shadow"], "EMA shadow")


# ------------------------------------------------------------------------------ at an epoch's end

# Real MDS data on two ranks, an epoch a subset of the data (--epoch_size: each epoch draws another 8 of the 16
# images), saved at each epoch's end: its own launches (the runs above are synthetic, saved by batches).
EPOCH_RUN = [*TINY_MODEL, "--num_workers", "0", "--epoch_size", "8", "--seed", "3", "--warmup_batches", "1",
             "--max_duration", "2ep", "--save_interval", "1ep"]
EPOCH_END, SECOND_EPOCH_END = "ep1-ba2-rank0.pt", "ep2-ba4-rank0.pt"


@pytest.fixture(scope="module")
def epoch_boundary(tmp_path_factory):
    """A two-epoch run, and a run resumed from its checkpoint at the end of epoch 0 (--load_path, copied as
    soon as it is written, while the first run goes on)."""
    tmp = tmp_path_factory.mktemp("epoch-boundary")
    images = write_images(tmp / "mds", 16)
    whole, resumed = tmp / "whole", tmp / "resumed"

    def launch(folder: Path, *extra: str) -> Launch:
        args = [*EPOCH_RUN, "--local", str(images), "--save_folder", str(folder), *extra]
        return Launch(two_ranks("benchmark.py", *args), tmp / f"{folder.name}.log")

    found: dict = {}

    def resume() -> Launch | None:
        if not (whole / EPOCH_END).exists():  # written whole under its name (checkpoints.write_whole)
            return None
        resumed.mkdir()
        shutil.copy(whole / EPOCH_END, resumed / "start.pt")
        found["resumed_run"] = launch(resumed, "--load_path", str(resumed / "start.pt"))
        return found["resumed_run"]

    first = launch(whole)
    supervise([first], resume)
    return dict(whole=whole, resumed=resumed, first=first, **found)


@pytest.mark.multirank
def test_a_resume_at_an_epochs_end_trains_the_next_epochs_order_bit_for_bit(epoch_boundary):
    # Composer saves its epoch checkpoint at sample 0 of the next epoch; Streaming 0.13 recorded the finished epoch
    # there, and the resumed run trained epoch 0's 8 images again in place of epoch 1's (streaming.ResumesAfterItsEpoch).
    first, again_run = epoch_boundary["first"], epoch_boundary["resumed_run"]
    assert first.proc.returncode == 0, first.tail()
    assert again_run.proc.returncode == 0, again_run.tail()
    start = load(epoch_boundary["whole"] / EPOCH_END)["state"]
    assert start["timestamp"]["Timestamp"]["epoch"] == 1 and start["dataset_state"]["train"]["epoch"] == 1
    assert start["dataset_state"]["train"]["sample_in_epoch"] == 0
    whole, again = load(epoch_boundary["whole"] / SECOND_EPOCH_END), load(epoch_boundary["resumed"] / SECOND_EPOCH_END)
    assert_tensors_equal(whole["state"]["model"], again["state"]["model"], "model weights")
    for key, state in whole["state"]["optimizers"]["AdamW"]["state"].items():
        assert_tensors_equal(state, again["state"]["optimizers"]["AdamW"]["state"][key], f"AdamW state {key}")
    assert whole["state"]["dataset_state"] == again["state"]["dataset_state"]
    assert whole["state"]["dataset_state"]["train"]["epoch"] == 2


# ------------------------------------------------------------------------------------ mcloud.yaml

README_COMMAND = "composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4"


@pytest.mark.parametrize("name, gpus", [("mcloud.yaml", 8), ("scripts/mcloud-multinode.yaml", 16)])
def test_mcloud_yaml_loads_with_mosaicml_cli(name, gpus):
    from mcli.models.run_config import FinalRunConfig, RunConfig

    path = ROOT / name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unknown or deprecated keys are warnings in mcli: fail on them
        config = RunConfig.from_file(path)
    # What `mcli run -f` does before it sends the run: finalize (name and image checks), then build
    # the API payload (integration and compute translation).
    final = FinalRunConfig.finalize_config(config)
    payload = final.to_create_run_api_input()["runInput"]
    assert final.name == config.name  # a valid RFC 1123 name, not silently rewritten
    assert payload["image"].startswith("mosaicml/pytorch:2.7.0_cu128")
    assert payload["compute"]["gpus"] == gpus and payload["compute"]["gpuType"]
    repos = [i for i in payload["integrations"] if i["type"] == "git_repo"]
    assert len(repos) == 1 and repos[0]["params"]["gitRepo"].count("/") == 1
    command = " ".join(payload["command"].split())
    assert "pip install -r requirements.txt" in command
    assert README_COMMAND in command
    assert "--autoresume" in command and "--save_folder" in command and "--run_name" in command
    # The command runs in the directory the integration clones into.
    assert f"cd {repos[0]['params']['path']}" in command

    # Run the command's shell text with stand-ins for cd, pip and composer: the exact arguments the
    # launcher would get, which benchmark.py must accept for this many GPUs.
    stand_ins = 'cd() { :; }; pip() { :; }; composer() { printf "%s\\0" "$@"; }\n'
    env = {**os.environ, **final.env_variables, "RUN_NAME": "sd2-benchmark-a1b2c3"}
    shell = subprocess.run(["bash", "-c", stand_ins + payload["command"]], env=env, capture_output=True, text=True)
    assert shell.returncode == 0, shell.stderr
    argv = shell.stdout.split("\0")[:-1]
    assert argv[0] == "benchmark.py", argv
    import benchmark

    args = benchmark.validate(benchmark.parse_args(argv[1:]), world_size=gpus)  # the run's settings
    assert args.use_ema and args.use_synth_data and args.device_train_microbatch_size == 4
    assert args.autoresume and args.run_name == "sd2-benchmark-a1b2c3"
    assert args.save_folder == final.env_variables["SAVE_FOLDER"] + "/sd2-benchmark-a1b2c3"
