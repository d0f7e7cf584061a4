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

A second fixture runs Flux.1's GPU default, --fsdp shard_grad_op with --activation_checkpointing,
under amp_bf16 next to DDP with checkpointing; one more test applies FSDP2 with a GPU's mixed
precision (bf16 weights, inputs cast to bf16) to the tiny Flux denoiser on one gloo rank, in process.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from t2ibench.families.flux import FLUX1_TINY
from t2ibench.train.parallel import enable_block_checkpointing
from tests.helpers import (TINY_RANKS, Launch, assert_tensors_equal, ema_state, free_port, kill_at, load, supervise,
                           two_ranks)

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


# Flux.1 with its blocks checkpointed under amp_bf16, 3 batches of 4 at 32 px (each block an FSDP unit).
CHECKPOINTED = ["--model_config", "flux1-tiny", "--use_synth_data", "--precomputed", "--batch_size", "4",
                "--image_size", "32", "--num_workers", "0", "--max_duration", "3ba", "--warmup_batches", "1",
                "--precision", "amp_bf16", "--seed", "3", "--activation_checkpointing"]


@pytest.fixture(scope="module")
def checkpointed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-checkpointing")
    launches = {name: Launch(two_ranks("tests/fault_run.py", "--report", str(tmp / f"{name}-report"),
                                       *CHECKPOINTED, *extra), tmp / f"{name}.log")
                for name, extra in (("ddp", []), ("shard_grad_op", ["--fsdp", "shard_grad_op"]))}
    supervise(list(launches.values()))
    return tmp, launches


@pytest.mark.multirank
def test_checkpointed_flux_blocks_train_under_fsdp_and_amp_bf16_as_under_ddp(checkpointed_runs):
    # FSDP2's pre-forward hook casts a unit's inputs in the forward but not in checkpointing's
    # recomputation: with diffusers' own checkpointing function this run stopped in its first backward.
    tmp, launches = checkpointed_runs
    for launch in launches.values():
        assert launch.proc.returncode == 0, launch.tail()
    ddp, sharded = ({int(b): loss for b, loss in json.loads((tmp / f"{name}-report" / "rank0.json").read_text())
                     ["losses"].items()} for name in launches)
    assert sorted(ddp) == sorted(sharded) == [1, 2, 3]
    assert all(np.isfinite(loss) for loss in sharded.values()), sharded
    for batch in ddp:
        assert sharded[batch] == pytest.approx(ddp[batch], rel=LOSS_RTOL), (batch, sharded, ddp)


@pytest.fixture
def one_gloo_rank(monkeypatch):
    """A default process group of one gloo rank for this test (or the one this process already has)."""
    if torch.distributed.is_initialized():
        yield
        return
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def flux_step_under_gpu_mixed_precision(checkpointing: str) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward of the tiny Flux denoiser with each block and the whole a `fully_shard`
    unit under the policy Composer builds for amp_bf16 on a GPU (weights gathered and inputs cast to bf16,
    gradients reduced in fp32), in bf16 autocast: the loss and the gradients. On a CPU Composer is told
    fp32 (it refuses AMP there), so benchmark.py's CPU runs cast to fp32 instead; this is the GPU's cast.
    `checkpointing`: "off", "diffusers" (its own function) or "project" (benchmark.py's)."""
    from diffusers import FluxTransformer2DModel
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    denoiser = FluxTransformer2DModel(**FLUX1_TINY["transformer"])
    if checkpointing == "diffusers":
        denoiser.enable_gradient_checkpointing()
    elif checkpointing == "project":
        enable_block_checkpointing(denoiser)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks, denoiser]:
        fully_shard(block, mp_policy=policy)
    generator = torch.Generator().manual_seed(1)
    image_ids = torch.stack([torch.zeros(16), torch.arange(16.0) // 4, torch.arange(16.0) % 4], dim=1)  # 4x4 tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = denoiser(hidden_states=torch.randn(2, 16, 64, generator=generator),
                       encoder_hidden_states=torch.randn(2, 8, 64, generator=generator),
                       pooled_projections=torch.randn(2, 64, generator=generator), timestep=torch.tensor([0.3, 0.7]),
                       img_ids=image_ids, txt_ids=torch.zeros(8, 3), return_dict=False)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.item(), [p.grad.full_tensor() for p in denoiser.parameters()]


def test_checkpointing_recomputes_fsdp_units_with_the_inputs_cast_as_on_a_gpu(one_gloo_rank):
    # Flux.1's rotary embedding is fp32: torch 2.7's FSDP2 casts it to bf16 for a block's forward but, in
    # backward's recomputation, hands it on uncast, and diffusers' function then fails checkpoint's dtype
    # check (newer torch, 2.14 in CI, casts in the recomputation too). The project's function must run on
    # what the forward ran on with either torch: the same numbers as no checkpointing, to the bit.
    reference_loss, reference_grads = flux_step_under_gpu_mixed_precision("off")
    loss, grads = flux_step_under_gpu_mixed_precision("project")
    assert loss == reference_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads))
    try:
        diffusers_loss, diffusers_grads = flux_step_under_gpu_mixed_precision("diffusers")
    except torch.utils.checkpoint.CheckpointError as error:
        assert "dtype" in str(error)  # the failure the project's function exists for, and no other
    else:  # a torch that casts in the recomputation: diffusers' function is then right as well
        assert diffusers_loss == reference_loss
        assert all(torch.equal(a, b) for a, b in zip(diffusers_grads, reference_grads))
