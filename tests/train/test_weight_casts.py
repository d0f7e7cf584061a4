"""Launch-bound steps (issue 28): weight casts once per step, the kernel count, the profile; the
step's gradients summed in fp32 and their norm (issue 36).

`--weight_casts step` must train exactly as autocast does with one microbatch per step (and, its
gradients summed in fp32, with several), give the fp32 weights their gradients before clipping and
the optimizer, and be counted by the memory model; bench/step_ops.py's count must agree with what
real CPU autocast dispatches (its SDXL --json: tests/commands/test_gpu_setup.py, which counts that set-up once);
`--profile_batches` must write a trace and report its table outside the
throughput window; every run reports the last step's gradient norm before clipping (`grad_norm`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

import benchmark
from t2ibench.memory import kernels
from t2ibench import memory
from t2ibench.families import family_of
from t2ibench.callbacks.nonfinite_loss import NonFiniteLossError
from t2ibench.train.grad_norm import gradient_norm, trained_parameters
from t2ibench.train.model import DiffusionModel
from t2ibench.train.norms import set_norm_precision
from t2ibench.train.weight_casts import CastWeightsOncePerStep
from tests.helpers import bench_script

TINY = ["--model_config", "tiny", "--use_synth_data", "--image_size", "64", "--num_workers", "0",
        "--num_synthetic_samples", "64", "--precision", "amp_bf16", "--warmup_batches", "1"]


def _run(tmp_path: Path, *flags: str, callbacks: list[Callback] | None = None) -> dict:
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    return benchmark.main([*TINY, "--results_json", str(out), *flags], extra_callbacks=callbacks)


@pytest.mark.slow
def test_one_microbatch_per_step_trains_bit_for_bit_as_autocast(tmp_path):
    # A cast is a cast whichever kernel makes it: with one microbatch per step the bf16 copies give
    # the same forward, the same bf16 gradients, the same fp32 gradients after the upcast.
    flags = ["--batch_size", "4", "--max_duration", "4ba", "--use_ema"]
    per_microbatch = _run(tmp_path, *flags, "--weight_casts", "microbatch")
    per_step = _run(tmp_path, *flags, "--weight_casts", "step")
    assert per_step["weight_casts"] == "step" and per_microbatch["weight_casts"] == "microbatch"
    assert per_step["final_loss"] == per_microbatch["final_loss"]
    assert per_step["loss_by_timestep_bin"] == per_microbatch["loss_by_timestep_bin"]
    assert per_step["grad_norm"] == per_microbatch["grad_norm"] > 0


@pytest.mark.slow
def test_several_microbatches_checkpointing_and_clipping_train_bit_for_bit_as_autocast(tmp_path):
    # Autocast adds each microbatch's bf16 weight gradient, upcast, into the fp32 .grad; the copies'
    # hooks add the same bf16 gradient into the same fp32 sum: the same numbers for any number of
    # microbatches. (Summed in the copies' bf16 .grad, as before issue 36, the final losses differed:
    # 1.0838381 against 1.0840685.)
    flags = ["--batch_size", "8", "--device_train_microbatch_size", "2", "--max_duration", "3ba",
             "--activation_checkpointing", "--grad_clip_norm", "0.5"]
    per_microbatch = _run(tmp_path, *flags, "--weight_casts", "microbatch")
    per_step = _run(tmp_path, *flags, "--weight_casts", "step")
    assert per_step["final_loss"] == per_microbatch["final_loss"]
    assert per_step["grad_norm"] == per_microbatch["grad_norm"]


def test_hundreds_of_microbatches_sum_in_fp32():
    # 512 microbatches of a small network under the copies, each loss scaled by 1/512 as Composer
    # scales it. The step's gradient must be the fp32 sum of the 512 bf16 per-microbatch gradients
    # (the same numbers added in the same order: equal to the bit), within 1e-6 of their exact sum.
    # Summed in bf16, as before issue 36, the same increments lose their low bits once the sum is a
    # few hundred of them: 2-7% off here (checked below, so the test tells the two apart).
    torch.manual_seed(0)
    num_microbatches = 512
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    inputs = torch.randn(num_microbatches, 4, 64)
    casts = CastWeightsOncePerStep(net)
    masters = casts.masters
    casts.begin_step()
    copies = list(net.parameters())
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in masters]
    fp32_sum: list[torch.Tensor] = []
    bf16_sum: list[torch.Tensor] = []
    for x in inputs:  # Composer's microbatch loop: forward, scaled loss, backward, AFTER_BACKWARD
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(x).float().square().mean() / num_microbatches
        increments = torch.autograd.grad(loss, copies, retain_graph=True)  # this microbatch's bf16 gradient
        assert all(g.dtype == torch.bfloat16 for g in increments)
        for total, g in zip(exact, increments):
            total += g.double()
        if not fp32_sum:
            fp32_sum, bf16_sum = [g.float() for g in increments], [g.clone() for g in increments]
        else:
            fp32_sum = [total.add_(g) for total, g in zip(fp32_sum, increments)]
            bf16_sum = [total.add_(g) for total, g in zip(bf16_sum, increments)]
        loss.backward()
        casts.after_backward()
        assert all(copy.grad is None for copy in copies)  # no bf16 gradient outlives its backward
    casts.end_step()
    assert [id(p) for p in net.parameters()] == [id(p) for p in masters]

    def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.double() - want).norm() / want.norm())

    for master, want, fp32, bf16 in zip(masters, exact, fp32_sum, bf16_sum):
        assert master.grad.dtype == torch.float32
        assert torch.equal(master.grad, fp32)
        assert relative_error(master.grad, want) < 1e-6
        assert relative_error(bf16, want) > 1e-2  # the old bf16 sum fails the check above by far


class IndependentNorm(Callback):
    """Each step's gradient norm in float64 from the optimizer's parameters: after the step's last
    backward (before any algorithm's AFTER_TRAIN_BATCH, clipping included), and after clipping."""

    def __init__(self, microbatches_per_step: int):
        self.microbatches_per_step, self.backwards = microbatches_per_step, 0
        self.before_clipping: list[float] = []
        self.after_clipping: list[float] = []

    @staticmethod
    def norm(state: State) -> float:
        return math.sqrt(sum(float(p.grad.double().square().sum()) for p in trained_parameters(state)
                             if p.grad is not None))

    def after_backward(self, state: State, logger: Logger) -> None:
        self.backwards += 1
        if self.backwards % self.microbatches_per_step == 0:
            self.before_clipping.append(self.norm(state))

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self.after_clipping.append(self.norm(state))


@pytest.mark.parametrize("weight_casts", ["microbatch", "step"])
@pytest.mark.slow
def test_grad_norm_is_the_last_steps_norm_before_clipping(tmp_path, capsys, weight_casts):
    clip = 1e-3  # far below the tiny model's gradient norms: every step is clipped
    independent = IndependentNorm(microbatches_per_step=4)
    result = _run(tmp_path, "--batch_size", "8", "--device_train_microbatch_size", "2", "--max_duration", "2ba",
                  "--weight_casts", weight_casts, "--grad_clip_norm", str(clip), callbacks=[independent])
    assert len(independent.before_clipping) == len(independent.after_clipping) == 2
    assert result["grad_norm"] == pytest.approx(independent.before_clipping[-1], rel=1e-5)
    assert result["grad_norm"] > 10 * clip
    assert independent.after_clipping[-1] == pytest.approx(clip, rel=1e-3)  # clipped with that norm
    assert json.loads(Path(tmp_path / "r0.json").read_text())["grad_norm"] == result["grad_norm"]
    assert f"grad norm    {result['grad_norm']:.6g} " in capsys.readouterr().out


class Poison(Callback):
    """At batch `at` (1-based): an inf in one gradient after the step's last backward ("gradient": the
    loss stays finite), or a NaN loss in the first of two microbatches ("loss": the last one is
    finite). Keeps the state, whose optimizer the test reads after the stop."""

    def __init__(self, what: str, at: int):
        self.what, self.at, self.backwards, self.state = what, at, 0, None

    def after_loss(self, state: State, logger: Logger) -> None:
        if self.what == "loss" and int(state.timestamp.batch) + 1 == self.at and self.backwards % 2 == 0:
            state.loss = state.loss * float("nan")

    def after_backward(self, state: State, logger: Logger) -> None:
        self.backwards, self.state = self.backwards + 1, state
        if self.what == "gradient" and int(state.timestamp.batch) + 1 == self.at and self.backwards % 2 == 0:
            next(p for p in trained_parameters(state) if p.grad is not None).grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("what, cause", [("gradient", "gradient norm (inf)"), ("loss", "loss")])
def test_a_nonfinite_gradient_or_loss_stops_the_run_before_the_optimizer_steps(tmp_path, what, cause):
    poison, saved, results = Poison(what, at=2), tmp_path / "ckpt", tmp_path / "results.json"
    results.write_text('{"images_per_sec": 9.9}')  # an earlier run's figures: replaced, not left to be read
    with pytest.raises(NonFiniteLossError) as stop:
        _run(tmp_path, "--batch_size", "4", "--device_train_microbatch_size", "2", "--max_duration", "3ba",
             "--save_folder", str(saved), "--save_interval", "1ba", "--results_json", str(results), callbacks=[poison])
    message = str(stop.value)
    assert message.startswith(f"non-finite {cause} at batch 2 (ba2); stopped before the optimizer step"), message
    assert f"last good checkpoint: {saved / 'ep0-ba1-rank0.pt'}" in message and "\n" not in message
    assert sorted(p.name for p in saved.glob("ep*")) == ["ep0-ba1-rank0.pt"]
    # AdamW stepped once (batch 1), and its moments hold no inf or NaN from batch 2.
    optimizer = poison.state.optimizers[0]
    for moments in optimizer.state.values():
        assert int(moments["step"]) == 1
        assert torch.isfinite(moments["exp_avg"]).all() and torch.isfinite(moments["exp_avg_sq"]).all()
    assert json.loads(results.read_text()) == {
        "diverged": message.removesuffix(f"; --results_json {results} says so."), "diverged_at_batch": 2,
        "diverged_on": cause.split(" (")[0], "images_per_sec": None, "images_per_sec_per_device": None,
        "final_loss": None, "grad_norm": None}


def test_counted_sums_upcast_and_norm_are_what_the_step_dispatches():
    # kernels.py's once-per-step part under weight casts per step, against the ops a real CPU step
    # dispatches through CastWeightsOncePerStep and grad_norm: the copies' refresh and the first
    # microbatch's upcast (one multi-tensor copy each), one add per tensor in each later microbatch
    # and no more casts than in the first, and the norm's multi-tensor launches.
    torch.manual_seed(0)
    family = family_of("tiny")
    model = DiffusionModel(family, family.build("tiny", None, vae=False, text_encoders=False, tokenizers=False),
                           num_loss_bins=0)
    set_norm_precision(model, "autocast")
    batch = memory.meta_batch(model, "tiny", 64, 2, device="cpu")
    batch = {k: (torch.randn_like(v.float()).half() if v.is_floating_point() else v) for k, v in batch.items()}
    casts = CastWeightsOncePerStep(model.denoiser)
    numels = [p.numel() for p in casts.masters]
    counters: dict[str, kernels.KernelCounter] = {}

    def counted(name: str, work) -> None:
        counters[name] = kernels.KernelCounter()
        with counters[name]:
            work()

    def microbatch() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(model(batch), batch)
        loss.backward()

    counted("begin", casts.begin_step)
    for i in range(3):
        counted(f"microbatch{i}", microbatch)
        counted(f"after_backward{i}", casts.after_backward)
    counted("end", casts.end_step)
    counted("norm", lambda: gradient_norm(casts.masters))
    copy_launches = kernels.multi_tensor_launches(numels, 2)
    assert dict(counters["begin"].kernels) == {"casts": copy_launches}
    assert dict(counters["after_backward0"].kernels) == {"casts": copy_launches}
    assert not counters["after_backward1"].kernels and not counters["end"].kernels
    first, later = counters["microbatch0"].kernels, counters["microbatch2"].kernels
    assert later["elementwise"] - first["elementwise"] == len(numels)  # the hooks' adds into the fp32 sum
    assert later["casts"] == first["casts"] and later == counters["microbatch1"].kernels
    # On the CPU the norm's partial sums finish in the same op and one stack takes every norm; CUDA
    # adds a launch for the first and one per 128 norms for the second.
    norm_launches = kernels.multi_tensor_launches(numels, 1)
    assert sum(counters["norm"].kernels.values()) == norm_launches + 2
    step = kernels.count_step_kernels("tiny", 64, 2, 6, weight_casts="step").per_step
    assert step["casts"] == 2 * copy_launches
    assert step["elementwise"] == 2 * len(numels) + kernels.COMPOSER_KERNELS_PER_STEP
    assert step["grad_norm"] == norm_launches + 2 + -(-len(numels) // kernels.CAT_INPUTS_PER_LAUNCH)


def test_fp32_weights_get_the_gradients_and_stay_the_parameters():
    torch.manual_seed(0)
    family = family_of("tiny")
    model = DiffusionModel(family, family.build("tiny", None, vae=False, text_encoders=False, tokenizers=False))
    set_norm_precision(model, "autocast")  # as benchmark.py under AMP: every weight feeds a bf16 op
    masters = list(model.denoiser.parameters())
    reference = [p.detach().clone() for p in masters]
    # 64 px: at 32 the deepest level is 1x1, where the CPU's bf16 3x3 convolution weight gradient returns
    # uninitialised memory for the taps that only see padding (2e26, 1e-20, NaN), in either path.
    batch = memory.meta_batch(model, "tiny", 64, 2, device="cpu")
    batch = {k: (torch.randn_like(v.float()).half() if v.is_floating_point() else v) for k, v in batch.items()}

    def step() -> list[torch.Tensor]:
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(model(batch), batch)
        loss.backward()
        return [p.grad.clone() for p in masters]

    expected = step()
    for p in masters:
        p.grad = None
    casts = CastWeightsOncePerStep(model.denoiser)
    casts.begin_step()
    assert all(p.dtype == torch.bfloat16 for p in model.denoiser.parameters())
    with torch.no_grad():
        assert all(torch.equal(copy.float(), p.bfloat16().float()) for copy, p in zip(model.denoiser.parameters(), masters))
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(model(batch), batch)
    loss.backward()
    assert all(p.grad is None for p in masters)  # the gradients are the copies' until the step ends
    casts.end_step()
    assert [id(p) for p in model.denoiser.parameters()] == [id(p) for p in masters]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in masters)
    for got, want in zip((p.grad for p in masters), expected):
        assert torch.equal(got, want)
    assert all(torch.equal(p, r) for p, r in zip(masters, reference))  # weights untouched by the casts


@pytest.mark.parametrize("flags,expect", [
    (["--weight_casts", "step", "--precision", "fp32"], "--weight_casts step needs --precision amp_bf16"),
    (["--weight_casts", "bf16"], "--weight_casts"),
])
def test_weight_casts_step_refused_where_it_cannot_run(flags, expect):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main([*TINY, *flags])  # later flags win
    message = str(exit_info.value.code)
    assert message.startswith("benchmark.py: error: ") and expect in message and "\n" not in message


@pytest.mark.slow
def test_memory_model_counts_the_copies_within_a_real_cpu_step():
    bench_memory = bench_script("memory")
    counted = bench_memory.count_cpu_step("tiny", 64, 2, "amp_bf16", "autocast", weight_casts="step")
    measured = bench_memory.measure_cpu_step("tiny", 64, 2, "amp_bf16", "autocast", weight_casts="step")
    # Without kernel scratch, as tests/memory/test_memory.py compares: with it, this CPU's convolution
    # kernel decides (ATen's im2col buffers where oneDNN has no bf16: 53% above the count there).
    assert measured["op_peak_bytes"] == pytest.approx(counted.backward_peak_bytes, rel=0.05)
    assert counted.weight_cast_bytes == 0  # nothing left for autocast to cast
    per_microbatch = memory.plan("sdxl-base", 1024, 79.1 * memory.GIB, precomputed=True,
                                 precomputed_format="text_states", fsdp="none", num_gpus=1)
    per_step = memory.plan("sdxl-base", 1024, 79.1 * memory.GIB, precomputed=True,
                           precomputed_format="text_states", fsdp="none", num_gpus=1, weight_casts="step")
    # The copies take the place of autocast's cached casts; the step's gradient sum is fp32 in both
    # (the first backward's bf16 gradients exist beside it only while they are upcast, activations
    # gone): without checkpointing the same peak at the same microbatch, to 0.01%.
    num_params = sum(p.numel() for p in family_of("sdxl-base").meta_parts("sdxl-base").denoiser.parameters())
    breakdown = per_step["fixed_bytes_breakdown"]
    assert breakdown["gradients"] == per_microbatch["fixed_bytes_breakdown"]["gradients"] == 4 * num_params
    assert breakdown["weight_casts_or_gathered"] == 2 * num_params
    assert per_step["step_end_bytes"] == per_step["fixed_tensor_bytes"] + 2 * num_params
    assert per_microbatch["step_end_bytes"] == per_microbatch["fixed_tensor_bytes"]
    assert per_step["microbatch"] == per_microbatch["microbatch"]
    assert per_step["predicted_bytes_at_microbatch"] == pytest.approx(per_microbatch["predicted_bytes_at_microbatch"],
                                                                      rel=1e-4)


def test_multi_tensor_launches_follow_cudas_chunking():
    chunk = kernels.MULTI_TENSOR_CHUNK_ELEMENTS
    assert kernels.multi_tensor_launches([1] * 36, 4) == 1
    assert kernels.multi_tensor_launches([1] * 37, 4) == 2
    assert kernels.multi_tensor_launches([1] * 64, 2) == 1
    assert kernels.multi_tensor_launches([320 * chunk], 2) == 1
    assert kernels.multi_tensor_launches([320 * chunk + 1], 2) == 2
    assert kernels.multi_tensor_launches([], 2) == 0


@pytest.mark.slow
def test_counted_kernels_are_what_real_cpu_autocast_dispatches():
    # The meta-device count (autocast's rules applied by the memory model's emulation) against the
    # same step run for real under CPU autocast, every op seen below autograd by the same counter.
    torch.manual_seed(0)
    family = family_of("tiny")
    model = DiffusionModel(family, family.build("tiny", None, vae=False, text_encoders=False, tokenizers=False),
                           num_loss_bins=0)
    for frozen in model.frozen():
        frozen.to(torch.bfloat16)
    set_norm_precision(model, "autocast")
    model.train()
    batch = memory.meta_batch(model, "tiny", 64, 2, device="cpu")
    batch = {k: (torch.randn_like(v.float()).half() if v.is_floating_point() else v) for k, v in batch.items()}
    real = kernels.KernelCounter()
    with real:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(model(batch), batch)
        loss.backward()
    meta = memory.build_meta_model("tiny", precomputed=True, precomputed_format="text_states",
                                   frozen_dtype=torch.bfloat16)
    meta.loss_bins = model.loss_bins
    meta.train()
    meta_batch = memory.meta_batch(meta, "tiny", 64, 2)
    assert {k: (v.shape, v.dtype) for k, v in meta_batch.items()} == {k: (v.shape, v.dtype) for k, v in batch.items()}
    counted = kernels.KernelCounter()
    policy = memory.probe_cpu_autocast().with_norms("autocast")
    with counted:
        with memory.AutocastRules(policy, torch.bfloat16, "cpu"):
            loss = meta.loss(meta(meta_batch), meta_batch)
        loss.backward()
    assert counted.kernels["casts"] == real.kernels["casts"]
    assert counted.kernels["matmul_conv"] == real.kernels["matmul_conv"]
    assert counted.kernels["attention"] == real.kernels["attention"]
    assert sum(counted.kernels.values()) == pytest.approx(sum(real.kernels.values()), rel=0.02)


@pytest.mark.slow
def test_profile_writes_a_trace_and_leaves_the_window(tmp_path):
    result = _run(tmp_path, "--batch_size", "4", "--max_duration", "5ba", "--profile_batches", "2",
                  "--profile_dir", str(tmp_path / "prof"))
    trace = json.loads(Path(result["profile_trace"]).read_text())
    assert trace["traceEvents"]
    assert result["profile_batches"] == 2 and len(result["profile_top_ops"]) == 15
    assert 0 < result["device_busy_fraction"] <= 1
    assert result["warmup_batches"] == 3 and result["measured_batches"] == 2  # 1 warm-up + 2 profiled left out
    with pytest.raises(SystemExit) as exit_info:
        _run(tmp_path, "--batch_size", "4", "--max_duration", "3ba", "--profile_batches", "2")
    assert "--profile_batches 2" in str(exit_info.value.code)
