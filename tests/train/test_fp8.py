"""--fp8 (t2ibench.train.fp8): flux1-tiny trains in emulated float8, compiled, to the loss of the same run without
it, every family and every float8 path trains, compiled (SD2's and SDXL's transformers feed proj_in a
permuted input), a run without --compile, a GPU without float8 tensor cores and fp16 are refused in one line
before anything is built, and the memory model counts what float8 keeps for backward.

The float8 runs compile with dynamo but not inductor: the converted layers run inside the blocks' graphs, as
under inductor. The learning run and the refusals that AOT autograd's backward decides use its aot_eager
backend (as tests/train/test_compile.py); the family cases dynamo's eager backend, the cheapest."""
from __future__ import annotations

import pytest
import torch
from composer.core import Callback

import benchmark
from t2ibench.train import fp8
from t2ibench import memory
from t2ibench.families import FAMILIES
from tests.helpers import error_of

FLUX_TINY = ["--model_config", "flux1-tiny", "--precomputed", "--use_synth_data", "--batch_size", "8",
             "--image_size", "64", "--num_workers", "0", "--warmup_batches", "2", "--precision", "amp_bf16",
             "--lr", "1e-3"]


class Losses(Callback):
    """From outside: the loss of every batch."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def after_train_batch(self, state, logger) -> None:
        self.values.append(float(state.loss.detach().sum()))


def run(argv: list[str]) -> tuple[dict, list[float]]:
    losses = Losses()
    results = benchmark.main(FLUX_TINY + argv, extra_callbacks=[losses])
    return results, losses.values


@pytest.mark.slow
def test_fp8_tensorwise_trains_flux_tiny_to_the_loss_of_the_same_run_without_it(aot_eager):
    plain, plain_losses = run(["--max_duration", "30ba"])
    float8, float8_losses = run(["--max_duration", "30ba", "--fp8", "tensorwise", "--compile"])
    assert len(plain_losses) == len(float8_losses) == 30
    # The run learns (the comparison means something), and float8 ends within 10% of it.
    assert plain["final_loss"] < 0.92 * plain_losses[0]
    assert abs(float8["final_loss"] - plain["final_loss"]) <= 0.10 * plain["final_loss"]
    # Float8 really ran: most layers converted, emulated here, and the numerics differ from the plain run's.
    conversion = float8["fp8_conversion"]
    assert conversion["emulated"] and conversion["mode"] == "tensorwise"
    assert conversion["converted_linears"] > conversion["kept_linears"] > 0
    assert float8_losses != plain_losses
    assert 0 < float8["flops_per_image_breakdown"]["fp8_fwd_bwd"] < float8["flops_per_image"]
    assert plain["fp8"] == "off" and plain["fp8_conversion"] is None
    assert float8["compile"] and float8["compiled_graphs"] == 3  # the blocks with their float8 layers


class Float8Inputs(Callback):
    """From outside: the float8 layers the run trains, and those that received an input that flattens
    into rows only by a copy (as SD2's and SDXL's proj_in do)."""

    def __init__(self) -> None:
        self.converted: set[str] = set()
        self.copied_inputs: set[str] = set()
        self.plain_linears = 0

    def fit_start(self, state, logger) -> None:
        for name, module in state.model.denoiser.named_modules():
            if isinstance(module, torch.nn.Linear) and type(module) is not torch.nn.Linear:
                self.converted.add(name)
                module.register_forward_pre_hook(self._recorder(name))
            elif type(module) is torch.nn.Linear:
                self.plain_linears += 1

    def _recorder(self, name: str):
        def record(module, args) -> None:
            if not fp8.flattens_without_copy(args[0]):
                self.copied_inputs.add(name)
        return record


# Each float8 path once, compiled on dynamo's cheapest backend: tensorwise and rowwise under bf16
# autocast (rowwise computes with bf16 weights there: weight casts per step; on fp32 ones it is refused,
# below), and rowwise with fp32 weights. The families take the cases in turn, so every family's tiny
# config trains in float8, one added to the registry too (a fourth takes the first case again).
TINY_CONFIGS = [family.configs[-1] for family in FAMILIES]
FLOAT8_CASES = [("tensorwise", "amp_bf16"), ("rowwise", "amp_bf16"), ("rowwise", "fp32")]
CASES = [(TINY_CONFIGS[i % len(TINY_CONFIGS)], *FLOAT8_CASES[i % len(FLOAT8_CASES)])
         for i in range(max(len(TINY_CONFIGS), len(FLOAT8_CASES)))]


@pytest.mark.parametrize("model_config, mode, precision", CASES)
@pytest.mark.slow
def test_every_family_trains_in_float8(model_config, mode, precision, capsys, one_thread, dynamo_eager):
    inputs, losses = Float8Inputs(), Losses()
    casts = ["--weight_casts", "step"] if mode == "rowwise" and precision != "fp32" else []
    results = benchmark.main(["--model_config", model_config, "--precomputed", "--use_synth_data",
                              "--batch_size", "2", "--image_size", "64", "--num_workers", "0",
                              "--max_duration", "2ba", "--warmup_batches", "1", "--precision", precision,
                              "--fp8", mode, "--compile", *casts], extra_callbacks=[inputs, losses])
    assert len(losses.values) == 2 and all(torch.isfinite(torch.tensor(losses.values)))
    conversion = results["fp8_conversion"]
    assert conversion["mode"] == mode and conversion["converted_linears"] == len(inputs.converted) > 0
    assert conversion["kept_linears"] == inputs.plain_linears
    if model_config != "flux1-tiny":
        # The layers that failed in rowwise: each transformer's proj_in, fed a permuted input, trains in float8.
        assert inputs.copied_inputs and all(name.endswith("proj_in") for name in inputs.copied_inputs)
    summary = capsys.readouterr().out
    assert f"float8       {mode}: {len(inputs.converted)} of " in summary and "emulated on the CPU" in summary
    assert results["compile"] and results["compiled_graphs"] > 0


@pytest.mark.slow
def test_blocks_py_times_sdxl_in_rowwise_float8_compiled(dynamo_eager):
    # bench/blocks.py converts with the same t2ibench.train.fp8 and compiles as the run: its UNet levels' blocks,
    # proj_in included, run compiled in float8, each level's compile seconds apart from its timed runs.
    import blocks  # bench/blocks.py

    result = blocks.main(["--model_config", "sdxl-tiny", "--precomputed", "--image_size", "64", "--global_batch", "2",
                          "--microbatch", "2", "--gpus", "1", "--num_workers", "0", "--fp8", "rowwise", "--compile",
                          "--repeats", "1", "--warmup", "0", "--harness_batches", "2"])
    assert result["fp8"] == "rowwise" and result["predicted"][0]["samples_per_sec_per_gpu"] > 0
    levels = result["measured"]["replicated"]["blocks"]
    assert result["compile"] and all(level["compile_seconds"] > 0 for level in levels)


def test_layers_float8_cannot_multiply_stay_in_the_runs_precision():
    rows = memory.linear_rows_per_sample("flux1-tiny", 64, "text_states")
    model = memory.build_meta_model("flux1-tiny", precomputed=True)
    conversion = fp8.convert(model.denoiser, "tensorwise", rows, emulate=True)
    modules = dict(model.denoiser.named_modules())
    for name in conversion.converted:
        module = modules[name]
        assert type(module).__name__ == "Float8LinearUnderAutocast"
        assert module.in_features % 16 == module.out_features % 16 == rows[name] % 16 == 0
    # Applied once per sample (AdaLN modulation, timestep and pooled-text embedders): one row per sample.
    assert conversion.kept and all("rows per sample 1 not a multiple of 16" in why for why in conversion.kept.values())
    assert all(type(modules[name]) is torch.nn.Linear for name in conversion.kept)


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_refused_on_a_gpu_without_float8_tensor_cores(monkeypatch, capability, refused):
    # From outside: torch says a CUDA GPU of this capability is here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    if not refused:
        fp8.check("tensorwise", "amp_bf16")
        return
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(FLUX_TINY + ["--max_duration", "2ba", "--fp8", "tensorwise", "--compile"])
    message = str(exit_info.value.code)
    assert message.startswith("benchmark.py: error: --fp8 tensorwise: NVIDIA A100-SXM4-80GB (compute capability "
                              f"{capability[0]}.{capability[1]}) has no float8 tensor cores") and "\n" not in message


def test_fp8_that_would_convert_no_layer_is_refused_in_one_line():
    # sdxl-tiny at 32 px: 16 latent tokens at the first level, 4 and 1 below it where its transformers
    # are, 1 row per sample in the embeddings: no product float8 can run (at 64 px, 30 of the 139 can).
    message = error_of(benchmark.main, ["--model_config", "sdxl-tiny", "--use_synth_data", "--image_size", "32",
                                        "--batch_size", "2", "--num_workers", "0", "--max_duration", "1ba",
                                        "--precision", "amp_bf16", "--fp8", "tensorwise", "--compile"])
    assert message.startswith("benchmark.py: error: --fp8 tensorwise: none of the denoiser's 139 Linear layers can "
                              "run in float8 at this size"), message
    assert "drop --fp8, or use a larger --image_size" in message


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_fp8_without_compile_is_refused_in_one_line(mode):
    import blocks  # bench/blocks.py: the same rule, the same line, before anything is timed

    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(FLUX_TINY + ["--max_duration", "2ba", "--fp8", mode])
    message = str(exit_info.value.code)
    assert message.startswith(f"benchmark.py: error: --fp8 {mode} needs --compile: eager float8")
    assert "\n" not in message
    predicted = error_of(blocks.main, ["--model_config", "flux1-tiny", "--precomputed", "--image_size", "32",
                                       "--gpus", "1", "--global_batch", "8", "--fp8", mode], prog="blocks.py")
    assert predicted.removeprefix("blocks.py") == message.removeprefix("benchmark.py")


def test_fp8_rowwise_compiled_on_fp32_weights_under_autocast_is_refused_in_one_line():
    # What it would meet at the first backward, outside the product: AOT autograd traces the backward
    # under the forward's autocast, which casts the rowwise float8 weight.
    torch._dynamo.reset()
    layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    fp8.convert(layers, "rowwise", {"0": 16, "1": 16}, emulate=True)
    layers.compile(backend="aot_eager")
    with pytest.raises(Exception, match="axiswise scaling is not supported"):
        with torch.autocast("cpu", torch.bfloat16):
            out = layers(torch.randn(16, 32))
        out.float().sum().backward()
    torch._dynamo.reset()
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(FLUX_TINY + ["--max_duration", "2ba", "--fp8", "rowwise", "--compile"])
    message = str(exit_info.value.code)
    assert message.startswith("benchmark.py: error: --fp8 rowwise --compile with fp32 weights under autocast")
    assert "--weight_casts step" in message and "\n" not in message
    # Under FSDP the compiled backward stops the same way (two CPU ranks, full_shard): blocks.py's prediction
    # for 2 GPUs (flux1-tiny shards there) is refused by the same rule, in one line.
    import blocks  # bench/blocks.py

    sharded = error_of(blocks.main, ["--model_config", "flux1-tiny", "--precomputed", "--image_size", "32", "--gpus",
                                     "2", "--global_batch", "8", "--precision", "amp_bf16", "--fp8", "rowwise",
                                     "--compile"], prog="blocks.py")
    assert sharded.startswith("blocks.py: error: --fp8 rowwise --compile with --fsdp under autocast")


def test_fp8_with_fp16_is_refused_in_one_line():
    with pytest.raises(SystemExit) as exit_info:
        fp8.check("rowwise", "amp_fp16")
    assert "--fp8 rowwise with --precision amp_fp16" in str(exit_info.value.code)


@pytest.mark.slow
def test_memory_model_counts_the_float8_weights_kept_for_backward():
    rows = memory.linear_rows_per_sample("flux1-tiny", 64, "text_states")
    model = memory.build_meta_model("flux1-tiny", precomputed=True)
    conversion = fp8.convert(model.denoiser, "tensorwise", rows, emulate=True)
    modules = dict(model.denoiser.named_modules())
    converted_weights = sum(modules[name].weight.numel() for name in conversion.converted)
    plans = {mode: memory.plan("flux1-tiny", 64, precomputed=True, fp8=mode) for mode in fp8.FP8_MODES}
    per_microbatch = {mode: plan["activation_bytes_per_microbatch"] for mode, plan in plans.items()}
    casts = {mode: plan["fixed_bytes_breakdown"]["weight_casts_or_gathered"] for mode, plan in plans.items()}
    # Tensorwise keeps each converted weight in float8 for backward (1 byte each, whatever the
    # microbatch); rowwise recasts it from the fp32 weight there and keeps nothing.
    assert per_microbatch["tensorwise"] - per_microbatch["off"] == pytest.approx(converted_weights, rel=0.01)
    assert abs(per_microbatch["rowwise"] - per_microbatch["off"]) < 0.01 * converted_weights
    # Neither goes through autocast's bf16 weight casts (2 bytes per parameter) for the converted layers.
    for mode in ("tensorwise", "rowwise"):
        assert casts["off"] - casts[mode] >= 0.95 * 2 * converted_weights
        assert plans[mode]["fp8"] == mode
