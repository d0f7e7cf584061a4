"""Train Stable Diffusion 2 base from scratch with Composer and measure images/sec.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # 1 node, all GPUs
    python benchmark.py --model_config tiny --use_synth_data --batch_size 8 --image_size 64 --max_duration 20ba

The UNet is built from the SD2-base config with random weights; the VAE and the OpenCLIP text
encoder are frozen (loaded from `--model_name` when available). Data is synthetic
(`--use_synth_data`) or LAION-style MDS shards streamed from `--remote` into `--local`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver, SpeedMonitor
from composer.core import Callback, State
from composer.loggers import Logger
from composer.loggers import WandBLogger
from composer.utils import FSDP2Config, ParallelismConfig, dist, reproducibility

import data
from checks import (DEFAULT_LOCAL, PRECISIONS, check_run_length, default_local, record_caches, storage_error, validate,
                    validate_recipe)
from console import ConsoleProgress
import gpu_memory
from flags import FRACTION, NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, SECONDS, SEED, Parser, Range
from model import (MODEL_CONFIGS, NUM_TRAIN_TIMESTEPS, LossByTimestep, StableDiffusion, build_components,
                   build_encoders_aside, sd2_meta_components, set_norm_precision)
from sample import MAX_GUIDANCE_SCALE
from tokenizer import tokenize
from throughput import Throughput, count_flops_per_image

SHUFFLE_ALGOS = ("py1e", "py1br", "py1s", "py2s", "naive")  # Streaming 0.13 has no py1b
DEFAULT_SHUFFLE_ALGO = "py1e"
FSDP_MODES = ("none", "shard_grad_op", "full_shard")


class JoinSources(argparse.Action):
    """A repeated --remote adds a source (comma-separated in args.remote, as one --remote with commas)."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous},{values}" if previous else values)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmark.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The flags of the 2023 benchmark, same names and defaults.
    p.add_argument("--batch_size", type=POSITIVE_INT, default=2048, help="global batch size, images per step over all devices")
    p.add_argument("--image_size", type=POSITIVE_INT, default=512, help="training resolution in pixels (multiple of 8)")
    p.add_argument("--remote", type=str, default=None, action=JoinSources,
                   help="MDS shards to stream: s3://, gs://, oci://, ... or a path. Several sources: repeat the flag "
                        "or separate them by commas, each optionally prefixed by its proportion: 0.7=s3://a,0.3=s3://b")
    p.add_argument("--local", type=str, default=None,
                   help=f"local cache for --remote shards (default {DEFAULT_LOCAL}/<hash of remote>), or shards already on disk")
    p.add_argument("--use_synth_data", action="store_true", help="random images and captions (measures the model only)")
    p.add_argument("--model_name", type=str, default="stabilityai/stable-diffusion-2-base",
                   help="hub id or local diffusers folder with pretrained vae/, text_encoder/, tokenizer/")
    p.add_argument("--use_ema", action="store_true", help="keep an EMA of the UNet weights (half-life --ema_half_life, 1000 batches)")
    p.add_argument("--ema_export_dir", type=str, default=None,
                   help="with --use_ema: write a complete diffusers pipeline with the EMA UNet here at the end (StableDiffusionPipeline.from_pretrained)")
    p.add_argument("--wandb_name", type=str, default=None, help="W&B run name (enables W&B logging)")
    p.add_argument("--wandb_project", type=str, default=None, help="W&B project (enables W&B logging)")
    p.add_argument("--device_train_microbatch_size", type=str, default="auto",
                   help="images per device per forward/backward, or 'auto' (GPU: largest that fits; CPU: no accumulation)")
    # Added by this project.
    p.add_argument("--max_duration", type=str, default="1ep", help="Composer time string: 20ba, 1ep, 100000sp")
    p.add_argument("--model_config", type=str, default="sd2-base", help=f"one of {sorted(MODEL_CONFIGS)}")
    p.add_argument("--precision", type=str, default="auto", help=f"one of {PRECISIONS}; auto: amp_bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=SEED, default=17)
    p.add_argument("--num_workers", type=NON_NEGATIVE_INT, default=8, help="DataLoader worker processes per device")
    p.add_argument("--results_json", type=str, default=None, help="write the throughput summary to this JSON file")
    p.add_argument("--num_synthetic_samples", type=POSITIVE_INT, default=100_000, help="size of the synthetic dataset")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=1e-4, help="AdamW learning rate (constant unless --lr_schedule / --lr_warmup_batches)")
    p.add_argument("--weight_decay", type=NON_NEGATIVE_FLOAT, default=1e-3, help="AdamW weight decay")
    p.add_argument("--warmup_batches", type=NON_NEGATIVE_INT, default=5, help="batches left out of the throughput measurement")
    p.add_argument("--peak_tflops", type=POSITIVE_FLOAT, default=None,
                   help="peak TFLOP/s of one device for MFU (default: Composer's table for A100/H100/H200)")
    p.add_argument("--allow_random_encoders", action="store_true",
                   help="train on real data even when the pretrained VAE/text encoder cannot be loaded")
    # Real data (data.py): MDS columns, streaming and bad-sample settings.
    p.add_argument("--image_key", type=str, default="jpg", help="MDS column holding the encoded image bytes")
    p.add_argument("--caption_key", type=str, default="caption", help="MDS column holding the caption text")
    p.add_argument("--no_shuffle", dest="shuffle", action="store_false",
                   help="stream samples in stored order (default: shuffled, seeded by --seed)")
    p.add_argument("--predownload", type=POSITIVE_INT, default=None,
                   help="samples each loader worker downloads ahead (default: 8 x per-device batch)")
    p.add_argument("--download_retry", type=NON_NEGATIVE_INT, default=2, help="download attempts per shard before failing")
    p.add_argument("--download_timeout", type=SECONDS, default=60.0, help="seconds before a shard download fails")
    p.add_argument("--cache_limit", type=str, default=None,
                   help="evict cached shards beyond this size, e.g. 500gb (default: keep all)")
    p.add_argument("--validate_hash", type=str, default=None,
                   help="check downloaded shards with this hash from index.json: sha1 or xxh64")
    p.add_argument("--max_bad_fraction", type=FRACTION, default=0.01,
                   help="stop when more than this fraction of the images one loader worker decoded failed "
                        "(checked after 1000)")
    # Checkpoints (Composer's machinery): local paths or object-store URIs (s3://, gs://, oci://).
    p.add_argument("--save_folder", type=str, default=None, help="where to save checkpoints (path or s3://... URI)")
    p.add_argument("--save_interval", type=str, default="1000ba", help="checkpoint every this long (20ba, 1ep)")
    p.add_argument("--save_num_checkpoints_to_keep", type=Range(int, -1), default=-1,
                   help="local checkpoints to keep (-1: all; 0: none, only with an object-store --save_folder, "
                        "which keeps every upload)")
    p.add_argument("--load_path", type=str, default=None, help="checkpoint to start from (path or URI)")
    p.add_argument("--autoresume", action="store_true",
                   help="resume from the latest checkpoint in --save_folder if there is one (needs --run_name)")
    p.add_argument("--run_name", type=str, default=None, help="run name; fixed names let --autoresume find the run")
    p.add_argument("--log_interval", type=str, default="10ba", help="in a log file, print a progress line this often (20ba, 1ep); on a terminal the line updates in place")
    # Speed. Defaults are the plain step until GPU measurements say otherwise.
    p.add_argument("--precomputed", action="store_true",
                   help="train from precomputed VAE latents (latents.py): no VAE; the text encoder runs on stored "
                        "token ids, or is skipped too for shards written with --store_text_states")
    p.add_argument("--channels_last", action="store_true", help="UNet and VAE in channels-last memory format")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every module that runs per step: the UNet, and the VAE encoder and text encoder "
                        "when they run (in place: checkpoint keys unchanged)")
    p.add_argument("--norm_precision", type=str, default="autocast", choices=gpu_memory.NORM_PRECISIONS,
                   help="under AMP, GroupNorm and LayerNorm run in the autocast dtype (autocast), or in fp32 as "
                        "CUDA autocast's own lists have them (fp32)")
    p.add_argument("--fused_adamw", type=str, default="auto", choices=("auto", "on", "off"),
                   help="fused AdamW kernel; auto: on with CUDA")
    p.add_argument("--xformers", action="store_true", help="use xFormers attention in the UNet (default: PyTorch SDPA)")
    p.add_argument("--fsdp", type=str, default="none", choices=FSDP_MODES,
                   help="shard the UNet's weights, gradients and AdamW state over the ranks (Composer's FSDP2): "
                        "full_shard (weights gathered block by block in forward and again in backward), "
                        "shard_grad_op (gathered once per microbatch, kept until its backward ends); none: DDP")
    # Streaming at scale: these reach both real-data loaders (images and --precomputed),
    # like --no_shuffle, --predownload, --download_retry, --download_timeout, --cache_limit and --validate_hash.
    p.add_argument("--shuffle_algo", type=str, default=DEFAULT_SHUFFLE_ALGO, choices=SHUFFLE_ALGOS,
                   help="Streaming's shuffle: py1e (Streaming's default), py1br, py1s, py2s, naive")
    p.add_argument("--shuffle_block_size", type=POSITIVE_INT, default=None,
                   help="samples per shuffle block (default: Streaming's, max(4M / canonical nodes, 262144))")
    p.add_argument("--epoch_size", type=str, default=None,
                   help="samples per epoch drawn from all sources, e.g. 200000000 or 200m (default: all of them "
                        "once). The epoch's partition takes memory per sample: see the README's LAION-scale plan")
    p.add_argument("--num_canonical_nodes", type=POSITIVE_INT, default=None,
                   help="Streaming's canonical nodes, fixing the sample order across node counts (default: the nodes "
                        "of the first run); keep it when resuming on another number of nodes")
    p.add_argument("--sampling_granularity", type=POSITIVE_INT, default=1,
                   help="with --epoch_size below the dataset: samples taken from a shard at a time when an epoch "
                        "picks part of the data; the samples per shard picks whole shards (no shard downloaded "
                        "for a few samples)")
    p.add_argument("--precomputed_format", type=str, default="tokens", choices=("tokens", "text_states"),
                   help="with --precomputed --use_synth_data: the format synthetic batches imitate (shards: read "
                        "from their columns)")
    # Errors: user errors are one line; --debug shows the traceback as well.
    p.add_argument("--debug", action="store_true", help="on an error, also print the Python traceback")
    # Training recipe. Every default keeps the 2023 step.
    p.add_argument("--lr_warmup_batches", type=NON_NEGATIVE_INT, default=0, help="linear learning-rate warm-up over this many batches")
    p.add_argument("--lr_schedule", type=str, default="constant", choices=("constant", "cosine"),
                   help="after the warm-up: constant, or cosine decay to 0 at --max_duration")
    p.add_argument("--grad_clip_norm", type=POSITIVE_FLOAT, default=None, help="clip the gradient's global L2 norm to this")
    p.add_argument("--caption_drop_prob", type=Range(float, 0, 1, high_open=True), default=0.0,
                   help="replace each caption by the empty one with this probability (classifier-free guidance)")
    p.add_argument("--ema_start", type=str, default="0ba", help="with --use_ema: start averaging at this time (e.g. 1350000ba)")
    p.add_argument("--ema_half_life", type=str, default="1000ba",
                   help="with --use_ema: EMA half-life in batches (6931ba is a smoothing of 0.9999 per batch)")
    p.add_argument("--snr_gamma", type=POSITIVE_FLOAT, default=None, help="min-SNR-gamma loss weighting (5 is the paper's value)")
    p.add_argument("--offset_noise", type=Range(float, 0, 1), default=0.0,
                   help="offset noise strength (e.g. 0.1; at most 1, where the offset is as strong as the noise)")
    p.add_argument("--loss_bins", type=Range(int, 0, NUM_TRAIN_TIMESTEPS), default=10,
                   help=f"log the loss in this many bins of timesteps (0: off; at most the {NUM_TRAIN_TIMESTEPS} timesteps)")
    # Samples while training (sample.py).
    p.add_argument("--sample_prompts", type=str, default=None,
                   help="draw these prompts while training: a text file (one per line) or a built-in set: default, shapes")
    p.add_argument("--sample_interval", type=str, default="1000ba", help="sample every this long (and at the end)")
    p.add_argument("--samples_dir", type=str, default=None, help="where sample grids go (default: <--save_folder>/samples)")
    p.add_argument("--sampler", type=str, default="ddim", choices=("ddim", "euler"), help="diffusers sampler for samples")
    p.add_argument("--sample_steps", type=Range(int, 1, NUM_TRAIN_TIMESTEPS), default=50,
                   help=f"sampler steps per sample (at most the {NUM_TRAIN_TIMESTEPS} training timesteps)")
    p.add_argument("--guidance_scale", type=Range(float, 0, MAX_GUIDANCE_SCALE), default=7.5,
                   help="classifier-free guidance scale of samples (<= 1: none, as in diffusers)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def streaming_options(args: argparse.Namespace) -> dict:
    """The Streaming settings of both real-data loaders, from the flags."""
    return dict(shuffle=args.shuffle, predownload=args.predownload, download_retry=args.download_retry,
                download_timeout=args.download_timeout, cache_limit=args.cache_limit,
                validate_hash=args.validate_hash, shuffle_algo=args.shuffle_algo,
                shuffle_block_size=args.shuffle_block_size, epoch_size=args.epoch_size,
                num_canonical_nodes=args.num_canonical_nodes, sampling_granularity=args.sampling_granularity)


def user_error(error: BaseException) -> str | None:
    """One line for an exception caused by the input (data, storage, checkpoint), None for a bug."""
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    if isinstance(error, (data.BadDataError, NonFiniteLossError, EmptyEpochError)):
        return lines[-1] if lines else text
    line = storage_error(error)
    if line:
        return line
    # A DataLoader worker's exception comes back re-created from its message: the original type and
    # message are the last line of that message ("Caught X in DataLoader worker process 0 ...").
    if lines and text.startswith("Caught ") and " in DataLoader worker process " in lines[0]:
        last = lines[-1]
        if re.match(r"(data\.BadDataError|botocore\.exceptions\.\w+|google\.\S+|FileNotFoundError): ", last):
            return last
    if isinstance(error, FileExistsError) and "may conflict with a future checkpoint" in text:
        return f"--save_folder: {lines[0]}"
    if type(error).__module__.startswith("wandb.errors"):
        return (f"W&B (--wandb_project/--wandb_name): {lines[0] if lines else type(error).__name__}; "
                "run `wandb login` or set WANDB_API_KEY, or log offline with WANDB_MODE=offline")
    if isinstance(error, RuntimeError) and text.startswith("Error(s) in loading state_dict"):
        return (f"the checkpoint does not fit this model ({lines[0]}...): it was saved with another "
                "--model_config; pass the same flags as the run that saved it")
    return None


def run_already_complete(trainer: Trainer, args: argparse.Namespace) -> bool:
    """True when the loaded checkpoint is already at --max_duration (a retried --autoresume job).

    Composer's fit() raises then ("No training would occur"); the job instead finishes what the
    killed one may not have: the EMA export. The summary and results say the run was complete.
    """
    state = trainer.state
    if state.timestamp.get(state.max_duration.unit) < state.max_duration:
        return False
    if args.use_ema and args.ema_export_dir:
        from ema import EMA
        ema = next((a for a in state.algorithms if isinstance(a, EMA)), None)
        if ema is not None and ema.initialized:
            ema.export_unet(state.model, os.path.join(args.ema_export_dir, "unet"))  # the pipeline follows in main
    return True


def cli(argv: list[str] | None = None) -> None:
    """The command line: main(), with user errors that surface during the run as one line."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        main(argv)
    except Exception as error:  # noqa: BLE001
        line = user_error(error)
        if line is None or "--debug" in argv:
            raise  # a bug, or asked for: the traceback
        raise SystemExit(f"benchmark.py: error: {line} (--debug shows the traceback)") from None


class NonFiniteLossError(RuntimeError):
    """The loss went NaN/inf: a property of the run (learning rate, precision, data), reported in one line."""


class StopOnNonFiniteLoss(Callback):
    """Stop the run at the first NaN/inf loss, before the checkpoint of that batch is written.

    Checked at BATCH_END, which comes before Composer's checkpoint event, so no broken state is
    saved. `state.loss` is only the last microbatch's loss: a NaN in an earlier microbatch would
    poison the step and pass. Composer's `total_loss_dict` sums every microbatch's loss and is
    already all-reduced over ranks (a float, the same on every rank), so checking it catches a NaN
    in any microbatch on any rank at its own batch, with no extra collective, and every rank stops
    at the same batch instead of the healthy ones waiting in the next collective until the timeout.
    """

    def __init__(self, load_path: str | None = None, save_folder: str | None = None):
        self.load_path, self.save_folder = load_path, save_folder

    def batch_end(self, state: State, logger: Logger) -> None:
        total = state.total_loss_dict.get("loss/train/total")
        if total is None:  # Composer did not fill it (no loss this batch): check this rank's last loss, synced
            losses = state.loss if isinstance(state.loss, (list, tuple)) else [state.loss]
            bad = torch.zeros(1, device=losses[0].device)
            for loss in losses:
                bad += (~torch.isfinite(loss.detach())).any().float()
            dist.all_reduce(bad, reduce_operation="MAX")
            if bad.item() == 0:
                return
        elif math.isfinite(total):
            return
        # The timestamp already counts this batch: it is the N of the console's [batch=N/...] and of
        # the ep*-baN checkpoint this batch would have written.
        batch = int(state.timestamp.batch)
        # Only rank 0 writes (and remembers) checkpoint files: every rank reports rank 0's answer.
        box = [self.last_good_checkpoint(state) if dist.get_global_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        where = f"last good checkpoint: {box[0]}" if box[0] else "no checkpoint was saved yet (see --save_folder)"
        raise NonFiniteLossError(
            f"non-finite loss at batch {batch} (ba{batch}); stopped before saving it; {where}. "
            "Resume from it (--load_path or --autoresume), perhaps with a lower --lr or --precision fp32.")

    def last_good_checkpoint(self, state: State) -> str | None:
        saver = next((cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)), None)
        if saver is not None and saver.saved_checkpoints:  # written by this process
            path = saver.saved_checkpoints[-1]
        elif self.load_path:  # started from --load_path, nothing saved since
            return self.load_path
        elif saver is not None and saver.all_saved_checkpoints_to_timestamp:
            # --autoresume: the saver's history came back with the checkpoint it loaded.
            path = max(saver.all_saved_checkpoints_to_timestamp.items(), key=lambda item: int(item[1].batch))[0]
        else:
            return None
        if self.save_folder and "://" in self.save_folder:  # locally there was only a temporary copy
            return f"{self.save_folder.rstrip('/')}/{os.path.basename(path)}"
        return path


class RunRecord(Callback):
    """What a checkpoint's weights do not say, saved in every checkpoint for export.py: the model
    configuration and --model_name, the seed the encoders were built from (the --seed, or the one
    precompute.json recorded for random encoders), the image size and whether it trained on latents."""

    def __init__(self, settings: dict):
        self.settings = settings

    def state_dict(self) -> dict:
        return dict(self.settings)

    def load_state_dict(self, state: dict) -> None:
        pass  # a resumed run records its own settings (validated against the data like the first run's)


class EmptyEpochError(RuntimeError):
    """An epoch that trained no batch: the data gives this rank less than one batch."""


class StopOnEmptyEpoch(Callback):
    """Stop at the end of an epoch that started and trained no batch, before its checkpoint.

    validate() refuses data smaller than one global batch up front; this catches what it cannot
    see (shards that shrank, a partition that leaves a rank short). Composer 0.32.1 only warns
    "No batches were trained": a run in epochs then writes empty results and exits 0, and a run in
    batches starts empty epochs forever. An epoch resumed at its end (a retried finished job) is
    not started here (no EPOCH_START), so it does not count.
    """

    def __init__(self):
        self.batches_in_epoch: int | None = None  # None: the current epoch was not started by this process

    def epoch_start(self, state: State, logger: Logger) -> None:
        self.batches_in_epoch = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.batches_in_epoch is not None:
            self.batches_in_epoch += 1

    def epoch_end(self, state: State, logger: Logger) -> None:
        started, self.batches_in_epoch = self.batches_in_epoch, None
        if started == 0:
            raise EmptyEpochError(
                f"epoch {int(state.timestamp.epoch)} trained no batch: the data gives rank {dist.get_global_rank()} "
                "less than one batch per epoch; use a smaller --batch_size, a larger --epoch_size, or more data")


def safe_auto_microbatch(args: argparse.Namespace, total_memory_bytes: int, world_size: int, precision: str,
                         text_format: str | None) -> int:
    """`auto` for several ranks: the memory model's microbatch for this GPU (gpu_memory.py), not an OOM search.

    Composer's auto microbatching catches an OOM and retries the batch with half the microbatch.
    Under DDP an OOM in the backward pass leaves the gradient reducer mid-reduction (buckets marked
    ready on one rank and not on another), and the size found on batch 1 ignores the AdamW and EMA
    state that is only allocated after it; so with several ranks `auto` takes the largest power of
    two that divides the per-device batch and that gpu_memory.plan counts as fitting this GPU's memory
    with this run's settings.
    """
    return gpu_memory.auto_microbatch(
        args.model_config, args.image_size, total_memory_bytes, args.batch_size // world_size,
        precision=precision, norm_precision=args.norm_precision, precomputed=args.precomputed,
        precomputed_format=text_format or "tokens", use_ema=args.use_ema,
        fsdp=getattr(args, "fsdp", None) or "none", num_gpus=world_size)


def fsdp_parallelism(mode: str) -> ParallelismConfig | None:
    """Composer's parallelism config for `--fsdp`: FSDP2 on the UNet, or None for DDP.

    Composer 0.32.1 has two FSDP paths. FSDP1 (`FSDPConfig`, `composer.distributed.prepare_fsdp_module`)
    builds torch's `FullyShardedDataParallel` with `device_id=torch.cuda.current_device()`, so it
    cannot run without CUDA. FSDP2 (`FSDP2Config`, `parallelize_composer_model`) calls torch's
    `fully_shard`, whose default mesh is the accelerator's or the CPU's (gloo), so the code path the
    GPUs run is the one the CPU tests run. `reshard_after_forward` is the mode: True frees each
    block's gathered weights after its forward and gathers them again for its backward (FSDP1's
    FULL_SHARD, ZeRO-3); False keeps them from the forward to the end of that microbatch's backward
    (SHARD_GRAD_OP, ZeRO-2: one all-gather per block per microbatch instead of two, more memory).
    Gradients and AdamW moments are sharded in both. Mixed precision is Composer's DEFAULT: weights
    gathered in the autocast dtype, gradients reduced in fp32. Checkpoints are 'full': Composer
    gathers the model and optimizer to rank 0, which writes one file as under DDP, so
    `--autoresume`, `latest-rank0.pt`, export.py and a change of world size work unchanged.
    """
    if mode == "none":
        return None
    with warnings.catch_warnings():  # "FSDP2 Config/APIs are experimental": said once in the README instead
        warnings.simplefilter("ignore", UserWarning)
        config = FSDP2Config(reshard_after_forward=mode == "full_shard", state_dict_type="full")
    return ParallelismConfig(fsdp2=config)


def average_gradients_over_gloo(unet: torch.nn.Module) -> None:
    """Make FSDP2 average the UNet's gradients over the ranks on CPU (gloo), as it does on GPUs.

    FSDP2 (torch 2.7, `_fsdp_collectives.foreach_reduce`) reduce-scatters fp32 and bf16 gradients
    with `ReduceOp.AVG`, which NCCL applies; gloo's `reduce_scatter_tensor` silently sums instead
    (measured: two ranks holding 1 and 2 both receive 3, not 1.5; its all_reduce refuses AVG). So on
    CPU every gradient shard would be the world size times DDP's: AdamW's step hardly shows it (it
    is scale-invariant but for eps), while gradient clipping and the AdamW moments saved in
    checkpoints do. FSDP2's hook on the reduce-scatter output divides it by the world size: exact
    for a power of two, so the CPU runs compute DDP's gradients. NCCL runs never come here.
    """
    from torch.distributed.fsdp import FSDPModule
    world_size = dist.get_world_size()
    for module in unet.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda shard: shard.div_(world_size))


def per_node_signal_files() -> None:
    """Make Composer's node signal files per node, so --autoresume works when nodes share --save_folder.

    Composer 0.32.1 (autoresume, checkpoint loading) names the file by which each node's local rank 0
    tells the node's other ranks it is done after node 0 plus a random suffix broadcast from rank 0,
    so every node uses the same name in the same folder, and every node's local rank 0 deletes it:
    on a file system shared by the nodes the second delete fails (FileNotFoundError) and the run
    dies before training. Adding this node's rank keeps the name equal within a node only.
    """
    original = dist.get_node_signal_file_name
    if getattr(original, "per_node", False):
        return

    def per_node(rng=None) -> str:
        return f"{original(rng)}_n{dist.get_node_rank()}"

    per_node.per_node = True
    dist.get_node_signal_file_name = per_node


def main(argv: list[str] | None = None, extra_callbacks: list[Callback] | None = None) -> dict:
    args = parse_args(argv)
    per_node_signal_files()
    world_size = dist.get_world_size()
    samples_per_epoch = validate(args, world_size)
    validate_recipe(args)
    check_run_length(args, samples_per_epoch)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and "OMP_NUM_THREADS" not in os.environ:
        # Composer's launcher leaves every CPU rank using all cores: N ranks oversubscribe N-fold.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_local_world_size()))
    if on_gpu:
        # Before anything touches CUDA: otherwise every rank creates a context on GPU 0.
        torch.cuda.set_device(dist.get_local_rank())
        # Fixed shapes every step: let cuDNN time its convolution algorithms once and keep the fastest.
        torch.backends.cudnn.benchmark = True
    precision = args.precision if args.precision != "auto" else ("amp_bf16" if on_gpu else "fp32")
    if not on_gpu and precision == "amp_fp16":
        raise SystemExit("benchmark.py: error: --precision amp_fp16 needs a CUDA GPU; on CPU use fp32 or amp_bf16 "
                         "(CPU autocast)")
    # Composer refuses AMP on CPU: there the model autocasts to bf16 itself and Composer runs "fp32".
    trainer_precision = "fp32" if not on_gpu else precision
    microbatch = args.device_train_microbatch_size
    if microbatch == "auto" and not on_gpu:
        microbatch = args.batch_size // world_size  # Composer's auto microbatching needs a GPU
    if args.channels_last and not args.compile and dist.get_global_rank() == 0:
        warnings.warn("--channels_last without --compile: eager GroupNorm returns contiguous tensors, so every "
                      "convolution after a norm converts its input back to channels-last; add --compile "
                      "(inductor keeps one layout), or measure before keeping the flag.", stacklevel=1)
    reproducibility.seed_all(args.seed)

    per_device = args.batch_size // world_size
    text_format = None  # how precomputed batches carry the text: token ids or text-encoder states
    if args.precomputed:  # before the model: the shards' format decides whether it needs the text encoder
        train_dataloader = data.latents_dataloader(
            synthetic=args.use_synth_data, remote=args.remote, local=args.local or default_local(args.remote),
            image_size=args.image_size, text_dim=MODEL_CONFIGS[args.model_config]["unet"]["cross_attention_dim"],
            batch_size_per_device=per_device, num_workers=args.num_workers,
            num_samples=args.num_synthetic_samples, seed=args.seed, synthetic_format=args.precomputed_format,
            **(streaming_options(args) if not args.use_synth_data else dict(shuffle=args.shuffle)))
        text_format = train_dataloader.dataset.text_format
    if microbatch == "auto" and world_size > 1:  # here: with precomputed latents it depends on the shards' format
        microbatch = safe_auto_microbatch(args, torch.cuda.get_device_properties(0).total_memory, world_size,
                                          precision, text_format)
        if dist.get_global_rank() == 0:
            print(f"--device_train_microbatch_size auto with {world_size} ranks: using {microbatch} "
                  f"(counted by gpu_memory.py for this GPU's memory and these settings; see README), "
                  "not Composer's OOM search", flush=True)
    components = build_components(args.model_config, args.model_name, with_encoders=not args.precomputed,
                                  with_text_encoder=text_format != "text_states")
    if components.random:
        missing = " and ".join(components.random)
        if not args.use_synth_data and args.model_config != "tiny" and not args.allow_random_encoders:
            raise SystemExit(
                f"benchmark.py: error: pretrained {missing} not found for --model_name {args.model_name}: "
                "training on real data needs them (download the model to a local folder and pass it), "
                "or pass --allow_random_encoders to measure throughput anyway")
        if dist.get_global_rank() == 0:
            why = ("the tiny configuration has no pretrained weights" if args.model_config == "tiny" else
                   f"--model_name {args.model_name}: pretrained {missing} not available here (offline or not downloaded)")
            print(f"note: {why}; using randomly initialized {missing} (throughput does not depend on the weights).",
                  file=sys.stderr, flush=True)
    model = StableDiffusion(components.unet, components.vae, components.text_encoder, components.noise_scheduler,
                            components.latent_scale, snr_gamma=args.snr_gamma, offset_noise=args.offset_noise,
                            num_loss_bins=args.loss_bins)
    # Encoders for what the training step itself does not need (the empty caption's text states,
    # samples, the exported pipeline): the model's own, or, on precomputed latents, built aside
    # exactly as latents.py built them under --seed.
    encoders = components
    if any(part is None for part in (components.vae, components.text_encoder, components.tokenizer)) and (
            args.caption_drop_prob > 0 or args.sample_prompts or args.ema_export_dir):
        # The model's own parts where it has them (on the tokens format it has the text encoder).
        encoders_seed = getattr(args, "encoders_seed", None)
        if encoders_seed is not None and encoders_seed != args.seed and dist.get_global_rank() == 0:
            print(f"note: the latents were computed with random encoders of seed {encoders_seed} (precompute.json): "
                  f"the encoders are rebuilt from it; --seed {args.seed} seeds the UNet, noise and data order",
                  file=sys.stderr, flush=True)
        aside = build_encoders_aside(args.model_config, args.model_name,
                                     encoders_seed if encoders_seed is not None else args.seed)
        encoders = dataclasses.replace(
            aside, vae=components.vae if components.vae is not None else aside.vae,
            text_encoder=components.text_encoder if components.text_encoder is not None else aside.text_encoder,
            tokenizer=components.tokenizer if components.tokenizer is not None else aside.tokenizer)
    if args.caption_drop_prob > 0:
        empty_ids = tokenize(encoders.tokenizer, [""])
        with torch.no_grad():
            empty_states = encoders.text_encoder(empty_ids)[0]
        model.set_caption_dropout(args.caption_drop_prob, empty_ids, empty_states)
    if not on_gpu and precision == "amp_bf16":
        model.cpu_autocast_dtype = torch.bfloat16
    if args.xformers:
        model.unet.enable_xformers_memory_efficient_attention()
    if args.channels_last:
        model.unet.to(memory_format=torch.channels_last)
        if model.vae is not None:
            model.vae.to(memory_format=torch.channels_last)
            model.vae_channels_last = True
    if precision in ("amp_bf16", "amp_fp16"):
        # Frozen encoders stored in the autocast dtype: autocast would otherwise re-cast their fp32
        # weights on every microbatch. GroupNorm and LayerNorm, which CUDA autocast runs in fp32
        # (reading and writing twice the bytes, keeping fp32 activations for backward and upcasting
        # the stored bf16 norm weights), run in the autocast dtype unless --norm_precision fp32.
        for frozen in model._frozen():
            frozen.to(torch.bfloat16 if precision == "amp_bf16" else torch.float16)
        set_norm_precision(model, args.norm_precision)
    if args.compile:
        if world_size > 1:
            # Under DDP, dynamo's DDPOptimizer splits the compiled graph at every gradient bucket
            # (~140 graphs for the SD2 UNet) so that all-reduces overlap the backward pass. With
            # gradient accumulation Composer syncs gradients only on a batch's last microbatch, so
            # that overlap is worth little, while the splits cost fusion and compile time.
            torch._dynamo.config.optimize_ddp = False
        # nn.Module.compile works in place and keeps parameter names, so checkpoints and the EMA are
        # unaffected. Every module that runs per step: the eager VAE encoder was 35-40% of an
        # online step, and the text encoder runs on token ids online and on the tokens format.
        model.unet.compile()
        if model.vae is not None:
            model.vae.encoder.compile()
        if model.text_encoder is not None:
            model.text_encoder.compile()

    # FLOPs per image, counted once on meta-device copies: nothing is computed.
    meta_unet, meta_vae, meta_text = sd2_meta_components(args.model_config)
    if args.precomputed:
        meta_vae = None  # its outputs are read from disk
        if text_format == "text_states":
            meta_text = None
    flops = count_flops_per_image(meta_unet, meta_vae, meta_text, args.image_size)
    model.flops_per_image = flops["total"]

    if args.remote and not args.use_synth_data:
        record_caches(args)
    if args.precomputed:
        pass  # built above, before the model
    elif args.use_synth_data:
        train_dataloader = data.synthetic_dataloader(args.image_size, per_device, args.num_workers,
                                                     args.num_synthetic_samples, args.seed)
    else:
        train_dataloader = data.laion_dataloader(
            remote=args.remote, local=args.local or default_local(args.remote), tokenizer=components.tokenizer, image_size=args.image_size,
            batch_size_per_device=per_device, num_workers=args.num_workers, seed=args.seed,
            image_key=args.image_key, caption_key=args.caption_key, max_bad_fraction=args.max_bad_fraction,
            **streaming_options(args))

    fused = args.fused_adamw == "on" or (args.fused_adamw == "auto" and on_gpu)
    optimizer = torch.optim.AdamW(model.unet.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused)
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
    throughput = Throughput(args.warmup_batches, flops["total"], peak_flops, flops["unet_fwd_bwd"])
    loggers = []
    if args.wandb_project or args.wandb_name:
        loggers.append(WandBLogger(project=args.wandb_project, name=args.wandb_name))
    algorithms = []
    if args.use_ema:
        from ema import EMA
        # The EMA writes the UNet into <ema_export_dir>/unet; the rest of the pipeline follows after fit.
        export_unet = os.path.join(args.ema_export_dir, "unet") if args.ema_export_dir else None
        algorithms.append(EMA(half_life=args.ema_half_life, ema_start=args.ema_start, export_dir=export_unet))
    if args.grad_clip_norm:
        from composer.algorithms import GradientClipping
        algorithms.append(GradientClipping(clipping_type="norm", clipping_threshold=args.grad_clip_norm))
    recipe_callbacks = []
    loss_by_timestep = None
    if args.loss_bins:
        loss_by_timestep = LossByTimestep(args.log_interval)
        recipe_callbacks.append(loss_by_timestep)
    if args.sample_prompts:
        from sample import SampleImages, load_prompts
        recipe_callbacks.append(SampleImages(
            load_prompts(args.sample_prompts), args.samples_dir or os.path.join(args.save_folder, "samples"),
            args.sample_interval, tokenizer=encoders.tokenizer, text_encoder=encoders.text_encoder, vae=encoders.vae,
            latent_scale=model.latent_scale, image_size=args.image_size, sampler=args.sampler,
            num_steps=args.sample_steps, guidance_scale=args.guidance_scale, seed=args.seed))

    parallelism = fsdp_parallelism(args.fsdp)
    if parallelism is not None:
        model.mark_fsdp_units()
        if on_gpu:
            # With a parallelism config Composer does not move the model (fully_shard moves only the
            # modules it wraps): the frozen encoders and buffers go to this rank's GPU here. Every
            # rank built the UNet from the same seed, so the shards come from identical weights
            # (Composer's FSDP2 broadcasts from rank 0 only when the other ranks are on the meta device).
            model.to(torch.device("cuda", dist.get_local_rank()))
    trainer = Trainer(
        model=model,
        parallelism_config=parallelism,
        train_dataloader=train_dataloader,
        optimizers=optimizer,
        schedulers=schedulers or None,
        max_duration=args.max_duration,
        algorithms=algorithms,
        callbacks=[SpeedMonitor(window_size=10, gpu_flops_available=peak_flops), throughput,
                   StopOnNonFiniteLoss(args.load_path, args.save_folder), StopOnEmptyEpoch(),
                   RunRecord({"model_config": args.model_config, "model_name": args.model_name,
                              "encoders_seed": args.seed if getattr(args, "encoders_seed", None) is None else args.encoders_seed,
                              "image_size": args.image_size, "precomputed": args.precomputed}),
                   ConsoleProgress(args.log_interval),
                   *recipe_callbacks, *(extra_callbacks or [])],
        loggers=loggers,
        precision=trainer_precision,
        device_train_microbatch_size=microbatch,
        seed=args.seed,
        run_name=args.run_name,
        save_folder=args.save_folder,
        save_interval=args.save_interval,
        save_num_checkpoints_to_keep=args.save_num_checkpoints_to_keep,
        save_overwrite=args.autoresume,
        load_path=args.load_path,
        autoresume=args.autoresume,
        progress_bar=False,  # console.ConsoleProgress prints the progress line instead
        log_to_console=False,
    )
    if parallelism is not None and torch.distributed.get_backend() == "gloo":
        average_gradients_over_gloo(model.unet)
    if on_gpu and model.vae is not None:
        # Training only encodes: the VAE decoder (~50M parameters) waits on the host. Anything that
        # decodes during a run (sampling) moves it back to the device first.
        model.vae.decoder.to("cpu")
        model.vae.post_quant_conv.to("cpu")
    trained_before = int(trainer.state.timestamp.batch)
    if not run_already_complete(trainer, args):
        trainer.fit()
    after_window_s = time.perf_counter() - throughput.window_end if throughput.window_end else None
    if args.ema_export_dir and dist.get_global_rank() == 0 and Path(args.ema_export_dir, "unet", "config.json").is_file():
        from diffusers import UNet2DConditionModel

        from export import write_pipeline
        write_pipeline(args.ema_export_dir, UNet2DConditionModel.from_pretrained(Path(args.ema_export_dir, "unet")),
                       encoders.vae, encoders.text_encoder, encoders.tokenizer, model.noise_scheduler.config)

    results = {
        **throughput.summary,
        # From the end of the last batch to the return of fit: final checkpoint, EMA export, uploads.
        "seconds_after_window": after_window_s,
        "world_size": world_size,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "precision": precision,
        "image_size": args.image_size,
        "global_batch_size": args.batch_size,
        "device_train_microbatch_size": trainer.state.device_train_microbatch_size,
        "model_config": args.model_config,
        "data": "synthetic" if args.use_synth_data else (args.remote or args.local),
        "use_ema": args.use_ema,
        "precomputed": args.precomputed,
        "precomputed_format": text_format,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "norm_precision": args.norm_precision if precision in ("amp_bf16", "amp_fp16") else None,
        "fused_adamw": fused,
        "xformers": args.xformers,
        "fsdp": args.fsdp,
        "pretrained_parts": components.pretrained,
        "random_parts": components.random,
        "flops_per_image_breakdown": flops,
        # Mean over all ranks and all microbatches of the last batch (Composer's all-reduced total).
        "final_loss": trainer.state.total_loss_dict.get("loss/train/total"),
        "loss_by_timestep_bin": loss_by_timestep.summary() if loss_by_timestep else [],
        "torch_version": torch.__version__,
    }
    if int(trainer.state.timestamp.batch) == trained_before:
        # A retried --autoresume job whose run had finished: nothing was trained or measured here.
        results.update(already_complete=True, images_per_sec=None, images_per_sec_per_device=None,
                       measured_batches=0, trained_batches=trained_before, save_folder=args.save_folder)
    trainer.close()
    if dist.get_global_rank() == 0:
        print_summary(results)
        if results.get("already_complete") and args.results_json and Path(args.results_json).exists():
            print(f"kept {args.results_json} (written by the run that trained)")
        elif args.results_json:
            Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.results_json).write_text(json.dumps(results, indent=2) + "\n")
            print(f"results written to {args.results_json}")
    return results


def print_summary(r: dict) -> None:
    if r.get("already_complete"):
        print("\n=== Stable Diffusion benchmark ===\n"
              f"model {r['model_config']} at {r['image_size']}x{r['image_size']}: the run was already complete "
              f"({r['trained_batches']} batches, checkpoint in {r['save_folder']}); nothing trained or measured "
              "in this run (its figures are those of the run that trained)\n", flush=True)
        return
    def percent(value: float | None) -> str:
        return f"{100 * value:.1f}%" if value is not None else "n/a"

    wait, wait_mean = percent(r["data_wait_fraction"]), percent(r["data_wait_fraction_mean"])
    after = f"{r['seconds_after_window']:.1f} s" if r.get("seconds_after_window") is not None else "n/a"
    reserved = (f", {r['peak_memory_reserved_bytes'] / 2**30:.2f} GiB reserved"
                if r.get("peak_memory_reserved_bytes") else "")
    since = " after warm-up" if r["peak_memory_kind"].startswith("cuda") else ", whole run"
    mfu = (f"{100 * r['mfu']:.1f}% of {r['peak_flops_per_device'] / 1e12:.0f} TFLOP/s peak per device" if r.get("mfu")
           else "n/a (unknown device peak; pass --peak_tflops)")
    trained = (f"; trained network alone (UNet forward + backward, {r['flops_per_image_trained_network'] / 1e9:.1f} "
               f"GFLOP/image): {100 * r['mfu_trained_network']:.1f}%" if r.get("mfu_trained_network") else "")
    print(
        "\n=== Stable Diffusion benchmark ===\n"
        f"model {r['model_config']} at {r['image_size']}x{r['image_size']}, {r['precision']}, "
        f"{r['world_size']} x {r['device']}, global batch {r['global_batch_size']}, "
        f"microbatch {r['device_train_microbatch_size']}\n"
        f"throughput   {r['images_per_sec']:.2f} images/s ({r['images_per_sec_per_device']:.2f} per device) "
        f"over {r['measured_batches']} batches after {r['warmup_batches']} warm-up\n"
        f"MFU          {mfu} at {r['flops_per_image'] / 1e9:.1f} GFLOP/image{trained}\n"
        f"data wait    {wait} of measured time in the loader's next() (max over ranks; mean {wait_mean})\n"
        f"checkpoints  {r['checkpoint_seconds_in_window']:.1f} s saving inside the measured "
        f"{r['measured_seconds']:.1f} s, {r['checkpoint_seconds_after_window']:.1f} s after it; "
        f"{after} from the last batch to the end of fit\n"
        f"peak memory  {r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['peak_memory_kind']}){reserved}{since}\n"
        f"final loss   {r['final_loss']}\n",
        flush=True,
    )


if __name__ == "__main__":
    cli()
