"""The kernels a training step launches on CUDA, counted on the meta device, per image and by kind.

    python bench/step_ops.py --model_config sdxl-base --image_size 1024 --precomputed --precomputed_format text_states

The step is the memory model's (`t2ibench.memory.step.build_meta_step`), run once under a dispatch
mode that sees every ATen op below autograd; what counts as a launch and a cast: docs/speed.md.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from t2ibench.families import family_of
from t2ibench.memory.step import build_meta_step
from t2ibench.datasets.precomputed import batch_text_format

KINDS = ("casts", "normalization", "elementwise", "matmul_conv", "attention", "grad_norm", "optimizer", "ema")
KIND_LABELS = {"casts": "weight, gradient and activation casts", "normalization": "normalization",
               "elementwise": "elementwise, reductions, copies, random", "matmul_conv": "matmul and convolution",
               "attention": "attention", "grad_norm": "gradient norm (grad_norm)",
               "optimizer": "optimizer (fused AdamW)", "ema": "EMA update"}
# ATen/native/cuda/MultiTensorApply.cuh (torch 2.7): per launch at most this many tensors by the
# number of tensor lists (depth 1..5), at most 320 blocks, each block one chunk of 65,536 elements.
MULTI_TENSOR_MAX_TENSORS = (110, 64, 48, 36, 30)
MULTI_TENSOR_MAX_BLOCKS = 320
MULTI_TENSOR_CHUNK_ELEMENTS = 65536
# ATen/native/cuda/Shape.cu (torch 2.7): torch.cat (and stack) copies at most this many inputs a launch.
CAT_INPUTS_PER_LAUNCH = 128
# Bytes of HBM the once-per-step updates read and write per fp32 parameter (4 bytes a tensor): fused AdamW
# reads the weight, gradient and two moments and writes three; the gradient norm reads the gradient; each
# microbatch after the first adds its gradient into the sum (two reads, one write); the EMA's lerp reads
# two and writes one; one GPU's bf16 copies (weight casts per step) are refreshed (fp32 in, bf16 out)
# and the first gradient upcast (bf16 in, fp32 out).
STEP_BYTES_PER_PARAM = {"adamw": 28, "grad_norm": 4, "accumulation": 12, "ema": 12, "copies": 12}
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
                       "lift_fresh", "_unsafe_view", "set_", "resize_", "_reshape_alias", "_local_scalar_dense",
                       "is_same_size", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride"})
MATMUL_CONV = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution",
                         "_convolution", "convolution_backward", "cudnn_convolution", "_scaled_mm"})
NORMALIZATION = frozenset({"native_group_norm", "native_group_norm_backward", "native_layer_norm",
                           "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"})
# Composer 0.32.1's Trainer per microbatch (_train_microbatch): the loss detached, cloned, averaged,
# scaled into the batch's total, the loss scaled in place before backward; per step: the total's
# zeros and the batch size copied to the device and read back (.item(), a host sync).
COMPOSER_KERNELS_PER_MICROBATCH = 5
COMPOSER_KERNELS_PER_STEP = 2
COMPOSER_SYNCS_PER_STEP = 1


def multi_tensor_launches(numels: list[int], depth: int) -> int:
    """Kernel launches of one `multi_tensor_apply` over tensors of these sizes with `depth` lists."""
    max_tensors = MULTI_TENSOR_MAX_TENSORS[depth - 1]
    launches = tensors = blocks = 0
    sizes = [n for n in numels if n > 0]
    for i, numel in enumerate(sizes):
        tensors += 1
        chunks = -(-numel // MULTI_TENSOR_CHUNK_ELEMENTS)
        for chunk in range(chunks):
            blocks += 1
            last = i == len(sizes) - 1 and chunk == chunks - 1
            if tensors == max_tensors or blocks == MULTI_TENSOR_MAX_BLOCKS or last:
                launches += 1
                blocks = 0
                # A tensor cut mid-way stays in the next launch's first slot.
                tensors = 0 if chunk == chunks - 1 else 1
    return launches


def classify(name: str, args: Any, out: Any) -> str | None:
    """The kind of kernel an ATen op launches (None: no kernel)."""
    if name in NO_KERNEL:
        return None
    if name in ("_to_copy", "copy_"):
        source = args[0] if name == "_to_copy" else args[1]
        result = out if isinstance(out, torch.Tensor) else args[0]
        if isinstance(source, torch.Tensor) and source.dtype != result.dtype:
            return "casts"
        return "elementwise"
    if name in MATMUL_CONV:
        return "matmul_conv"
    if "attention" in name:
        return "attention"
    if name in NORMALIZATION:
        return "normalization"
    return "elementwise"


FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


def op_work(func: Any, args: Any, kwargs: dict, out: Any) -> tuple[float, float, bool]:
    """One op's work for the roofline (t2ibench.core.devices.scaled_seconds): its FLOPs (torch's FlopCounterMode
    table: matmuls, convolutions, attention; 0 for the rest), the bytes of the tensors it reads and writes
    (each once: a lower bound for an op that reads an input twice), and whether it multiplies float8."""
    packet = func.overloadpacket
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    num_bytes = float(sum(t.numel() * t.element_size() for t in tensors))
    if packet is torch.ops.aten._scaled_mm:  # float8: (m, k) @ (k, n)
        a, b = args[0], args[1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1], num_bytes, True
    count = flop_registry.get(packet)
    flops = float(count(*args, **(kwargs or {}), out_val=out)) if count else 0.0
    # torchao's float8 tensors (torchao 0.11) reach a dispatch mode as the matmul of their original dtype and
    # call torch._scaled_mm below it: a matmul of one of them runs in float8.
    fp8 = bool(flops) and any(getattr(t, "_data", t).dtype in FLOAT8_DTYPES for t in tensors)
    return flops, num_bytes, fp8


class KernelCounter(TorchDispatchMode):
    """Counts kernel launches of the ops it sees, by kind, and host syncs (`.item()` and the like); with
    `work`, also each launching op's FLOPs and bytes (`op_work`)."""

    def __init__(self, work: bool = False):
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.host_syncs = 0
        self.phase = "forward"  # set by the caller: casts are also counted by phase
        self.casts_by_phase: Counter[str] = Counter()
        self.work: list[tuple[float, float, bool]] | None = [] if work else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.host_syncs += 1
        elif name.startswith(("_foreach_", "_fused_")):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            kind = "casts" if name == "_foreach_copy_" and lists[0][0].dtype != lists[1][0].dtype else "elementwise"
            self.kernels[kind] += multi_tensor_launches([t.numel() for t in lists[0]], len(lists))
            if self.work is not None:
                self.work.append(op_work(func, args, kwargs or {}, out))
        else:
            kind = classify(name, args, out)
            if kind is not None:
                self.kernels[kind] += 1
                if kind == "casts":
                    self.casts_by_phase[self.phase] += 1
                if self.work is not None:
                    self.work.append(op_work(func, args, kwargs or {}, out))
        return out


@dataclasses.dataclass
class StepKernels:
    """What one training step launches, and its parts."""

    microbatch: int
    batch_size_per_device: int
    per_microbatch: dict[str, int]  # forward, loss and backward of one microbatch, by kind
    per_step: dict[str, int]  # launched once per optimizer step, by kind
    host_syncs_per_step: int
    casts_per_microbatch_by_phase: dict[str, int]  # forward (and loss) against backward (recomputation included)
    work_per_microbatch: tuple[tuple[float, float, bool], ...] = ()  # each op's (FLOPs, bytes, fp8), with work=True
    work_per_step: tuple[tuple[float, float, bool], ...] = ()  # the once-per-step updates' bytes

    def work_per_image(self) -> list[tuple[float, float, bool]]:
        """The step's work (count_step_kernels' `work`) spread over its images, for the roofline."""
        scale = self.microbatches_per_step / self.batch_size_per_device
        return ([(f * scale, b * scale, fp8) for f, b, fp8 in self.work_per_microbatch]
                + [(f / self.batch_size_per_device, b / self.batch_size_per_device, fp8)
                   for f, b, fp8 in self.work_per_step])

    @property
    def microbatches_per_step(self) -> int:
        return self.batch_size_per_device // self.microbatch

    def per_image(self) -> dict[str, float]:
        step = Counter({k: v * self.microbatches_per_step for k, v in self.per_microbatch.items()})
        step.update(self.per_step)
        return {kind: step.get(kind, 0) / self.batch_size_per_device for kind in KINDS}


def count_step_kernels(model_config: str, image_size: int, microbatch: int, batch_size_per_device: int, *,
                       precision: str = "amp_bf16", norm_precision: str = "autocast", precomputed: bool = False,
                       precomputed_format: str | None = None, activation_checkpointing: bool = False,
                       weight_casts: str = "microbatch", use_ema: bool = True, work: bool = False) -> StepKernels:
    """Count one microbatch's forward, loss and backward on the meta device under CUDA's autocast
    rules, and the step's once-per-step kernels, for a run with these settings on one GPU; with `work`,
    each op's FLOPs and bytes too (`op_work`), and the per-step updates' bytes (STEP_BYTES_PER_PARAM)."""
    if batch_size_per_device % microbatch:
        raise ValueError(f"microbatch {microbatch} does not divide the per-device batch {batch_size_per_device}")
    copies = weight_casts == "step" and precision != "fp32"
    text_format = batch_text_format(family_of(model_config), precomputed, precomputed_format)
    meta = build_meta_step(model_config, image_size, precision=precision, norm_precision=norm_precision,
                           text_format=text_format, activation_checkpointing=activation_checkpointing,
                           low_precision_weights=copies)
    model, batch = meta.model, meta.batch(microbatch)
    counter = KernelCounter(work=work)
    with torch.random.fork_rng(devices=[]), counter:
        with meta.rules():
            loss = model.loss(model(batch), batch)
        counter.phase = "backward"
        loss.backward()
    per_microbatch = dict(counter.kernels)
    per_microbatch["elementwise"] = per_microbatch.get("elementwise", 0) + COMPOSER_KERNELS_PER_MICROBATCH

    trained = [p for p in model.denoiser.parameters() if p.requires_grad]
    numels = [p.numel() for p in trained]
    step: Counter[str] = Counter()
    microbatches = batch_size_per_device // microbatch
    # From the second microbatch on, each tensor's new gradient is added into the step's sum, one add
    # a tensor: by AccumulateGrad into autocast's fp32 gradients, or under weight casts per step by
    # the bf16 copy's hook into the fp32 sum (t2ibench.train.weight_casts).
    step["elementwise"] += (microbatches - 1) * len(trained) + COMPOSER_KERNELS_PER_STEP
    if copies:
        # The copies refreshed from the fp32 weights; the first microbatch's bf16 gradients upcast
        # into the fp32 sum (after its backward, one multi-tensor copy, whatever the microbatches).
        step["casts"] += 2 * multi_tensor_launches(numels, 2)
    # t2ibench.train.grad_norm (torch's get_total_norm on CUDA): the multi-tensor norm of every gradient
    # (its partial sums, then one launch that finishes them), those norms stacked, their norm.
    # --grad_clip_norm would add a few scalar ops and a multi-tensor multiply (off by default).
    step["grad_norm"] += multi_tensor_launches(numels, 1) + 1 + -(-len(numels) // CAT_INPUTS_PER_LAUNCH) + 1
    step["optimizer"] += multi_tensor_launches(numels, 4)  # fused AdamW: params, grads, two moments
    if use_ema:
        step["ema"] += multi_tensor_launches(numels, 2)  # ema.py: _foreach_lerp_(shadow, params, w)
    for p in model.parameters():
        p.grad = None
    per_param = (STEP_BYTES_PER_PARAM["adamw"] + STEP_BYTES_PER_PARAM["grad_norm"]
                 + (microbatches - 1) * STEP_BYTES_PER_PARAM["accumulation"]
                 + (STEP_BYTES_PER_PARAM["ema"] if use_ema else 0) + (STEP_BYTES_PER_PARAM["copies"] if copies else 0))
    return StepKernels(microbatch, batch_size_per_device, per_microbatch, dict(step),
                       counter.host_syncs + COMPOSER_SYNCS_PER_STEP, dict(counter.casts_by_phase),
                       tuple(counter.work) if work else (), ((0.0, float(per_param * sum(numels)), False),) if work else ())


def summary(kernels: StepKernels) -> dict[str, Any]:
    """The JSON-able figures: per image by kind, totals, and the step's parts."""
    per_image = kernels.per_image()
    return {"microbatch": kernels.microbatch, "batch_size_per_device": kernels.batch_size_per_device,
            "microbatches_per_step": kernels.microbatches_per_step,
            "kernels_per_image": sum(per_image.values()), "casts_per_image": per_image["casts"],
            "kernels_per_image_by_kind": per_image, "kernels_per_microbatch": kernels.per_microbatch,
            "casts_per_microbatch_by_phase": kernels.casts_per_microbatch_by_phase,
            "kernels_per_step_once": kernels.per_step, "host_syncs_per_step": kernels.host_syncs_per_step,
            "kernels_per_step": sum(kernels.per_microbatch.values()) * kernels.microbatches_per_step
            + sum(kernels.per_step.values())}


