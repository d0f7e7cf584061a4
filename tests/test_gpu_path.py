"""What a first GPU run depends on, driven through the real CLI on CPU with faults injected from outside.

Two-rank launches through Composer's launcher (gloo), started together by one module fixture:

* timing faults (tests/fault_run.py): rank 0's checkpoint saves slowed, rank 1 slowed after each
  batch's last collective. The measured window must end at the last batch (the final save after
  it), report the saves inside and after it, and count only the loader's next() as data wait;
* a NaN in the first of two microbatches on one rank (tests/nan_run.py): caught at its own batch,
  before that batch's checkpoint;
* the speed settings with --use_ema: --precision amp_bf16 (CPU autocast), --channels_last,
  --fused_adamw on, with images (the timing-fault run), and with --precomputed --compile (dynamo
  and AOT autograd under DDP; inductor's CPU code generation is left out for time, see
  tests/fault_run.py).

In-process: --compile compiling every module that runs per step (UNet, VAE encoder, text encoder) block by block,
refusals (--xformers where absent, amp_fp16 on CPU) and uint8 images crossing from loader workers
(the multi-rank `auto` microbatch: tests/memory/test_memory.py; the GPU driver's plan: tests/bench/test_gpu_report.py).
"""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

import benchmark
import data
from t2ibench.families import MODEL_CONFIGS
from t2ibench.train.model import scale_images
from tests.helpers import TINY_SYNTH, Launch, supervise, two_ranks

SD2 = MODEL_CONFIGS["sd2-base"]

TINY = [*TINY_SYNTH, "--num_synthetic_samples", "64", "--log_interval", "1ba"]
SLOW_SAVE_S = 1.5  # rank 0 sleeps this long in every checkpoint save
SLOW_RANK_S = 0.4  # rank 1 sleeps this long after every batch's last collective
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every launch at once (each spends most of its time importing), wait for all, return them."""
    tmp = tmp_path_factory.mktemp("gpu-path")
    # At 64 px: at 32 the tiny UNet's last level convolves 1x1 maps, where the CPU's channels-last bf16
    # convolutions sent gradient norms to 1e8 within 6 batches (seed 1) and to inf on a CPU with AMX; at 64
    # the same runs stay near 3.
    speed = ["--use_ema", "--precision", "amp_bf16", "--channels_last", "--fused_adamw", "on", "--image_size", "64"]
    short = ["--max_duration", "3ba", "--warmup_batches", "1"]
    commands = {
        # Also the speed settings with images (one microbatch per rank: the NaN and compile runs accumulate).
        "faults": two_ranks("tests/fault_run.py", *TINY, *speed, "--max_duration", "6ba", "--warmup_batches", "2",
                            "--save_folder", str(tmp / "faults-ckpt"), "--save_interval", "3ba",
                            "--slow_save_s", str(SLOW_SAVE_S), "--slow_rank", "1", "--slow_rank_s", str(SLOW_RANK_S),
                            "--report", str(tmp / "faults-report"), "--results_json", str(tmp / "faults.json")),
        "nan": two_ranks("tests/nan_run.py", *TINY, "--use_ema", "--max_duration", "5ba", "--warmup_batches", "1",
                         "--device_train_microbatch_size", "1", "--save_folder", str(tmp / "nan-ckpt"),
                         "--save_interval", "1ba", "--nan_at_batch", "3", "--nan_microbatch", "0", "--nan_rank", "1",
                         "--report", str(tmp / "nan-report")),
        # Dynamo + AOT autograd under DDP, without inductor's C++ code generation (see tests/fault_run.py):
        # the UNet and the text encoder on token ids (the VAE encoder's compilation: in-process below).
        "compile": two_ranks("tests/fault_run.py", *TINY, *speed, *short, "--compile", "--precomputed",
                             "--device_train_microbatch_size", "1", "--compile_backend", "aot_eager",
                             "--report", str(tmp / "compile-report"),
                             "--results_json", str(tmp / "compile.json")),
    }
    launches = {name: Launch(cmd, tmp / f"{name}.log", timeout_s=TIMEOUT_S) for name, cmd in commands.items()}
    supervise(list(launches.values()))
    return {"tmp": tmp, "rc": {n: launch.proc.returncode for n, launch in launches.items()},
            "log": {n: launch.output() for n, launch in launches.items()}}


def results(runs, name: str) -> dict:
    assert runs["rc"][name] == 0, runs["log"][name][-5000:]
    return json.loads((runs["tmp"] / f"{name}.json").read_text())


@pytest.mark.multirank
def test_clock_stops_at_the_last_batch_and_saves_are_reported(runs):
    r = results(runs, "faults")
    report = json.loads((runs["tmp"] / "faults-report" / "rank0.json").read_text())
    saves, window_end = report["save_starts"], report["window_end"]
    # Saves at batch 3 (inside the window, which starts after batch 2) and batch 6 (the last).
    assert len(saves) == 2, report
    assert saves[0] < window_end <= saves[1], report  # the final save starts after the clock stopped
    assert r["checkpoint_seconds_in_window"] >= SLOW_SAVE_S
    assert r["checkpoint_seconds_after_window"] >= SLOW_SAVE_S
    assert r["seconds_after_window"] >= SLOW_SAVE_S
    assert r["measured_seconds"] >= r["checkpoint_seconds_in_window"] + 4 * SLOW_RANK_S  # 4 slowed batches inside
    assert r["images_per_sec"] == pytest.approx(16 / r["measured_seconds"])
    assert (runs["tmp"] / "faults-ckpt" / "ep0-ba6-rank0.pt").is_file()
    assert "saving inside the measured" in runs["log"]["faults"]


@pytest.mark.multirank
def test_waiting_for_a_slow_rank_is_not_data_wait(runs):
    r = results(runs, "faults")
    # Rank 0 waited >= 0.4 s per batch for rank 1 in Composer's end-of-data all-reduce (inside the
    # BEFORE/AFTER_DATALOADER events): that was >= 1.6 s of the window. The loader itself is instant.
    assert r["data_wait_fraction"] is not None and r["data_wait_fraction"] < 0.1, r
    assert 0 <= r["data_wait_fraction_mean"] <= r["data_wait_fraction"]


@pytest.mark.multirank
def test_nan_in_an_earlier_microbatch_is_caught_at_its_batch(runs):
    assert runs["rc"]["nan"] not in (0, None), runs["log"]["nan"][-5000:]
    reports = {int(p.stem[4:]): p.read_text().splitlines() for p in (runs["tmp"] / "nan-report").glob("rank*.txt")}
    assert reports[1][0] == "poisoned the loss of batch 3 microbatch 0", reports
    folder = runs["tmp"] / "nan-ckpt"
    for rank in (0, 1):
        stop = reports[rank][-1]
        assert "non-finite loss at batch 3 (ba3)" in stop, stop
        assert f"last good checkpoint: {folder}/ep0-ba2-rank0.pt" in stop, stop
    assert not list(folder.glob("*-ba3-*")), sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("name", ["faults", "compile"])
@pytest.mark.multirank
def test_speed_settings_run_with_ema_on_two_ranks(runs, name):
    r = results(runs, name)
    assert r["world_size"] == 2 and r["use_ema"] and r["measured_batches"] >= 1
    assert math.isfinite(r["final_loss"]) and r["images_per_sec"] > 0
    assert r["precision"] == "amp_bf16" and r["channels_last"] and r["fused_adamw"]
    assert r["precomputed"] is r["compile"] is (name == "compile")
    # The warning the README explains, only where it applies.
    assert ("--channels_last without --compile" in runs["log"][name]) is (name != "compile")
    # compile: two microbatches per rank, accumulation under autocast and DDP's no_sync.
    assert r["device_train_microbatch_size"] == (1 if name == "compile" else 2)


class ModulesAtFitStart(Exception):
    """Raised by a callback at FIT_START, carrying the model: nothing has been compiled or trained yet."""


@pytest.mark.slow
def test_compile_compiles_every_module_that_runs_per_step():
    from composer.core import Callback

    class Stop(Callback):
        def fit_start(self, state, logger):
            raise ModulesAtFitStart(state.model)

    def compiled(module: torch.nn.Module) -> bool:
        return getattr(module, "_compiled_call_impl", None) is not None  # nn.Module.compile, in place

    for data_flags, parts in (([], ("unet", "vae.encoder", "text_encoder")), (["--precomputed"], ("unet", "text_encoder"))):
        with pytest.raises(ModulesAtFitStart) as stopped:
            benchmark.main([*TINY, *data_flags, "--max_duration", "1ba", "--compile"], extra_callbacks=[Stop()])
        model = stopped.value.args[0]
        assert ("vae.encoder" in parts) is (model.vae is not None)
        for name in parts:
            module = model.get_submodule(name)
            # Block by block (the family's compile_blocks): the blocks compiled, nothing above or in them.
            blocks = {id(block) for block in model.family.compile_blocks(module)}
            assert blocks and {id(m) for m in module.modules() if compiled(m)} == blocks, name


def test_xformers_is_refused_clearly_where_absent(capsys):
    if importlib.util.find_spec("xformers") is not None:
        pytest.skip("xformers is installed here")
    with pytest.raises(SystemExit) as stop:
        benchmark.main(TINY + ["--max_duration", "1ba", "--xformers"])
    message = str(stop.value)
    assert message.startswith("benchmark.py: error: --xformers") and "pip install" in message
    assert "\n" not in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_amp_fp16_on_cpu_is_refused_in_one_line():
    with pytest.raises(SystemExit) as stop:
        benchmark.main(TINY + ["--max_duration", "1ba", "--precision", "amp_fp16"])
    assert str(stop.value).startswith("benchmark.py: error: --precision amp_fp16 needs a CUDA GPU")


def test_images_cross_from_loader_workers_as_uint8():
    loader = data.synthetic_dataloader(image_size=16, batch_size_per_device=4, num_workers=1, num_samples=8)
    batch = next(iter(loader))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (4, 3, 16, 16)
    assert batch["image"].float().std() > 50  # random pixels over the whole byte range, not a constant
    scaled = scale_images(torch.tensor([0, 255], dtype=torch.uint8))
    assert scaled.tolist() == [-1.0, 1.0] and scaled.dtype == torch.float32
