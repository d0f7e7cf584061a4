"""The node predicted from one device: each repeated block of the denoiser timed, the full step composed,
the sharded-training traffic added, samples/s per GPU predicted for a node.

    python bench/blocks.py --model_config flux1-schnell --precomputed --microbatch 8 --fp8 tensorwise   # one GPU
    python bench/blocks.py --model_config flux1-tiny --precomputed --image_size 64 --global_batch 8 --microbatch 8 \\
        --gpus 1 --num_workers 0 --compare_results_json results/flux-tiny-cpu.json --json                 # CPU check

A model that fits no single GPU (Flux.1-schnell: about 190 GB of training state) cannot be run on the
one GPU a user has, but each of its blocks can. On the visible device (CUDA, else CPU) this times,
after `--warmup` rounds, as the median of `--repeats` rounds (each part once per round, in turn: a
busy spell of a shared machine falls on every part alike), the forward and backward of one microbatch
through one of each distinct repeated block of the denoiser (the family's FSDP units,
`ModelFamily.fsdp_blocks`: Flux.1's double-stream and single-stream blocks; one block per resolution
level of SD2's and SDXL's UNets), with the inputs the full model hands it (shapes and dtypes read off
the step on the meta device), under the run's precision, norms, `--fp8` (t2ibench.fp8) and
`--activation_checkpointing` (the block recomputed in backward, as diffusers wraps it). "The rest" is
the training model's step with every block replaced by a stand-in of zero cost (its outputs' shapes
out, zeros back): embedders, final layer, noising, loss, and the frozen encoders where they run. The
optimizer (AdamW as benchmark.py runs it) and the EMA update (`--use_ema`) are timed per parameter,
and the harness (Composer's Trainer, the run's loader and the throughput callback, around a model of
one parameter) per step at the run's per-device batch and microbatch.

The step of the full model, per GPU of `G`, per-GPU batch `B/G` in microbatches of `m`:

    compute = (B/G / m) x (rest + sum over blocks of count x block) + params per GPU x (AdamW + EMA) + harness
    traffic = the bytes the memory model's sharding implies per GPU per step (ring collectives, each GPU
              sending (G-1)/G of the buffer): DDP one fp32 all-reduce of the gradients (2x); FSDP
              full_shard per microbatch two all-gathers of the weights in the autocast dtype (forward,
              backward) and one fp32 reduce-scatter of the gradients; shard_grad_op one all-gather and
              one reduce-scatter per microbatch (Composer 0.32.1 reduce-scatters every microbatch)
    predicted samples/s per GPU = (B/G) / (compute + traffic / --link_gbps)   (not overlapped; the JSON's)
                                = (B/G) / max(compute, traffic / --link_gbps)  (fully overlapped)

`--link_gbps` is in gigabytes per second per direction per GPU (default: NVLink 4 on an H100, 450);
a multi-node figure takes the slower inter-node rate. The prediction is labelled **predicted**: it
assumes a node of the device it ran on and times nothing of a node (no collective, no straggler).
`--compare_results_json` reads a benchmark.py run of the same settings and prints the ratio of the
prediction for its device count to its measured images/s per device. `--json` ends with one line:
the measured times, the composition and `predicted` (a list of {gpus, samples_per_sec_per_gpu}).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project root: run as python bench/NAME.py

from bench_gpu import GLOBAL_BATCH, MLPERF_FLUX_GLOBAL_BATCH  # noqa: E402
from t2ibench import checks, cpu_threads, errors, flags, fp8, memory, precomputed  # noqa: E402
from t2ibench.cli import NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, SEED, Parser  # noqa: E402
from t2ibench.errors import fail  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, family_of  # noqa: E402
from t2ibench.norms import NORM_PRECISIONS, set_norm_precision  # noqa: E402
from t2ibench.parallel import FSDP_CHOICES, resolve_mode  # noqa: E402
from t2ibench.precision import PRECISION_CHOICES, resolve_precision  # noqa: E402
from t2ibench.precomputed import TEXT_FORMATS  # noqa: E402
from t2ibench.scale import MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU  # noqa: E402

NVLINK4_GB_PER_SEC = 450.0  # H100 SXM NVLink 4: 900 GB/s both directions, 450 each way
OPTIMIZER_PROBE_PARAMS = 2**22  # at least this many parameters per optimizer and EMA timing (4M)
# fp16 is left out: fp8 refuses it and MLPerf's reference runs bf16.
PRECISIONS = tuple(p for p in PRECISION_CHOICES if p != "amp_fp16")
# The settings a benchmark.py results JSON must share with the prediction it is compared with.
COMPARED = {"model_config": "model_config", "image_size": "image_size", "global_batch_size": "global_batch",
            "device_train_microbatch_size": "microbatch", "precision": "precision", "fp8": "fp8",
            "activation_checkpointing": "activation_checkpointing", "precomputed": "precomputed",
            "use_ema": "use_ema"}


def build_parser() -> Parser:
    p = Parser("blocks.py", description=__doc__)
    g = p.add_argument_group("the run predicted (benchmark.py's flags)")
    g.add_argument("--model_config", type=str, default="flux1-schnell", choices=sorted(MODEL_CONFIGS),
                   help="the model")
    g.add_argument("--image_size", type=POSITIVE_INT, default=None, help="pixels (default: the family's: 256 for Flux.1)")
    g.add_argument("--global_batch", type=POSITIVE_INT, default=None,
                   help=f"images per step over all GPUs (default: MLPerf's {MLPERF_FLUX_GLOBAL_BATCH} for Flux.1, "
                        f"{GLOBAL_BATCH} otherwise)")
    g.add_argument("--microbatch", type=POSITIVE_INT, default=None,
                   help="images per GPU per forward/backward (default: on a GPU the memory model's largest that "
                        "fits its memory at every --gpus count and divides the per-GPU batch of the largest; on a "
                        "CPU 8, or that batch when smaller)")
    g.add_argument("--precision", type=str, default="auto", choices=PRECISIONS, help="auto: amp_bf16 on a GPU, fp32 on CPU")
    g.add_argument("--norm_precision", type=str, default="autocast", choices=NORM_PRECISIONS, help="as benchmark.py's")
    g.add_argument("--precomputed", action="store_true", help="precomputed latents (no VAE in the step)")
    g.add_argument("--precomputed_format", type=str, default=None, choices=TEXT_FORMATS,
                   help="with --precomputed: token ids or text states (default: the family's, text states for Flux.1)")
    g.add_argument("--activation_checkpointing", action="store_true", help="each block recomputed in backward")
    flags.add_fp8(g)
    g.add_argument("--use_ema", action="store_true", help="add the EMA update per step (MLPerf's Flux.1 runs none)")
    g.add_argument("--fsdp", type=str, default="auto", choices=FSDP_CHOICES,
                   help="sharding on several GPUs, as benchmark.py's (auto: full_shard for Flux.1, else DDP)")
    g.add_argument("--num_workers", type=NON_NEGATIVE_INT, default=8, help="loader processes of the harness, as benchmark.py's")
    g = p.add_argument_group("the node and the measurement")
    g.add_argument("--gpus", type=POSITIVE_INT, nargs="+", default=[8, 16], help="GPU counts to predict for")
    g.add_argument("--link_gbps", type=POSITIVE_FLOAT, default=NVLINK4_GB_PER_SEC,
                   help="gigabytes (not bits) per second per direction per GPU for the collectives")
    g.add_argument("--warmup", type=NON_NEGATIVE_INT, default=3, help="untimed runs of each part first")
    g.add_argument("--repeats", type=POSITIVE_INT, default=10, help="timed runs of each part (the median is taken)")
    g.add_argument("--harness_batches", type=POSITIVE_INT, default=12, help="batches the harness is timed over")
    g.add_argument("--seed", type=SEED, default=17, help="seeds the random weights and inputs")
    g.add_argument("--compare_results_json", type=str, default=None,
                   help="a benchmark.py --results_json of the same settings: print the prediction against it")
    g.add_argument("--json", action="store_true", help="end with one line of JSON")
    return p


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """The flags with every default resolved and what the prediction derives from them (device,
    text_format, compared), in a new namespace: the parsed one is left as it was parsed."""
    family = family_of(parsed.model_config)
    image_size = parsed.image_size or family.default_image_size(parsed.model_config)
    multiple = family.latent_downsample * family.patch_size
    if image_size % multiple:
        fail(f"--image_size {image_size} must be a multiple of {multiple} for {parsed.model_config}")
    on_gpu = torch.cuda.is_available()
    precision = resolve_precision(parsed.precision, on_gpu)
    fp8.check(parsed.fp8, precision)
    if parsed.precomputed_format and not parsed.precomputed:
        fail("--precomputed_format needs --precomputed")
    text_format = precomputed.batch_text_format(family, parsed.precomputed, parsed.precomputed_format)
    global_batch = parsed.global_batch or (MLPERF_FLUX_GLOBAL_BATCH if family.name == "flux" else GLOBAL_BATCH)
    microbatch = parsed.microbatch
    if microbatch is None:
        per_gpu = global_batch // max(parsed.gpus)  # a microbatch that divides every count's per-GPU batch
        if on_gpu:  # the largest that fits at every count (fewer GPUs shard less: more fixed bytes each)
            microbatch = max(1, min(memory.plan(
                parsed.model_config, image_size, torch.cuda.get_device_properties(0).total_memory,
                precision=precision, norm_precision=parsed.norm_precision, precomputed=parsed.precomputed,
                precomputed_format=text_format, use_ema=parsed.use_ema, fsdp=mode_for(parsed, gpus), num_gpus=gpus,
                per_device_batch=per_gpu, activation_checkpointing=parsed.activation_checkpointing,
                fp8=parsed.fp8)["microbatch"] for gpus in parsed.gpus))
        else:
            microbatch = min(8, per_gpu)
    for gpus in parsed.gpus:
        if global_batch % gpus or (global_batch // gpus) % microbatch:
            fail(f"--global_batch {global_batch} over --gpus {gpus} is {global_batch / gpus:g} per GPU, "
                 f"which --microbatch {microbatch} does not divide; pick a batch all --gpus counts divide")
    args = argparse.Namespace(**{**vars(parsed), "image_size": image_size, "device": "cuda" if on_gpu else "cpu",
                                 "precision": precision, "text_format": text_format, "global_batch": global_batch,
                                 "microbatch": microbatch})
    # The compared run is checked against the resolved settings, so it is added to them last.
    return argparse.Namespace(**{**vars(args), "compared": compared_run(args) if args.compare_results_json else None})


def mode_for(args: argparse.Namespace, gpus: int) -> str:
    """The sharding of a run on `gpus` GPUs (`--fsdp auto` resolved as benchmark.py resolves it)."""
    return resolve_mode(args.fsdp, family_of(args.model_config).parallelism, gpus)


# -- the step on the meta device: where the blocks are and what they see --------------------------

def meta_model(args: argparse.Namespace, sharded: bool) -> Any:
    dtype = memory.autocast_dtype(args.precision)
    return memory.build_meta_model(args.model_config, precomputed=args.precomputed,
                                   precomputed_format=args.text_format, frozen_dtype=dtype,
                                   denoiser_dtype=dtype if sharded else None)


def block_calls(args: argparse.Namespace, sharded: bool) -> tuple[dict[str, tuple], dict[str, Any]]:
    """Each block's inputs (args, kwargs) and outputs in one meta-device step at --microbatch, by the
    block's name in the denoiser, under the device's autocast rules."""
    model = meta_model(args, sharded)
    dtype = memory.autocast_dtype(args.precision)
    if args.fp8 != "off":
        memory.use_float8(model, args.fp8, rows(args), dtype, args.device)
    names = block_names(model.denoiser, args.model_config)
    inputs, outputs = {}, {}
    handles = []
    for name, block in names.items():
        handles.append(block.register_forward_pre_hook(
            lambda module, a, k, name=name: inputs.__setitem__(name, (a, k)), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda module, a, out, name=name: outputs.__setitem__(name, out)))
    policy = (memory.CUDA_AUTOCAST if args.device == "cuda" else memory.probe_cpu_autocast()).with_norms(
        args.norm_precision)
    # With autograd on: what requires grad at a block's inputs (its backward computes their gradients).
    with memory.AutocastRules(policy, dtype, args.device), torch.random.fork_rng(devices=[]):
        model(memory.meta_batch(model, args.model_config, args.image_size, args.microbatch))
    for handle in handles:
        handle.remove()
    return inputs, outputs


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


# -- timing on the device ---------------------------------------------------------------------------

def materialize(module: torch.nn.Module, device: str, seed: int) -> torch.nn.Module:
    """A meta-device module on `device` with random weights (timing does not depend on their values)."""
    module = module.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=generator)
        for b in module.buffers():
            b.zero_()
    return module


def real_tensors(tree: Any, device: str, generator: torch.Generator) -> Any:
    """Device tensors of the meta tensors' shapes and dtypes (floats random, the rest zeros);
    floats that required grad in the step require it here too."""
    def make(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            x = torch.randn(t.shape, device=device, generator=generator).to(t.dtype)
            return x.requires_grad_(t.requires_grad)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return tree_map_only(torch.Tensor, make, tree)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(calls: dict[str, Callable[[], None]], device: str, warmup: int, repeats: int) -> dict[str, float]:
    """The median seconds of each call, timed in turns (one of each per round), so that a busy spell of
    a shared machine falls on every part alike rather than on whichever was being timed."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def autocast(args: argparse.Namespace) -> Any:
    dtype = memory.autocast_dtype(args.precision)
    return torch.autocast(args.device, dtype=dtype, enabled=dtype is not None)


def prepare(module: torch.nn.Module, args: argparse.Namespace, sharded: bool, prefix: str) -> None:
    """The run's settings on a materialized part: FSDP's bf16 weights, the norms, float8 (names in the
    denoiser under `prefix`)."""
    if sharded and args.precision == "amp_bf16":
        module.to(torch.bfloat16)
    if args.precision == "amp_bf16":
        set_norm_precision(module, args.norm_precision)
    if args.fp8 != "off":
        sub = {name[len(prefix):]: n for name, n in rows(args).items() if name.startswith(prefix)}
        fp8.convert(module, args.fp8, sub)


def block_step(args: argparse.Namespace, name: str, call: tuple, output: Any, sharded: bool) -> Callable[[], None]:
    """One forward and backward of the block `name` on its recorded inputs."""
    denoiser = meta_model(args, sharded).denoiser
    block = materialize(copy.deepcopy(dict(denoiser.named_modules())[name]), args.device, args.seed)
    prepare(block, args, sharded, name + ".")
    block.train()
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    block_args, block_kwargs = real_tensors(call, args.device, generator)
    out_leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    grads = [torch.randn(t.shape, device=args.device, generator=generator).to(t.dtype) for t in out_leaves]
    for p in block.parameters():  # gradient accumulation's steady state: the gradients exist
        p.grad = torch.zeros_like(p)

    def step() -> None:
        with autocast(args):
            if args.activation_checkpointing:  # as diffusers' gradient checkpointing wraps each block
                out = torch.utils.checkpoint.checkpoint(block, *block_args, use_reentrant=False, **block_kwargs)
            else:
                out = block(*block_args, **block_kwargs)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        torch.autograd.backward(leaves, grads)

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


def rest_step(args: argparse.Namespace, outputs: dict[str, Any], sharded: bool) -> Callable[[], None]:
    """The training model's step with every block a stand-in: the parts not repeated."""
    model = meta_model(args, sharded)
    for name, block in block_names(model.denoiser, args.model_config).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.denoiser.get_submodule(parent), attr, StandInBlock(outputs[name], block))
    model = materialize(model, args.device, args.seed)
    prepare(model.denoiser, args, sharded, "")
    if args.precision == "amp_bf16":
        set_norm_precision(model, args.norm_precision)
    model.train()
    batch = memory.meta_batch(model, args.model_config, args.image_size, args.microbatch, device=args.device)
    for p in model.denoiser.parameters():
        p.grad = torch.zeros_like(p)

    def step() -> None:
        with autocast(args):
            loss = model.loss(model(batch), batch)
        loss.backward()

    return step


def update_steps(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """AdamW's step (fused on a GPU, as benchmark.py's auto) and the EMA's lerp (ema.py's update) over
    OPTIMIZER_PROBE_PARAMS fp32 parameters."""
    params = [torch.zeros(OPTIMIZER_PROBE_PARAMS // 4, device=args.device, requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=args.device == "cuda")
    shadow = [torch.zeros_like(p) for p in params]

    def ema() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(shadow, params, 1e-3)

    return {"adamw": optimizer.step, **({"ema": ema} if args.use_ema else {})}


# -- the harness, the composition, the report -------------------------------------------------------

def harness_seconds_per_step(args: argparse.Namespace, per_device_batch: int) -> float:
    """Seconds per step of what benchmark.py runs around the model: Composer's Trainer (events,
    microbatch split, batch to device, AdamW on one parameter), the run's own loader (synthetic data of
    the run's format, --num_workers) and the throughput callback, timed over --harness_batches with a
    model of one parameter."""
    import benchmark
    from composer import Trainer
    from composer.models import ComposerModel

    from t2ibench.callbacks.throughput import Pauses, Throughput
    from t2ibench.runtime import Runtime

    class OneParameter(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def forward(self, batch: dict) -> torch.Tensor:
            return self.weight * 1.0

        def loss(self, outputs: torch.Tensor, batch: dict) -> torch.Tensor:
            return outputs

    warmup = min(3, args.harness_batches - 1)
    argv = ["--model_config", args.model_config, "--use_synth_data", "--batch_size", str(per_device_batch),
            "--image_size", str(args.image_size), "--device_train_microbatch_size", str(args.microbatch),
            "--num_workers", str(args.num_workers), "--precision", args.precision, "--seed", str(args.seed),
            "--max_duration", f"{args.harness_batches}ba", "--warmup_batches", str(warmup)]
    if args.precomputed:
        argv += ["--precomputed", "--precomputed_format", args.text_format]
    run_args = benchmark.parse_args(argv)
    # Only what the loader reads: benchmark.py's full validation would refuse flux1-schnell on one GPU,
    # and no model is built here.
    settings = checks.resolve(run_args)
    run = Runtime.start(settings)
    loader = benchmark.build_data(settings, run).loader
    model = OneParameter()
    throughput = Throughput(warmup, 0.0, None, Pauses(), 0.0)
    trainer = Trainer(model=model, train_dataloader=loader, optimizers=torch.optim.AdamW(model.parameters()),
                      max_duration=run_args.max_duration, device_train_microbatch_size=args.microbatch,
                      callbacks=[throughput], precision=run.trainer_precision, progress_bar=False,
                      log_to_console=False, seed=args.seed)
    trainer.fit()
    summary = throughput.summary
    trainer.close()
    return summary["measured_seconds"] / summary["measured_batches"]


def traffic_bytes_per_gpu(mode: str, gpus: int, params: int, accumulation: int, precision: str) -> float:
    """Bytes each GPU sends per step for the sharding `mode` (ring collectives: (G-1)/G of the buffer,
    twice for an all-reduce), as the memory model shards: weights gathered in the autocast dtype,
    gradients reduced in fp32."""
    if gpus == 1:
        return 0.0
    share, weight_bytes = (gpus - 1) / gpus, 4 if precision == "fp32" else 2
    if mode == "none":
        return 2 * share * 4 * params  # one all-reduce per step (Composer syncs on the last microbatch)
    gathers = 2 if mode == "full_shard" else 1  # full_shard gathers again for backward
    return accumulation * share * (gathers * weight_bytes * params + 4 * params)


def compose(args: argparse.Namespace, measured: dict[bool, dict], harness_per_image: float, params: int
            ) -> list[dict[str, Any]]:
    """The predicted step and samples/s per GPU for each --gpus."""
    rows = []
    for gpus in args.gpus:
        mode = mode_for(args, gpus)
        times = measured[mode != "none"]
        per_gpu = args.global_batch // gpus
        accumulation = per_gpu // args.microbatch
        params_per_gpu = params / gpus if mode != "none" else params
        optimizer = params_per_gpu * (times["adamw_seconds_per_param"] + times["ema_seconds_per_param"])
        harness = harness_per_image * per_gpu
        compute = accumulation * times["composed_microbatch_seconds"] + optimizer + harness
        traffic = traffic_bytes_per_gpu(mode, gpus, params, accumulation, args.precision)
        comm = traffic / (args.link_gbps * 1e9)
        rows.append({"gpus": gpus, "fsdp": mode, "per_gpu_batch": per_gpu, "accumulation": accumulation,
                     "optimizer_seconds": optimizer, "harness_seconds": harness, "compute_seconds": compute,
                     "traffic_bytes_per_gpu": traffic, "comm_seconds": comm, "step_seconds": compute + comm,
                     "samples_per_sec_per_gpu": per_gpu / (compute + comm),
                     "samples_per_sec_per_gpu_overlapped": per_gpu / max(compute, comm)})
    return rows


def compared_run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark.py results JSON of --compare_results_json, refused (before any timing) unless its
    settings are this prediction's and its device count is among --gpus."""
    path = args.compare_results_json
    try:
        measured = json.loads(Path(path).read_text())
        measured["images_per_sec_per_device"] + 0
    except (OSError, ValueError, KeyError, TypeError) as error:
        fail(f"--compare_results_json {path}: not a benchmark.py results JSON ({type(error).__name__}: {error})")
    ours = {**vars(args), "precomputed_format": args.text_format}
    for key, flag in {**COMPARED, **({"precomputed_format": "precomputed_format"} if args.precomputed else {})}.items():
        theirs = measured.get(key, "off" if key == "fp8" else None)
        if theirs != ours[flag]:
            fail(f"--compare_results_json {path}: its {key} is {theirs!r}, this prediction's "
                 f"{'--' + flag if flag in vars(args) else flag} is {ours[flag]!r}; predict with the run's settings")
    if measured.get("world_size") not in args.gpus:
        fail(f"--compare_results_json {path}: the run had {measured.get('world_size')} device(s); add it to --gpus")
    return measured


def compare(args: argparse.Namespace, predicted: list[dict]) -> dict[str, Any]:
    """The prediction for the compared run's device count against its measured images/s per device."""
    measured = args.compared
    row = next(r for r in predicted if r["gpus"] == measured["world_size"])
    ratio = row["samples_per_sec_per_gpu"] / measured["images_per_sec_per_device"]
    return {"results_json": args.compare_results_json, "gpus": row["gpus"], "device": measured.get("device"),
            "measured_images_per_sec_per_device": measured["images_per_sec_per_device"],
            "predicted_samples_per_sec_per_gpu": row["samples_per_sec_per_gpu"], "ratio": ratio,
            "within_25_percent": abs(ratio - 1) <= 0.25}


def measure(args: argparse.Namespace, sharded: bool) -> dict[str, Any]:
    """Every part timed on the device with the weights as the run holds them (`sharded`: FSDP's bf16)."""
    calls, outputs = block_calls(args, sharded)
    denoiser = meta_model(args, sharded).denoiser
    members = groups(denoiser, args.model_config)
    steps = {label: block_step(args, names[0], calls[names[0]], outputs[names[0]], sharded)
             for label, names in members.items()}
    steps["the rest"] = rest_step(args, outputs, sharded)
    steps.update(update_steps(args))
    seconds = median_seconds(steps, args.device, args.warmup, args.repeats)
    blocks = [{"name": label, "count": len(names), "seconds": seconds[label]} for label, names in members.items()]
    rest = seconds["the rest"]
    return {"blocks": blocks, "rest_seconds": rest,
            "composed_microbatch_seconds": rest + sum(b["count"] * b["seconds"] for b in blocks),
            "adamw_seconds_per_param": seconds["adamw"] / OPTIMIZER_PROBE_PARAMS,
            "ema_seconds_per_param": seconds.get("ema", 0.0) / OPTIMIZER_PROBE_PARAMS}


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['model_config']} at {result['image_size']}x{result['image_size']}, {result['precision']}, "
             f"fp8 {result['fp8']}{', activation checkpointing' if result['activation_checkpointing'] else ''}, "
             f"microbatch {result['microbatch']}, global batch {result['global_batch']}; measured on "
             f"{result['device']} (median of {result['repeats']} after {result['warmup']} warm-up), per microbatch:"]
    for kind, times in result["measured"].items():
        lines.append(f"  weights {kind}:")
        lines += [f"    {b['name']:<34} x{b['count']:<3} {1e3 * b['seconds']:10.2f} ms forward + backward"
                  for b in times["blocks"]]
        lines.append(f"    {'the rest (embedders, final layer, loss)':<38} {1e3 * times['rest_seconds']:10.2f} ms")
        lines.append(f"    {'composed: the full model':<38} {1e3 * times['composed_microbatch_seconds']:10.2f} ms; "
                     f"AdamW {1e9 * times['adamw_seconds_per_param']:.2f} ns, EMA "
                     f"{1e9 * times['ema_seconds_per_param']:.2f} ns per parameter")
    lines.append(f"  harness (Trainer, loader, callbacks): {1e3 * result['harness_seconds_per_step']:.1f} ms per step of "
                 f"{result['harness_per_device_batch']} images")
    lines.append(f"predicted (not measured) samples/s per GPU, links at {result['link_gbps']:g} GB/s per direction:")
    lines.append("  GPUs  sharding       batch/GPU  microbatches  compute s  traffic GB/GPU  comm s   predicted  "
                 "overlapped")
    for r in result["predicted"]:
        lines.append(f"  {r['gpus']:<5} {r['fsdp']:<14} {r['per_gpu_batch']:<10} {r['accumulation']:<13} "
                     f"{r['compute_seconds']:<10.3f} {r['traffic_bytes_per_gpu'] / 1e9:<15.2f} {r['comm_seconds']:<8.3f} "
                     f"{r['samples_per_sec_per_gpu']:<10.3g} {r['samples_per_sec_per_gpu_overlapped']:.3g}")
    for gpu, per_gpu in result["reference"].items():
        lines.append(f"  reference: MLPerf Training v5.1, {gpu}, MXFP8 (published, not measured here): {per_gpu:g}")
    if result["comparison"]:
        c = result["comparison"]
        lines.append(f"against {c['results_json']} ({c['gpus']} x {c['device']}): measured "
                     f"{c['measured_images_per_sec_per_device']:.2f} images/s per device, predicted "
                     f"{c['predicted_samples_per_sec_per_gpu']:.2f}: ratio {c['ratio']:.3f} "
                     f"({'within' if c['within_25_percent'] else 'outside'} 25%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with errors.command("blocks.py"):
        args = validate(build_parser().parse_args(argv))
        if args.device == "cpu":
            cpu_threads.choose(args.num_workers, 1)  # as benchmark.py's one CPU rank runs (runtime.Runtime)
        torch.manual_seed(args.seed)
        measured = {}
        for sharded in sorted({mode_for(args, gpus) != "none" for gpus in args.gpus}):
            print(f"timing the blocks of {args.model_config} on {args.device}, weights "
                  f"{'sharded (FSDP: gathered in the autocast dtype)' if sharded else 'replicated'}...",
                  file=sys.stderr, flush=True)
            measured[sharded] = measure(args, sharded)
        per_device = args.global_batch // args.gpus[0]
        harness = harness_seconds_per_step(args, per_device)
        params = sum(p.numel() for p in meta_model(args, False).denoiser.parameters())
        predicted = compose(args, measured, harness / per_device, params)
        result = {
            "model_config": args.model_config, "image_size": args.image_size, "precision": args.precision,
            "norm_precision": args.norm_precision, "precomputed": args.precomputed, "precomputed_format": args.text_format,
            "activation_checkpointing": args.activation_checkpointing, "fp8": args.fp8, "use_ema": args.use_ema,
            "microbatch": args.microbatch, "global_batch": args.global_batch, "link_gbps": args.link_gbps,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "warmup": args.warmup, "repeats": args.repeats, "denoiser_params": params,
            "measured": {("sharded" if sharded else "replicated"): times for sharded, times in measured.items()},
            "harness_seconds_per_step": harness, "harness_per_device_batch": per_device,
            "predicted": predicted,
            "reference": MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU if family_of(args.model_config).name == "flux" else {},
            "comparison": None,
        }
        if args.compared:
            result["comparison"] = compare(args, predicted)
        print(report(result), flush=True)
        if args.json:
            print(json.dumps(result), flush=True)
        return result


if __name__ == "__main__":
    main()
