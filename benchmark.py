"""Train a text-to-image model (Stable Diffusion 2 base by default) from scratch with Composer and measure images/s.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # 1 node, all GPUs
    python benchmark.py --model_config tiny --use_synth_data --batch_size 8 --image_size 64 --max_duration 20ba
    composer benchmark.py @recipes/sd2-stage1.args --remote s3://my-bucket/laion/mds ...   # flags from a file

The denoiser (SD2: the UNet) is built from its config with random weights; the VAE and the text
encoder are frozen (loaded from `--model_name` when available). Data is synthetic
(`--use_synth_data`), LAION-style MDS shards streamed from `--remote` into `--local`, or latents
precomputed by latents.py (`--precomputed`). The run reads as `main` says: runtime, data, model,
trainer, results.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from composer import Evaluator, Trainer
from composer.callbacks import SpeedMonitor
from composer.core import Callback
from composer.loggers import WandBLogger
from composer.utils import dist
from torch.utils.data import DataLoader

import data
from t2ibench import checks, errors, flags, fp8, memory, parallel, stack
from t2ibench.callbacks.empty_epoch import EmptyEpochError, StopOnEmptyEpoch
from t2ibench.callbacks.loss_by_timestep import LossByTimestep
from t2ibench.callbacks.nonfinite_loss import NonFiniteLossError, StopOnNonFiniteLoss
from t2ibench.callbacks.profile import ProfileBatches
from t2ibench.callbacks.progress import ConsoleProgress
from t2ibench.callbacks.resume_rng import RestoreRngOnStreamingResume
from t2ibench.callbacks.run_record import RunRecord
from t2ibench.callbacks.samples import SampleImages
from t2ibench.callbacks.throughput import Pauses, Throughput
from t2ibench.callbacks.validation import EVAL_LABEL, ValidationLog
from t2ibench.checkpoints import write_whole
from t2ibench.precision import PRECISION_CHOICES
from t2ibench.cli import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, Range
from t2ibench.families import ModelFamily, Parts, build_aside, require_pretrained
from t2ibench.files import STAGING_FOLDER, no_room, hold_output, staged_folder, write_error, write_text
from t2ibench.norms import NORM_PRECISIONS, set_norm_precision
from t2ibench.model import DiffusionModel, unwrap_model, vae_overflows_in
from t2ibench.runtime import Runtime
from t2ibench.sampling import MAX_GUIDANCE_SCALE, load_prompts, write_pipeline
from t2ibench.objectives import TIMESTEP_SAMPLINGS
from t2ibench.sources import parse_sources, record_cache
from t2ibench.streaming import StreamingSettings
from t2ibench.weight_casts import WEIGHT_CAST_CHOICES, CastWeightsOncePerStep
from t2ibench.summary import print_summary

# SD2's and SDXL's DDPM schedules have 1000 training timesteps (Flux's are continuous): more loss bins
# than that would stay empty, and more sampler steps than that repeat timesteps.
MAX_LOSS_BINS = MAX_SAMPLE_STEPS = 1000


def build_parser() -> flags.Parser:
    p = flags.Parser("benchmark.py", description=__doc__)
    # The flags of the 2023 benchmark keep their names and defaults (--remote, --local, --image_size
    # and --model_name among the shared groups below).
    g = p.add_argument_group("the 2023 benchmark's flags")
    g.add_argument("--batch_size", type=POSITIVE_INT, default=2048, help="global batch size, images per step over all devices")
    g.add_argument("--use_synth_data", action="store_true", help="random images and captions (measures the model only)")
    g.add_argument("--use_ema", action="store_true",
                   help="keep an EMA of the denoiser's weights (half-life --ema_half_life, 1000 batches)")
    g.add_argument("--wandb_name", type=str, default=None, help="W&B run name (enables W&B logging)")
    g.add_argument("--wandb_project", type=str, default=None, help="W&B project (enables W&B logging)")
    g.add_argument("--device_train_microbatch_size", type=str, default="auto",
                   help="images per device per forward/backward, or 'auto' (GPU: largest that fits; CPU: no accumulation)")
    flags.add_source(p)
    flags.add_model(p)
    flags.add_run(p, "seeds model init, noise, timesteps, data order")
    g = p.add_argument_group("run length, precision, results")
    g.add_argument("--max_duration", type=str, default="1ep", help="Composer time string: 20ba, 1ep, 100000sp")
    g.add_argument("--precision", type=str, default="auto", help=f"one of {PRECISION_CHOICES}; auto: amp_bf16 on GPU, fp32 on CPU")
    g.add_argument("--results_json", type=str, default=None, help="write the throughput summary to this JSON file")
    g.add_argument("--num_synthetic_samples", type=POSITIVE_INT, default=100_000, help="size of the synthetic dataset")
    g.add_argument("--lr", type=POSITIVE_FLOAT, default=1e-4, help="AdamW learning rate (constant unless --lr_schedule / --lr_warmup_batches)")
    g.add_argument("--weight_decay", type=NON_NEGATIVE_FLOAT, default=1e-3, help="AdamW weight decay")
    g.add_argument("--warmup_batches", type=NON_NEGATIVE_INT, default=5, help="batches left out of the throughput measurement")
    g.add_argument("--peak_tflops", type=POSITIVE_FLOAT, default=None,
                   help="peak TFLOP/s of one device for MFU (default: Composer's table for A100/H100/H200)")
    g.add_argument("--log_interval", type=str, default="10ba",
                   help="in a log file, print a progress line this often (20ba, 1ep); on a terminal the line updates in place")
    flags.add_streaming(p)
    g = p.add_argument_group("checkpoints (Composer's: local paths or s3://, gs://, oci://... URIs)")
    g.add_argument("--save_folder", type=str, default=None, help="where to save checkpoints (path or s3://... URI)")
    g.add_argument("--save_interval", type=str, default="1000ba", help="checkpoint every this long (20ba, 1ep)")
    g.add_argument("--save_num_checkpoints_to_keep", type=Range(int, -1), default=-1,
                   help="local checkpoints to keep (-1: all; 0: none, only with an object-store --save_folder, "
                        "which keeps every upload)")
    g.add_argument("--load_path", type=str, default=None, help="checkpoint to start from (path or URI)")
    g.add_argument("--autoresume", action="store_true",
                   help="resume from the latest checkpoint in --save_folder if there is one (needs --run_name)")
    g.add_argument("--run_name", type=str, default=None, help="run name; fixed names let --autoresume find the run")
    g = p.add_argument_group("speed (defaults are the plain step until GPU measurements say otherwise)")
    g.add_argument("--precomputed", action="store_true",
                   help="train from precomputed VAE latents (latents.py): no VAE; the text encoder runs on stored "
                        "token ids, or is skipped too for shards written with --store_text_states")
    g.add_argument("--precomputed_format", type=str, default=None, choices=("tokens", "text_states"),
                   help="with --precomputed --use_synth_data: the format synthetic batches imitate (shards: read "
                        "from their columns); default tokens for SD2, text_states (MLPerf's) for Flux")
    g.add_argument("--channels_last", action="store_true", help="denoiser and VAE in channels-last memory format")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile every module that runs per step: the denoiser, and the VAE encoder and text "
                        "encoders when they run (in place: checkpoint keys unchanged)")
    g.add_argument("--norm_precision", type=str, default="autocast", choices=NORM_PRECISIONS,
                   help="under AMP, GroupNorm and LayerNorm run in the autocast dtype (autocast), or in fp32 as "
                        "CUDA autocast's own lists have them (fp32)")
    g.add_argument("--fsdp", type=str, default="auto", choices=parallel.FSDP_CHOICES,
                   help="shard the denoiser's weights, gradients and AdamW state over the ranks (Composer's FSDP2): "
                        "full_shard (weights gathered block by block in forward and again in backward), "
                        "shard_grad_op (gathered once per microbatch, kept until its backward ends); none: DDP; "
                        "auto: full_shard for Flux.1 on several ranks, else none")
    g.add_argument("--fused_adamw", type=str, default="auto", choices=("auto", "on", "off"),
                   help="fused AdamW kernel; auto: on with CUDA")
    g.add_argument("--xformers", action="store_true", help="use xFormers attention in the UNet (default: PyTorch SDPA)")
    g.add_argument("--weight_casts", type=str, default="auto", choices=WEIGHT_CAST_CHOICES,
                   help="cast the denoiser's weights to bf16 once per optimizer step (step: bf16 copies, fp32 "
                        "weights for the optimizer) or in every microbatch's forward and backward as autocast does "
                        "(microbatch); auto: step on one CUDA device under amp_bf16, else microbatch")
    g.add_argument("--profile_batches", type=Range(int, 0, 1000), default=0,
                   help="profile this many batches right after the warm-up with the torch profiler (left out of "
                        "the throughput window): a trace for Perfetto / chrome://tracing, the 15 most expensive "
                        "ops and the device-busy fraction in the summary and the results JSON")
    g.add_argument("--profile_dir", type=str, default="profile", help="where --profile_batches writes its trace")
    g.add_argument("--activation_checkpointing", action="store_true",
                   help="recompute each block of the denoiser in the backward pass instead of keeping its activations "
                        "(diffusers' gradient checkpointing): less memory, about a third more compute")
    flags.add_fp8(g)
    g = p.add_argument_group("training recipe (every default keeps the 2023 step)")
    g.add_argument("--lr_warmup_batches", type=NON_NEGATIVE_INT, default=0, help="linear learning-rate warm-up over this many batches")
    g.add_argument("--lr_schedule", type=str, default="constant", choices=("constant", "cosine"),
                   help="after the warm-up: constant, or cosine decay to 0 at --max_duration")
    g.add_argument("--grad_clip_norm", type=POSITIVE_FLOAT, default=None, help="clip the gradient's global L2 norm to this")
    g.add_argument("--caption_drop_prob", type=Range(float, 0, 1, high_open=True), default=0.0,
                   help="replace each caption by the empty one with this probability (classifier-free guidance)")
    g.add_argument("--ema_start", type=str, default="0ba", help="with --use_ema: start averaging at this time (e.g. 1350000ba)")
    g.add_argument("--ema_half_life", type=str, default="1000ba",
                   help="with --use_ema: EMA half-life in batches (6931ba is a smoothing of 0.9999 per batch)")
    g.add_argument("--ema_export_dir", type=str, default=None,
                   help="with --use_ema: write a complete diffusers pipeline with the EMA weights here at the end")
    g.add_argument("--snr_gamma", type=POSITIVE_FLOAT, default=None, help="min-SNR-gamma loss weighting (5 is the paper's value)")
    g.add_argument("--offset_noise", type=Range(float, 0, 1), default=0.0,
                   help="offset noise strength (e.g. 0.1; at most 1, where the offset is as strong as the noise)")
    g.add_argument("--loss_bins", type=Range(int, 0, MAX_LOSS_BINS), default=10,
                   help=f"log the loss in this many bins of timesteps (0: off; at most {MAX_LOSS_BINS}, and at most "
                        "the training timesteps of a DDPM model)")
    g.add_argument("--timestep_sampling", type=str, default="uniform", choices=TIMESTEP_SAMPLINGS,
                   help="how training draws timesteps: uniform (SD2's DDPM steps; Flux: t ~ U(0,1) as MLPerf's "
                        "reference), or logit_normal (SD3's, Flux only)")
    g = p.add_argument_group("validation loss (MLPerf's quality measure, every model)")
    g.add_argument("--eval_interval", type=str, default=None,
                   help="compute the validation loss at 8 fixed timesteps on held-out samples this often (e.g. "
                        "1000ba) and at the end; off by default")
    g.add_argument("--eval_remote", type=str, default=None,
                   help="held-out MDS shards, in the training data's format (images, or latents with --precomputed)")
    g.add_argument("--eval_local", type=str, default=None, help="local cache of --eval_remote, or held-out shards on disk")
    g.add_argument("--eval_samples", type=POSITIVE_INT, default=None,
                   help="held-out samples per evaluation (default: 256 synthetic ones with --use_synth_data, "
                        "else all of --eval_remote)")
    g.add_argument("--eval_target", type=POSITIVE_FLOAT, default=None,
                   help="report when the validation loss first reaches this (MLPerf Flux.1: 0.586)")
    g = p.add_argument_group("sample grids while training")
    g.add_argument("--sample_prompts", type=str, default=None,
                   help="draw these prompts while training: a text file (one per line) or a built-in set: default, shapes")
    g.add_argument("--sample_interval", type=str, default="1000ba", help="sample every this long (and at the end)")
    g.add_argument("--samples_dir", type=str, default=None, help="where sample grids go (default: <--save_folder>/samples)")
    g.add_argument("--sampler", type=str, default=None, choices=("ddim", "euler"),
                   help="diffusers sampler for samples: ddim (SD2's default) or euler (for Flux: flow-matching Euler, "
                        "FluxPipeline's)")
    g.add_argument("--sample_steps", type=Range(int, 1, MAX_SAMPLE_STEPS), default=50,
                   help=f"sampler steps per sample (at most {MAX_SAMPLE_STEPS}, the training timesteps of SD2 and SDXL)")
    g.add_argument("--guidance_scale", type=Range(float, 0, MAX_GUIDANCE_SCALE), default=7.5,
                   help="classifier-free guidance scale of samples (<= 1: none, as in diffusers)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> ModelFamily:
    """Every check of the flags (t2ibench.checks), as the command reports them; the model's family."""
    with errors.command("benchmark.py"):
        return checks.validate(args, world_size)


def main(argv: list[str] | None = None, extra_callbacks: list[Callback] | None = None) -> dict:
    """One run: runtime, data, model, trainer, results; returns the results (what --results_json holds)."""
    args = parse_args(argv)
    with errors.command("benchmark.py"), contextlib.ExitStack() as held:
        family = validate(args, dist.get_world_size())  # every user error, before anything is built
        if dist.get_global_rank() == 0:  # a second run writing the same folders is refused, not mixed in
            for flag in ("save_folder", "ema_export_dir"):
                held.enter_context(hold_output(f"--{flag}", getattr(args, flag)))
        run = Runtime.start(args, family)
        training_data = build_data(args, run, family)
        run = run.with_counted_microbatch(args, family, training_data.text_format)  # the shards' format counts
        model = build_model(args, run, family, training_data)
        trainer, measured = build_trainer(args, run, model, training_data, extra_callbacks)
        try:
            results = train(args, run, trainer, model, measured)
            report(args, results)  # the figures are kept whatever the export does
            export_average(args, run, trainer, model, measured)
        finally:
            trainer.close()
        return results


@dataclasses.dataclass
class TrainingData:
    loader: DataLoader
    text_format: str | None  # precomputed shards: "tokens" (token ids) or "text_states" (encoder outputs)
    tokenizers: Parts | None  # the tokenizers the image loader uses, with where they came from
    eval_loader: DataLoader | None = None  # held-out samples for the validation loss (--eval_interval)


def build_data(args: argparse.Namespace, run: Runtime, family: ModelFamily) -> TrainingData:
    """The training loader and the held-out one, built here only. They come before the model: the
    shards' format decides which encoders the model needs, and the image loader tokenizes captions
    in its workers. Held-out data is read like the training data, in stored order; synthetic
    held-out samples are drawn with another seed than the training ones."""
    tokenizers = None
    for source in [] if args.use_synth_data else [*args.sources, *args.eval_sources]:
        record_cache(source)  # the remote a cache holds, before Streaming fills it
    if not args.precomputed and not args.use_synth_data:
        tokenizers = family.build(args.model_config, args.model_name, denoiser=False, vae=False, text_encoders=False)

    def loader(sources: list, seed: int, num_samples: int, held_out: bool) -> DataLoader:
        common = dict(batch_size_per_device=run.batch_size_per_device, num_workers=args.num_workers, seed=seed,
                      family=family)
        settings = StreamingSettings.from_args(args)
        if held_out:  # every held-out sample once per evaluation, in stored order
            settings = dataclasses.replace(settings, shuffle=False, epoch_size=None, sampling_granularity=1)
        if args.precomputed:
            scaled = family.meta_parts(args.model_config) if args.use_synth_data else None
            return data.latents_dataloader(
                synthetic=args.use_synth_data, sources=sources, image_size=args.image_size, text_dim=text_dim,
                latent_channels=family.latent_channels(args.model_config), num_samples=num_samples,
                synthetic_format=args.precomputed_format, settings=settings,
                latent_scale=scaled.latent_scale if scaled else None, latent_shift=scaled.latent_shift if scaled else 0.0,
                config=args.model_config, **common)
        if args.use_synth_data:
            return data.synthetic_dataloader(args.image_size, num_samples=num_samples, shuffle=not held_out,
                                             config=args.model_config, **common)
        return data.laion_dataloader(sources=sources, tokenizer=tokenizers.tokenizers, image_size=args.image_size,
                                     settings=settings, image_key=args.image_key, caption_key=args.caption_key,
                                     max_bad_fraction=args.max_bad_fraction, **common)

    text_dim = next(iter(family.conditioning_shapes(args.model_config).values()))[-1]
    training = loader(args.sources, args.seed, args.num_synthetic_samples, False)
    held_out = None
    if args.eval_interval:
        held_out = loader(args.eval_sources, args.seed + 1, args.eval_samples or 256, True)
    text_format = training.dataset.text_format if args.precomputed else None
    return TrainingData(training, text_format, tokenizers, held_out)


@dataclasses.dataclass
class Model:
    """The training model and what the run needs beside it."""

    model: DiffusionModel
    encoders: Parts  # used outside the step: the empty caption, samples, the exported pipeline
    flops: dict[str, float]  # FLOPs per image of the step (family.flops_per_image; fp8_fwd_bwd: those in float8)
    text_format: str | None  # precomputed shards: "tokens" or "text_states"
    float8: fp8.Conversion | None = None  # --fp8: the Linear layers in float8


def build_model(args: argparse.Namespace, run: Runtime, family: ModelFamily, training_data: TrainingData) -> Model:
    """The training model with its frozen parts, the encoders the run uses outside the step, the FLOPs."""
    text_format = training_data.text_format
    parts = family.build(args.model_config, args.model_name, vae=not args.precomputed,
                         text_encoders=text_format != "text_states", tokenizers=False)
    if training_data.tokenizers is not None:
        parts.pretrained += training_data.tokenizers.pretrained
        parts.random += training_data.tokenizers.random
    tokenizers = training_data.tokenizers.tokenizers if training_data.tokenizers is not None else None
    require_pretrained(parts, needed=not args.use_synth_data and args.model_config in family.pretrained_configs,
                       allowed=args.allow_random_encoders, model_name=args.model_name)
    if parts.random_encoders and run.is_rank_zero:
        missing = " and ".join(parts.random_encoders)
        why = (f"the {args.model_config} configuration has no pretrained weights"
               if args.model_config not in family.pretrained_configs else
               f"--model_name {args.model_name}: pretrained {missing} not available here (offline or not downloaded)")
        print(f"note: {why}; using randomly initialized {missing} (throughput does not depend on the weights).",
              file=sys.stderr, flush=True)
    model = DiffusionModel(family, parts, snr_gamma=args.snr_gamma, offset_noise=args.offset_noise,
                           num_loss_bins=args.loss_bins, timestep_sampling=args.timestep_sampling,
                           validation_seed=args.seed)
    encoders = dataclasses.replace(parts, denoiser=None, tokenizers=tokenizers or {})
    if (args.caption_drop_prob > 0 or args.sample_prompts or args.ema_export_dir) and not (
            parts.vae and parts.text_encoders and tokenizers):
        # On precomputed latents: the missing parts exactly as latents.py built them (precompute.json's
        # seed for random encoders, checks.check_precompute_record; else --seed).
        encoders_seed = getattr(args, "encoders_seed", None)
        if encoders_seed is not None and encoders_seed != args.seed and run.is_rank_zero:
            print(f"note: the latents were computed with random encoders of seed {encoders_seed} (precompute.json): "
                  f"the encoders are rebuilt from it; --seed {args.seed} seeds the denoiser, noise and data order",
                  file=sys.stderr, flush=True)
        aside = build_aside(family, args.model_config, args.model_name,
                            encoders_seed if encoders_seed is not None else args.seed)
        encoders = dataclasses.replace(aside, vae=parts.vae or aside.vae,
                                       text_encoders=parts.text_encoders or aside.text_encoders,
                                       tokenizers=tokenizers or aside.tokenizers, pretrained=parts.pretrained,
                                       random=parts.random)
    if args.caption_drop_prob > 0:
        empty = family.tokenize(encoders.tokenizers, [""])
        with torch.no_grad():
            model.set_caption_dropout(args.caption_drop_prob, empty,
                                      family.as_unconditional(family.encode_text(encoders.text_encoders, empty)))
    conversion = None
    if args.fp8 != "off":  # before compile and FSDP wrap them; the same parameters, so before AdamW too
        rows = memory.linear_rows_per_sample(args.model_config, args.image_size, text_format)
        conversion = fp8.convert(model.denoiser, args.fp8, rows)
    apply_speed_settings(args, run, model)
    flops = family.flops_per_image(args.model_config, args.image_size, vae=not args.precomputed,
                                   text_encoders=text_format != "text_states")
    if conversion:
        flops["fp8_fwd_bwd"] = fp8.linear_flops_per_sample(model.denoiser, rows, conversion.converted)
    model.flops_per_image = flops["total"]
    return Model(model, dataclasses.replace(encoders, latent_scale=model.latent_scale), flops, text_format,
                 conversion)


def apply_speed_settings(args: argparse.Namespace, run: Runtime, model: DiffusionModel) -> None:
    """CPU autocast, xFormers, activation checkpointing, channels-last, the frozen parts' dtype, the
    norms' precision and torch.compile."""
    if not run.on_gpu and run.precision == "amp_bf16":
        model.cpu_autocast_dtype = torch.bfloat16
    if args.xformers:
        model.denoiser.enable_xformers_memory_efficient_attention()
    if args.activation_checkpointing:
        model.denoiser.enable_gradient_checkpointing()
    if args.channels_last:
        model.denoiser.to(memory_format=torch.channels_last)
        if model.vae is not None:
            model.vae.to(memory_format=torch.channels_last)
            model.vae_channels_last = True
    if run.precision in ("amp_bf16", "amp_fp16"):
        # Frozen encoders stored in the autocast dtype: autocast would otherwise re-cast their fp32
        # weights on every microbatch. GroupNorm and LayerNorm, which CUDA autocast runs in fp32
        # (reading and writing twice the bytes, keeping fp32 activations for backward and upcasting
        # the stored bf16 norm weights), run in the autocast dtype unless --norm_precision fp32.
        dtype = torch.bfloat16 if run.precision == "amp_bf16" else torch.float16
        for frozen in model.frozen():
            if frozen is model.vae and vae_overflows_in(frozen, dtype):
                model.vae_in_fp32 = True  # SDXL's own VAE under fp16: fp32, outside autocast
                continue
            frozen.to(dtype)
        set_norm_precision(model, args.norm_precision)
    if args.compile:
        if run.world_size > 1:
            # Under DDP, dynamo's DDPOptimizer splits the compiled graph at every gradient bucket
            # (~140 graphs for the SD2 UNet) so that all-reduces overlap the backward pass. With
            # gradient accumulation Composer syncs gradients only on a batch's last microbatch, so
            # that overlap is worth little, while the splits cost fusion and compile time.
            torch._dynamo.config.optimize_ddp = False
        # nn.Module.compile works in place and keeps parameter names, so checkpoints and the EMA are
        # unaffected. Every module that runs per step: the eager VAE encoder was 35-40% of an
        # online SD2 step, and the text encoders run on token ids online and on the tokens format.
        model.denoiser.compile()
        if model.vae is not None:
            model.vae.encoder.compile()
        for encoder in model.text_encoders.values():
            encoder.compile()


@dataclasses.dataclass
class Measured:
    """The callbacks whose figures go into the results."""

    throughput: Throughput
    loss_by_timestep: LossByTimestep | None
    ema: Callback | None  # ema.EMA (an Algorithm)
    validation: ValidationLog | None = None
    profile: ProfileBatches | None = None


def build_trainer(args: argparse.Namespace, run: Runtime, built: Model, training_data: TrainingData,
                  extra_callbacks: list[Callback] | None) -> tuple[Trainer, Measured]:
    """Composer's Trainer: AdamW on the denoiser, the recipe's algorithms, the benchmark's callbacks,
    and Composer's evaluator on the held-out data for the validation loss."""
    model, encoders, flops = built.model, built.encoders, built.flops
    loader = training_data.loader
    fused = args.fused_adamw == "on" or (args.fused_adamw == "auto" and run.on_gpu)
    optimizer = torch.optim.AdamW(model.denoiser.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    schedulers = []
    if args.lr_warmup_batches or args.lr_schedule != "constant":
        from composer.optim import ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler
        # Composer's warm-up schedulers need t_warmup in the unit of the run's length (ba and ep
        # runs are counted in batches): a run in samples warms up over as many samples.
        warmup = (f"{args.lr_warmup_batches * args.batch_size}sp" if args.max_duration.endswith("sp")
                  else f"{args.lr_warmup_batches}ba")
        schedulers.append(CosineAnnealingWithWarmupScheduler(t_warmup=warmup, alpha_f=0.0) if args.lr_schedule == "cosine"
                          else ConstantWithWarmupScheduler(t_warmup=warmup))
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    pauses = Pauses()
    trained_flops = flops["total"] - flops["vae_encoder"] - flops["text_encoder"]  # the denoiser's forward and backward
    # Profiled batches (slowed by the profiler) come right after the warm-up, before the measured window.
    measured = Measured(Throughput(args.warmup_batches + args.profile_batches, flops["total"], peak_flops, pauses,
                                   trained_flops),
                        LossByTimestep(args.log_interval) if args.loss_bins else None, None)
    if args.profile_batches:
        measured.profile = ProfileBatches(args.warmup_batches, args.profile_batches, args.profile_dir, pauses)
    algorithms = []
    if args.use_ema:
        from ema import EMA
        # The averaged pipeline is exported after the results are written (export_average).
        measured.ema = EMA(half_life=args.ema_half_life, ema_start=args.ema_start)
        algorithms.append(measured.ema)
    if args.grad_clip_norm:
        from composer.algorithms import GradientClipping
        algorithms.append(GradientClipping(clipping_type="norm", clipping_threshold=args.grad_clip_norm))
    if run.weight_casts == "step":
        # Last in the list: Composer runs AFTER_* events in reverse order, and the fp32 weights must
        # have their gradients back before gradient clipping looks at them.
        algorithms.append(CastWeightsOncePerStep(model.denoiser))
    evaluators = []
    if training_data.eval_loader is not None:
        measured.validation = ValidationLog(pauses, args.eval_target)
        # --eval_samples caps held-out shards at whole global batches; synthetic ones are that many.
        capped = args.eval_samples and not args.use_synth_data
        evaluators.append(Evaluator(label=EVAL_LABEL, dataloader=training_data.eval_loader,
                                    metric_names=["ValidationLoss"], device_eval_microbatch_size=run.microbatch
                                    if isinstance(run.microbatch, int) else None,
                                    subset_num_batches=-(-args.eval_samples // args.batch_size) if capped else -1))
    write_whole()  # a checkpoint is complete under its name, or absent (a full disk leaves no part of it)
    restore_rng = RestoreRngOnStreamingResume()
    callbacks = [SpeedMonitor(window_size=10, gpu_flops_available=peak_flops), measured.throughput,
                 StopOnNonFiniteLoss(args.load_path, args.save_folder), StopOnEmptyEpoch(),
                 RunRecord({"model_config": args.model_config, "model_name": args.model_name,
                            "encoders_seed": args.seed if getattr(args, "encoders_seed", None) is None
                            else args.encoders_seed,
                            "image_size": args.image_size, "precomputed": args.precomputed}),
                 ConsoleProgress(args.log_interval, validation=measured.validation), restore_rng]
    if measured.validation:
        callbacks.append(measured.validation)
    if measured.loss_by_timestep:
        callbacks.append(measured.loss_by_timestep)
    if measured.profile:
        callbacks.append(measured.profile)
    if args.sample_prompts:
        callbacks.append(SampleImages(
            model.family, load_prompts(args.sample_prompts), args.samples_dir or os.path.join(args.save_folder, "samples"),
            args.sample_interval, encoders=encoders,
            image_size=args.image_size, pauses=pauses, average=measured.ema, sampler=args.sampler,
            num_steps=args.sample_steps, guidance_scale=args.guidance_scale, seed=args.seed))
    fsdp = parallel.fsdp_parallelism(args.fsdp)
    if fsdp is not None:
        model.mark_fsdp_units()
        if run.on_gpu:
            # With a parallelism config Composer does not move the model (fully_shard moves only the
            # modules it wraps): the frozen encoders and buffers go to this rank's GPU here. Every
            # rank built the denoiser from the same seed, so the shards come from identical weights
            # (Composer's FSDP2 broadcasts from rank 0 only when the other ranks are on the meta device).
            model.to(torch.device("cuda", dist.get_local_rank()))
    trainer = Trainer(
        model=model, parallelism_config=fsdp, train_dataloader=loader, optimizers=optimizer, schedulers=schedulers or None,
        eval_dataloader=evaluators or None, eval_interval=args.eval_interval or 1,
        eval_subset_num_batches=-1,
        max_duration=args.max_duration, algorithms=algorithms, callbacks=[*callbacks, *(extra_callbacks or [])],
        loggers=[WandBLogger(project=args.wandb_project, name=args.wandb_name)]
        if args.wandb_project or args.wandb_name else [],
        precision=run.trainer_precision, device_train_microbatch_size=run.microbatch, seed=args.seed,
        run_name=args.run_name, save_folder=args.save_folder, save_interval=args.save_interval,
        save_num_checkpoints_to_keep=args.save_num_checkpoints_to_keep, save_overwrite=args.autoresume,
        load_path=args.load_path, autoresume=args.autoresume,
        progress_bar=False, log_to_console=False)  # callbacks.progress.ConsoleProgress prints the progress line
    restore_rng.arm(trainer)
    if fsdp is not None and torch.distributed.get_backend() == "gloo":
        parallel.average_gradients_over_gloo(model.denoiser)
    if run.on_gpu and model.vae is not None:
        # Training only encodes: the VAE decoder (~50M parameters) waits on the host. Anything that
        # decodes during a run (sampling) moves it back to the device first.
        model.vae.decoder.to("cpu")
        if model.vae.post_quant_conv is not None:  # Flux's VAE has none
            model.vae.post_quant_conv.to("cpu")
    return trainer, measured


def train(args: argparse.Namespace, run: Runtime, trainer: Trainer, built: Model, measured: Measured) -> dict:
    """Fit (unless a retried job finds its run complete); the results."""
    model, encoders = built.model, built.encoders
    trained_before = int(trainer.state.timestamp.batch)
    if not run_already_complete(trainer):
        trainer.fit()
    window_end = measured.throughput.window_end
    after_window_s = time.perf_counter() - window_end if window_end else None
    results = {
        **measured.throughput.summary,
        # From the end of the last batch to the return of fit: final checkpoint, uploads (the EMA
        # export follows the results: export_average).
        "seconds_after_window": after_window_s,
        "world_size": run.world_size,
        "device": torch.cuda.get_device_name() if run.on_gpu else "cpu",
        "precision": run.precision,
        "image_size": args.image_size,
        "global_batch_size": args.batch_size,
        "device_train_microbatch_size": trainer.state.device_train_microbatch_size,
        "model_config": args.model_config,
        "data": "synthetic" if args.use_synth_data else ",".join(source.spec for source in args.sources),
        "use_ema": args.use_ema,
        "precomputed": args.precomputed,
        "precomputed_format": built.text_format,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "fused_adamw": args.fused_adamw == "on" or (args.fused_adamw == "auto" and run.on_gpu),
        "xformers": args.xformers,
        "norm_precision": args.norm_precision if run.precision in ("amp_bf16", "amp_fp16") else None,
        "fsdp": args.fsdp,
        "pretrained_parts": encoders.pretrained,
        "random_parts": encoders.random,
        "flops_per_image_breakdown": built.flops,
        # Mean over all ranks and all microbatches of the last batch (Composer's all-reduced total).
        "final_loss": trainer.state.total_loss_dict.get("loss/train/total"),
        "loss_by_timestep_bin": measured.loss_by_timestep.summary() if measured.loss_by_timestep else [],
        "timestep_sampling": args.timestep_sampling,
        "activation_checkpointing": args.activation_checkpointing,
        "weight_casts": run.weight_casts,
        **(measured.profile.summary if measured.profile else {}),
        "fp8": args.fp8,
        "fp8_conversion": built.float8.summary() if built.float8 else None,
        **(measured.validation.summary() if measured.validation else {"eval_loss": None}),
        "torch_version": torch.__version__,
        "versions": stack.versions(),  # the pinned stack beside this torch (two installs: README)
    }
    if int(trainer.state.timestamp.batch) == trained_before:
        # A retried --autoresume job whose run had finished: nothing was trained or measured here.
        results.update(already_complete=True, images_per_sec=None, images_per_sec_per_device=None,
                       measured_batches=0, trained_batches=trained_before, save_folder=args.save_folder)
    return results


def run_already_complete(trainer: Trainer) -> bool:
    """True when the loaded checkpoint is already at --max_duration (a retried --autoresume job).

    Composer's fit() raises then ("No training would occur"); the job instead finishes what the
    killed one may not have: the EMA export (export_average). The summary and results say the run
    was complete.
    """
    state = trainer.state
    return state.timestamp.get(state.max_duration.unit) >= state.max_duration


def export_average(args: argparse.Namespace, run: Runtime, trainer: Trainer, built: Model, measured: Measured) -> None:
    """--ema_export_dir: the pipeline with the averaged denoiser, written after the results (a full disk
    here loses no figure), into a staging folder moved into place with model_index.json last."""
    ema, folder = measured.ema, args.ema_export_dir
    if not folder or ema is None:
        return
    if not ema.initialized:
        print(f"note: the EMA had not started by the end of training (--ema_start {args.ema_start}): nothing "
              f"exported to --ema_export_dir {folder}", file=sys.stderr, flush=True)
        return
    model, name = built.model, built.model.denoiser_name
    staging = Path(folder, STAGING_FOLDER)
    try:
        with staged_folder(folder, last="model_index.json") if run.is_rank_zero else contextlib.nullcontext():
            ema.export_denoiser(trainer.state.model, staging / name, submodule=name)  # every rank: FSDP gathers
            if run.is_rank_zero:
                averaged = type(model.denoiser).from_pretrained(staging / name)
                write_pipeline(staging, model.family, dataclasses.replace(
                    built.encoders, denoiser=averaged, noise_scheduler=model.noise_scheduler))
    except OSError as error:
        errors.fail(write_error(f"--ema_export_dir {folder}", error) + "; the results were written before it")


def report(args: argparse.Namespace, results: dict) -> None:
    """Rank 0: the summary, and the results JSON."""
    if dist.get_global_rank() != 0:
        return
    print_summary(results)
    if results.get("already_complete") and args.results_json and Path(args.results_json).exists():
        print(f"kept {args.results_json} (written by the run that trained)")
    elif args.results_json:
        try:
            write_text(args.results_json, json.dumps(results, indent=2) + "\n")  # the old file or the new one
        except OSError as error:
            errors.fail(write_error(f"--results_json {args.results_json}", error) + " (the figures are printed above)")
        print(f"results written to {args.results_json}")


def user_error(error: BaseException) -> str | None:
    """One line for an exception the input causes while the run is under way (data, storage,
    checkpoint, W&B account), None for a bug."""
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    if isinstance(error, (data.BadDataError, NonFiniteLossError, EmptyEpochError)):
        # From a loader worker, PyTorch re-raises the type with the worker's traceback as its message.
        return errors.worker_error(error, ("data.BadDataError",)) or (lines[-1] if lines else text)
    line = errors.storage_error(error) or errors.worker_error(error, ("data.BadDataError",))
    if line:
        return line
    full = no_room(error)
    if full is not None:  # a checkpoint or a sample grid on a full disk
        return write_error(full.filename or "a file of the run (--save_folder, --samples_dir)", full)
    if isinstance(error, FileExistsError) and "may conflict with a future checkpoint" in text:
        return f"--save_folder: {lines[0]}"
    if type(error).__module__.startswith("wandb.errors"):
        return (f"W&B (--wandb_project/--wandb_name): {lines[0] if lines else type(error).__name__}; "
                "run `wandb login` or set WANDB_API_KEY, or log offline with WANDB_MODE=offline")
    if isinstance(error, RuntimeError) and text.startswith("Error(s) in loading state_dict"):
        return (f"the checkpoint does not fit this model ({lines[0]}...): it was saved with another "
                "--model_config; pass the same flags as the run that saved it")
    return None


def cli(argv: list[str] | None = None) -> None:
    """The command line: main(), with user errors that surface during the run as one line."""
    argv = sys.argv[1:] if argv is None else argv
    with errors.command("benchmark.py", debug="--debug" in argv, explain=user_error):
        main(argv)


if __name__ == "__main__":
    cli()
