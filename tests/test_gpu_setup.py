"""The set-up the GPU defaults pick (t2ibench.gpu_setup, issue 36): `--activation_checkpointing
auto|on|off` with its bare form, the rule on real meta-device counts, the run's summary and results
JSON, the runtime on a GPU, and the choice for SDXL, SD2 and Flux.1 on an 80 GB H100 through
bench/memory.py and bench/step_ops.py."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from composer.core import Callback

import benchmark
import step_ops
from t2ibench import kernels, memory
from t2ibench.families import family_of
from t2ibench.gpu_setup import MIN_CHECKPOINTING_GAIN, choose_setup
from t2ibench.runtime import Runtime
from tests.helpers import ROOT, TINY_2BA, bench_script, error_of, offline_env

H100_BYTES = memory.GPU_MEMORY_GIB["H100 80GB"] * memory.GIB
# The tiny SD2 model at 64x64 beside the CUDA context: 64 images fit without checkpointing, 128 with it.
TINY_GPU_BYTES = memory.CUDA_CONTEXT_BYTES + 150 * 2**20
TINY_STEP = dict(precision="amp_bf16", weight_casts="step", num_gpus=1)  # one GPU: weights cast once per step


def test_the_flag_takes_auto_on_off_and_bare_still_means_on(tmp_path):
    assert benchmark.parse_args([]).activation_checkpointing == "auto"
    assert benchmark.parse_args(["--activation_checkpointing", "off"]).activation_checkpointing == "off"
    bare = benchmark.parse_args(["--activation_checkpointing", "--use_ema"])  # recipes and scripts write it so
    assert bare.activation_checkpointing == "on" and bare.use_ema
    recipe = tmp_path / "r.args"
    recipe.write_text("--activation_checkpointing\n--use_ema\n")
    assert benchmark.parse_args([f"@{recipe}"]).activation_checkpointing == "on"
    message = error_of(benchmark.main, [*TINY_2BA, "--activation_checkpointing", "sometimes"], "benchmark.py")
    assert "--activation_checkpointing" in message and "'auto', 'on', 'off'" in message
    for parser in (bench_script("memory").build_parser(), step_ops.build_parser()):
        assert parser.parse_args([]).activation_checkpointing == "auto"
        assert parser.parse_args(["--activation_checkpointing", "--json"]).activation_checkpointing == "on"


class RecordCheckpointing(Callback):
    """Whether the denoiser the Trainer runs recomputes its blocks."""

    def fit_start(self, state, logger) -> None:
        self.enabled = state.model.denoiser.is_gradient_checkpointing


def test_a_cpu_run_says_which_rule_chose_checkpointing(tmp_path, capsys):
    seen = RecordCheckpointing()
    results = benchmark.main([*TINY_2BA, "--results_json", str(tmp_path / "auto.json")], extra_callbacks=[seen])
    # On a CPU `auto` keeps the plain step; the summary's set-up line and the results JSON say why.
    assert not seen.enabled and results["activation_checkpointing"] is False
    assert results["activation_checkpointing_reason"] == "auto: off without CUDA"
    written = json.loads((tmp_path / "auto.json").read_text())
    assert written["activation_checkpointing_reason"] == "auto: off without CUDA"
    assert "activation checkpointing off (auto: off without CUDA)" in capsys.readouterr().out
    results = benchmark.main([*TINY_2BA, "--activation_checkpointing", "--results_json", str(tmp_path / "on.json")],
                             extra_callbacks=[seen])
    assert seen.enabled and results["activation_checkpointing"] is True
    assert json.loads((tmp_path / "on.json").read_text())["activation_checkpointing_reason"] == \
        "--activation_checkpointing on"
    assert "activation checkpointing on (--activation_checkpointing on)" in capsys.readouterr().out


def _plans(per_device_batch: int = 1024) -> tuple[dict, dict]:
    return tuple(memory.plan("tiny", 64, TINY_GPU_BYTES, per_device_batch=per_device_batch,
                             activation_checkpointing=checkpointing, **TINY_STEP) for checkpointing in (False, True))


def test_auto_weighs_the_largest_microbatch_without_and_with_checkpointing():
    plain, checkpointed = _plans()
    assert checkpointed["microbatch"] > plain["microbatch"] >= 1
    setup = choose_setup("tiny", 64, TINY_GPU_BYTES, 1024, **TINY_STEP)
    without, with_it = setup.candidates
    assert (without.microbatch, with_it.microbatch) == (plain["microbatch"], checkpointed["microbatch"])
    # Each candidate's cost: its launches per image as bench/step_ops.py counts them, and the step's
    # FLOPs, the denoiser's forward once more when it is recomputed.
    counted = kernels.count_step_kernels("tiny", 64, with_it.microbatch, 1024, weight_casts="step",
                                         activation_checkpointing=True)
    assert with_it.kernels_per_image == pytest.approx(sum(counted.per_image().values()))
    assert with_it.kernels_per_image < without.kernels_per_image  # the same launches over more images
    flops = family_of("tiny").flops_per_image("tiny", 64)
    assert without.flops_per_image == flops["total"]
    assert with_it.flops_per_image == flops["total"] + flops["denoiser_fwd"]
    # A model of a few million parameters is all launches: the larger microbatch wins by far.
    gain = without.cost_flops_per_image / with_it.cost_flops_per_image
    assert gain >= MIN_CHECKPOINTING_GAIN and setup.activation_checkpointing
    assert setup.microbatch == with_it.microbatch and f"{gain:.2f}x" in setup.reason
    assert setup.weight_casts == "step" and setup.summary()["activation_checkpointing_reason"] == setup.reason
    # Where checkpointing fits no larger microbatch (both reach the per-device batch), it stays off.
    small = choose_setup("tiny", 64, TINY_GPU_BYTES, plain["microbatch"], **TINY_STEP)
    assert not small.activation_checkpointing and small.microbatch == plain["microbatch"]
    assert small.reason == f"auto: it fits no larger microbatch than {plain['microbatch']}"


def test_the_flag_and_a_given_microbatch_are_respected():
    plain, checkpointed = _plans()
    on = choose_setup("tiny", 64, TINY_GPU_BYTES, 1024, activation_checkpointing="on", **TINY_STEP)
    off = choose_setup("tiny", 64, TINY_GPU_BYTES, 1024, activation_checkpointing="off", **TINY_STEP)
    assert (on.activation_checkpointing, on.microbatch, on.reason) == (True, checkpointed["microbatch"],
                                                                         "--activation_checkpointing on")
    assert (off.activation_checkpointing, off.microbatch, off.reason) == (False, plain["microbatch"],
                                                                            "--activation_checkpointing off")
    # A given microbatch: checkpointing only when it does not fit without it.
    fits = choose_setup("tiny", 64, TINY_GPU_BYTES, 1024, microbatch=plain["microbatch"], **TINY_STEP)
    assert not fits.activation_checkpointing and fits.microbatch == plain["microbatch"]
    assert fits.reason.startswith(f"auto: microbatch {plain['microbatch']} fits without it")
    larger = 2 * plain["microbatch"]
    too_large = choose_setup("tiny", 64, TINY_GPU_BYTES, 1024, microbatch=larger, **TINY_STEP)
    assert too_large.activation_checkpointing and too_large.microbatch == larger
    assert too_large.reason.startswith(f"auto: microbatch {larger} does not fit without it")
    assert choose_setup("tiny", 64, TINY_GPU_BYTES, 1024, microbatch=larger, activation_checkpointing="off",
                        **TINY_STEP).activation_checkpointing is False
    # Nothing fits without it: on (a microbatch of 1 when nothing fits at all: the run's OOM says so).
    nothing = choose_setup("tiny", 64, memory.CUDA_CONTEXT_BYTES, 1024, **TINY_STEP)
    assert nothing.activation_checkpointing and nothing.microbatch == 1
    assert nothing.reason.startswith("auto: no microbatch fits without it")


def test_the_runtime_takes_the_counted_setup_on_a_gpu(monkeypatch):
    flags = [*TINY_2BA, "--image_size", "64", "--batch_size", "256", "--precision", "amp_bf16"]
    settings = benchmark.validate(benchmark.parse_args(flags), 1)
    # A GPU of TINY_GPU_BYTES as torch reports it; nothing else of CUDA is touched before the model.
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=TINY_GPU_BYTES))
    pending = Runtime(1, True, "amp_bf16", "amp_bf16", 256, "auto", "step", False, "auto: decided with the data")
    run = pending.with_counted_setup(settings, None)
    expected = choose_setup("tiny", 64, TINY_GPU_BYTES, 256, **TINY_STEP)
    assert (run.microbatch, run.activation_checkpointing, run.activation_checkpointing_reason) == \
        (expected.microbatch, expected.activation_checkpointing, expected.reason)
    assert run.activation_checkpointing  # the tiny model is all launches (see above)
    # A given microbatch stays; auto checkpoints only where it does not fit without.
    given = Runtime(1, True, "amp_bf16", "amp_bf16", 256, 2, "step", False, "").with_counted_setup(settings, None)
    assert (given.microbatch, given.activation_checkpointing) == (2, False)
    assert given.activation_checkpointing_reason.startswith("auto: microbatch 2 fits without it")
    # On or off by the flag on one GPU: nothing counted, `auto` stays Composer's OOM search.
    explicit = benchmark.validate(benchmark.parse_args([*flags, "--activation_checkpointing", "off"]), 1)
    kept = Runtime(1, True, "amp_bf16", "amp_bf16", 256, "auto", "step", False, "--activation_checkpointing off")
    assert kept.with_counted_setup(explicit, None) == kept


def _last_json(command: list[str]) -> dict:
    out = subprocess.run([sys.executable, *command], cwd=ROOT, env=offline_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.multirank
def test_defaults_on_an_80gb_h100_checkpoint_sdxl_and_not_sd2_or_flux():
    # Counted on the meta device for a GPU of 79.1 GiB (an 80 GB H100 as torch reports it), as the
    # bench scripts do: the issue's targets and the set-up keys of both scripts' --json.
    sdxl = _last_json(["bench/step_ops.py", "--model_config", "sdxl-base", "--precomputed", "--precomputed_format",
                       "text_states", "--json"])
    # 32, as the H100 ran: with fp32 gradient sums it fits through the allocator's expandable segments
    # (78.7 GiB counted with their 4% reserve, 83.2 with torch's default allocator's 10%: docs/speed.md).
    assert (sdxl["activation_checkpointing"], sdxl["microbatch"], sdxl["weight_casts"]) == (True, 32, "step")
    assert sdxl["activation_checkpointing_reason"].startswith("auto: microbatch 32 with it is predicted")
    sd2 = _last_json(["bench/memory.py", "--model_config", "sd2-base", "--image_size", "512", "--precomputed",
                      "--num_gpus", "1", "--per_device_batch", "2048", "--json"])
    assert (sd2["activation_checkpointing"], sd2["microbatch"], sd2["weight_casts"]) == (False, 32, "step")
    assert "under 1.10x the" in sd2["activation_checkpointing_reason"]
    # Flux.1-schnell as MLPerf trains it, 8 GPUs under full_shard: microbatch 8 fits without checkpointing,
    # which would gain less than it must.
    flux = _last_json(["bench/memory.py", "--model_config", "flux1-schnell", "--precomputed", "--no_ema",
                       "--per_device_batch", "64", "--json"])
    assert (flux["activation_checkpointing"], flux["microbatch"], flux["weight_casts"]) == (False, 8, "microbatch")
    assert "predicted only" in flux["activation_checkpointing_reason"]
