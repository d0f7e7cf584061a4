"""ema.py: closed-form EMA through Composer's Trainer, parity with composer.algorithms.EMA,
frozen parameters not copied, bit-exact checkpoint resume, export, weight swap, and 2 ranks
(DDP through Composer's Trainer; FSDP1 shards driven directly).

This file is also the training script of the 2-rank tests: `composer -n 2 tests/test_ema.py
--dist-worker OUT` runs `_ddp_worker` then `_fsdp_worker` on each rank (gloo, CPU).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from composer import Trainer
from composer.core import Callback
from composer.models import ComposerModel
from composer.utils import dist
from torch.utils.data import DataLoader, TensorDataset

import ema as ema_module
from ema import EMA
from tests import preloaded
from tests.helpers import composer_launcher, rank_env

EPS32 = 2.0 ** -24  # unit roundoff of fp32
BATCHES_PER_EPOCH = 8


class Tiny(ComposerModel):
    """A trainable Linear, a frozen Linear and a buffer: what EMA must and must not copy."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(4, 3).to(dtype)
        self.frozen = torch.nn.Linear(3, 2).to(dtype).requires_grad_(False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, batch):
        x, _ = batch
        return self.frozen(self.body(x.to(self.body.weight.dtype)))

    def loss(self, outputs, batch):
        return F.mse_loss(outputs.float(), batch[1])


def loader(batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(batch_size * BATCHES_PER_EPOCH, 4, generator=g),
                         torch.randn(batch_size * BATCHES_PER_EPOCH, 2, generator=g))
    return DataLoader(data, batch_size=batch_size, sampler=dist.get_sampler(data, shuffle=False))


class Recorder(Callback):
    """Trainable parameters after every optimizer step (batch n -> snapshots[n - 1])."""

    def __init__(self):
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def batch_end(self, state, logger):
        model = state.model.module if hasattr(state.model, "module") else state.model
        self.snapshots.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def make_trainer(algorithms, max_duration="12ba", callbacks=(), seed=0, **kwargs) -> Trainer:
    model = Tiny(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    return Trainer(model=model, train_dataloader=loader(), max_duration=max_duration, optimizers=opt,
                   algorithms=algorithms, callbacks=list(callbacks), device="cpu", progress_bar=False,
                   log_to_console=False, loggers=[], seed=seed, **kwargs)


def closed_form(snapshots, smoothing: float, start: int, interval: int, every: int = 1):
    """Float64 EMA of the recorded parameters: copy at the first event n >= start, then
    E = s E + (1 - s) theta_n at events with n % interval == 0. Events are every `every` batches
    (1 for batch units, BATCHES_PER_EPOCH for epochs); n counts events. Returns (EMA, #updates)."""
    average, updates = None, 0
    for i in range(every - 1, len(snapshots), every):
        n = (i + 1) // every
        theta = {k: v.double() for k, v in snapshots[i].items()}
        if average is None:
            if n >= start:
                average = theta
        elif n % interval == 0:
            average = {k: smoothing * average[k] + (1 - smoothing) * theta[k] for k in average}
            updates += 1
    return average, updates


def assert_close_fp32(shadow, expected, updates: int):
    """fp32 tolerance: each lerp rounds at most ~3 times (difference, product, sum), each error
    <= EPS32 * M with M the largest magnitude involved, and earlier errors are only damped
    (multiplied by s < 1). So |fp32 - exact| <= 4 * EPS32 * M * (updates + 1): the +1 is the
    initial copy, exact here but kept for safety."""
    assert shadow.keys() == expected.keys()
    m = max(max(v.abs().max().item() for v in expected.values()), 1.0)
    atol = 4 * EPS32 * m * (updates + 1)
    for k in expected:
        assert shadow[k].dtype == torch.float32
        err = (shadow[k].double() - expected[k]).abs().max().item()
        assert err <= atol, (k, err, atol)


# --------------------------------------------------------------------------------- options


@pytest.mark.parametrize("kwargs, option", [
    (dict(half_life="abc"), "half_life"),
    (dict(half_life="0ba"), "half_life"),
    (dict(half_life="10sp"), "half_life"),
    (dict(half_life="2ep"), "half_life"),  # unit differs from update_interval '1ba'
    (dict(half_life=None), "half_life"),
    (dict(smoothing=1.0), "smoothing"),
    (dict(smoothing=-0.1), "smoothing"),
    (dict(smoothing=0.9, half_life="10ba"), "smoothing"),
    (dict(update_interval="0ba"), "update_interval"),
    (dict(update_interval="1.5ba"), "update_interval"),
    (dict(update_interval="3dur"), "update_interval"),
    (dict(ema_start="-1ba"), "ema_start"),
    (dict(ema_start="2dur"), "ema_start"),
    (dict(ema_start=5), "ema_start"),
])
def test_invalid_options_raise_one_line_value_error(kwargs, option):
    with pytest.raises(ValueError, match=f"EMA {option}") as info:
        EMA(**kwargs)
    assert "\n" not in str(info.value)


def test_smoothing_from_half_life():
    assert EMA(half_life="10ba", update_interval="5ba").smoothing == 2 ** -0.5
    assert EMA(smoothing=0.9).smoothing == 0.9
    assert EMA(half_life="3ep", update_interval="1ep").smoothing == 2 ** (-1 / 3)


# ------------------------------------------------------------------------- closed form, Trainer


@pytest.mark.parametrize("options, start, interval, every, duration", [
    (dict(half_life="3ba", update_interval="2ba", ema_start="3ba"), 3, 2, 1, "12ba"),
    (dict(smoothing=0.6, half_life=None, ema_start="0ba"), 0, 1, 1, "12ba"),
    (dict(half_life="2ep", update_interval="1ep", ema_start="1ep"), 1, 1, BATCHES_PER_EPOCH, "4ep"),
])
def test_matches_closed_form_through_trainer(options, start, interval, every, duration):
    algo, rec = EMA(**options), Recorder()
    make_trainer([algo], max_duration=duration, callbacks=[rec]).fit()
    expected, updates = closed_form(rec.snapshots, algo.smoothing, start, interval, every)
    assert algo.initialized and algo.num_updates == updates > 0
    assert_close_fp32(algo.shadow, expected, updates)


def test_ema_start_in_duration_units():
    algo, rec = EMA(half_life="2ba", ema_start="0.5dur"), Recorder()
    make_trainer([algo], max_duration="12ba", callbacks=[rec]).fit()
    expected, updates = closed_form(rec.snapshots, algo.smoothing, 6, 1)  # 0.5 * 12 batches
    assert algo.num_updates == updates == 6
    assert_close_fp32(algo.shadow, expected, updates)


def test_bf16_parameters_average_in_fp32(monkeypatch):
    """Non-fp32 parameters: fp32 shadow, cast path (chunked: force tiny chunks), closed form."""
    monkeypatch.setattr(ema_module, "_CAST_CHUNK_NUMEL", 5)  # body.weight (12) and bias (3) in separate chunks
    model = Tiny(dtype=torch.bfloat16)
    algo = EMA(smoothing=0.75, half_life=None)
    snapshots = []
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        with torch.no_grad():
            for p in model.body.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        snapshots.append({f"body.{n}": p.detach().clone() for n, p in model.body.named_parameters()})
        algo.update(model)
    assert len(algo._groups) == 2 and all(cast for _, _, cast in algo._groups)
    expected, updates = closed_form(snapshots, 0.75, 0, 1)
    assert_close_fp32(algo.shadow, expected, updates)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with algo.averaged_weights(model):
        assert torch.equal(model.body.weight, algo.shadow["body.weight"].to(torch.bfloat16))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


# ------------------------------------------------------------- what is copied, memory, parity


def _tiny_sd():
    from t2ibench.families import MODEL_CONFIGS
    from t2ibench.train.model import DiffusionModel
    family = MODEL_CONFIGS["tiny"]
    torch.manual_seed(0)
    return DiffusionModel(family, family.build("tiny", tokenizers=False))


def test_only_trainable_parameters_are_copied():
    sd = _tiny_sd()
    algo = EMA()
    algo.update(sd)
    trainable = {n: p for n, p in sd.named_parameters() if p.requires_grad}
    assert set(algo.shadow) == set(trainable) and all(n.startswith("unet.") for n in algo.shadow)
    assert algo.shadow_nbytes == 4 * sum(p.numel() for p in trainable.values())
    assert not any(n in algo.shadow for n, _ in sd.named_buffers())
    assert all(t.dtype == torch.float32 and t.device == trainable[n].device for n, t in algo.shadow.items())
    # one fused group: every trainable tensor goes through a single _foreach_lerp_ per update
    assert len(algo._groups) == 1 and len(algo._groups[0][0]) == len(trainable)


def test_update_is_one_foreach_lerp(monkeypatch):
    model = Tiny()
    algo = EMA(smoothing=0.5, half_life=None)
    algo.update(model)
    calls = []
    real = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a: calls.append(len(a[0])) or real(*a))
    for _ in range(3):
        algo.update(model)
    assert calls == [2, 2, 2]  # body.weight and body.bias together, once per update


def test_matches_composer_ema():
    """Same parameter sequence (both algorithms in one run), same half_life/start/interval."""
    from composer.algorithms import EMA as ComposerEMA
    options = dict(half_life="6ba", update_interval="2ba", ema_start="3ba")
    ours, theirs = EMA(**options), ComposerEMA(**options)
    make_trainer([ours, theirs], max_duration="16ba").fit()
    reference = theirs.ema_model.named_parameters_dict
    assert set(ours.shadow) == set(reference) == {"body.weight", "body.bias"}
    # Composer computes s*E + (1-s)*p, we compute lerp: equal up to fp32 rounding of both.
    assert_close_fp32(ours.shadow, {k: v.double() for k, v in reference.items()}, 2 * ours.num_updates)
    assert ours.num_updates == 7  # batches 4, 6, ..., 14, 16 after the copy at batch 3


# --------------------------------------------------------------------------------- checkpoints


def test_checkpoint_resume_is_bit_exact(tmp_path):
    options = dict(half_life="3ba", update_interval="2ba", ema_start="1ba")
    full = EMA(**options)
    reference = make_trainer([full], max_duration="8ba")
    reference.fit()
    trained = {n: p.detach().clone() for n, p in reference.state.model.named_parameters()}

    # Interrupted run: checkpoints every 2 batches, stops after 4 of 8.
    first = make_trainer([EMA(**options)], max_duration="8ba", save_folder=str(tmp_path / "ckpt"),
                         save_interval="2ba", run_name="ema-resume")
    first.fit(duration="4ba")
    first.close()
    assert (tmp_path / "ckpt" / "ep0-ba4-rank0.pt").exists()

    for how, kwargs in {
        "load_path": dict(load_path=str(tmp_path / "ckpt" / "ep0-ba4-rank0.pt")),
        "autoresume": dict(autoresume=True, save_folder=str(tmp_path / "ckpt"), run_name="ema-resume",
                           save_interval="100ba"),
    }.items():
        algo = EMA(**options)
        trainer = make_trainer([algo], max_duration="8ba", seed=123, **kwargs)  # other init: all must load
        trainer.fit()
        assert trainer.state.timestamp.batch.value == 8, how
        for n, p in trainer.state.model.named_parameters():
            assert torch.equal(p, trained[n]), (how, n)  # training itself resumed exactly
        assert algo.num_updates == full.num_updates and algo.initialized, how
        for n in full.shadow:
            assert torch.equal(algo.shadow[n], full.shadow[n]), (how, n)
        trainer.close()


def test_state_dict_round_trip_and_foreign_state():
    src = EMA(smoothing=0.5, half_life=None)
    model = Tiny()
    src.update(model)
    with torch.no_grad():
        model.body.weight.add_(1.0)
    src.update(model)
    sd = src.state_dict()
    assert sd["format"] and sd["initialized"] and sd["num_updates"] == 1 and "repr" in sd
    dst = EMA(smoothing=0.5, half_life=None)
    dst.load_state_dict({k: ({n: t.clone() for n, t in v.items()} if k == "shadow" else v) for k, v in sd.items()})
    dst.update(model)  # binds, then continues averaging
    src.update(model)
    for n in src.shadow:
        assert torch.equal(src.shadow[n], dst.shadow[n])
    with pytest.raises(ValueError, match="composer.algorithms.EMA"):
        EMA().load_state_dict({"repr": "EMA()", "ema_model": {}, "ema_started": True})


# ------------------------------------------------------------------------ export and swapping


def test_export_loads_with_from_pretrained_and_swap_restores(tmp_path):
    from diffusers import UNet2DConditionModel
    sd = _tiny_sd()
    algo = EMA(smoothing=0.5, half_life=None)
    algo.update(sd)
    with torch.no_grad():
        for p in sd.unet.parameters():
            p.mul_(1.5).add_(0.01)
    algo.update(sd)  # the shadow now differs from the parameters
    training = {n: p.detach().clone() for n, p in sd.named_parameters()}

    algo.export_denoiser(sd, tmp_path / "ema_unet")
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "ema_unet")
    for n, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, algo.shadow["unet." + n]), n
    for n, p in sd.named_parameters():
        assert torch.equal(p, training[n]), n  # exporting does not touch the model

    shadow_before = {n: t.clone() for n, t in algo.shadow.items()}
    with algo.averaged_weights(sd):
        for n, p in sd.named_parameters():
            expected = shadow_before.get(n, training[n])  # frozen VAE/text encoder untouched
            assert torch.equal(p, expected), n
        with pytest.raises(RuntimeError):
            algo.state_dict()
    for n, p in sd.named_parameters():
        assert torch.equal(p, training[n]), n
    for n, t in algo.shadow.items():
        assert torch.equal(t, shadow_before[n]), n


def test_export_dir_option_writes_at_fit_end(tmp_path):
    from diffusers import UNet2DConditionModel

    class TinySD(ComposerModel):  # a trainable `unet` attribute, as in t2ibench.train.model.DiffusionModel
        def __init__(self):
            super().__init__()
            self.unet = _tiny_sd().unet

        def forward(self, batch):
            x, _ = batch
            sample = x[:, :4, None, None].expand(-1, 4, 8, 8).contiguous()
            return self.unet(sample, torch.zeros(x.shape[0]), torch.zeros(x.shape[0], 1, 64)).sample

        def loss(self, outputs, batch):
            return outputs.pow(2).mean()

    model = TinySD()
    algo = EMA(half_life="2ba", export_dir=str(tmp_path / "export"))
    Trainer(model=model, train_dataloader=loader(), max_duration="2ba", algorithms=[algo],
            optimizers=torch.optim.SGD(model.parameters(), lr=0.01), device="cpu", progress_bar=False,
            log_to_console=False, loggers=[]).fit()
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "export")
    for n, p in loaded.named_parameters():
        assert torch.equal(p, algo.shadow["unet." + n]), n


# --------------------------------------------------------------------------- 2 ranks: DDP, FSDP
# One launch of `composer -n 2 tests/test_ema.py --dist-worker OUT` (gloo on CPU) runs both parts:
# DDP through Composer's Trainer, and FSDP1 (torch's, on CPU: Composer's FSDP wrapping needs CUDA)
# driven directly, with the parameters moved by a deterministic step instead of an optimizer.


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    env = rank_env()
    cmd = [*composer_launcher(2), "--stdout", str(out / "rank{rank}.out"), "--stderr", str(out / "rank{rank}.err"),
           str(Path(__file__).resolve()), "--dist-worker", str(out)]
    proc = preloaded.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text() for p in out.glob("rank*.err"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-3000:]
    return out


@pytest.mark.multirank
def test_two_rank_ddp_ranks_hold_the_same_ema(two_ranks):
    results = [torch.load(two_ranks / f"ddp_rank{r}.pt") for r in range(2)]
    assert results[0]["world_size"] == results[1]["world_size"] == 2
    shadows = [r["shadow"] for r in results]
    assert set(shadows[0]) == {"body.weight", "body.bias"}  # no DDP 'module.' prefix
    for n in shadows[0]:
        assert torch.equal(shadows[0][n], shadows[1][n]), n
        assert torch.equal(results[0]["params"][n], results[1]["params"][n]), n
    expected, updates = closed_form(results[0]["snapshots"], results[0]["smoothing"], 0, 1)
    assert updates == 7
    assert_close_fp32(shadows[0], expected, updates)


@pytest.mark.multirank
def test_two_rank_fsdp_updates_local_shards_and_checkpoints(two_ranks):
    from diffusers import UNet2DConditionModel
    results = [torch.load(two_ranks / f"fsdp_rank{r}.pt") for r in range(2)]
    full = results[0]["full_numel"]
    # each rank holds only its shards, together exactly one fp32 copy
    assert 0 < results[0]["local_numel"] < full and results[0]["local_numel"] + results[1]["local_numel"] == full
    for r in results:
        assert r["shadow_nbytes"] == 4 * r["local_numel"]
        assert r["restored_exactly"] and r["weights_restored"]
    expected, updates = closed_form(results[0]["full_snapshots"], 0.5, 0, 1)
    expected = {k[len("unet."):]: v for k, v in expected.items()}
    loaded = UNet2DConditionModel.from_pretrained(two_ranks / "fsdp_export")
    assert_close_fp32(dict(loaded.named_parameters()), expected, updates)


def _ddp_worker(out: str) -> None:
    algo, rec = EMA(half_life="2ba"), Recorder()
    trainer = make_trainer([algo], max_duration="8ba", callbacks=[rec])
    trainer.fit()
    model = trainer.state.model.module
    torch.save({"world_size": dist.get_world_size(), "shadow": algo.shadow, "smoothing": algo.smoothing,
                "snapshots": rec.snapshots, "params": dict(model.named_parameters())},
               os.path.join(out, f"ddp_rank{dist.get_global_rank()}.pt"))


def _fsdp_worker(out: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    rank = dist.get_global_rank()
    container = torch.nn.Module()
    from diffusers import UNet2DConditionModel

    from t2ibench.families.sd2 import CONFIGS
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**CONFIGS["tiny"]["unet"])
    container.unet = FSDP(unet, device_id=torch.device("cpu"), use_orig_params=True)
    algo = EMA(smoothing=0.5, half_life=None)
    full_snapshots = []
    for step in range(1, 6):
        with torch.no_grad():  # stands in for an optimizer step on the local shards
            for p in container.parameters():
                p.mul_(0.9).add_(0.01 * step)
        with FSDP.summon_full_params(container.unet):
            full_snapshots.append({"unet." + n: p.detach().clone() for n, p in container.unet.named_parameters()})
        algo.update(container)
    local_numel = sum(t.numel() for t in algo.shadow.values())

    # checkpoint: state_dict gathers shards to rank 0, which writes; every rank restores its own
    sd = algo.state_dict()
    path = os.path.join(out, "fsdp_ema.pt")
    if rank == 0:
        torch.save(sd, path)
    dist.barrier()
    restored = EMA(smoothing=0.5, half_life=None)
    restored.load_state_dict(torch.load(path, weights_only=False))
    restored.update(container)  # binds (checks names/shapes, places tensors), then one more step
    algo.update(container)
    restored_exactly = all(torch.equal(restored.shadow[n], t) for n, t in algo.shadow.items())

    # the same through torch.distributed.checkpoint, laid out as Composer's sharded checkpoints are
    # (state.algorithms is a list of (name, state) pairs, which DCP pickles as one rank-0 entry)
    import torch.distributed.checkpoint as dcp
    dcp.save({"state": {"algorithms": [("EMA", algo.state_dict())]}}, checkpoint_id=os.path.join(out, "dcp"))
    from_dcp = EMA(smoothing=0.5, half_life=None)
    template = {"state": {"algorithms": [("EMA", from_dcp.state_dict())]}}
    dcp.load(template, checkpoint_id=os.path.join(out, "dcp"))
    from_dcp.load_state_dict(dict(template["state"]["algorithms"])["EMA"])
    restored_exactly &= all(torch.equal(from_dcp.shadow[n], t) for n, t in algo.shadow.items())

    before = [p.detach().clone() for p in container.parameters()]
    algo.export_denoiser(container, os.path.join(out, "fsdp_export"))
    weights_restored = all(torch.equal(p, b) for p, b in zip(container.parameters(), before))
    full_snapshots.append(full_snapshots[-1])  # the extra update above saw the same parameters
    torch.save({"full_numel": sum(p.numel() for p in full_snapshots[0].values()), "local_numel": local_numel,
                "shadow_nbytes": algo.shadow_nbytes, "restored_exactly": restored_exactly,
                "weights_restored": weights_restored, "full_snapshots": full_snapshots if rank == 0 else None},
               os.path.join(out, f"fsdp_rank{rank}.pt"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--dist-worker":
        _ddp_worker(sys.argv[2])
        _fsdp_worker(sys.argv[2])
    else:
        print(json.dumps({"usage": "composer -n 2 tests/test_ema.py --dist-worker OUT_DIR"}))
