"""`--compile`: torch.compile of every repeated block of the modules a step runs, one block at a time
and in place, so that a block's repeats run one compiled graph (regional compilation), and the
seconds spent compiling. Which blocks: the family's `compile_blocks`; why block by block: docs/speed.md,
"--compile: block by block"; with aspect-ratio buckets, the blocks' spatial sizes are dynamic:
docs/speed.md, "With aspect-ratio buckets".
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch

# Recompilations dynamo allows per code object (the forward of a block class) before it runs that
# code eagerly from then on: torch 2.7's default is 8, while the SD2 UNet alone has 14 resnets of
# distinct shapes sharing ResnetBlock2D.forward, and evaluation and sampling (no grad, other batch
# sizes) add graphs of their own. Per block compiled, room for this many graphs.
GRAPHS_PER_BLOCK = 4
# Dynamo's two limits (torch 2.7 names; before 2.6: cache_size_limit, accumulated_cache_size_limit):
# graphs per code object and guarded object, and graphs per code object whatever the objects (256).
RECOMPILE_LIMITS = (("recompile_limit", "cache_size_limit"),
                    ("accumulated_recompile_limit", "accumulated_cache_size_limit"))
# The warning dynamo logs when a code object reaches a limit and runs eagerly from then on (torch 2.7,
# torch/_dynamo/convert_frame.py, logger torch._dynamo.convert_frame); its arguments: the limit's
# name, its value, the function.
LIMIT_HIT_LOGGER = "torch._dynamo.convert_frame"
LIMIT_HIT_MESSAGE = "torch._dynamo hit config."


def share_attention_processors(module: torch.nn.Module) -> None:
    """One attention processor object per processor class and settings, shared by every attention
    layer of `module` that has such a processor.

    diffusers (0.35) gives each `Attention` a processor object of its own, and dynamo guards on that
    object's identity, so every transformer block of the same shapes would compile again (sdxl-tiny:
    20 graphs for its 22 blocks, 11 once shared). Processors are plain objects holding settings at
    most (AttnProcessor2_0 and FluxAttnProcessor none, xFormers' its attention op), so two of one
    class with equal settings compute the same; a processor that is a module (with weights of its
    own) or holds unhashable state keeps its own object.
    """
    shared: dict[tuple, object] = {}
    for layer in module.modules():
        processor = getattr(layer, "processor", None)
        if processor is None or isinstance(processor, torch.nn.Module):
            continue
        key = (type(processor), tuple(sorted(vars(processor).items())))
        try:
            hash(key)
        except TypeError:
            continue
        layer.processor = shared.setdefault(key, processor)


def mark_spatial_sizes(value: Any) -> None:
    """Mark the dimensions of a block's input that an aspect-ratio bucket changes as dynamic, so that one
    graph serves every bucket: the height and width of a feature map or an image (N, C, H, W), the length
    of a sequence (N, L, C: an SDXL transformer block's image tokens, Flux.1's image and joint tokens),
    and the tokens of Flux.1's rotary embedding (cos, sin: L x D each). A text sequence is marked too:
    its length does not change, but in Flux.1's single-stream blocks it is a slice of the joint sequence,
    whose strides change with the image tokens (left static, it compiled again per token count). The
    mark is dynamo's weak one (`maybe_mark_dynamic`): a size the block's code needs as a constant (a
    side of 1) is guarded, not refused."""
    if isinstance(value, torch.Tensor):
        for dim in {4: (2, 3), 3: (1,)}.get(value.dim(), ()):
            torch._dynamo.maybe_mark_dynamic(value, dim)
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor) and item.dim() == 2:
                torch._dynamo.maybe_mark_dynamic(item, 0)


def compile_blocks(modules: Iterable[torch.nn.Module],
                   blocks_of: Callable[[torch.nn.Module], list[torch.nn.Module]], num_buckets: int = 0) -> int:
    """Compile each block of `modules` (`blocks_of(module)`, the family's `compile_blocks`) in place;
    the number of blocks compiled.

    `nn.Module.compile` keeps the block where it is (parameter names, checkpoint keys, the EMA's
    names, FSDP's units: unchanged) and compiles the block's forward when it first runs: the hooks
    around it (FSDP2's gathers, activation checkpointing's recomputation, which calls the block
    again) stay outside the graph and run as they do eagerly. Blocks of one class and shapes share
    the class's forward code, so they run one compiled graph; `dynamic=False` keeps each distinct
    shape its own static graph (dynamo would otherwise make the second shape it sees dynamic). What
    is outside the blocks (embeddings, the down- and upsampling convolutions, the output layers)
    runs eagerly: a few percent of the ops (docs/speed.md).

    `num_buckets` above 1 (a run of several aspect-ratio buckets, whose inputs to these blocks change
    with the bucket): each call marks the block's spatial sizes dynamic (`mark_spatial_sizes`) before
    the compiled forward sees them, so that a block compiles once for every bucket instead of once per
    bucket (measured: docs/speed.md). Dynamo's limits are raised to room for every graph, per bucket
    where a block could not be marked, so that no block falls back to eager; should one still reach a
    limit, `recompile_limit_hits` says so.
    """
    dynamic = num_buckets > 1
    if dynamic:
        # Duck sizing (torch.fx.experimental._config.use_duck_shape) gives two sizes of the same value
        # one symbol: a graph traced on a square bucket would hold height == width and compile again
        # for the first oblong one. Process-wide; only runs of several buckets turn it off.
        torch.fx.experimental._config.use_duck_shape = False
    num_blocks = num_static = 0
    for module in modules:
        share_attention_processors(module)
        for block in blocks_of(module):
            block.compile(dynamic=False)
            num_blocks += 1
            if not (dynamic and mark_before_compiled_call(block)):
                num_static += 1
    graphs = GRAPHS_PER_BLOCK * (num_blocks + num_static * (max(1, num_buckets) - 1))
    raise_recompile_limits(graphs)
    watch_recompile_limits()
    return num_blocks


def mark_before_compiled_call(block: torch.nn.Module) -> bool:
    """Run `mark_spatial_sizes` on every argument of `block` just before its compiled forward. A marker
    has to be set outside the compiled code (dynamo refuses to trace `maybe_mark_dynamic`), and
    `nn.Module.compile` compiles the whole call, forward hooks included: so the compiled call itself
    (torch 2.7: `_compiled_call_impl`, which `Module.__call__` runs) is wrapped. A torch without it
    keeps static graphs, one per bucket, within the limits `compile_blocks` sets (False)."""
    compiled = getattr(block, "_compiled_call_impl", None)
    if compiled is None:
        return False

    def marked_call(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            mark_spatial_sizes(value)
        return compiled(*args, **kwargs)

    block._compiled_call_impl = marked_call
    return True


def raise_recompile_limits(graphs: int) -> None:
    """Raise both of dynamo's recompile limits to at least `graphs` (never lower them)."""
    config = torch._dynamo.config
    for names in RECOMPILE_LIMITS:
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None:
            setattr(config, name, max(getattr(config, name), graphs))


class _LimitHits(logging.Handler):
    """Dynamo's warnings that a function reached a recompile limit, kept: from then on that function
    runs eagerly for every shape it has no graph for, which a benchmark must not do without a word."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith(LIMIT_HIT_MESSAGE) and len(record.args or ()) >= 3:
            limit, value, function = record.args[:3]
            self.hits.append(f"{function} reached {limit} ({value})")


_LIMIT_HITS = _LimitHits()


def watch_recompile_limits() -> None:
    """Keep dynamo's recompile-limit warnings from now on (once per process)."""
    logger = logging.getLogger(LIMIT_HIT_LOGGER)
    if _LIMIT_HITS not in logger.handlers:
        logger.addHandler(_LIMIT_HITS)


def recompile_limit_hits() -> list[str]:
    """Every function that has reached one of dynamo's recompile limits in this process so far (and runs
    eagerly for shapes it has no graph for), with the limit: "'forward' (.../resnet.py:320) reached
    recompile_limit (8)"."""
    return list(_LIMIT_HITS.hits)


def compile_step_parts(model: torch.nn.Module, blocks_of: Callable[[torch.nn.Module], list[torch.nn.Module]],
                       num_buckets: int = 0) -> int:
    """`--compile` of a training model (t2ibench.train.model's DiffusionModel): the blocks of every part that runs
    per step, the denoiser and, where the step runs them, the VAE encoder and the text encoders (the eager
    VAE encoder was 35-40% of an online SD2 step; the text encoders run on token ids online and on the
    tokens format); the number of blocks compiled. benchmark.py compiles its run with it, and
    bench/blocks.py each part it times, so that the blocks it times are compiled as the run's.
    `num_buckets`: the run's aspect-ratio buckets (0: square), which the denoiser's and the VAE encoder's
    blocks see; the text encoders' inputs do not depend on the bucket."""
    vae = getattr(model, "vae", None)
    image_parts = [model.denoiser, *([vae.encoder] if vae is not None else [])]
    return (compile_blocks(image_parts, blocks_of, num_buckets)
            + compile_blocks(model.text_encoders.values(), blocks_of))


def compile_seconds() -> float | None:
    """Seconds this process has spent compiling so far: dynamo's frames with their forward graphs, and
    the backward graphs AOT autograd compiles at their first backward (torch's own cumulative
    timers); None where this torch does not keep them."""
    timers = getattr(torch._dynamo.utils, "calculate_time_spent", None)
    if timers is None:
        return None
    spent = timers()
    return spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (its `unique_graphs` counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
