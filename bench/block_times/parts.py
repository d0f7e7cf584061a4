"""bench/blocks.py's parts of the step: the set-up that holds the weights, each repeated block of the
denoiser and "the rest" (the model with every block a stand-in of zero cost) built from one meta-device
step on a device (or on the meta device, to count their memory), and the per-step updates (AdamW, the
EMA, one GPU's weight casts) over a probe of parameters. Each part is a function that runs one step of it.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from t2ibench.train import fp8
from t2ibench import memory
from t2ibench.train.compiling import compile_blocks, compile_step_parts
from t2ibench.families import family_of
from t2ibench.train.norms import set_norm_precision
from t2ibench.train.parallel import resolve_mode
from t2ibench.train.weight_casts import CastWeightsOncePerStep

OPTIMIZER_PROBE_PARAMS = 2**22  # at least this many parameters per optimizer, EMA and weight-cast timing (4M)


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a run holds the weights its blocks compute with: replicated (DDP, or one GPU) or sharded
    (FSDP: gathered in the autocast dtype), and cast by autocast in every microbatch or once per step
    into bf16 copies (t2ibench.train.weight_casts)."""

    sharded: bool
    weight_casts: str  # "microbatch" or "step"

    @property
    def label(self) -> str:
        return "sharded" if self.sharded else "replicated" if self.weight_casts == "microbatch" else "cast_per_step"

    def describe(self) -> str:
        return {"sharded": "sharded (FSDP: gathered in the autocast dtype)", "replicated": "replicated",
                "cast_per_step": "replicated, cast once per step into bf16 copies"}[self.label]

    def low_precision_weights(self, precision: str) -> bool:
        """The forward computes with weights in the autocast dtype (FSDP's gathered copy, the bf16 copies)."""
        return precision != "fp32" and (self.sharded or self.weight_casts == "step")


def mode_for(args: argparse.Namespace, gpus: int) -> str:
    """The sharding of a run on `gpus` GPUs (`--fsdp auto` resolved as benchmark.py resolves it)."""
    return resolve_mode(args.fsdp, family_of(args.model_config).parallelism, gpus)


def device_name(device: str) -> str:
    """The device as benchmark.py's results JSON names it ("device")."""
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# -- the step on the meta device: where the blocks are and what they see --------------------------

def meta_model(args: argparse.Namespace, low_precision: bool) -> Any:
    """The training model on the meta device; `low_precision`: the denoiser's weights in the autocast
    dtype, as the forward sees them under FSDP or weight copies."""
    dtype = memory.autocast_dtype(args.precision)
    return memory.build_meta_model(args.model_config, precomputed=args.precomputed,
                                   precomputed_format=args.text_format, frozen_dtype=dtype,
                                   denoiser_dtype=dtype if low_precision else None)


def autocast_policy(args: argparse.Namespace) -> memory.AutocastPolicy:
    policy = memory.CUDA_AUTOCAST if args.device_type == "cuda" else memory.probe_cpu_autocast()
    return policy.with_norms(args.norm_precision)


@dataclasses.dataclass
class BlockCalls:
    """What one meta-device step shows of the blocks, by name: inputs (args, kwargs), outputs, and the
    blocks the model's own gradient checkpointing wraps whole (Flux.1's; a UNet checkpoints the layers
    inside its levels)."""

    inputs: dict[str, tuple]
    outputs: dict[str, Any]
    wrapped: set[str]


def block_calls(args: argparse.Namespace, setup: Setup) -> BlockCalls:
    """Each block's inputs and outputs in one meta-device step at --microbatch, under the device's
    autocast rules, and (with --activation_checkpointing) which blocks the denoiser checkpoints whole."""
    model = meta_model(args, setup.low_precision_weights(args.precision))
    dtype = memory.autocast_dtype(args.precision)
    if args.fp8 != "off":
        memory.use_float8(model, args.fp8, rows(args), dtype, args.device_type)
    names = block_names(model.denoiser, args.model_config)
    checkpointed: set[int] = set()
    if args.activation_checkpointing:
        def record(module: Any, *call_args: Any) -> Any:  # what the model hands its checkpoint function
            checkpointed.add(id(module))
            return module(*call_args)
        model.denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=record)
    inputs, outputs = {}, {}
    handles = []
    for name, block in names.items():
        handles.append(block.register_forward_pre_hook(
            lambda module, a, k, name=name: inputs.__setitem__(name, (a, k)), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda module, a, out, name=name: outputs.__setitem__(name, out)))
    # With autograd on: what requires grad at a block's inputs (its backward computes their gradients).
    with memory.AutocastRules(autocast_policy(args), dtype, args.device_type), torch.random.fork_rng(devices=[]):
        model(memory.meta_batch(model, args.model_config, args.image_size, args.microbatch))
    for handle in handles:
        handle.remove()
    return BlockCalls(inputs, outputs, {name for name, block in names.items() if id(block) in checkpointed})


def block_names(denoiser: torch.nn.Module, model_config: str) -> dict[str, torch.nn.Module]:
    """The family's blocks (its FSDP units) by their names in the denoiser, in order."""
    blocks = {id(b) for b in family_of(model_config).fsdp_blocks(denoiser)}
    return {name: module for name, module in denoiser.named_modules() if id(module) in blocks}


def rows(args: argparse.Namespace) -> dict[str, int]:
    return memory.linear_rows_per_sample(args.model_config, args.image_size, args.text_format)


def groups(denoiser: torch.nn.Module, model_config: str) -> dict[str, list[str]]:
    """Blocks of one structure (class and parameter shapes) together: 'transformer_blocks.*' -> names."""
    by_structure: dict[tuple, list[str]] = {}
    for name, block in block_names(denoiser, model_config).items():
        key = (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
        by_structure.setdefault(key, []).append(name)
    labelled = {}
    for names in by_structure.values():
        prefixes = {name.rsplit(".", 1)[0] for name in names}
        label = f"{prefixes.pop()}.*" if len(names) > 1 and len(prefixes) == 1 else names[0]
        labelled[label] = names
    return labelled


# -- the parts, each built on a device ("meta" to count its memory) -----------------------------------

def checkpointing(args: argparse.Namespace, model: Any, device: str) -> Callable[..., Any] | None:
    """Turn on the denoiser's gradient checkpointing as the run does (--activation_checkpointing) and
    return the function the model wraps a checkpointed module with. On a device: diffusers' own, as
    benchmark.py calls `enable_gradient_checkpointing()`; on the meta device the memory model's, which
    recomputes under its autocast rules."""
    if not args.activation_checkpointing:
        return None
    if device == "meta":
        memory.use_checkpointing(model, autocast_policy(args), memory.autocast_dtype(args.precision),
                                 args.device_type)
    else:
        model.denoiser.enable_gradient_checkpointing()
    return next(m._gradient_checkpointing_func for m in model.denoiser.modules()
                if getattr(m, "gradient_checkpointing", False))


def materialize(module: torch.nn.Module, device: str, seed: int) -> torch.nn.Module:
    """A meta-device module on `device` with random weights (timing does not depend on their values)."""
    module = module.to_empty(device=device)
    if device == "meta":
        return module
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=generator)
        for b in module.buffers():
            b.zero_()
    return module


def real_tensors(tree: Any, device: str, seed: int) -> Any:
    """Tensors of the meta tensors' shapes and dtypes on `device` (floats random, the rest zeros); the
    floats that required grad in the step require it here too."""
    generator = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)

    def make(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            x = torch.randn(t.shape, device=device, generator=generator).to(t.dtype)
            return x.requires_grad_(t.requires_grad)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return tree_map_only(torch.Tensor, make, tree)


def autocast(args: argparse.Namespace, device: str) -> Any:
    """The run's autocast: torch's on a device, the memory model's rules on the meta device."""
    dtype = memory.autocast_dtype(args.precision)
    if device == "meta":
        return memory.AutocastRules(autocast_policy(args), dtype, args.device_type)
    return torch.autocast(device, dtype=dtype, enabled=dtype is not None)


def prepare(module: torch.nn.Module, args: argparse.Namespace, setup: Setup, prefix: str, device: str
            ) -> CastWeightsOncePerStep | None:
    """The run's settings on a materialized part (names in the denoiser under `prefix`): the norms and
    float8 as benchmark.py sets them (on the meta device the autocast rules and the meta model carry
    both), FSDP's bf16 weights, or the one GPU's bf16 copies (returned: begun, their step running)."""
    if setup.sharded and args.precision == "amp_bf16":
        module.to(torch.bfloat16)
    if device != "meta":
        if args.precision == "amp_bf16":
            set_norm_precision(module, args.norm_precision)
        if args.fp8 != "off":
            sub = {name[len(prefix):]: n for name, n in rows(args).items() if name.startswith(prefix)}
            fp8.convert(module, args.fp8, sub)
    if setup.weight_casts == "step" and args.precision == "amp_bf16":
        casts = CastWeightsOncePerStep(module)
        casts.begin_step()  # the microbatches of a step compute with the copies; timed per step apart
        return casts
    return None


def steady_gradients(module: torch.nn.Module) -> None:
    """Gradient accumulation's steady state: the gradients exist and backward adds into them."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def block_step(args: argparse.Namespace, setup: Setup, name: str, calls: BlockCalls, part: torch.nn.Module,
               wrap: Callable[..., Any] | None, device: str) -> Callable[[], None]:
    """One forward and backward of the block `name` (built from the meta `part`) on its recorded inputs."""
    block = materialize(part, device, args.seed)
    casts = prepare(block, args, setup, name + ".", device)
    if args.compile and device != "meta":  # the block's own compiled blocks, as the run compiles the denoiser's
        compile_blocks([block], family_of(args.model_config).compile_blocks)
    block.train()
    block_args, block_kwargs = real_tensors(calls.inputs[name], device, args.seed)
    leaves = [t for t in tree_flatten((block_args, block_kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outputs = [t for t in tree_flatten(calls.outputs[name])[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    grads = real_tensors([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outputs], device, args.seed + 1)
    steady_gradients(block)
    # The model checkpoints this block whole (Flux.1): wrap it as the model's forward does.
    call = functools.partial(wrap, block) if name in calls.wrapped and wrap is not None else block

    def step() -> None:
        for leaf in leaves:  # the gradient of a block's input is handed on in the run, not summed into
            leaf.grad = None
        with autocast(args, device):
            out = call(*block_args, **block_kwargs)
        torch.autograd.backward([t for t in tree_flatten(out)[0]
                                 if isinstance(t, torch.Tensor) and t.is_floating_point()], grads)

    step.casts = casts  # kept alive with the step
    return step


class StandIn(torch.autograd.Function):
    """A block of zero cost: outputs of the recorded shapes (zeros), zero gradients to its inputs."""

    @staticmethod
    def forward(ctx, shapes: list, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.inputs = [(t.shape, t.dtype) for t in inputs]
        return tuple(torch.zeros(shape, dtype=dtype, device=inputs[0].device) for shape, dtype in shapes)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        return (None, *(torch.zeros(shape, dtype=dtype, device=grads[0].device) for shape, dtype in ctx.inputs))


class StandInBlock(torch.nn.Module):
    """In place of a block: its recorded outputs, at no cost. What the parent reads of the block
    (a UNet asks its up blocks for `resnets` and `has_cross_attention`) comes from the original, kept on
    the meta device and not registered (never materialized)."""

    def __init__(self, output: Any, original: torch.nn.Module):
        super().__init__()
        leaves, self.spec = tree_flatten(output)
        self.shapes = [(t.shape, t.dtype) for t in leaves]
        object.__setattr__(self, "original", original)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return tree_unflatten(list(StandIn.apply(self.shapes, *inputs)), self.spec)


def meta_rest(model: Any, calls: BlockCalls, model_config: str) -> Any:
    """A copy of the meta `model` with every block a stand-in."""
    model = copy.deepcopy(model)
    for name, block in block_names(model.denoiser, model_config).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.denoiser.get_submodule(parent), attr, StandInBlock(calls.outputs[name], block))
    return model


def rest_step(args: argparse.Namespace, setup: Setup, model: Any, device: str) -> Callable[[], None]:
    """The training model's step (built from the meta `model` of stand-ins): the parts not repeated."""
    model = materialize(model, device, args.seed)
    casts = prepare(model.denoiser, args, setup, "", device)
    if args.precision == "amp_bf16" and device != "meta":
        set_norm_precision(model, args.norm_precision)  # the frozen encoders' norms too, as benchmark.py's
    if args.compile and device != "meta":  # the stand-ins hold no block: what the run compiles outside them
        compile_step_parts(model, family_of(args.model_config).compile_blocks)
    model.train()
    batch = memory.meta_batch(model, args.model_config, args.image_size, args.microbatch, device=device)
    steady_gradients(model.denoiser)

    def step() -> None:
        with autocast(args, device):
            loss = model.loss(model(batch), batch)
        loss.backward()

    step.casts = casts
    return step


def adamw_step(args: argparse.Namespace) -> Callable[[], None]:
    """AdamW's step (fused on a GPU, as benchmark.py's auto) over OPTIMIZER_PROBE_PARAMS fp32 parameters."""
    params = probe_params(args)
    for p in params:
        p.grad = torch.zeros_like(p)
    return torch.optim.AdamW(params, lr=1e-4, fused=args.device == "cuda").step


def ema_step(args: argparse.Namespace) -> Callable[[], None]:
    """The EMA's lerp (ema.py's update) over OPTIMIZER_PROBE_PARAMS fp32 parameters."""
    params = probe_params(args)
    shadow = [torch.zeros_like(p) for p in params]

    def ema() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(shadow, params, 1e-3)
    return ema


def weight_casts_step(args: argparse.Namespace) -> Callable[[], None]:
    """One step's weight casts as t2ibench.train.weight_casts runs them over OPTIMIZER_PROBE_PARAMS fp32
    parameters: the bf16 copies refreshed, and the copies' gradients (the backward's, here a buffer
    handed over without a kernel) made the fp32 weights' for the optimizer, whose zero_grad drops them."""
    module = torch.nn.Module()
    for i, p in enumerate(probe_params(args)):
        module.register_parameter(f"p{i}", p)
    casts = CastWeightsOncePerStep(module)
    casts.begin_step()
    backward_grads = [torch.zeros_like(copy) for copy in module.parameters()]
    casts.end_step()

    def step() -> None:
        casts.begin_step()
        for copy, grad in zip(module.parameters(), backward_grads):
            copy.grad = grad
        casts.end_step()
        for master in module.parameters():
            master.grad = None
    return step


def probe_params(args: argparse.Namespace) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(OPTIMIZER_PROBE_PARAMS // 4, device=args.device)) for _ in range(4)]
