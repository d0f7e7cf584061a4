"""`benchmark.py --fsdp`: Composer's FSDP2 on two CPU ranks (gloo), against DDP and across a kill -9.

One module fixture starts, side by side, through Composer's launcher and tests/fault_run.py (which
records every batch's loss at full precision and each rank's EMA bytes):

* `ddp`: the tiny model under DDP (no --fsdp) for 4 batches, sampling one prompt every 2 batches;
* `reference`: --fsdp full_shard for 6 batches, EMA on, checkpoints at 4 and 6, the same sampling
  (one prompt on two ranks: rank 1 has none of its own), --ema_export_dir;
* `killed`: --fsdp shard_grad_op with the same flags but no sampling, SIGKILLed (launcher and ranks)
  once its checkpoint at batch 4 is the latest; then `resumed`, the same command with --autoresume.

So one comparison covers three claims: the resumed run's last checkpoint (UNet, EMA, AdamW, RNG)
and EMA export equal the reference's bit for bit, which holds only if resuming is exact, if
shard_grad_op computes what full_shard computes (the same gathers and reductions, kept longer), and
if sampling between steps leaves training untouched (FSDP2 keeps gathered weights after a forward
that no backward follows; sample.py frees them, or the next step would train on the EMA's weights).
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY_RANKS, Launch, assert_tensors_equal, ema_state, kill_at, load, supervise, two_ranks

# Sampling at batch 2 is followed by training, not by a checkpoint: a checkpoint's state_dict call
# would reshard FSDP2's gathered weights itself and hide a sampler that leaves them gathered.
SAMPLING = ["--sample_interval", "2ba", "--sample_steps", "2"]  # + --sample_prompts FILE (one prompt)
# An epoch is 3 batches: the kill comes mid-epoch. Few saves: each gathers every tensor of the model,
# AdamW and the EMA over gloo, seconds on this machine.
RUN = TINY_RANKS + ["--max_duration", "6ba", "--save_interval", "4ba", "--run_name", "fsdp-test"]
KILL_AFTER = "ep1-ba4-rank0.pt"
FINAL = "ep1-ba6-rank0.pt"  # batch 6 ends epoch 2, but the batch checkpoint comes first
# Relative loss difference allowed between FSDP and DDP after the first step. Both compute the same
# gradients but sum them in another order (DDP all-reduces buckets, FSDP2 reduce-scatters per
# block), so they differ in the last bits; AdamW's normalized step turns that into weight differences
# up to ~lr (1e-4) where a gradient is near zero. Measured: 1e-5 in weights, 1e-7 in loss after 6
# steps. 1e-4 keeps a 1000x margin and still fails a rank that trains on its own gradients or weights.
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    prompts = tmp / "prompts.txt"
    prompts.write_text("a red square\n")
    ref_dir, killed_dir = tmp / "reference", tmp / "killed"

    def fault_run(name: str, *args: str) -> Launch:
        return Launch(two_ranks("tests/fault_run.py", "--report", str(tmp / f"{name}-report"), *args), tmp / f"{name}.log")

    def sharded_run(name: str, folder: Path, *extra: str) -> Launch:
        return fault_run(name, *RUN, "--fsdp", "shard_grad_op", "--save_folder", str(folder), "--autoresume",
                      "--ema_export_dir", str(tmp / f"{name}-export"), *extra)

    ddp = fault_run("ddp", *TINY_RANKS, "--max_duration", "4ba", *SAMPLING, "--sample_prompts", str(prompts),
                    "--samples_dir", str(tmp / "ddp-samples"), "--save_folder", str(tmp / "ddp"), "--save_interval", "4ba")
    reference = fault_run("reference", *RUN, "--fsdp", "full_shard", "--save_folder", str(ref_dir),
                       "--ema_export_dir", str(tmp / "reference-export"), *SAMPLING, "--sample_prompts", str(prompts),
                       "--results_json", str(tmp / "reference.json"))
    killed = sharded_run("killed", killed_dir)
    found: dict = {}

    def resume() -> Launch:
        found["killed_at"] = sorted(p.name for p in killed_dir.iterdir())
        found["resumed"] = sharded_run("resumed", killed_dir, "--results_json", str(tmp / "resumed.json"))
        return found["resumed"]

    supervise([ddp, reference, killed], kill_at(killed, killed_dir, KILL_AFTER, resume))
    return dict(tmp=tmp, ddp=ddp, reference=reference, killed=killed, ref_dir=ref_dir, killed_dir=killed_dir,
                **found)


def report(runs: dict, name: str, rank: int = 0) -> dict:
    return json.loads((runs["tmp"] / f"{name}-report" / f"rank{rank}.json").read_text())


def losses(runs: dict, name: str) -> dict[int, float]:
    return {int(batch): loss for batch, loss in report(runs, name)["losses"].items()}


@pytest.mark.multirank
def test_full_shard_and_shard_grad_op_train_as_ddp_does(runs):
    for name in ("ddp", "reference"):
        assert runs[name].proc.returncode == 0, runs[name].tail()
    ddp = losses(runs, "ddp")
    assert sorted(ddp) == [1, 2, 3, 4]
    for name in ("reference", "killed"):  # full_shard, shard_grad_op
        sharded = losses(runs, name)
        assert set(ddp) <= set(sharded), (name, sharded)
        # Before the first step every rank holds the same weights whole (DDP) or gathers them from
        # the shards (FSDP): the same numbers, so the same loss to the bit.
        assert sharded[1] == ddp[1], (name, sharded, ddp)
        for batch in (2, 3, 4):
            assert sharded[batch] == pytest.approx(ddp[batch], rel=LOSS_RTOL), (name, batch, sharded, ddp)
    result = json.loads((runs["tmp"] / "reference.json").read_text())
    assert result["fsdp"] == "full_shard" and result["world_size"] == 2

    # The gradient norm each rank reads (grad_norm) is the whole gradient's: the same on both ranks,
    # and DDP's (a rank's own shard would give about 1/sqrt(2) of it, different on each rank).
    ddp_norms = [report(runs, "ddp", rank)["grad_norms"] for rank in (0, 1)]
    assert ddp_norms[0] == ddp_norms[1] and sorted(ddp_norms[0]) == ["1", "2", "3", "4"]
    for name in ("reference", "killed"):
        norms = [report(runs, name, rank)["grad_norms"] for rank in (0, 1)]
        assert norms[0] == norms[1], (name, norms)
        for batch in ("1", "2", "3", "4"):
            assert norms[0][batch] == pytest.approx(ddp_norms[0][batch], rel=LOSS_RTOL), (name, batch, norms, ddp_norms)
    assert result["grad_norm"] == report(runs, "reference")["grad_norms"]["6"]

    # The gradients themselves, through AdamW's moments after 4 steps: averaged over the ranks as DDP
    # averages them (AdamW's step hardly changes if they are summed instead: the loss cannot tell).
    # Sums over the whole UNet, so that tensors whose gradients are rounding noise (self-attention
    # over the 1x1 latents of the deepest blocks) do not decide.
    ddp_moments = load(runs["tmp"] / "ddp" / KILL_AFTER)["state"]["optimizers"]["AdamW"]["state"]
    for folder in (runs["ref_dir"], runs["killed_dir"]):
        moments = load(folder / KILL_AFTER)["state"]["optimizers"]["AdamW"]["state"]
        assert moments.keys() == ddp_moments.keys()
        for name in ("exp_avg", "exp_avg_sq"):
            ours, ddp_sum = (sum(float(m[k][name].abs().sum()) for k in m) for m in (moments, ddp_moments))
            assert ours == pytest.approx(ddp_sum, rel=1e-3), (folder.name, name, ours / ddp_sum)


@pytest.mark.multirank
def test_ema_keeps_only_this_ranks_shard(runs):
    assert runs["reference"].proc.returncode == 0, runs["reference"].tail()
    shards = [report(runs, "reference", rank)["ema_shadow_bytes"] for rank in (0, 1)]
    unet = [v for k, v in load(runs["ref_dir"] / FINAL)["state"]["model"].items() if k.startswith("unet.")]
    whole = 4 * sum(v.numel() for v in unet)  # fp32
    assert sum(shards) == whole and max(shards) < 0.6 * whole, (shards, whole)
    ddp = report(runs, "ddp")["ema_shadow_bytes"]
    assert ddp == whole


@pytest.mark.multirank
def test_killed_fsdp_run_resumes_to_the_uninterrupted_runs_weights_ema_and_export(runs):
    reference, killed, resumed = runs["reference"], runs["killed"], runs["resumed"]
    assert reference.proc.returncode == 0, reference.tail()
    assert killed.proc.returncode == -signal.SIGKILL
    assert FINAL not in runs["killed_at"], f"killed too late: {runs['killed_at']}"
    assert resumed.proc.returncode == 0, resumed.tail()
    assert sorted(losses(runs, "resumed")) == [5, 6], "it resumed from batch 4, not from the start"

    ref, res = load(runs["ref_dir"] / FINAL), load(runs["killed_dir"] / FINAL)
    model = ref["state"]["model"]
    assert_tensors_equal(model, res["state"]["model"], "model weights")
    ema_ref, ema_res = ema_state(ref), ema_state(res)
    assert ema_ref["num_updates"] == ema_res["num_updates"] == 5  # copied at batch 1, averaged at 2..6
    assert_tensors_equal(ema_ref["shadow"], ema_res["shadow"], "EMA shadow")
    # The checkpoint holds whole tensors (gathered at save), named and shaped as the model's.
    unet = {k: v for k, v in model.items() if k.startswith("unet.")}
    assert {k: v.shape for k, v in ema_ref["shadow"].items()} == {k: v.shape for k, v in unet.items()}
    assert not all(torch.equal(ema_ref["shadow"][k], v) for k, v in unet.items())  # an average, not the weights
    opt_ref, opt_res = ref["state"]["optimizers"]["AdamW"]["state"], res["state"]["optimizers"]["AdamW"]["state"]
    assert opt_ref.keys() == opt_res.keys() and len(opt_ref) == len(unet)
    for key in opt_ref:
        assert_tensors_equal(opt_ref[key], opt_res[key], f"AdamW state {key}")
    for rank in range(2):
        assert torch.equal(ref["rng"][rank]["torch"], res["rng"][rank]["torch"]), f"torch RNG of rank {rank}"
    for batch in (5, 6):
        assert losses(runs, "resumed")[batch] == losses(runs, "reference")[batch], batch

    # --ema_export_dir gathered the average once, at the end: the checkpoint's shadow, in a pipeline.
    from diffusers import UNet2DConditionModel
    exported = {name: UNet2DConditionModel.from_pretrained(runs["tmp"] / f"{name}-export" / "unet")
                for name in ("reference", "resumed")}
    for name, unet_model in exported.items():
        weights = {"unet." + k: v for k, v in unet_model.state_dict().items()}
        assert_tensors_equal(ema_ref["shadow"], weights, f"{name}'s exported EMA UNet")
    assert (runs["tmp"] / "reference-export" / "model_index.json").is_file()


@pytest.mark.multirank
def test_export_reads_an_fsdp_checkpoint(runs, tmp_path):
    import export
    from diffusers import UNet2DConditionModel

    checkpoint = load(runs["ref_dir"] / FINAL)
    for ema, expected in ((True, ema_state(checkpoint)["shadow"]), (False, checkpoint["state"]["model"])):
        out = export.main([str(runs["ref_dir"] / FINAL), "--out", str(tmp_path / f"ema-{ema}")] + ["--ema"] * ema)
        unet = UNet2DConditionModel.from_pretrained(out / "unet")
        for k, v in unet.state_dict().items():
            assert torch.equal(v, expected["unet." + k]), (ema, k)


@pytest.mark.multirank
def test_samples_under_fsdp_are_drawn_from_the_whole_weights(runs):
    assert runs["reference"].proc.returncode == 0, runs["reference"].tail()
    grids = runs["ref_dir"] / "samples"
    assert sorted(p.name for p in grids.glob("*.png")) == ["2.png", "4.png", "6.png"]
    # The same prompt, seed and (to within LOSS_RTOL's weight differences) EMA weights as under DDP:
    # the same image, to a level or two of 255. Weights gathered wrongly, or the training weights
    # in place of the average, would draw another image.
    for batch in (2, 4):
        fsdp = np.asarray(Image.open(grids / f"{batch}.png"), dtype=np.int16)
        ddp = np.asarray(Image.open(runs["tmp"] / "ddp-samples" / f"{batch}.png"), dtype=np.int16)
        assert fsdp.shape == ddp.shape == (32, 32, 3)
        assert np.abs(fsdp - ddp).max() <= 2, (batch, np.abs(fsdp - ddp).max())


def test_fsdp_on_one_rank_or_with_channels_last_is_refused_in_one_line():
    import benchmark

    with pytest.raises(SystemExit) as stop:
        benchmark.main(TINY_RANKS + ["--max_duration", "1ba", "--fsdp", "full_shard"])  # this process: one rank
    message = str(stop.value)
    assert message.startswith("benchmark.py: error: --fsdp full_shard shards") and "\n" not in message, message
    args = benchmark.parse_args(TINY_RANKS + ["--fsdp", "shard_grad_op", "--channels_last"])
    with pytest.raises(SystemExit) as stop:
        benchmark.validate(args, world_size=2)
    message = str(stop.value)
    assert message.startswith("benchmark.py: error: --channels_last with --fsdp shard_grad_op") and "\n" not in message
    benchmark.validate(benchmark.parse_args(TINY_RANKS + ["--fsdp", "shard_grad_op"]), world_size=2)  # accepted
