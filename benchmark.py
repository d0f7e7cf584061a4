"""Train a text-to-image model (SD2 base by default; SDXL, Flux.1) from scratch with Composer and measure images/s.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # 1 node, all GPUs
    python benchmark.py --model_config tiny --use_synth_data --batch_size 8 --image_size 64 --max_duration 20ba
    composer benchmark.py @recipes/sd2-stage1.args --remote s3://my-bucket/laion/mds ...   # flags from a file

The denoiser starts from random weights; the VAE and text encoders are frozen (from --model_name). Data is
synthetic (--use_synth_data), MDS shards streamed from --remote, or latents.py's latents (--precomputed).
How a run goes: docs/design.md; every flag: docs/flags.md.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from composer import Trainer
from composer.callbacks import SpeedMonitor
from composer.core import Callback
from composer.loggers import WandBLogger
from composer.utils import dist
from torch.utils.data import DataLoader

import data
from t2ibench.train import allocator, cpu_convs, fp8, parallel
from t2ibench.commands import checks, flags, stack
from t2ibench.core import errors
from t2ibench import memory
from t2ibench.callbacks.buckets import BucketFlops, BucketThroughput
from t2ibench.callbacks.empty_epoch import EmptyEpochError, StopOnEmptyEpoch
from t2ibench.callbacks.loss_by_timestep import LossByTimestep
from t2ibench.callbacks.mlperf_log import MlperfLog, note_init_start
from t2ibench.callbacks.nonfinite_loss import NonFiniteLossError, StopOnNonFiniteLoss
from t2ibench.callbacks.oom_fallback import HalveMicrobatchOnOom, oom_line, serves
from t2ibench.callbacks.profile import ProfileBatches
from t2ibench.callbacks.progress import ConsoleProgress
from t2ibench.callbacks.resume_rng import RestoreRngOnStreamingResume
from t2ibench.callbacks.resume_threads import KeepCpuThreadsOnResume
from t2ibench.callbacks.run_record import RunRecord
from t2ibench.callbacks.samples import SampleImages
from t2ibench.callbacks.throughput import Pauses, Throughput
from t2ibench.callbacks.validation import ValidationLog, image_quality
from t2ibench.datasets.buckets import Bucket, largest_bucket
from t2ibench.train.checkpoints import write_whole
from t2ibench.train.compiling import compile_step_parts
from t2ibench.commands.data_checks import SYNTHETIC_EVAL_SAMPLES
from t2ibench.train.data_order import data_order
from t2ibench.eval.eval_curve import write_run_curve
from t2ibench.families import ModelFamily, Parts, build_aside, require_pretrained
from t2ibench.core.files import STAGING_FOLDER, no_room, hold_output, staged_folder, write_error, write_text
from t2ibench.train.grad_norm import GradientNorm
from t2ibench.train.model import DiffusionModel, vae_overflows_in
from t2ibench.train.norms import set_norm_precision
from t2ibench.datasets.precomputed import RECORD_FILE, TEXT_STATES
from t2ibench.commands.runtime import Runtime
from t2ibench.eval.sampling import load_prompts, write_pipeline
from t2ibench.train.settings import Settings
from t2ibench.datasets.sources import Source, record_cache
from t2ibench.datasets.streaming import StreamingSettings
from t2ibench.commands.summary import print_summary
from t2ibench.eval.validation import validation_evaluator
from t2ibench.train.weight_casts import CastWeightsOncePerStep


def build_parser() -> flags.Parser:
    """benchmark.py's flags (t2ibench.commands.flags), with this file's docstring heading --help."""
    return flags.benchmark_parser(__doc__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> Settings:
    """The run's settings (t2ibench.commands.checks.validate), with a bad flag reported as the command's error."""
    with errors.command("benchmark.py"):
        return checks.validate(args, world_size)


def main(argv: list[str] | None = None, extra_callbacks: list[Callback] | None = None) -> dict:
    """One run: runtime, data, model, trainer, results; returns the results (what --results_json holds)."""
    args = parse_args(argv)
    note_init_start()  # MLPerf's init_start: what follows, up to the first batch, is the run's initialization
    with errors.command("benchmark.py"), contextlib.ExitStack() as held:
        settings = validate(args, dist.get_world_size())  # every user error, before anything is built
        if dist.get_global_rank() == 0:  # a second run writing the same folders is refused, not mixed in
            held.enter_context(hold_output("--save_folder", settings.save_folder))
            held.enter_context(hold_output("--ema_export_dir", settings.ema_export_dir))
        run = Runtime.start(settings)
        training_data = build_data(settings, run)
        run = run.with_counted_setup(settings, training_data.text_format)  # the shards' format counts
        model = build_model(settings, run, training_data)
        trainer, measured = build_trainer(settings, run, model, training_data, extra_callbacks)
        try:
            results = train(settings, run, trainer, model, measured)
            report(settings, results)  # the figures are kept whatever the export does
            export_average(settings, run, trainer, model, measured)
        finally:
            trainer.close()
        return results


@dataclasses.dataclass
class TrainingData:
    loader: DataLoader
    text_format: str | None  # precomputed shards: TOKENS (token ids) or TEXT_STATES (encoder outputs)
    tokenizers: Parts | None  # the tokenizers the image loader uses, with where they came from
    eval_loader: DataLoader | None = None  # held-out samples for the validation loss (--eval_interval)


def build_data(settings: Settings, run: Runtime) -> TrainingData:
    """The training loader and the held-out one, built here only. They come before the model: the
    shards' format decides which encoders the model needs, and the image loader tokenizes captions
    in its workers. Held-out data is read like the training data, in stored order; synthetic
    held-out samples are drawn with another seed than the training ones."""
    family, tokenizers = settings.family, None
    for source in [] if settings.use_synth_data else [*settings.sources, *settings.eval_sources]:
        record_cache(source)  # the remote a cache holds, before Streaming fills it
    if not settings.precomputed and not settings.use_synth_data:
        tokenizers = family.build(settings.model_config, settings.model_name, denoiser=False, vae=False,
                                  text_encoders=False)

    def loader(sources: tuple[Source, ...], seed: int, num_samples: int, held_out: bool) -> DataLoader:
        common = dict(batch_size_per_device=run.batch_size_per_device, num_workers=settings.num_workers, seed=seed,
                      family=family)
        streaming = StreamingSettings.from_args(settings)
        if held_out:  # every held-out sample once per evaluation, in stored order
            streaming = dataclasses.replace(streaming, shuffle=False, epoch_size=None, sampling_granularity=1)
        if settings.precomputed:
            scaled = family.meta_parts(settings.model_config) if settings.use_synth_data else None
            return data.latents_dataloader(
                synthetic=settings.use_synth_data, sources=sources, image_size=settings.image_size, text_dim=text_dim,
                latent_channels=family.latent_channels(settings.model_config), num_samples=num_samples,
                synthetic_format=settings.precomputed_format, settings=streaming,
                latent_scale=scaled.latent_scale if scaled else None, latent_shift=scaled.latent_shift if scaled else 0.0,
                config=settings.model_config, buckets=() if held_out else settings.buckets, **common)
        if settings.use_synth_data:
            return data.synthetic_dataloader(settings.image_size, num_samples=num_samples, shuffle=not held_out,
                                             buckets=() if held_out else settings.buckets,
                                             bucket_weights=settings.bucket_weights,
                                             config=settings.model_config, **common)
        return data.laion_dataloader(sources=sources, tokenizer=tokenizers.tokenizers, image_size=settings.image_size,
                                     settings=streaming, image_key=settings.image_key, caption_key=settings.caption_key,
                                     max_bad_fraction=settings.max_bad_fraction,
                                     buckets=() if held_out else settings.buckets, crop=settings.bucket_crop, **common)

    text_dim = next(iter(family.conditioning_shapes(settings.model_config).values()))[-1]
    training = loader(settings.sources, settings.seed, settings.num_synthetic_samples, False)
    held_out = None
    if settings.eval_interval:
        held_out = loader(settings.eval_sources, settings.seed + 1, settings.eval_samples or SYNTHETIC_EVAL_SAMPLES, True)
    text_format = training.dataset.text_format if settings.precomputed else None
    return TrainingData(training, text_format, tokenizers, held_out)


@dataclasses.dataclass
class Model:
    """The training model and what the run needs beside it."""

    model: DiffusionModel
    encoders: Parts  # used outside the step: the empty caption, samples, the exported pipeline
    flops: dict[str, float]  # FLOPs per image of the step (family.flops_per_image; fp8_fwd_bwd: those in float8)
    text_format: str | None  # precomputed shards: TOKENS or TEXT_STATES
    float8: fp8.Conversion | None = None  # --fp8: the Linear layers in float8


def build_model(settings: Settings, run: Runtime, training_data: TrainingData) -> Model:
    """The training model with its frozen parts, the encoders the run uses outside the step, the FLOPs."""
    family, text_format = settings.family, training_data.text_format
    parts = family.build(settings.model_config, settings.model_name, vae=not settings.precomputed,
                         text_encoders=text_format != TEXT_STATES, tokenizers=False)
    if training_data.tokenizers is not None:
        parts.pretrained += training_data.tokenizers.pretrained
        parts.random += training_data.tokenizers.random
    tokenizers = training_data.tokenizers.tokenizers if training_data.tokenizers is not None else None
    require_pretrained(parts, needed=not settings.use_synth_data and settings.model_config in family.pretrained_configs,
                       allowed=settings.allow_random_encoders, model_name=settings.model_name)
    if parts.random_encoders and run.is_rank_zero:
        missing = " and ".join(parts.random_encoders)
        why = (f"the {settings.model_config} configuration has no pretrained weights"
               if settings.model_config not in family.pretrained_configs else
               f"--model_name {settings.model_name}: pretrained {missing} not available here (offline or not downloaded)")
        print(f"note: {why}; using randomly initialized {missing} (throughput does not depend on the weights).",
              file=sys.stderr, flush=True)
    model = DiffusionModel(family, parts, snr_gamma=settings.snr_gamma, offset_noise=settings.offset_noise,
                           num_loss_bins=settings.loss_bins, timestep_sampling=settings.timestep_sampling,
                           validation_seed=settings.seed)
    encoders = dataclasses.replace(parts, denoiser=None, tokenizers=tokenizers or {})
    if (settings.caption_drop_prob > 0 or settings.sample_prompts or settings.ema_export_dir) and not (
            parts.vae and parts.text_encoders and tokenizers):
        # On precomputed latents: the missing parts exactly as latents.py built them (precompute.json's
        # seed for random encoders, data_checks.check_precompute_record; else --seed).
        if settings.encoders_seed != settings.seed and run.is_rank_zero:
            print(f"note: the latents were computed with random encoders of seed {settings.encoders_seed} "
                  f"({RECORD_FILE}): the encoders are rebuilt from it; --seed {settings.seed} seeds the denoiser, "
                  "noise and data order", file=sys.stderr, flush=True)
        aside = build_aside(family, settings.model_config, settings.model_name, settings.encoders_seed)
        encoders = dataclasses.replace(aside, vae=parts.vae or aside.vae,
                                       text_encoders=parts.text_encoders or aside.text_encoders,
                                       tokenizers=tokenizers or aside.tokenizers, pretrained=parts.pretrained,
                                       random=parts.random)
    if settings.caption_drop_prob > 0:
        empty = family.tokenize(encoders.tokenizers, [""])
        with torch.no_grad():
            model.set_caption_dropout(settings.caption_drop_prob, empty,
                                      family.as_unconditional(family.encode_text(encoders.text_encoders, empty)))
    conversion = None
    if settings.fp8 != "off":  # before compile and FSDP wrap them; the same parameters, so before AdamW too
        rows = memory.linear_rows_per_sample(settings.model_config, settings.image_size, text_format)
        conversion = fp8.convert(model.denoiser, settings.fp8, rows, refuse_none=True)
    apply_speed_settings(settings, run, model)
    flops = step_flops(settings, text_format, settings.image_size)
    if conversion:
        flops["fp8_fwd_bwd"] = fp8.linear_flops_per_sample(model.denoiser, rows, conversion.converted)
    model.flops_per_image = flops["total"]
    return Model(model, dataclasses.replace(encoders, latent_scale=model.latent_scale), flops, text_format,
                 conversion)


def step_flops(settings: Settings, text_format: str | None, image_size: int | tuple[int, int]) -> dict[str, float]:
    """FLOPs per image of the run's step at `image_size` (the square's side, or a bucket's (height,
    width)): the family's count with the encoders that run in it (none whose outputs are precomputed)."""
    return dict(counted_flops(settings.family, settings.model_config, image_size, not settings.precomputed,
                              text_format != TEXT_STATES))


@functools.lru_cache(maxsize=None)
def counted_flops(family: ModelFamily, model_config: str, image_size: int | tuple[int, int], vae: bool,
                  text_encoders: bool) -> dict[str, float]:
    """`family.flops_per_image`, counted once per process: a count takes about a second for a tiny
    model and 5 s for SDXL base on the meta device, and runs in the same process (the tests, a bucket
    list) ask for the same ones again. Callers copy the dict they change."""
    return family.flops_per_image(model_config, image_size, vae=vae, text_encoders=text_encoders)


def trained_network_flops(flops: dict[str, float]) -> float:
    """The denoiser's forward and backward alone, of a `family.flops_per_image` count (`mfu_trained_network`'s)."""
    return flops["total"] - flops["vae_encoder"] - flops["text_encoder"]


def bucket_flops(settings: Settings, text_format: str | None) -> BucketFlops | None:
    """A bucketed run's FLOPs per image of each bucket it may train (synthetic batches: those of a
    positive weight), counted as the square's are (`build_model`) at the bucket's (height, width),
    when the throughput callback starts (`BucketFlops.count_shared`: a few of them, the rest from the
    quadratic in the pixel count they fit); None for square images."""
    if not settings.buckets:
        return None
    trained = tuple(bucket for bucket, weight in zip(settings.buckets, settings.bucket_weights)
                    if weight > 0 or not settings.use_synth_data)

    def count(bucket: Bucket) -> tuple[float, float]:
        flops = step_flops(settings, text_format, (bucket.height, bucket.width))
        return flops["total"], trained_network_flops(flops)

    return BucketFlops(trained, count, settings.family.latent_downsample,
                       settings.family.flops_exact_multiple(settings.model_config))


def apply_speed_settings(settings: Settings, run: Runtime, model: DiffusionModel) -> None:
    """CPU autocast (its bf16 convolutions guarded), xFormers, activation checkpointing, channels-last, the
    frozen parts' dtype, the norms' precision and torch.compile."""
    if not run.on_gpu and run.precision == "amp_bf16":
        model.cpu_autocast_dtype = torch.bfloat16
        cpu_convs.guard_convolutions(model.denoiser)  # torch 2.7.0's oneDNN bf16 weight gradient (t2ibench.train.cpu_convs)
    if settings.xformers:
        model.denoiser.enable_xformers_memory_efficient_attention()
    if run.activation_checkpointing:
        parallel.enable_block_checkpointing(model.denoiser)
    if settings.channels_last:
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
        set_norm_precision(model, settings.norm_precision)
    if settings.compile:
        if run.world_size > 1:
            # Under DDP, dynamo's DDPOptimizer splits a compiled graph at every gradient bucket (25 MB:
            # ~140 graphs for the whole SD2 UNet; a block's graph too, as a 1280-wide resnet holds
            # 118 MB of fp32 weights) so that all-reduces overlap the backward pass. With gradient
            # accumulation Composer syncs gradients only on a batch's last microbatch, so that overlap
            # is worth little, while the splits cost fusion and compile time.
            torch._dynamo.config.optimize_ddp = False
        # Every part that runs per step, block by block (t2ibench.train.compiling). After the float8
        # conversion (build_model), so the converted layers run compiled, and before FSDP wraps the
        # blocks (the Trainer), whose hooks stay outside the graphs.
        compile_step_parts(model, settings.family.compile_blocks, num_buckets=len(settings.buckets))


@dataclasses.dataclass
class Measured:
    """The callbacks whose figures go into the results."""

    throughput: Throughput
    loss_by_timestep: LossByTimestep | None
    ema: Callback | None  # ema.EMA (an Algorithm)
    grad_norm: GradientNorm  # the last step's gradient norm before clipping (an Algorithm, which also clips)
    # A CPU run's intra-op threads (None on a GPU): the runtime's choice, or the count of the run it resumes.
    cpu_threads: KeepCpuThreadsOnResume
    validation: ValidationLog | None = None
    profile: ProfileBatches | None = None
    buckets: BucketThroughput | None = None  # --aspect_buckets: images and images/s per bucket
    oom: HalveMicrobatchOnOom | None = None  # one rank without FSDP: the first batches halve on OOM


def build_trainer(settings: Settings, run: Runtime, built: Model, training_data: TrainingData,
                  extra_callbacks: list[Callback] | None) -> tuple[Trainer, Measured]:
    """Composer's Trainer: AdamW on the denoiser, the recipe's algorithms, the benchmark's callbacks,
    and Composer's evaluator on the held-out data for the validation loss."""
    model, encoders, flops = built.model, built.encoders, built.flops
    loader = training_data.loader
    fused = settings.fused_adamw == "on" or (settings.fused_adamw == "auto" and run.on_gpu)
    optimizer = torch.optim.AdamW(model.denoiser.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                  betas=(settings.adamw_beta1, settings.adamw_beta2), eps=settings.adamw_eps, fused=fused)
    schedulers = []
    if settings.lr_warmup_batches or settings.lr_schedule != "constant":
        from composer.optim import ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler
        # Composer's warm-up schedulers need t_warmup in the unit of the run's length (ba and ep
        # runs are counted in batches): a run in samples warms up over as many samples.
        warmup = (f"{settings.lr_warmup_batches * settings.batch_size}sp" if settings.max_duration.endswith("sp")
                  else f"{settings.lr_warmup_batches}ba")
        schedulers.append(CosineAnnealingWithWarmupScheduler(t_warmup=warmup, alpha_f=0.0)
                          if settings.lr_schedule == "cosine" else ConstantWithWarmupScheduler(t_warmup=warmup))
    peak_flops = settings.peak_tflops * 1e12 if settings.peak_tflops else None
    pauses = Pauses()
    # A bucketed run's FLOPs are those of the buckets its batches hold (the square's otherwise), in the
    # throughput window and in Composer's rolling MFU alike.
    by_bucket = bucket_flops(settings, built.text_format)
    if by_bucket is not None:
        model.flops_of_batch = lambda batch: by_bucket.of_batch(batch)[0]
    # Profiled batches (slowed by the profiler) come right after the warm-up, before the measured window.
    measured = Measured(Throughput(settings.warmup_batches + settings.profile_batches, flops["total"], peak_flops, pauses,
                                   trained_network_flops(flops), by_bucket),
                        LossByTimestep(settings.log_interval) if settings.loss_bins else None, None,
                        GradientNorm(clip_norm=settings.grad_clip_norm),
                        KeepCpuThreadsOnResume(run.cpu_threads, dist.get_local_world_size()))
    if settings.profile_batches:
        measured.profile = ProfileBatches(settings.warmup_batches, settings.profile_batches, settings.profile_dir,
                                          settings.batch_size, pauses)
    algorithms = []
    if settings.use_ema:
        from ema import EMA
        # The averaged pipeline is exported after the results are written (export_average).
        measured.ema = EMA(half_life=settings.ema_half_life, ema_start=settings.ema_start)
        algorithms.append(measured.ema)
    # The norm, and --grad_clip_norm's clipping with it, in every run.
    algorithms.append(measured.grad_norm)
    if run.weight_casts == "step":
        # Last in the list: Composer runs AFTER_* events in reverse order, and the fp32 weights must
        # have their gradients back before the norm and the clipping look at them.
        algorithms.append(CastWeightsOncePerStep(model.denoiser))
    evaluators = []
    if training_data.eval_loader is not None:
        images = image_quality(settings, training_data.eval_loader.dataset, encoders, pauses, measured.ema)
        measured.validation = ValidationLog.for_run(settings, pauses, images)  # stops the run at its targets
        evaluators.append(validation_evaluator(training_data.eval_loader, run.microbatch, settings.eval_samples))
    write_whole()  # a checkpoint is complete under its name, or absent (a full disk leaves no part of it)
    restore_rng = RestoreRngOnStreamingResume()
    # RunRecord first: a resume it refuses stops before any other callback's set-up (the buckets' FLOPs).
    callbacks = [RunRecord({"model_config": settings.model_config, "model_name": settings.model_name,
                            "encoders_seed": settings.encoders_seed,
                            "image_size": settings.image_size, "precomputed": settings.precomputed,
                            "aspect_buckets": [bucket.name for bucket in settings.buckets]},
                           data_order(settings, dist.get_world_size(),
                                      dist.get_world_size() // max(1, dist.get_local_world_size()))),
                 SpeedMonitor(window_size=10, gpu_flops_available=peak_flops), measured.throughput,
                 StopOnNonFiniteLoss.for_run(settings, measured.grad_norm), StopOnEmptyEpoch(),
                 ConsoleProgress(settings.log_interval, validation=measured.validation), restore_rng,
                 measured.cpu_threads]
    if settings.buckets:  # before the sampling callback: its pause at BATCH_END is not a bucket's time
        measured.buckets = BucketThroughput(settings.warmup_batches + settings.profile_batches,
                                            model.family.latent_downsample)
        callbacks.append(measured.buckets)
    # The MLPerf log after the validation log: it writes each evaluation that one keeps, on its clock.
    mlperf_log = MlperfLog.for_run(settings, measured.validation)
    callbacks += [c for c in (measured.validation, mlperf_log, measured.loss_by_timestep, measured.profile) if c]
    if settings.sample_prompts:
        callbacks.append(SampleImages(
            model.family, load_prompts(settings.sample_prompts),
            settings.samples_dir or os.path.join(settings.save_folder, "samples"),
            settings.sample_interval, encoders=encoders,
            height=settings.sample_shape.height, width=settings.sample_shape.width, pauses=pauses,
            average=measured.ema, sampler=settings.sampler,
            num_steps=settings.sample_steps, guidance_scale=settings.guidance_scale, seed=settings.seed))
    fsdp = parallel.fsdp_parallelism(settings.fsdp)
    if serves(run.world_size, sharded=fsdp is not None):
        # Ended with the warm-up: the measured batches pay no search (t2ibench.callbacks.oom_fallback).
        measured.oom = HalveMicrobatchOnOom(settings.warmup_batches, average=measured.ema)
        callbacks.append(measured.oom)
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
        eval_dataloader=evaluators or None, eval_interval=settings.eval_interval or 1,
        eval_subset_num_batches=-1,
        max_duration=settings.max_duration, algorithms=algorithms, callbacks=[*callbacks, *(extra_callbacks or [])],
        loggers=[WandBLogger(project=settings.wandb_project, name=settings.wandb_name)]
        if settings.wandb_project or settings.wandb_name else [],
        precision=run.trainer_precision, device_train_microbatch_size=run.microbatch, seed=settings.seed,
        run_name=settings.run_name, save_folder=settings.save_folder, save_interval=settings.save_interval,
        save_num_checkpoints_to_keep=settings.save_num_checkpoints_to_keep, save_overwrite=settings.autoresume,
        load_path=settings.load_path, autoresume=settings.autoresume,
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


def train(settings: Settings, run: Runtime, trainer: Trainer, built: Model, measured: Measured) -> dict:
    """Fit (unless a retried job finds its run complete); the results."""
    encoders = built.encoders
    threads = measured.cpu_threads.threads  # after the checkpoint's load: a resumed run's may be the saved one's
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
        "image_size": settings.image_size,
        "global_batch_size": settings.batch_size,
        "device_train_microbatch_size": trainer.state.device_train_microbatch_size,
        # The microbatch the run started with, and each halving of it by an OOM in the first batches
        # (None: several ranks or FSDP, where no fallback runs).
        **(measured.oom.summary() if measured.oom else
           {"device_train_microbatch_size_planned": run.microbatch, "microbatch_fallbacks": None}),
        "model_config": settings.model_config,
        "data": "synthetic" if settings.use_synth_data else ",".join(source.spec for source in settings.sources),
        "use_ema": settings.use_ema,
        "precomputed": settings.precomputed,
        "precomputed_format": built.text_format,
        "channels_last": settings.channels_last,
        "compile": settings.compile,
        "fused_adamw": settings.fused_adamw == "on" or (settings.fused_adamw == "auto" and run.on_gpu),
        "xformers": settings.xformers,
        "norm_precision": settings.norm_precision if run.precision in ("amp_bf16", "amp_fp16") else None,
        "fsdp": settings.fsdp,
        "pretrained_parts": encoders.pretrained,
        "random_parts": encoders.random,
        "flops_per_image_breakdown": built.flops,
        # Mean over all ranks and all microbatches of the last batch (Composer's all-reduced total).
        "final_loss": trainer.state.total_loss_dict.get("loss/train/total"),
        # Every rank reads it (under FSDP a collective reduces the shards' parts): the same on each.
        "grad_norm": measured.grad_norm.last_norm(),
        "loss_by_timestep_bin": measured.loss_by_timestep.summary() if measured.loss_by_timestep else [],
        "timestep_sampling": settings.timestep_sampling,
        "aspect_buckets": settings.aspect_buckets,
        # The list itself ("HxW" names): runs of one list are compared by it (cost.py), whatever file held it.
        "bucket_list": [bucket.name for bucket in settings.buckets] if settings.buckets else None,
        "bucket_crop": settings.bucket_crop if settings.buckets and not settings.use_synth_data else None,
        "synthetic_bucket_weights": settings.synthetic_bucket_weights if settings.buckets and settings.use_synth_data
        else None,
        **(measured.buckets.summary() if measured.buckets else {}),
        # The bucket the memory model sizes the microbatch for on a GPU (runtime.counted_image_size).
        "largest_bucket": largest_bucket(settings.buckets, settings.family.latent_downsample,
                                         settings.family.patch_size)[1] if settings.buckets else None,
        "activation_checkpointing": run.activation_checkpointing,
        "activation_checkpointing_reason": run.activation_checkpointing_reason,
        "weight_casts": run.weight_casts,
        "cpu_threads": threads.threads if threads else None, "cpu_threads_rule": threads.rule if threads else None,
        # The CUDA caching allocator's setting and whose it is (t2ibench.train.allocator), and how often it
        # freed its cached memory and retried an allocation the device refused (memory_stats'
        # num_alloc_retries; the memory model's reserve is for none): rank 0's.
        "cuda_allocator_conf": run.allocator.conf if run.allocator else None,
        "cuda_allocator_conf_source": run.allocator.source if run.allocator else None,
        "cuda_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if run.on_gpu else None,
        "cuda_memory_outside_torch_bytes": allocator.memory_outside_torch_bytes() if run.on_gpu else None,
        **(measured.profile.summary if measured.profile else {}),
        "fp8": settings.fp8,
        "fp8_conversion": built.float8.summary() if built.float8 else None,
        **(measured.validation.summary() if measured.validation else {"eval_loss": None}),
        "torch_version": torch.__version__,
        "versions": stack.versions(),  # the pinned stack beside this torch (two installs: README)
    }
    if int(trainer.state.timestamp.batch) == trained_before:
        # A retried --autoresume job whose run had finished: nothing was trained or measured here.
        results.update(already_complete=True, images_per_sec=None, images_per_sec_per_device=None,
                       measured_batches=0, trained_batches=trained_before, save_folder=settings.save_folder)
    return results


def run_already_complete(trainer: Trainer) -> bool:
    """True when the loaded checkpoint is already at --max_duration (a retried --autoresume job).

    Composer's fit() raises then ("No training would occur"); the job instead finishes what the
    killed one may not have: the EMA export (export_average). The summary and results say the run
    was complete.
    """
    state = trainer.state
    return state.timestamp.get(state.max_duration.unit) >= state.max_duration


def export_average(settings: Settings, run: Runtime, trainer: Trainer, built: Model, measured: Measured) -> None:
    """--ema_export_dir: the pipeline with the averaged denoiser, written after the results (a full disk
    here loses no figure), into a staging folder moved into place with model_index.json last."""
    ema, folder = measured.ema, settings.ema_export_dir
    if not folder or ema is None:
        return
    if not ema.initialized:
        print(f"note: the EMA had not started by the end of training (--ema_start {settings.ema_start}): nothing "
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
                    built.encoders, denoiser=averaged, noise_scheduler=model.noise_scheduler),
                    buckets=settings.buckets)
    except OSError as error:
        errors.fail(write_error(f"--ema_export_dir {folder}", error) + "; the results were written before it")


def report(settings: Settings, results: dict) -> None:
    """Rank 0: the summary, and the results JSON."""
    if dist.get_global_rank() != 0:
        return
    print_summary(results)
    if results.get("already_complete") and settings.results_json and Path(settings.results_json).exists():
        print(f"kept {settings.results_json} (written by the run that trained)")
    elif settings.results_json:
        try:
            write_text(settings.results_json, json.dumps(results, indent=2) + "\n")  # the old file or the new one
        except OSError as error:
            errors.fail(write_error(f"--results_json {settings.results_json}", error) + " (the figures are printed above)")
        print(f"results written to {settings.results_json}")
        write_run_curve(settings.results_json, results)  # after the JSON: a failure here loses no figure


def user_error(error: BaseException) -> str | None:
    """One line for an exception the input causes while the run is under way (data, storage,
    checkpoint, W&B account), None for a bug."""
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    if isinstance(error, (data.BadDataError, NonFiniteLossError, EmptyEpochError)):
        # From a loader worker, PyTorch re-raises the type with the worker's traceback as its message.
        return errors.worker_error(error, ("data.BadDataError",)) or (lines[-1] if lines else text)
    line = errors.storage_error(error) or errors.worker_error(error, ("data.BadDataError",)) or oom_line(error)
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
