"""Train Stable Diffusion 2 base from scratch with Composer and measure images/sec.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # 1 node, all GPUs
    python benchmark.py --model_config tiny --use_synth_data --batch_size 8 --image_size 64 --max_duration 20ba

The UNet is built from the SD2-base config with random weights; the VAE and the OpenCLIP text
encoder are frozen (loaded from `--model_name` when available). Data is synthetic
(`--use_synth_data`) or LAION-style MDS shards streamed from `--remote` into `--local`.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver, SpeedMonitor
from composer.core import Callback, State, Time
from composer.loggers import Logger
from composer.loggers import WandBLogger
from composer.utils import dist, reproducibility

import data
from model import MODEL_CONFIGS, LossByTimestep, StableDiffusion, build_components, build_encoders_aside, sd2_meta_components
from tokenizer import tokenize
from throughput import Throughput, count_flops_per_image

PRECISIONS = ("auto", "fp32", "amp_bf16", "amp_fp16")
DEFAULT_LOCAL = "/tmp/mds-cache"


def default_local(remote: str | None) -> str:
    """A cache folder per remote: Streaming trusts an index.json already in the cache, so one shared
    default folder would silently serve the previous remote's samples."""
    return f"{DEFAULT_LOCAL}/{hashlib.sha1(str(remote).encode()).hexdigest()[:12]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The flags of the 2023 benchmark, same names and defaults.
    p.add_argument("--batch_size", type=int, default=2048, help="global batch size, images per step over all devices")
    p.add_argument("--image_size", type=int, default=512, help="training resolution in pixels (multiple of 8)")
    p.add_argument("--remote", type=str, default=None, help="MDS shards to stream: s3://, gs://, oci://, ... or a path")
    p.add_argument("--local", type=str, default=None,
                   help=f"local cache for --remote shards (default {DEFAULT_LOCAL}/<hash of remote>), or shards already on disk")
    p.add_argument("--use_synth_data", action="store_true", help="random images and captions (measures the model only)")
    p.add_argument("--model_name", type=str, default="stabilityai/stable-diffusion-2-base",
                   help="hub id or local diffusers folder with pretrained vae/, text_encoder/, tokenizer/")
    p.add_argument("--use_ema", action="store_true", help="keep an EMA of the UNet weights (half-life 1000 batches)")
    p.add_argument("--ema_export_dir", type=str, default=None,
                   help="with --use_ema: write the EMA UNet here at the end as a diffusers folder (from_pretrained)")
    p.add_argument("--wandb_name", type=str, default=None, help="W&B run name (enables W&B logging)")
    p.add_argument("--wandb_project", type=str, default=None, help="W&B project (enables W&B logging)")
    p.add_argument("--device_train_microbatch_size", type=str, default="auto",
                   help="images per device per forward/backward, or 'auto' (GPU: largest that fits; CPU: no accumulation)")
    # Added by this project.
    p.add_argument("--max_duration", type=str, default="1ep", help="Composer time string: 20ba, 1ep, 100000sp")
    p.add_argument("--model_config", type=str, default="sd2-base", help=f"one of {sorted(MODEL_CONFIGS)}")
    p.add_argument("--precision", type=str, default="auto", help=f"one of {PRECISIONS}; auto: amp_bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--num_workers", type=int, default=8, help="DataLoader worker processes per device")
    p.add_argument("--results_json", type=str, default=None, help="write the throughput summary to this JSON file")
    p.add_argument("--num_synthetic_samples", type=int, default=100_000, help="size of the synthetic dataset")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant)")
    p.add_argument("--weight_decay", type=float, default=1e-3, help="AdamW weight decay")
    p.add_argument("--warmup_batches", type=int, default=5, help="batches left out of the throughput measurement")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="peak TFLOP/s of one device for MFU (default: Composer's table for A100/H100/H200)")
    p.add_argument("--allow_random_encoders", action="store_true",
                   help="train on real data even when the pretrained VAE/text encoder cannot be loaded")
    # Real data (data.py): MDS columns, streaming and bad-sample settings.
    p.add_argument("--image_key", type=str, default="jpg", help="MDS column holding the encoded image bytes")
    p.add_argument("--caption_key", type=str, default="caption", help="MDS column holding the caption text")
    p.add_argument("--no_shuffle", dest="shuffle", action="store_false",
                   help="stream samples in stored order (default: shuffled, seeded by --seed)")
    p.add_argument("--predownload", type=int, default=None,
                   help="samples each loader worker downloads ahead (default: 8 x per-device batch)")
    p.add_argument("--download_retry", type=int, default=2, help="download attempts per shard before failing")
    p.add_argument("--download_timeout", type=float, default=60.0, help="seconds before a shard download fails")
    p.add_argument("--cache_limit", type=str, default=None,
                   help="evict cached shards beyond this size, e.g. 500gb (default: keep all)")
    p.add_argument("--validate_hash", type=str, default=None,
                   help="check downloaded shards with this hash from index.json: sha1 or xxh64")
    p.add_argument("--max_bad_fraction", type=float, default=0.01,
                   help="stop when more than this fraction of the images one loader worker decoded failed "
                        "(checked after 1000)")
    # Checkpoints (Composer's machinery): local paths or object-store URIs (s3://, gs://, oci://).
    p.add_argument("--save_folder", type=str, default=None, help="where to save checkpoints (path or s3://... URI)")
    p.add_argument("--save_interval", type=str, default="1000ba", help="checkpoint every this long (20ba, 1ep)")
    p.add_argument("--save_num_checkpoints_to_keep", type=int, default=-1,
                   help="local checkpoints to keep (-1: all); object-store copies are kept")
    p.add_argument("--load_path", type=str, default=None, help="checkpoint to start from (path or URI)")
    p.add_argument("--autoresume", action="store_true",
                   help="resume from the latest checkpoint in --save_folder if there is one (needs --run_name)")
    p.add_argument("--run_name", type=str, default=None, help="run name; fixed names let --autoresume find the run")
    p.add_argument("--log_interval", type=str, default="10ba", help="console log interval (Composer time string)")
    # Speed (issue: fastest correct step). Defaults are the plain step until GPU measurements say otherwise.
    p.add_argument("--precomputed", action="store_true",
                   help="train from precomputed VAE latents and text-encoder outputs (latents.py): skips both encoders")
    p.add_argument("--channels_last", action="store_true", help="UNet and VAE in channels-last memory format")
    p.add_argument("--compile", action="store_true", help="torch.compile the UNet (in place: checkpoint keys unchanged)")
    p.add_argument("--fused_adamw", type=str, default="auto", choices=("auto", "on", "off"),
                   help="fused AdamW kernel; auto: on with CUDA")
    p.add_argument("--xformers", action="store_true", help="use xFormers attention in the UNet (default: PyTorch SDPA)")
    # Training recipe (issue: train a model someone could use). Every default keeps the 2023 step.
    p.add_argument("--lr_warmup_batches", type=int, default=0, help="linear learning-rate warm-up over this many batches")
    p.add_argument("--lr_schedule", type=str, default="constant", choices=("constant", "cosine"),
                   help="after the warm-up: constant, or cosine decay to 0 at --max_duration")
    p.add_argument("--grad_clip_norm", type=float, default=None, help="clip the gradient's global L2 norm to this")
    p.add_argument("--caption_drop_prob", type=float, default=0.0,
                   help="replace each caption by the empty one with this probability (classifier-free guidance)")
    p.add_argument("--ema_start", type=str, default="0ba", help="with --use_ema: start averaging at this time (e.g. 1350000ba)")
    p.add_argument("--ema_half_life", type=str, default="1000ba",
                   help="with --use_ema: EMA half-life in batches (6931ba is a smoothing of 0.9999 per batch)")
    p.add_argument("--snr_gamma", type=float, default=None, help="min-SNR-gamma loss weighting (5 is the paper's value)")
    p.add_argument("--offset_noise", type=float, default=0.0, help="offset noise strength (e.g. 0.1)")
    p.add_argument("--loss_bins", type=int, default=10, help="log the loss in this many bins of timesteps (0: off)")
    # Samples while training (sample.py).
    p.add_argument("--sample_prompts", type=str, default=None,
                   help="draw these prompts while training: a text file (one per line) or a built-in set: default, shapes")
    p.add_argument("--sample_interval", type=str, default="1000ba", help="sample every this long (and at the end)")
    p.add_argument("--samples_dir", type=str, default=None, help="where sample grids go (default: <--save_folder>/samples)")
    p.add_argument("--sampler", type=str, default="ddim", choices=("ddim", "euler"), help="diffusers sampler for samples")
    p.add_argument("--sample_steps", type=int, default=50, help="sampler steps per sample")
    p.add_argument("--guidance_scale", type=float, default=7.5, help="classifier-free guidance scale of samples (1: none)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Fail at once, with a one-line message naming the flag, on values that would fail later."""
    def fail(message: str) -> None:
        raise SystemExit(f"benchmark.py: error: {message}")

    if args.model_config not in MODEL_CONFIGS:
        fail(f"--model_config '{args.model_config}' is unknown; choose one of {sorted(MODEL_CONFIGS)}")
    if args.precision not in PRECISIONS:
        fail(f"--precision '{args.precision}' is unknown; choose one of {PRECISIONS}")
    if args.image_size <= 0 or args.image_size % 8:
        fail(f"--image_size {args.image_size} must be a positive multiple of 8 (the VAE downsamples by 8)")
    if args.batch_size <= 0 or args.batch_size % world_size:
        fail(f"--batch_size {args.batch_size} must be a positive multiple of the world size {world_size}")
    per_device = args.batch_size // world_size
    if args.device_train_microbatch_size != "auto":
        try:
            micro = int(args.device_train_microbatch_size)
        except ValueError:
            fail(f"--device_train_microbatch_size '{args.device_train_microbatch_size}' must be an integer or 'auto'")
        if micro <= 0 or per_device % micro:
            fail(f"--batch_size {args.batch_size} over {world_size} device(s) gives {per_device} per device, "
                 f"which --device_train_microbatch_size {micro} does not divide")
        args.device_train_microbatch_size = micro
    if not args.use_synth_data and not args.remote and not args.local:
        fail("no data: pass --use_synth_data, or --remote (with --local as cache), or --local with MDS shards already there")
    if not args.use_synth_data and not args.remote and not Path(args.local).is_dir():
        fail(f"--local {args.local} is not a folder; give --remote to stream shards into it")
    if not args.use_synth_data and args.remote and "://" not in args.remote and not Path(args.remote, "index.json").is_file():
        fail(f"--remote {args.remote} holds no MDS dataset (no index.json); write one with convert.py first")
    if args.num_workers < 0:
        fail(f"--num_workers {args.num_workers} must be >= 0")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        fail(f"--peak_tflops {args.peak_tflops} must be positive (TFLOP/s of one device)")
    if args.xformers and importlib.util.find_spec("xformers") is None:
        fail("--xformers: xformers is not installed; on a GPU machine `pip install xformers==0.0.30`, or drop the flag")
    if args.ema_export_dir and not args.use_ema:
        fail("--ema_export_dir needs --use_ema")
    if args.warmup_batches < 0:
        fail(f"--warmup_batches {args.warmup_batches} must be >= 0")
    for flag in ("max_duration", "save_interval", "log_interval"):
        try:
            Time.from_timestring(getattr(args, flag))
        except (ValueError, TypeError):
            fail(f"--{flag} '{getattr(args, flag)}' is not a Composer time string such as 20ba, 1ep or 1000sp")
    if args.autoresume and not (args.save_folder and args.run_name):
        fail("--autoresume needs --save_folder and --run_name (the same on every restart) to find the latest checkpoint")
    if args.autoresume and "://" not in args.save_folder and Path(args.save_folder).is_dir():
        # Composer replaces `latest` by delete-then-link: a kill in between leaves checkpoints but no
        # `latest`, and autoresume would silently start over and overwrite them.
        saved = sorted(Path(args.save_folder).glob("ep*-ba*-rank0.pt"), key=lambda p: p.stat().st_mtime)
        if saved and not (Path(args.save_folder) / "latest-rank0.pt").exists():
            fail(f"--autoresume: {args.save_folder} holds checkpoints but no latest-rank0.pt; "
                 f"resume explicitly with --load_path {saved[-1]} (or move the old checkpoints away)")


def validate_recipe(args: argparse.Namespace) -> None:
    """One-line errors for the training-recipe, sampling and export flags."""
    def fail(message: str) -> None:
        raise SystemExit(f"benchmark.py: error: {message}")

    if args.lr_warmup_batches < 0:
        fail(f"--lr_warmup_batches {args.lr_warmup_batches} must be >= 0")
    if args.grad_clip_norm is not None and args.grad_clip_norm <= 0:
        fail(f"--grad_clip_norm {args.grad_clip_norm} must be positive")
    if not 0.0 <= args.caption_drop_prob < 1.0:
        fail(f"--caption_drop_prob {args.caption_drop_prob} must be in [0, 1)")
    if args.snr_gamma is not None and args.snr_gamma <= 0:
        fail(f"--snr_gamma {args.snr_gamma} must be positive")
    if args.offset_noise < 0:
        fail(f"--offset_noise {args.offset_noise} must be >= 0")
    if args.loss_bins < 0:
        fail(f"--loss_bins {args.loss_bins} must be >= 0")
    for flag, units in (("ema_start", ("ba", "ep", "dur")), ("ema_half_life", ("ba",)), ("sample_interval", ("ba", "ep"))):
        try:
            unit = Time.from_timestring(getattr(args, flag)).unit.value
        except (ValueError, TypeError):
            unit = None
        if unit not in units:
            fail(f"--{flag} '{getattr(args, flag)}' must be a Composer time string in {', '.join(units)} (e.g. 1000ba)")
    if (args.ema_start != "0ba" or args.ema_half_life != "1000ba") and not args.use_ema:
        fail("--ema_start and --ema_half_life need --use_ema")
    if Time.from_timestring(args.ema_half_life).value <= 0:
        fail(f"--ema_half_life {args.ema_half_life} must be positive")
    if args.sample_prompts:
        from sample import load_prompts
        try:
            load_prompts(args.sample_prompts)
        except ValueError as e:
            fail(f"--sample_prompts {e}")
        if not args.samples_dir and not args.save_folder:
            fail("--sample_prompts needs --samples_dir or --save_folder (samples go to <save_folder>/samples)")
        if not args.samples_dir and "://" in args.save_folder:
            fail(f"--sample_prompts: --save_folder {args.save_folder} is an object store; give a local --samples_dir")
        if args.sample_steps <= 0:
            fail(f"--sample_steps {args.sample_steps} must be positive")
    if args.samples_dir and not args.sample_prompts:
        fail("--samples_dir needs --sample_prompts (a prompt file or a built-in set: default, shapes)")
    if args.ema_export_dir and Path(args.ema_export_dir).is_dir() and any(Path(args.ema_export_dir).iterdir()):
        fail(f"--ema_export_dir {args.ema_export_dir} is not empty; choose a new folder (nothing is overwritten)")


class StopOnNonFiniteLoss(Callback):
    """Stop the run at the first NaN/inf loss, before the checkpoint of that batch is written.

    Checked at BATCH_END, which comes before Composer's checkpoint event, so no broken state is
    saved. The flag is all-reduced so that every rank stops at the same batch instead of the
    healthy ranks waiting in the next collective until the timeout.
    """

    def __init__(self, load_path: str | None = None, save_folder: str | None = None):
        self.load_path, self.save_folder = load_path, save_folder

    def batch_end(self, state: State, logger: Logger) -> None:
        losses = state.loss if isinstance(state.loss, (list, tuple)) else [state.loss]
        bad = torch.zeros(1, device=losses[0].device)
        for loss in losses:
            bad += (~torch.isfinite(loss.detach())).any().float()
        dist.all_reduce(bad, reduce_operation="MAX")
        if bad.item() == 0:
            return
        # The timestamp already counts this batch: it is the N of the console's [batch=N/...] and of
        # the ep*-baN checkpoint this batch would have written.
        batch = int(state.timestamp.batch)
        # Only rank 0 writes (and remembers) checkpoint files: every rank reports rank 0's answer.
        box = [self.last_good_checkpoint(state) if dist.get_global_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        where = f"last good checkpoint: {box[0]}" if box[0] else "no checkpoint was saved yet (see --save_folder)"
        raise RuntimeError(
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
    validate(args, world_size)
    validate_recipe(args)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and "OMP_NUM_THREADS" not in os.environ:
        # Composer's launcher leaves every CPU rank using all cores: N ranks oversubscribe N-fold.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_local_world_size()))
    if on_gpu:
        # Before anything touches CUDA: otherwise every rank creates a context on GPU 0.
        torch.cuda.set_device(dist.get_local_rank())
    precision = args.precision if args.precision != "auto" else ("amp_bf16" if on_gpu else "fp32")
    microbatch = args.device_train_microbatch_size
    if microbatch == "auto" and not on_gpu:
        microbatch = args.batch_size // world_size  # Composer's auto microbatching needs a GPU
    reproducibility.seed_all(args.seed)

    components = build_components(args.model_config, args.model_name, with_encoders=not args.precomputed)
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
            warnings.warn(f"{why}; using randomly initialized {missing} (throughput does not depend on the weights).",
                          stacklevel=1)
    model = StableDiffusion(components.unet, components.vae, components.text_encoder, components.noise_scheduler,
                            components.latent_scale, snr_gamma=args.snr_gamma, offset_noise=args.offset_noise,
                            num_loss_bins=args.loss_bins)
    # Encoders for what the training step itself does not need (the empty caption's text states,
    # samples, the exported pipeline): the model's own, or, on precomputed latents, built aside
    # exactly as latents.py built them under --seed.
    encoders = components
    if components.text_encoder is None and (args.caption_drop_prob > 0 or args.sample_prompts or args.ema_export_dir):
        encoders = build_encoders_aside(args.model_config, args.model_name, args.seed)
    if args.caption_drop_prob > 0:
        empty_ids = tokenize(encoders.tokenizer, [""])
        with torch.no_grad():
            empty_states = encoders.text_encoder(empty_ids)[0]
        model.set_caption_dropout(args.caption_drop_prob, empty_ids, empty_states)
    if args.xformers:
        model.unet.enable_xformers_memory_efficient_attention()
    if args.channels_last:
        model.unet.to(memory_format=torch.channels_last)
        if model.vae is not None:
            model.vae.to(memory_format=torch.channels_last)
    if args.compile:
        model.unet.compile()  # nn.Module.compile keeps parameter names, so checkpoints and EMA are unaffected

    # FLOPs per image, counted once on meta-device copies: nothing is computed.
    meta_unet, meta_vae, meta_text = sd2_meta_components(args.model_config)
    if args.precomputed:
        meta_vae = meta_text = None  # their outputs are read from disk
    flops = count_flops_per_image(meta_unet, meta_vae, meta_text, args.image_size)
    model.flops_per_image = flops["total"]

    per_device = args.batch_size // world_size
    if args.precomputed:
        train_dataloader = data.latents_dataloader(
            synthetic=args.use_synth_data, remote=args.remote, local=args.local or default_local(args.remote),
            image_size=args.image_size, text_dim=model.unet.config.cross_attention_dim,
            batch_size_per_device=per_device, num_workers=args.num_workers,
            num_samples=args.num_synthetic_samples, seed=args.seed)
    elif args.use_synth_data:
        train_dataloader = data.synthetic_dataloader(args.image_size, per_device, args.num_workers,
                                                     args.num_synthetic_samples, args.seed)
    else:
        train_dataloader = data.laion_dataloader(
            remote=args.remote, local=args.local or default_local(args.remote), tokenizer=components.tokenizer, image_size=args.image_size,
            batch_size_per_device=per_device, num_workers=args.num_workers, seed=args.seed,
            image_key=args.image_key, caption_key=args.caption_key, shuffle=args.shuffle, predownload=args.predownload,
            download_retry=args.download_retry, download_timeout=args.download_timeout,
            cache_limit=args.cache_limit, validate_hash=args.validate_hash, max_bad_fraction=args.max_bad_fraction)

    fused = args.fused_adamw == "on" or (args.fused_adamw == "auto" and on_gpu)
    optimizer = torch.optim.AdamW(model.unet.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    schedulers = []
    if args.lr_warmup_batches or args.lr_schedule != "constant":
        from composer.optim import ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler
        warmup = f"{args.lr_warmup_batches}ba"
        schedulers.append(CosineAnnealingWithWarmupScheduler(t_warmup=warmup, alpha_f=0.0) if args.lr_schedule == "cosine"
                          else ConstantWithWarmupScheduler(t_warmup=warmup))
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    throughput = Throughput(args.warmup_batches, flops["total"], peak_flops)
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

    trainer = Trainer(
        model=model,
        train_dataloader=train_dataloader,
        optimizers=optimizer,
        schedulers=schedulers or None,
        max_duration=args.max_duration,
        algorithms=algorithms,
        callbacks=[SpeedMonitor(window_size=10, gpu_flops_available=peak_flops), throughput,
                   StopOnNonFiniteLoss(args.load_path, args.save_folder), *recipe_callbacks, *(extra_callbacks or [])],
        loggers=loggers,
        precision=precision,
        device_train_microbatch_size=microbatch,
        seed=args.seed,
        run_name=args.run_name,
        save_folder=args.save_folder,
        save_interval=args.save_interval,
        save_num_checkpoints_to_keep=args.save_num_checkpoints_to_keep,
        save_overwrite=args.autoresume,
        load_path=args.load_path,
        autoresume=args.autoresume,
        progress_bar=False,
        log_to_console=True,
        console_log_interval=args.log_interval,
    )
    trainer.fit()
    if args.ema_export_dir and dist.get_global_rank() == 0 and Path(args.ema_export_dir, "unet", "config.json").is_file():
        from diffusers import UNet2DConditionModel

        from export import write_pipeline
        write_pipeline(args.ema_export_dir, UNet2DConditionModel.from_pretrained(Path(args.ema_export_dir, "unet")),
                       encoders.vae, encoders.text_encoder, encoders.tokenizer, model.noise_scheduler.config)

    results = {
        **throughput.summary,
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
        "channels_last": args.channels_last,
        "compile": args.compile,
        "fused_adamw": fused,
        "xformers": args.xformers,
        "pretrained_parts": components.pretrained,
        "random_parts": components.random,
        "flops_per_image_breakdown": flops,
        "final_loss": float(trainer.state.loss.item()) if isinstance(trainer.state.loss, torch.Tensor) else None,
        "loss_by_timestep_bin": loss_by_timestep.summary() if loss_by_timestep else [],
        "torch_version": torch.__version__,
    }
    trainer.close()
    if dist.get_global_rank() == 0:
        print_summary(results)
        if args.results_json:
            Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.results_json).write_text(json.dumps(results, indent=2) + "\n")
            print(f"results written to {args.results_json}")
    return results


def print_summary(r: dict) -> None:
    mfu = (f"{100 * r['mfu']:.1f}% of {r['peak_flops_per_device'] / 1e12:.0f} TFLOP/s peak per device" if r.get("mfu")
           else "n/a (unknown device peak; pass --peak_tflops)")
    print(
        "\n=== Stable Diffusion benchmark ===\n"
        f"model {r['model_config']} at {r['image_size']}x{r['image_size']}, {r['precision']}, "
        f"{r['world_size']} x {r['device']}, global batch {r['global_batch_size']}, "
        f"microbatch {r['device_train_microbatch_size']}\n"
        f"throughput   {r['images_per_sec']:.2f} images/s ({r['images_per_sec_per_device']:.2f} per device) "
        f"over {r['measured_batches']} batches after {r['warmup_batches']} warm-up\n"
        f"MFU          {mfu} at {r['flops_per_image'] / 1e9:.1f} GFLOP/image\n"
        f"data wait    {100 * r['data_wait_fraction']:.1f}% of step time\n"
        f"peak memory  {r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['peak_memory_kind']})\n"
        f"final loss   {r['final_loss']}\n",
        flush=True,
    )


if __name__ == "__main__":
    main()
