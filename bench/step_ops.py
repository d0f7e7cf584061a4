"""Count the kernels one training step launches on CUDA, per image and by kind, on any machine (no GPU).

    python bench/step_ops.py --model_config sdxl-base --precomputed --precomputed_format text_states
    python bench/step_ops.py --model_config sdxl-base --precomputed --precomputed_format text_states \
        --microbatch 2 --weight_casts microbatch --norm_precision fp32 --json     # the 2026-11-25 H100 profile
    python bench/step_ops.py --model_config sd2-base --compare                    # every set-up side by side

The step is benchmark.py's on one GPU, counted on the meta device under CUDA autocast's rules
(t2ibench.memory.kernels, with the memory model's machinery). Without `--microbatch` the microbatch is the
one the memory model picks for `--gpu_memory_gib` with these settings. `--weight_casts auto` is
benchmark.py's CUDA default on one GPU (step), and `--activation_checkpointing auto` its choice
(t2ibench.commands.gpu_setup): `--json` reports the set-up benchmark.py's defaults pick (`microbatch`,
`activation_checkpointing`, `weight_casts`, `activation_checkpointing_reason`). What the figures
mean: docs/speed.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from t2ibench.core import errors  # noqa: E402
from t2ibench.commands import flags  # noqa: E402
from t2ibench.memory import kernels  # noqa: E402
from t2ibench import memory  # noqa: E402
from t2ibench.core.cli import BATCH_SIZE, GPU_MEMORY_GIB, IMAGE_SIZE, Parser  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, family_of  # noqa: E402
from t2ibench.commands.gpu_setup import choose_setup, step_kernels  # noqa: E402
from t2ibench.datasets.precomputed import TEXT_FORMATS, batch_text_format  # noqa: E402
from t2ibench.train.weight_casts import WEIGHT_CAST_CHOICES, resolve_weight_casts, weight_casts_problem  # noqa: E402


def build_parser() -> Parser:
    p = Parser("step_ops.py", description=__doc__)
    p.add_argument("--model_config", default="sd2-base", help=f"one of {sorted(MODEL_CONFIGS)}")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=None,
                   help="training resolution in pixels (default: the family's: 512 SD2, 1024 SDXL, 256 Flux.1)")
    p.add_argument("--precomputed", action="store_true", help="precomputed latents (no VAE in the step)")
    p.add_argument("--precomputed_format", default=None, choices=TEXT_FORMATS,
                   help="with --precomputed: token ids (text encoders in the step) or text states (none)")
    flags.add_activation_checkpointing(
        p, "the denoiser's blocks recomputed in backward (benchmark.py's flag); auto: benchmark.py's choice on one "
           "GPU of --gpu_memory_gib. The bare flag means on")
    p.add_argument("--weight_casts", default="auto", choices=WEIGHT_CAST_CHOICES,
                   help="weights cast per microbatch (autocast) or once per step (bf16 copies); auto: "
                        "benchmark.py's default on one GPU (step under amp_bf16)")
    p.add_argument("--precision", default="amp_bf16", choices=memory.PRECISIONS)
    p.add_argument("--norm_precision", default="autocast", choices=memory.NORM_PRECISIONS,
                   help="GroupNorm/LayerNorm in the autocast dtype (benchmark.py's default) or fp32 "
                        "(plain CUDA autocast's)")
    p.add_argument("--microbatch", type=BATCH_SIZE, default=None,
                   help="images per forward/backward (default: the memory model's pick for --gpu_memory_gib)")
    p.add_argument("--batch_size", type=BATCH_SIZE, default=None,
                   help="images per optimizer step on the one GPU (default: benchmark.py's 2048)")
    p.add_argument("--gpu_memory_gib", type=GPU_MEMORY_GIB, default=memory.GPU_MEMORY_GIB["H100 80GB"],
                   help="GPU memory as torch reports it, GiB (80 GB H100: 79.1)")
    p.add_argument("--no_ema", action="store_true", help="without --use_ema")
    p.add_argument("--compare", action="store_true",
                   help="count every set-up (weight casts per microbatch or per step, with and without "
                        "activation checkpointing), each at the memory model's microbatch")
    p.add_argument("--json", action="store_true", help="end with the figures as one JSON object on one line")
    return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with the defaults resolved, in a new namespace (the parsed one is left as it was parsed)."""
    family = family_of(args.model_config)  # one line for an unknown --model_config
    image_size = flags.checked_image_size(family, args.model_config, args.image_size)
    if args.precomputed_format and not args.precomputed:
        errors.fail("--precomputed_format needs --precomputed")
    batch_size = args.batch_size or 2048
    if args.microbatch and batch_size % args.microbatch:
        errors.fail(f"--microbatch {args.microbatch} must divide --batch_size {batch_size}")
    weight_casts = resolve_weight_casts(args.weight_casts, on_gpu=True, precision=args.precision, world_size=1)
    problem = weight_casts_problem(weight_casts, precision=args.precision, world_size=1)
    if problem:
        errors.fail(problem)
    return argparse.Namespace(**{**vars(args), "image_size": image_size, "batch_size": batch_size,
                                 "weight_casts": weight_casts})


def count(args: argparse.Namespace, weight_casts: str, activation_checkpointing: bool) -> dict:
    """One set-up's counts, at --microbatch or at the memory model's pick."""
    settings = dict(precision=args.precision, norm_precision=args.norm_precision, precomputed=args.precomputed,
                    precomputed_format=args.precomputed_format, activation_checkpointing=activation_checkpointing)
    microbatch = args.microbatch
    if microbatch is None:
        plan = memory.plan(args.model_config, args.image_size, args.gpu_memory_gib * memory.GIB, use_ema=not args.no_ema,
                           fsdp="none", num_gpus=1, per_device_batch=args.batch_size, weight_casts=weight_casts,
                           **settings)
        microbatch = plan["microbatch"]
        if not microbatch:
            return {"weight_casts": weight_casts, "activation_checkpointing": activation_checkpointing,
                    "microbatch": 0, "fits": False}
    counted = step_kernels(args.model_config, args.image_size, microbatch, args.batch_size, weight_casts=weight_casts,
                           use_ema=not args.no_ema, **settings)
    return {"weight_casts": weight_casts, "activation_checkpointing": activation_checkpointing, "fits": True,
            **kernels.summary(counted)}


def print_row(args: argparse.Namespace, row: dict) -> None:
    setup = (f"weight casts per {row['weight_casts']}, "
             f"{'activation checkpointing' if row['activation_checkpointing'] else 'no checkpointing'}")
    if not row["fits"]:
        print(f"{setup}: no microbatch fits {args.gpu_memory_gib:g} GiB on one GPU (bench/memory.py says why); "
              "pass --microbatch N to count the step anyway")
        return
    print(f"{setup}: microbatch {row['microbatch']}, {row['microbatches_per_step']} per step of {args.batch_size}")
    for kind in kernels.KINDS:
        print(f"  {kernels.KIND_LABELS[kind]:<42} {row['kernels_per_image_by_kind'][kind]:>9.1f} per image")
    print(f"  {'total':<42} {row['kernels_per_image']:>9.1f} per image, {row['kernels_per_step']:,} per step; "
          f"{row['host_syncs_per_step']} host sync(s) per step")


def main(argv: list[str] | None = None) -> dict:
    with errors.command("step_ops.py"):
        args = validate(build_parser().parse_args(argv))
    text_format = batch_text_format(family_of(args.model_config), args.precomputed, args.precomputed_format)
    data = f"precomputed {text_format}" if text_format else "online"
    print(f"{args.model_config} at {args.image_size}x{args.image_size}, {data}, {args.precision}, norms "
          f"{args.norm_precision}, {'EMA' if not args.no_ema else 'no EMA'}, one GPU of {args.gpu_memory_gib:g} GiB: "
          "CUDA kernels one training step launches (counted on the meta device)")
    # The set-up benchmark.py's defaults pick on this GPU (or the flag's), and why.
    setup = choose_setup(args.model_config, args.image_size, args.gpu_memory_gib * memory.GIB, args.batch_size,
                         activation_checkpointing=args.activation_checkpointing, microbatch=args.microbatch,
                         precision=args.precision, norm_precision=args.norm_precision, precomputed=args.precomputed,
                         precomputed_format=args.precomputed_format, use_ema=not args.no_ema, num_gpus=1,
                         weight_casts=args.weight_casts)
    print(f"activation checkpointing {'on' if setup.activation_checkpointing else 'off'}: {setup.reason}")
    if args.compare:
        modes = ["microbatch", "step"] if args.precision == "amp_bf16" else ["microbatch"]
        rows = [count(args, mode, checkpointing) for mode in modes for checkpointing in (False, True)]
        for row in rows:
            print_row(args, row)
        result = {"setups": rows, **next(r for r in rows if r["weight_casts"] == args.weight_casts
                                         and r["activation_checkpointing"] == setup.activation_checkpointing)}
    else:
        result = count(args, args.weight_casts, setup.activation_checkpointing)
        print_row(args, result)
    result["activation_checkpointing_reason"] = setup.reason
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
