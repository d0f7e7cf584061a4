"""`--compile`: torch.compile of every repeated block of the modules a step runs, one block at a time
and in place, so that a block's repeats run one compiled graph (regional compilation), and the
seconds spent compiling. Which blocks: the family's `compile_blocks`; why block by block: docs/speed.md,
"--compile: block by block".
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

# Recompilations dynamo allows per code object (the forward of a block class) before it runs that
# code eagerly from then on: torch 2.7's default is 8, while the SD2 UNet alone has 14 resnets of
# distinct shapes sharing ResnetBlock2D.forward, and evaluation and sampling (no grad, other batch
# sizes) add graphs of their own. Per block compiled, room for this many graphs.
GRAPHS_PER_BLOCK = 4


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


def compile_blocks(modules: Iterable[torch.nn.Module],
                   blocks_of: Callable[[torch.nn.Module], list[torch.nn.Module]]) -> int:
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
    """
    num_blocks = 0
    for module in modules:
        share_attention_processors(module)
        for block in blocks_of(module):
            block.compile(dynamic=False)
            num_blocks += 1
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its older name
    setattr(config, name, max(getattr(config, name), GRAPHS_PER_BLOCK * num_blocks))
    return num_blocks


def compile_step_parts(model: torch.nn.Module, blocks_of: Callable[[torch.nn.Module], list[torch.nn.Module]]) -> int:
    """`--compile` of a training model (t2ibench.model's DiffusionModel): the blocks of every part that runs
    per step, the denoiser and, where the step runs them, the VAE encoder and the text encoders (the eager
    VAE encoder was 35-40% of an online SD2 step; the text encoders run on token ids online and on the
    tokens format); the number of blocks compiled. benchmark.py compiles its run with it, and
    bench/blocks.py each part it times, so that the blocks it times are compiled as the run's."""
    vae = getattr(model, "vae", None)
    parts = [model.denoiser, *([vae.encoder] if vae is not None else []), *model.text_encoders.values()]
    return compile_blocks(parts, blocks_of)


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
