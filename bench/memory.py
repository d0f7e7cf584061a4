"""GPU memory of training per GPU, counted (t2ibench.memory), and the largest microbatch that fits, for
any model family.

    python bench/memory.py --model_config sd2-base --image_size 512 --gpu_memory_gib 80 --json
    python bench/memory.py --gpu_memory_gib 80 --precomputed --fsdp shard_grad_op --num_gpus 8
    python bench/memory.py --model_config flux1-schnell --precomputed --table   # FSDP full_shard (auto)
    python bench/memory.py --table                       # the README's microbatch table (SD2 base)
    python bench/memory.py --check_cpu                   # the count against a real CPU step
    python bench/memory.py --check_cpu --model_config flux1-tiny --precomputed --activation_checkpointing
    python bench/memory.py --model_config flux1-schnell --precomputed --no_ema --fp8 tensorwise   # float8's bytes
    python bench/memory.py --model_config sdxl-base --precomputed --precomputed_format text_states --num_gpus 1 --json

Prints the bytes saved for backward per image (with the other norm precision beside it: what
low-precision GroupNorm/LayerNorm saves), the fixed bytes per GPU and what holds them, the largest
power-of-two microbatch for `--gpu_memory_gib` and the FLOPs of the trained network per image.
`--activation_checkpointing auto` (the default, as benchmark.py's) counts the set-up benchmark.py's
defaults pick on such GPUs (t2ibench.commands.gpu_setup: with or without checkpointing, and why).
With `--json` the last line is one JSON object (`activation_bytes_per_image`, `fixed_bytes`,
`microbatch`, `activation_checkpointing`, `activation_checkpointing_reason`, `weight_casts`,
`train_flops_per_image`, ...). The step is counted on the meta device: no GPU, no
memory, seconds to a minute per setting on a CPU. `--image_size` defaults to the family's training
resolution, `--precomputed_format` to the family's (text states for Flux.1), `--fsdp auto` to
full_shard for Flux.1 and DDP otherwise, as benchmark.py's flags do.

`--check_cpu` runs the same step for real on the CPU (fp32, and bf16 autocast with either norm
precision) and compares what the CPU allocator reported (the profiler's allocation events) with
the count made on the meta device by the same rules: bytes alive after forward, and the peak of
forward and backward, with and without the scratch that kernels allocate and free inside themselves
(the count sees ops' outputs only; see `measure_cpu_step`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

from t2ibench.commands import flags  # noqa: E402
from t2ibench import memory  # noqa: E402
from t2ibench.core.cli import BATCH_SIZE, GPU_COUNT, GPU_MEMORY_GIB, IMAGE_SIZE, Parser  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, ModelFamily, family_of  # noqa: E402
from t2ibench.train.fp8 import FP8_MODES  # noqa: E402
from t2ibench.commands.gpu_setup import choose_setup, from_flag  # noqa: E402
from t2ibench.core.images import GEOMETRY_KEYS  # noqa: E402
from t2ibench.train.model import DiffusionModel  # noqa: E402
from t2ibench.train.norms import set_norm_precision  # noqa: E402
from t2ibench.train.parallel import FSDP_CHOICES, enable_block_checkpointing, resolve_mode  # noqa: E402
from t2ibench.datasets.precomputed import LATENT_KEYS, TEXT_FORMATS, TEXT_STATES, TOKENS, batch_text_format  # noqa: E402
from t2ibench.train.weight_casts import (WEIGHT_CAST_CHOICES, CastWeightsOncePerStep, resolve_weight_casts,  # noqa: E402
                                  weight_casts_problem)

# The table's columns: (heading, precomputed, text format); None: the family's own precomputed format.
TABLE_COLUMNS = (("online (VAE + text encoders in the loop)", False, None),
                 ("`--precomputed` (token ids)", True, TOKENS),
                 ("`--precomputed` (text states)", True, TEXT_STATES))


def fail(message: str) -> None:
    raise SystemExit(f"memory.py: error: {message}")


def real_batch(family: ModelFamily, model_config: str, image_size: int, microbatch: int,
               text_format: str | None = None) -> dict[str, torch.Tensor]:
    """A batch of random data as the loaders yield it for `family`: images and captions' token ids
    online (`text_format` None); fp16 latent moments with token ids (`TOKENS`) or with the stored
    conditioning (`TEXT_STATES`) on precomputed latents."""
    generator = torch.Generator().manual_seed(0)
    if text_format is None:
        batch = {"image": torch.randint(0, 256, (microbatch, 3, image_size, image_size), dtype=torch.uint8,
                                        generator=generator)}
    else:
        latent = image_size // family.latent_downsample
        shape = (microbatch, family.latent_channels(model_config), latent, latent)
        # Log-variances around -10, as a trained VAE's posterior (data.py's synthetic latents).
        mean_key, logvar_key = LATENT_KEYS
        batch = {mean_key: torch.randn(shape, generator=generator).half(),
                 logvar_key: torch.full(shape, -10.0, dtype=torch.float16)}
    if text_format == TEXT_STATES:
        batch.update({key: torch.randn(microbatch, *shape, generator=generator).half()
                      for key, shape in family.conditioning_shapes(model_config).items()})
    else:
        captions = [family.random_text_inputs(generator, model_config) for _ in range(microbatch)]
        batch.update({key: torch.stack([ids[key] for ids in captions]) for key in family.text_input_keys})
    if family.micro_conditioning:  # uncropped images of the training size
        batch.update({key: torch.full((microbatch, 2), image_size, dtype=torch.long) for key in GEOMETRY_KEYS})
    return batch


class CountedOps(TorchDispatchMode):
    """Marks every op the memory count sees with a profiler scope (`SCOPE`): a dispatch mode, as the
    count's `LiveBytes` is, so it sees the same ops (those reaching the tensors' backend, below
    autograd and autocast); the ATen ops a kernel calls inside itself run within the scope."""

    SCOPE = "counted op"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with torch.profiler.record_function(self.SCOPE):
            return func(*args, **(kwargs or {}))


def measure_cpu_step(model_config: str, image_size: int, microbatch: int, precision: str = "fp32",
                     norm_precision: str = "autocast", seed: int = 0, activation_checkpointing: bool = False,
                     text_format: str | None = None, weight_casts: str = "microbatch") -> dict[str, int]:
    """One real forward, loss and backward on the CPU, gradients already there (as in gradient
    accumulation); bytes the CPU allocator reported above what was allocated before the step: alive
    when backward starts, the peak, and the peak without kernels' scratch. Uses the profiler's
    allocation events (every allocation and free with the allocator's running total). The model is
    benchmark.py's: the family's parts in `DiffusionModel`, frozen parts in bf16 and norms set under
    AMP, gradient checkpointing as --activation_checkpointing turns it on; `text_format` None
    online, else precomputed latents with token ids or text states (no VAE, and no text encoder for
    text states).

    Kernel scratch is memory an op allocates and frees itself, inside its kernel; `op_peak_bytes`
    leaves it out. "An op" is one the count sees: every op dispatched to the tensors' backend, marked
    here by `CountedOps` (a dispatch mode at the count's own level), so whatever a kernel allocates
    and frees before it returns, directly or through the ATen ops it calls inside, is scratch.
    Which kernel runs, and so its scratch, is the machine's: oneDNN's bf16 GEMM under CPU autocast
    (aten::addmm) keeps a scratchpad that grows with the thread count and changed with the oneDNN
    release (at the peak of flux1-tiny with checkpointing, 62 KB on 1 thread and 124 KB on 2 with
    torch 2.7.0, 112 KB and 223 KB with torch 2.14.1); where oneDNN has no bf16 (a CPU without
    AVX-512, `torch.ops.mkldnn._is_mkldnn_bf16_supported()` false) a bf16 convolution runs ATen's
    im2col kernel (aten::_slow_conv2d_forward), which unfolds its input into a temporary of
    in_channels x kernel area x output pixels per image (an aten::empty inside the op; 144 KB at
    sdxl-tiny's peak). The count sees ops' outputs, not their insides, so the op-level peak is what
    it predicts on any machine; on a GPU cuBLAS's workspace is allocated once and kept."""
    from torch.profiler import ProfilerActivity, profile, record_function

    family = family_of(model_config)
    torch.manual_seed(seed)
    parts = family.build(model_config, None, vae=text_format is None, text_encoders=text_format != TEXT_STATES,
                         tokenizers=False)
    model = DiffusionModel(family, parts, num_loss_bins=0)
    if precision != "fp32":
        for frozen in model.frozen():
            frozen.to(torch.bfloat16)
        model.cpu_autocast_dtype = torch.bfloat16
        set_norm_precision(model, norm_precision)
    if activation_checkpointing:
        enable_block_checkpointing(model.denoiser)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    if weight_casts == "step":  # the denoiser computes with its bf16 copies, as benchmark.py's step does
        casts = CastWeightsOncePerStep(model.denoiser)
        casts.begin_step()
        # From the second microbatch on the fp32 weights hold the step's gradient sum and each copy's
        # bf16 gradient is added into it (and freed) as backward makes it.
        trained = casts.masters  # the denoiser's, the only trained parameters
    for p in trained:  # gradient accumulation's steady state, as counted
        p.grad = torch.zeros_like(p)
    batch = real_batch(family, model_config, image_size, microbatch, text_format)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, CountedOps():
        loss = model.loss(model(batch), batch)
        with record_function("backward starts"):
            loss.backward()
    # (time, bytes: negative for a free, allocator's running total, address, the counted op it
    # happened in: 0 outside any)
    allocations: list[tuple[int, int, int, int, int]] = []
    backward_start, ops_seen = None, 0

    def visit(node, op: int) -> None:
        nonlocal backward_start, ops_seen
        if node.tag == torch._C._profiler._EventType.Allocation:
            fields = node.extra_fields
            allocations.append((node.start_time_ns, fields.alloc_size, fields.total_allocated, fields.ptr, op))
            return
        if node.name == "backward starts":
            backward_start = node.start_time_ns
        if node.name == CountedOps.SCOPE:
            ops_seen += 1
            op = ops_seen
        for child in node.children:
            visit(child, op)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root, 0)
    allocations.sort()
    before = allocations[0][2] - allocations[0][1]
    after_forward = [total for t, _, total, _, _ in allocations if t < backward_start][-1] - before
    peak = max(total for _, _, total, _, _ in allocations) - before
    # Scratch: an allocation freed inside the counted op that made it.
    allocated_in: dict[int, tuple[int, int]] = {}  # address -> (index, op)
    scratch: set[int] = set()
    for index, (_, nbytes, _, address, op) in enumerate(allocations):
        if nbytes > 0:
            allocated_in[address] = (index, op)
        elif address in allocated_in:
            start, start_op = allocated_in.pop(address)
            if start_op == op != 0:
                scratch.update((start, index))
    scratch_alive = op_peak = 0
    for index, (_, nbytes, total, _, _) in enumerate(allocations):
        scratch_alive += nbytes if index in scratch else 0
        op_peak = max(op_peak, total - scratch_alive)
    return {"after_forward_bytes": after_forward, "peak_bytes": peak, "op_peak_bytes": op_peak - before}


def count_cpu_step(model_config: str, image_size: int, microbatch: int, precision: str = "fp32",
                   norm_precision: str = "autocast", activation_checkpointing: bool = False,
                   text_format: str | None = None, weight_casts: str = "microbatch") -> memory.StepCount:
    """The same step counted on the meta device with CPU autocast's rules and the CPU's attention kernel."""
    dtype = None if precision == "fp32" else torch.bfloat16
    policy = memory.probe_cpu_autocast().with_norms(norm_precision)
    model = memory.build_meta_model(model_config, precomputed=text_format is not None, precomputed_format=text_format,
                                    frozen_dtype=dtype, denoiser_dtype=dtype if weight_casts == "step" else None)
    if activation_checkpointing:
        memory.use_checkpointing(model, policy, dtype, "cpu")
    model.train()
    return memory.count_step(model, memory.meta_batch(model, model_config, image_size, microbatch), policy, dtype,
                             "cpu")


def check_cpu(model_config: str, image_size: int, microbatch: int, activation_checkpointing: bool = False,
              text_format: str | None = None, weight_casts: str = "microbatch") -> list[dict]:
    rows = []
    for precision, norm_precision in (("fp32", "fp32"), ("amp_bf16", "autocast"), ("amp_bf16", "fp32")):
        casts = weight_casts if precision == "amp_bf16" else "microbatch"
        counted = count_cpu_step(model_config, image_size, microbatch, precision, norm_precision,
                                 activation_checkpointing, text_format, casts)
        measured = measure_cpu_step(model_config, image_size, microbatch, precision, norm_precision,
                                    activation_checkpointing=activation_checkpointing, text_format=text_format,
                                    weight_casts=casts)
        rows.append({"precision": precision, "norm_precision": norm_precision, "weight_casts": casts,
                     "activation_checkpointing": activation_checkpointing, "precomputed_format": text_format,
                     "counted_after_forward_bytes": counted.after_forward_bytes,
                     "measured_after_forward_bytes": measured["after_forward_bytes"],
                     "counted_saved_bytes": counted.saved_bytes,
                     "counted_peak_bytes": counted.backward_peak_bytes, "measured_peak_bytes": measured["peak_bytes"],
                     "measured_op_peak_bytes": measured["op_peak_bytes"]})
    print(f"{model_config} at {image_size}x{image_size}, microbatch {microbatch}, "
          f"{'precomputed ' + text_format if text_format else 'online'}"
          f"{', activation checkpointing' if activation_checkpointing else ''}, on this CPU "
          f"({torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
          f"{'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}): count (meta device) vs the CPU allocator")
    print(f"{'precision':<10} {'norms':<9} {'after forward: counted':>23} {'measured':>12} {'ratio':>7} "
          f"{'peak: counted':>15} {'measured':>12} {'ratio':>7} {'without kernel scratch':>23} {'ratio':>7}")
    for r in rows:
        print(f"{r['precision']:<10} {r['norm_precision']:<9} {r['counted_after_forward_bytes']:>23,} "
              f"{r['measured_after_forward_bytes']:>12,} "
              f"{r['measured_after_forward_bytes'] / r['counted_after_forward_bytes']:>7.4f} "
              f"{r['counted_peak_bytes']:>15,} {r['measured_peak_bytes']:>12,} "
              f"{r['measured_peak_bytes'] / r['counted_peak_bytes']:>7.4f} {r['measured_op_peak_bytes']:>23,} "
              f"{r['measured_op_peak_bytes'] / r['counted_peak_bytes']:>7.4f}")
    return rows


def table(model_config: str, image_size: int | None, fsdp: str, num_gpus: int, **options) -> str:
    """The README's microbatch table: one row per GPU, one column per data path."""
    heads = [name for name, _, _ in TABLE_COLUMNS]
    head = "| GPU (total memory as torch reports it) | " + " | ".join(heads) + " |"
    lines = [head, "|---" * (len(TABLE_COLUMNS) + 1) + "|"]
    for gpu, memory_gib in memory.GPU_MEMORY_GIB.items():
        cells = []
        for _, precomputed, text_format in TABLE_COLUMNS:
            result = memory.plan(model_config, image_size, memory_gib * memory.GIB, precomputed=precomputed,
                                 precomputed_format=text_format, fsdp=fsdp, num_gpus=num_gpus, **options)
            micro = result["microbatch"]
            # Nothing fits: say what one image would need, so the table shows how far off it is.
            cells.append(str(micro) if micro else f"0 ({memory.gib(memory.predicted_bytes(result, 1)):.0f} GiB at 1)")
        lines.append(f"| {gpu} ({memory_gib} GiB) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> Parser:
    p = Parser("memory.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_config", default="sd2-base", help=f"one of {sorted(MODEL_CONFIGS)}")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=None,
                   help="training resolution in pixels (default: the family's, 512 for SD2, 1024 for SDXL)")
    p.add_argument("--gpu_memory_gib", type=GPU_MEMORY_GIB, default=memory.GPU_MEMORY_GIB["H100 80GB"],
                   help="memory of one GPU in GiB, as torch.cuda.get_device_properties(0).total_memory / 2**30 "
                        "(an 80 GB A100 or H100 reports 79.1)")
    p.add_argument("--precomputed", action="store_true", help="train from precomputed latents (no VAE)")
    p.add_argument("--precomputed_format", default=None, choices=TEXT_FORMATS,
                   help="with --precomputed: token ids (the text encoders run) or text states (no encoder); "
                        "default: the family's (tokens for SD2 and SDXL, text states for Flux.1)")
    p.add_argument("--precision", default="amp_bf16", choices=memory.PRECISIONS)
    p.add_argument("--norm_precision", default="autocast", choices=memory.NORM_PRECISIONS,
                   help="GroupNorm/LayerNorm in the autocast dtype (benchmark.py's default) or in fp32")
    p.add_argument("--fsdp", default="auto", choices=FSDP_CHOICES,
                   help="none (DDP), shard_grad_op or full_shard over --num_gpus ranks; auto: the family's "
                        "default (full_shard for Flux.1 on several GPUs, else none), as benchmark.py's")
    p.add_argument("--num_gpus", type=GPU_COUNT, default=8, help="ranks the model is replicated or sharded over")
    p.add_argument("--no_ema", action="store_true", help="without benchmark.py's --use_ema")
    flags.add_activation_checkpointing(
        p, "the denoiser's blocks recomputed in backward (benchmark.py's flag); auto: the set-up benchmark.py's "
           "defaults pick for these GPUs (--check_cpu and --table: off). The bare flag means on")
    p.add_argument("--weight_casts", default="auto", choices=WEIGHT_CAST_CHOICES,
                   help="weights cast per microbatch (autocast's) or bf16 copies once per step; auto: benchmark.py's "
                        "default (step on one GPU under amp_bf16 without FSDP)")
    p.add_argument("--fp8", default="off", choices=FP8_MODES,
                   help="the denoiser's Linear layers in float8 as benchmark.py's --fp8 converts them")
    p.add_argument("--per_device_batch", type=BATCH_SIZE, default=None,
                   help="images per GPU per step: the microbatch must divide it (benchmark.py's auto)")
    p.add_argument("--json", action="store_true", help="end with the figures as one JSON object on one line")
    p.add_argument("--table", action="store_true", help="print the README's microbatch table instead")
    p.add_argument("--check_cpu", action="store_true",
                   help="compare the count with a real CPU step (--model_config, --image_size, --microbatch, "
                        "the data path and --activation_checkpointing)")
    p.add_argument("--microbatch", type=BATCH_SIZE, default=2, help="with --check_cpu: images in the real CPU step")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.model_config not in MODEL_CONFIGS:
        fail(f"--model_config '{args.model_config}' is unknown; choose one of {sorted(MODEL_CONFIGS)}")
    family = MODEL_CONFIGS[args.model_config]
    image_size = family.default_image_size(args.model_config) if args.image_size is None else args.image_size
    pixels_per_token = family.latent_downsample * family.patch_size  # a whole number of latent patches
    if image_size <= 0 or image_size % pixels_per_token:
        fail(f"--image_size {image_size} must be a positive multiple of {pixels_per_token} for "
             f"{args.model_config}")
    if not args.gpu_memory_gib > 0:
        fail(f"--gpu_memory_gib {args.gpu_memory_gib} must be positive")
    if args.num_gpus < 1:
        fail(f"--num_gpus {args.num_gpus} must be >= 1")
    fsdp = resolve_mode(args.fsdp, family.parallelism, args.num_gpus)
    if fsdp != "none" and args.num_gpus == 1:
        fail(f"--fsdp {fsdp} shards over the ranks and --num_gpus is 1: pass --num_gpus N or --fsdp none")
    if args.per_device_batch is not None and args.per_device_batch < 1:
        fail(f"--per_device_batch {args.per_device_batch} must be >= 1")
    if args.precomputed_format is not None and not args.precomputed:
        fail("--precomputed_format needs --precomputed")
    if args.microbatch < 1:
        fail(f"--microbatch {args.microbatch} must be >= 1")
    weight_casts = resolve_weight_casts(args.weight_casts, on_gpu=not args.check_cpu, precision=args.precision,
                                        world_size=args.num_gpus)
    problem = weight_casts_problem(weight_casts, precision=args.precision, world_size=args.num_gpus)
    if problem and not args.check_cpu:
        fail(problem)
    # A new namespace with the defaults resolved: the parsed one is left as it was parsed. A CPU step
    # and the table count one setting: `auto` is off there (`main` counts the GPU defaults' choice).
    return argparse.Namespace(**{**vars(args), "image_size": image_size, "fsdp": fsdp, "weight_casts": weight_casts,
                                 "checkpointing_flag": args.activation_checkpointing,
                                 "activation_checkpointing": from_flag(args.activation_checkpointing)[0]})


def main(argv: list[str] | None = None) -> dict | list | str:
    args = parse_args(argv)
    if args.check_cpu:
        text_format = batch_text_format(family_of(args.model_config), args.precomputed, args.precomputed_format)
        return check_cpu(args.model_config, args.image_size, args.microbatch, args.activation_checkpointing,
                         text_format, args.weight_casts)
    if args.table:
        text = table(args.model_config, args.image_size, args.fsdp, args.num_gpus, precision=args.precision,
                     norm_precision=args.norm_precision, use_ema=not args.no_ema,
                     activation_checkpointing=args.activation_checkpointing, weight_casts=args.weight_casts)
        print(f"{args.model_config} at {args.image_size}x{args.image_size}, {args.precision}, norms "
              f"{args.norm_precision}, {'EMA, ' if not args.no_ema else ''}"
              f"{'activation checkpointing, ' if args.activation_checkpointing else ''}"
              f"{'DDP' if args.fsdp == 'none' else 'FSDP ' + args.fsdp} over {args.num_gpus} GPU(s): "
              "largest power-of-two microbatch per GPU")
        print(text)
        return text
    setup = choose_setup(args.model_config, args.image_size, args.gpu_memory_gib * memory.GIB, args.per_device_batch,
                         activation_checkpointing=args.checkpointing_flag, precision=args.precision,
                         norm_precision=args.norm_precision, precomputed=args.precomputed,
                         precomputed_format=args.precomputed_format, use_ema=not args.no_ema, fsdp=args.fsdp,
                         num_gpus=args.num_gpus, weight_casts=args.weight_casts, fp8=args.fp8)
    args = argparse.Namespace(**{**vars(args), "activation_checkpointing": setup.activation_checkpointing})
    options = dict(precision=args.precision, precomputed=args.precomputed, precomputed_format=args.precomputed_format,
                   use_ema=not args.no_ema, fsdp=args.fsdp, num_gpus=args.num_gpus,
                   per_device_batch=args.per_device_batch, activation_checkpointing=args.activation_checkpointing,
                   weight_casts=args.weight_casts, fp8=args.fp8)
    result = memory.plan(args.model_config, args.image_size, args.gpu_memory_gib * memory.GIB,
                         norm_precision=args.norm_precision, **options)
    # The set-up benchmark.py's defaults pick (microbatch, checkpointing, weight casts: the plan's) and why.
    result.update(activation_checkpointing_reason=setup.reason,
                  setup_candidates=setup.summary()["setup_candidates"])
    if args.precision != "fp32":
        other = "fp32" if args.norm_precision == "autocast" else "autocast"
        result["activation_bytes_per_image_by_norm_precision"] = {
            args.norm_precision: result["activation_bytes_per_image"],
            other: memory.plan(args.model_config, args.image_size, args.gpu_memory_gib * memory.GIB,
                               norm_precision=other, **options)["activation_bytes_per_image"]}
    g = memory.gib
    data = "precomputed " + result["precomputed_format"] if args.precomputed else "online"
    print(f"{args.model_config} at {args.image_size}x{args.image_size}, {args.precision}, norms {args.norm_precision}, "
          f"{data}, {'EMA, ' if not args.no_ema else ''}"
          f"activation checkpointing {'on' if args.activation_checkpointing else 'off'} ({setup.reason}), "
          f"weight casts per {args.weight_casts}, "
          f"{'fp8 ' + args.fp8 + ', ' if args.fp8 != 'off' else ''}"
          f"{'DDP' if args.fsdp == 'none' else 'FSDP ' + args.fsdp} over {args.num_gpus} GPU(s) of "
          f"{args.gpu_memory_gib:g} GiB")
    print(f"  saved for backward  {g(result['activation_bytes_per_image']):.3f} GiB per image"
          + (f" (+{g(result['activation_bytes_per_microbatch']):.3f} GiB per microbatch)"
             if abs(result["activation_bytes_per_microbatch"]) >= 2**20 else ""))
    by_norm = result.get("activation_bytes_per_image_by_norm_precision")
    if by_norm:
        print(f"                      {g(by_norm['fp32']):.3f} GiB with fp32 norms, {g(by_norm['autocast']):.3f} "
              f"in the autocast dtype: {g(by_norm['fp32'] - by_norm['autocast']):.3f} GiB per image saved")
    print(f"  step peak           {g(result['peak_bytes_per_image']):.3f} GiB per image "
          "(backward's transients included)")
    for name, nbytes in result["fixed_bytes_breakdown"].items():
        print(f"  {name:<19} {g(nbytes):7.2f} GiB")
    print(f"  CUDA context        {g(result['cuda_context_bytes']):7.2f} GiB, allocator reserve "
          f"{100 * result['allocator_reserve_fraction']:.0f}% of what tensors hold ("
          f"{'expandable segments' if result['expandable_segments'] else 'torch default allocator'}, "
          "as a run from this environment sets it)")
    print(f"  fixed per GPU       {g(result['fixed_bytes']):7.2f} GiB")
    if result["microbatch"]:
        print(f"  microbatch          {result['microbatch']} (needs "
              f"{g(result['predicted_bytes_at_microbatch']):.1f} of the {g(result['usable_bytes']):.1f} GiB usable "
              f"of {args.gpu_memory_gib:g}: {100 * result['headroom_fraction']:.0f}% is left as headroom)")
    else:
        print(f"  microbatch          none fits in the {g(result['usable_bytes']):.1f} GiB usable of "
              f"{args.gpu_memory_gib:g} (one image needs "
              f"{g(memory.predicted_bytes(result, 1)):.1f})")
    denoiser = family_of(args.model_config).denoiser_name
    print(f"  trained network     {result['train_flops_per_image'] / 1e9:,.1f} GFLOP per image ({denoiser} forward + "
          "backward)")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
