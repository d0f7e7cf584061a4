"""Float8 training of the denoiser's Linear layers through torchao (`--fp8 tensorwise|rowwise`):
which layers can be converted, the refusal on GPUs without float8 tensor cores, emulation on a CPU.
What it does and what was checked: docs/flux.md, "Float8 training".
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import torch

from t2ibench.core.errors import fail

FP8_MODES = ("off", "tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)
ALIGNMENT = 16  # torch._scaled_mm: every dimension of a float8 product a multiple of 16


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What `convert` did: the layers in float8 and those left in the run's precision, with why."""

    mode: str
    emulated: bool
    converted: tuple[str, ...]  # module names in the denoiser
    kept: dict[str, str]  # module name -> why it stays in the run's precision
    converted_params: int
    linear_params: int  # of every Linear, converted or not

    def summary(self) -> dict[str, Any]:
        """The results JSON's `fp8_conversion`: counts, not names (`converted` and `kept` have those)."""
        return {"mode": self.mode, "emulated": self.emulated, "converted_linears": len(self.converted),
                "kept_linears": len(self.kept), "converted_params": self.converted_params,
                "linear_params": self.linear_params}


def describe(summary: dict[str, Any]) -> str:
    """One line for a run's summary, from `Conversion.summary()`."""
    where = ("emulated on the CPU (torch._scaled_mm has no CPU kernel): float8's numerics, not its speed"
             if summary["emulated"] else "torch._scaled_mm on the GPU")
    total = summary["converted_linears"] + summary["kept_linears"]
    share = summary["converted_params"] / max(1, summary["linear_params"])
    return (f"{summary['mode']}: {summary['converted_linears']} of {total} Linear layers ({share:.0%} of their "
            f"parameters) in float8, the others in the run's precision; {where}")


def check(mode: str, precision: str) -> None:
    """Refuse `--fp8` where it cannot run, in one line, before anything is built."""
    if mode == "off":
        return
    if precision == "amp_fp16":
        fail(f"--fp8 {mode} with --precision amp_fp16: float8 training keeps the layers it does not convert in "
             "bf16 (torchao's recipes); use --precision amp_bf16 (the default on a GPU)")
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            fail(f"--fp8 {mode}: {torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]}) "
                 f"has no float8 tensor cores (they start at {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper, "
                 "Blackwell); drop --fp8")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        fail(f"--fp8 {mode}: torchao is not installed; pip install -r requirements.txt (it pins torchao)")


def check_compiled(mode: str, compiled: bool, fp32_weights_under_autocast: bool, sharded_under_autocast: bool = False
                   ) -> None:
    """Refuse `--fp8` without `--compile`, in one line: torchao's float8 training is made to run compiled.
    And rowwise scales where the compiled layers would see fp32 weights under autocast (no weight casts
    per step, no FSDP): AOT autograd (torch 2.7) traces the backward under the forward's autocast, which
    casts the rowwise float8 weight to bf16, and torchao 0.11 refuses ("aten._to_copy.default with
    axiswise scaling is not supported yet"); eager backward runs outside autocast, and the bf16 copies of
    weight casts per step need no cast. Under FSDP with autocast the compiled backward meets the same
    refusal (flux1-tiny, full_shard on two CPU ranks), though eager rowwise trains there."""
    if mode != "off" and not compiled:
        fail(f"--fp8 {mode} needs --compile: eager float8 runs every amax, scale and cast as a kernel of its own "
             "(65 ops per Linear forward and backward against 11 in bf16), which made Flux.1's blocks 2.4x slower "
             "than bf16 on an H100; add --compile, which fuses them into the layers' graphs")
    if mode == "rowwise" and fp32_weights_under_autocast:
        fail("--fp8 rowwise --compile with fp32 weights under autocast (--weight_casts microbatch, no --fsdp): the "
             "compiled backward casts the rowwise float8 weight, which torchao 0.11 cannot do; compute with bf16 "
             "weights (--weight_casts step on one device) or use --fp8 tensorwise")
    if mode == "rowwise" and compiled and sharded_under_autocast:
        fail("--fp8 rowwise --compile with --fsdp under autocast: the compiled backward casts the rowwise float8 "
             "weight FSDP gathers, which torchao 0.11 cannot do; use --fp8 tensorwise, or rowwise on one device "
             "with --weight_casts step")


def emulated_here() -> bool:
    """Whether float8 products are emulated: no CUDA GPU (the CPU has no `_scaled_mm` kernel)."""
    return not torch.cuda.is_available()


def why_kept(linear: torch.nn.Linear, rows_per_sample: int | None) -> str | None:
    """Why a Linear stays in the run's precision (None: it is converted)."""
    if rows_per_sample is None:
        return "not run in the step"
    odd = [f"{name} {size}" for name, size in (("input features", linear.in_features),
                                              ("output features", linear.out_features),
                                              ("rows per sample", rows_per_sample)) if size % ALIGNMENT]
    return f"{', '.join(odd)} not a multiple of {ALIGNMENT}" if odd else None


def config_of(mode: str, emulate: bool) -> Any:
    """torchao's recipe `mode` (its defaults), emulated or not."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(mode), emulate=emulate)


def flattens_without_copy(tensor: torch.Tensor) -> bool:
    """Whether `tensor.reshape(-1, last dimension)` is a view: its leading dimensions merge into rows."""
    merged_stride = None
    for size, stride in reversed(list(zip(tensor.shape[:-1], tensor.stride()[:-1]))):
        if size == 1:
            continue
        if merged_stride is not None and stride != merged_stride:
            return False
        merged_stride = stride * size
    return True


def dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor` fills its span of memory with no gaps: a contiguous tensor with its dimensions
    permuted (a slice is not). An elementwise op's output keeps such a layout, else it is contiguous."""
    expected = 1
    for size, stride in sorted(((size, stride) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1),
                               key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def scales_input_by_row(config: Any) -> bool:
    """Whether the recipe scales a layer's input per row (rowwise) rather than by one number (tensorwise)."""
    from torchao.float8.config import ScalingGranularity

    return config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE


@functools.cache  # one class: isinstance checks hold across conversions
def _float8_linear_class() -> type:
    from torchao.float8.float8_linear import Float8Linear

    class Float8LinearUnderAutocast(Float8Linear):
        """torchao 0.11's Float8Linear, run outside autocast on its input cast to the autocast dtype,
        and on an input it can flatten into rows without a copy under rowwise scales.

        Autocast: its own forward casts the input for CUDA autocast only (`torch.is_autocast_enabled()`
        is CUDA's) and leaves the float8 product to autocast, which then casts the fp32 master weight's
        float8 tensor to bf16: fine for tensorwise scales, refused for rowwise ("aten._to_copy.default
        with axiswise scaling is not supported yet"), measured on the CPU and on the same path under
        CUDA autocast with DDP's fp32 weights. Casting the input here, for the autocast of its own
        device, and running the product outside autocast gives every recipe, on every device, what
        torchao's bf16-weight path computes (FSDP2 hands it bf16 weights already).

        Layout: torchao flattens the float8 input to rows (`reshape(-1, in_features)`); where that
        needs a copy, a rowwise float8 tensor cannot be copied ("aten.clone.default with axiswise
        scaling is not supported yet"). That happens where the input is a dense permuted layout, which
        the float8 cast keeps (a slice, such as Flux's joint-attention outputs, comes out of the cast
        contiguous): SD2's and SDXL's transformers feed `proj_in` the GroupNorm's output permuted to
        channels-last (diffusers' Transformer2DModel with linear projections), and every such layer
        failed at the first step. Under rowwise scales such an input is made contiguous here, in the
        cast to the autocast dtype where there is one; torchao's backward flattens the same saved
        input, so the copy moves from the backward to the forward rather than adding one."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rows_scaled_input = scales_input_by_row(self.config)  # read once, not per forward

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            device = input.device.type
            autocast = device in ("cuda", "cpu") and torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if autocast else input.dtype
            # is_contiguous first: one C++ call settles almost every layer (measured 14 us for the
            # layout checks in Python, per layer and forward, on this 2-core VM).
            if (self.rows_scaled_input and not input.is_contiguous() and input.dim() > 2 and dense(input)
                    and not flattens_without_copy(input)):
                # One copy: `to` with the input's own dtype returns the input as it is, whatever the format.
                input = (input.contiguous() if input.dtype == dtype
                         else input.to(dtype, memory_format=torch.contiguous_format))
            if autocast:
                with torch.autocast(device, enabled=False):
                    return super().forward(input.to(dtype))
            return super().forward(input)

    return Float8LinearUnderAutocast


def convert(denoiser: torch.nn.Module, mode: str, rows_per_sample: dict[str, int], *,
            emulate: bool | None = None, refuse_none: bool = False) -> Conversion:
    """Swap the denoiser's Linear layers that float8 supports (`why_kept`) for torchao's Float8Linear,
    in place (same parameters: checkpoints, the EMA and the optimizer see no difference).
    `rows_per_sample`: module name -> rows of its input per sample (`memory.linear_rows_per_sample`).
    `refuse_none`: a run's whole denoiser, where converting no layer is refused in one line (a part
    of it, as bench/blocks.py times, may hold none that float8 takes)."""
    from torchao.float8.float8_linear_utils import swap_linear_layers

    emulate = emulated_here() if emulate is None else emulate
    linears = {name: m for name, m in denoiser.named_modules() if type(m) is torch.nn.Linear}
    kept = {name: why for name, m in linears.items() if (why := why_kept(m, rows_per_sample.get(name)))}
    converted = tuple(name for name in linears if name not in kept)
    if refuse_none and not converted:
        # A run of the run's precision recorded as float8 would be taken for a float8 measurement.
        why, count = collections.Counter(kept.values()).most_common(1)[0] if kept else ("none is run", 0)
        fail(f"--fp8 {mode}: none of the denoiser's {len(linears)} Linear layers can run in float8 at this size "
             f"({count} of them: {why}), so the run would train in its own precision under float8's name; drop "
             f"--fp8, or use a larger --image_size (float8 needs every dimension of a product a multiple of "
             f"{ALIGNMENT}, the tokens per sample too)")
    config, cls = config_of(mode, emulate), _float8_linear_class()
    # torchao's own conversion (convert_to_float8_training) with this module's Float8Linear subclass.
    swap_linear_layers(denoiser, lambda linear: cls.from_float(linear, config=config),
                       module_filter_fn=lambda module, name: name in converted)

    def params(names) -> int:
        return sum(p.numel() for name in names for p in linears[name].parameters())

    return Conversion(mode, emulate, converted, kept, params(converted), params(linears))


def linear_flops_per_sample(denoiser: torch.nn.Module, rows_per_sample: dict[str, int], names: tuple[str, ...]
                            ) -> float:
    """Forward and backward FLOPs per sample of the named Linear layers' products (2 per multiply-add;
    backward twice the forward: the input's and the weight's gradients)."""
    modules = dict(denoiser.named_modules())
    return sum(6.0 * rows_per_sample[name] * modules[name].in_features * modules[name].out_features
               for name in names)
