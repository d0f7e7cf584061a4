"""Count the graphs `--compile` compiles, against what compiling each whole part would trace, on any
machine (no GPU): one training step's forward on the meta device under CUDA autocast's rules.

    python bench/compile_graphs.py --model_config sdxl-base --precomputed --precomputed_format text_states
    python bench/compile_graphs.py --model_config sd2-base --precomputed --json

For each part the step runs (the denoiser; the VAE encoder online; the text encoders on token ids):
its blocks (`ModelFamily.compile_blocks`), the distinct graphs they need (a block's class with its
parameters' shapes and its inputs' shapes, strides and dtypes, and whether grad is on: what dynamo
specializes a static graph on, after t2ibench.train.compiling shares the attention processors), and the
forward ops (aten calls) of the part, of its distinct graphs and of what runs outside the blocks.
Compiling a whole part traces, lowers and generates code for all of its ops (and their backward);
block by block, for those of its distinct graphs. Strides are those the meta kernels give: a device
kernel that returns another layout for the same shapes (the CPU's bf16 convolutions on the VAE's
latents, online) can add a graph. Why it matters: docs/speed.md, "--compile: block by block".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from t2ibench.core import errors  # noqa: E402
from t2ibench import memory  # noqa: E402
from t2ibench.core.cli import Parser, Range  # noqa: E402
from t2ibench.commands.flags import checked_image_size  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, family_of  # noqa: E402
from t2ibench.memory.autocast import CUDA_AUTOCAST, AutocastPolicy  # noqa: E402
from t2ibench.datasets.precomputed import TEXT_FORMATS, batch_text_format  # noqa: E402


def build_parser() -> Parser:
    p = Parser("compile_graphs.py", description=__doc__)
    p.add_argument("--model_config", default="sd2-base", help=f"one of {sorted(MODEL_CONFIGS)}")
    p.add_argument("--image_size", type=Range(int, 1, 8192), default=None,
                   help="training resolution in pixels (default: the family's: 512 SD2, 1024 SDXL, 256 Flux.1)")
    p.add_argument("--precomputed", action="store_true", help="precomputed latents (no VAE in the step)")
    p.add_argument("--precomputed_format", default=None, choices=TEXT_FORMATS,
                   help="with --precomputed: token ids (text encoders in the step) or text states (none)")
    p.add_argument("--precision", default="amp_bf16", choices=memory.PRECISIONS)
    p.add_argument("--microbatch", type=Range(int, 1, 1 << 20), default=1,
                   help="images per forward (the graphs' shapes; their number does not depend on it)")
    p.add_argument("--json", action="store_true", help="end with the figures as one JSON object on one line")
    return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with the defaults resolved, in a new namespace (the parsed one is left as it was parsed)."""
    family = family_of(args.model_config)  # one line for an unknown --model_config
    image_size = checked_image_size(family, args.model_config, args.image_size)
    if args.precomputed_format and not args.precomputed:
        errors.fail("--precomputed_format needs --precomputed")
    return argparse.Namespace(**{**vars(args), "image_size": image_size})


class OpCount(TorchDispatchMode):
    """Every aten call, counted (on the meta device each is one op of the graph dynamo would trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def signature(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a static graph of `block` is specialized on (see the module's docstring)."""

    def of(value: Any) -> Any:
        # The stride of a dimension of size 1 is never used (meta kernels differ there).
        if isinstance(value, torch.Tensor):
            strides = tuple(stride if size > 1 else None for size, stride in zip(value.shape, value.stride()))
            return ("tensor", tuple(value.shape), strides, value.dtype, value.requires_grad)
        if isinstance(value, (tuple, list)):
            return tuple(of(item) for item in value)
        if isinstance(value, dict):
            return tuple(sorted((key, of(item)) for key, item in value.items()))
        return value if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__

    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    # Settings held as plain attributes (a resnet's output_scale_factor, a norm's eps): dynamo guards
    # on those its code reads, so two blocks that differ only there compile twice.
    settings = tuple((name, key, type(value).__name__, value) for name, module in block.named_modules()
                     for key, value in sorted(vars(module).items())
                     if value is None or isinstance(value, (bool, int, float, str)))
    return type(block).__qualname__, params, settings, of(args), of(kwargs), torch.is_grad_enabled()


def count_graphs(model_config: str, image_size: int, *, precomputed: bool, precomputed_format: str | None,
                 precision: str = "amp_bf16", microbatch: int = 1, policy: AutocastPolicy = CUDA_AUTOCAST,
                 device_type: str = "cuda") -> dict[str, dict[str, int]]:
    """Per part of the step: `blocks`, `graphs` (distinct), `forward_ops` (the whole part's),
    `forward_ops_in_graphs` (one of each distinct graph) and `forward_ops_outside_blocks` (eager)."""
    family = family_of(model_config)
    text_format = batch_text_format(family, precomputed, precomputed_format)
    meta = memory.build_meta_step(model_config, image_size, precision=precision, norm_precision="autocast",
                                  text_format=text_format, policy=policy, device_type=device_type)
    model = meta.model
    parts = {model.denoiser_name: model.denoiser, **({"vae.encoder": model.vae.encoder} if model.vae else {}),
             **model.text_encoders}
    counter = OpCount()
    figures: dict[str, dict[str, int]] = {}
    hooks = []
    for name, part in parts.items():
        blocks = family.compile_blocks(part)
        seen: dict[tuple, int] = {}  # signature -> forward ops of its graph
        row = figures[name] = {"blocks": len(blocks), "graphs": 0, "forward_ops": 0, "forward_ops_in_graphs": 0,
                               "forward_ops_outside_blocks": 0}

        def part_pre(module, args, row=row):
            row["_start"] = counter.ops

        def part_post(module, args, output, row=row):
            row["forward_ops"] += counter.ops - row.pop("_start")

        def block_pre(block, args, kwargs, seen=seen):
            block._counted = (signature(block, args, kwargs), counter.ops)

        def block_post(block, args, kwargs, output, seen=seen, row=row):
            key, start = block._counted
            ops = counter.ops - start
            row["forward_ops_outside_blocks"] -= ops  # the part's ops are added once it has run
            if key not in seen:
                seen[key] = ops
                row["graphs"] += 1
                row["forward_ops_in_graphs"] += ops

        hooks += [part.register_forward_pre_hook(part_pre), part.register_forward_hook(part_post)]
        for block in blocks:
            hooks += [block.register_forward_pre_hook(block_pre, with_kwargs=True),
                      block.register_forward_hook(block_post, with_kwargs=True)]
    batch = meta.batch(microbatch)
    with torch.random.fork_rng(devices=[]), counter, meta.rules():
        model.loss(model(batch), batch)
    for hook in hooks:
        hook.remove()
    for row in figures.values():
        row["forward_ops_outside_blocks"] += row["forward_ops"]
    return figures


def main(argv: list[str] | None = None) -> dict:
    with errors.command("compile_graphs.py"):
        args = validate(build_parser().parse_args(argv))
    text_format = batch_text_format(family_of(args.model_config), args.precomputed, args.precomputed_format)
    figures = count_graphs(args.model_config, args.image_size, precomputed=args.precomputed,
                           precomputed_format=args.precomputed_format, precision=args.precision,
                           microbatch=args.microbatch)
    data = f"precomputed {text_format}" if text_format else "online"
    print(f"{args.model_config} at {args.image_size}x{args.image_size}, {data}, {args.precision}: the graphs "
          "--compile compiles (counted on the meta device under CUDA autocast's rules)")
    print(f"  {'part':<16} {'blocks':>6} {'graphs':>6} {'forward ops':>12} {'in the graphs':>15} "
          f"{'outside blocks':>15}")
    for name, row in figures.items():
        total = max(1, row["forward_ops"])
        print(f"  {name:<16} {row['blocks']:>6} {row['graphs']:>6} {row['forward_ops']:>12,} "
              f"{row['forward_ops_in_graphs']:>8,} ({row['forward_ops_in_graphs'] / total:4.0%}) "
              f"{row['forward_ops_outside_blocks']:>8,} ({row['forward_ops_outside_blocks'] / total:4.0%})")
    result = {"model_config": args.model_config, "image_size": args.image_size, "text_format": text_format,
              "precision": args.precision, "parts": figures}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
