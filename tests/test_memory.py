"""The memory model (gpu_memory.py, bench/memory.py), low-precision norms, and no host work per microbatch.

The count is checked against a real CPU step (the CPU allocator's own running total, from the
profiler's allocation events), with CPU autocast's rules in place of CUDA's; CUDA's rules are
checked op by op; the JSON contract, FSDP's per-GPU bytes and `auto` are checked on the tiny model.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpu_memory as memory  # noqa: E402
from model import (AutocastGroupNorm, AutocastLayerNorm, Fp32GroupNorm, StableDiffusion, build_components,  # noqa: E402
                   set_norm_precision)
from tokenizer import tokenize  # noqa: E402


def _bench_memory():
    """bench/memory.py, the command, imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench_memory()
REQUIRED_KEYS = {"activation_bytes_per_image", "fixed_bytes", "microbatch", "train_flops_per_image"}


@pytest.mark.parametrize("precision,norm_precision", [("fp32", "fp32"), ("amp_bf16", "autocast"), ("amp_bf16", "fp32")])
def test_count_matches_a_real_cpu_step(precision, norm_precision):
    # The same step counted on the meta device (CPU autocast's rules, the CPU's attention kernel)
    # and run for real: what is alive when backward starts is what was saved for backward (measured
    # to within 0.2% here: the loss and a few scalars). 1% would still catch any error of method: a
    # view counted apart from its storage, a cast dtype or a missed kernel moves the count by whole
    # activations (tens of percent). The real peak may only exceed the count by kernels' scratch
    # buffers, which no op-level count sees (a CPU convolution backward's is 5% of this tiny step).
    counted = BENCH.count_cpu_step("tiny", 64, 2, precision, norm_precision)
    measured = BENCH.measure_cpu_step("tiny", 64, 2, precision, norm_precision)
    assert measured["after_forward_bytes"] == pytest.approx(counted.after_forward_bytes, rel=0.01)
    assert counted.saved_bytes == pytest.approx(counted.after_forward_bytes, rel=0.01)
    assert 0.99 * counted.backward_peak_bytes <= measured["peak_bytes"] <= 1.15 * counted.backward_peak_bytes


def test_cuda_rules_cast_as_cuda_autocast_does():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, device="meta")
    linear = torch.nn.Linear(8, 8, device="meta")
    x = torch.randn(2, 8, 16, 16, device="meta")
    with memory.AutocastRules(memory.CUDA_AUTOCAST, torch.bfloat16) as rules:
        y = conv(x)
        normed = torch.nn.functional.group_norm(y, 4)
        upsampled = torch.nn.functional.interpolate(y, scale_factor=2.0, mode="nearest")
        tokens = y.flatten(2).transpose(1, 2)
        twice = linear(linear(tokens))
        q = tokens.view(2, 256, 2, 4).transpose(1, 2)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert y.dtype == twice.dtype == attention.dtype == torch.bfloat16
    assert normed.dtype == upsampled.dtype == torch.float32  # torch 2.7's CUDA fp32 list
    assert len(rules.weight_casts) == 4  # conv and linear weights and biases, each cast once (the cache)
    assert attention.grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"  # no L x L matrix kept
    with memory.AutocastRules(memory.CUDA_AUTOCAST.with_low_precision_norms(), torch.bfloat16):
        assert torch.nn.functional.group_norm(conv(x), 4).dtype == torch.bfloat16
    with memory.AutocastRules(memory.CUDA_AUTOCAST, None):  # fp32: no casts, memory-efficient attention
        q32 = torch.randn(2, 2, 256, 4, device="meta", requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q32, q32, q32)
    assert out.dtype == torch.float32 and out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"


def test_json_contract_and_the_microbatch_fits(capsys):
    gib = 2.0  # the tiny model: a microbatch in the hundreds fits in 2 GiB beside the CUDA context
    result = BENCH.main(["--model_config", "tiny", "--image_size", "64", "--gpu_memory_gib", str(gib), "--json"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert REQUIRED_KEYS <= set(figures) and figures == json.loads(json.dumps(result))
    micro = figures["microbatch"]
    assert micro >= 1 and micro & (micro - 1) == 0  # a power of two
    reserve = 1 + figures["allocator_reserve_fraction"]

    def needed(b: int) -> float:
        return (figures["fixed_tensor_bytes"] + figures["peak_bytes_per_image"] * b
                + figures["peak_bytes_per_microbatch"]) * reserve + figures["cuda_context_bytes"]

    assert needed(micro) <= gib * 2**30 < needed(2 * micro)
    assert figures["fixed_bytes"] == int(figures["fixed_tensor_bytes"] * reserve + figures["cuda_context_bytes"])
    by_norm = figures["activation_bytes_per_image_by_norm_precision"]
    assert by_norm["autocast"] == figures["activation_bytes_per_image"] < by_norm["fp32"]
    assert figures["train_flops_per_image"] > 0


def test_encoders_keep_nothing_for_backward():
    # Online and on precomputed latents with token ids, the UNet sees the same inputs and the VAE and
    # text encoder run without gradients: the same bytes per image are saved for backward.
    online = memory.activation_model("tiny", 64)
    precomputed = memory.activation_model("tiny", 64, precomputed=True)
    assert online.saved_per_image == precomputed.saved_per_image > 0
    fp32_norms = memory.activation_model("tiny", 64, norm_precision="fp32")  # counted by the JSON test
    assert fp32_norms.saved_per_image > online.saved_per_image  # fp32 norm outputs kept for backward


def test_fsdp_shards_what_each_mode_shards():
    parts = {mode: memory.fixed_bytes("tiny", fsdp=mode, num_gpus=8, weight_cast_bytes=1000)
             for mode in memory.FSDP_MODES}
    none, grad_op, full = parts["none"], parts["shard_grad_op"], parts["full_shard"]
    for name in ("gradients", "adamw_moments", "ema"):
        assert grad_op[name] == full[name] == none[name] // 8
    assert grad_op["weights"] == full["weights"] == none["weights"] // 8  # fp32 masters sharded at rest
    assert none["ddp_buckets"] > 0 and grad_op["ddp_buckets"] == full["ddp_buckets"] == 0
    # Parameters gathered in bf16: all of them from forward to backward, or two blocks at a time.
    assert grad_op["weight_casts_or_gathered"] == none["weights"] // 2 > full["weight_casts_or_gathered"] > 0
    assert sum(none.values()) > sum(grad_op.values()) > sum(full.values())
    assert memory.fixed_bytes("tiny", fsdp="none", num_gpus=1)["ddp_buckets"] == 0  # no DDP on one GPU


def test_auto_microbatch_divides_the_per_device_batch_and_grows_with_memory():
    context = memory.CUDA_CONTEXT_BYTES
    small, large = (memory.auto_microbatch("tiny", 64, context + extra * 2**20, 48) for extra in (12, 400))
    assert 48 % small == 0 and 48 % large == 0 and 1 <= small < large <= 16  # 16: the largest power of two in 48
    assert memory.auto_microbatch("tiny", 64, context, 48) == 1  # nothing fits: still a valid microbatch


def test_low_precision_norms_keep_parameters_and_run_in_the_autocast_dtype():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.GroupNorm(2, 8), torch.nn.LayerNorm(8))
    module[0].to(torch.bfloat16).requires_grad_(False)  # a frozen part stored in bf16
    before = [(id(p), p.dtype, p.requires_grad) for p in module.parameters()]
    keys = list(module.state_dict())
    assert set_norm_precision(module, "autocast") == 2
    assert isinstance(module[0], AutocastGroupNorm) and isinstance(module[1], AutocastLayerNorm)
    assert [(id(p), p.dtype, p.requires_grad) for p in module.parameters()] == before
    assert list(module.state_dict()) == keys
    x = torch.randn(2, 8, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = module[0](x.bfloat16())
        assert low.dtype == torch.bfloat16
        set_norm_precision(module, "fp32")
        assert isinstance(module[0], Fp32GroupNorm) and module[0](x.bfloat16()).dtype == torch.float32
    assert module[0](x.bfloat16()).dtype == torch.bfloat16  # without autocast: plain GroupNorm


class HostToDevice(TorchDispatchMode):
    """Copies from a host (CPU) tensor to another device, by op and shape."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in ("aten::_to_copy", "aten::copy_"):
            source = args[1] if name == "aten::copy_" else args[0]
            target = args[0].device if name == "aten::copy_" else kwargs.get("device")
            if source.device.type == "cpu" and target is not None and torch.device(target).type != "cpu":
                self.copies.append((name, tuple(source.shape)))
        return func(*args, **kwargs)


def test_steady_state_step_copies_nothing_from_host_but_the_batch():
    # The model on the meta device stands in for a GPU: a host tensor used with its tensors must be
    # copied over, and the copy shows as an op from cpu to meta. Every per-microbatch option is on
    # (caption dropout, min-SNR weighting, offset noise, loss bins) and the EMA updates after each step.
    from ema import EMA

    torch.manual_seed(0)
    parts = build_components("tiny")
    model = StableDiffusion(parts.unet, parts.vae, parts.text_encoder, parts.noise_scheduler, parts.latent_scale,
                            snr_gamma=5.0, offset_noise=0.1)
    empty_ids = tokenize(parts.tokenizer, [""])
    with torch.no_grad():
        model.set_caption_dropout(0.5, empty_ids, parts.text_encoder(empty_ids)[0])
    model.to("meta").train()
    ema = EMA(half_life="10ba")
    batch = {"image": torch.zeros(2, 3, 64, 64, dtype=torch.uint8, device="meta"),
             "captions": torch.zeros(2, 77, dtype=torch.long, device="meta")}
    copies = []
    for step in range(3):
        with HostToDevice() as counter:
            model.loss(model(batch), batch).backward()
            ema.update(model)
        copies.append(counter.copies)
    assert copies[0], "the first step moves the constants to the device: the counter must see that"
    assert copies[1] == copies[2] == [], copies
