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
import math
import os
import re
import sys
import tarfile
import tempfile
import urllib.parse
import warnings
import zipfile
from pathlib import Path
from typing import NoReturn

import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver, SpeedMonitor
from composer.core import Callback, State, Time
from composer.loggers import Logger
from composer.loggers import WandBLogger
from composer.utils import dist, reproducibility

import data
from model import MODEL_CONFIGS, StableDiffusion, build_components, sd2_meta_components
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
                   help="local checkpoints to keep (-1: all; 0: none, only with an object-store --save_folder, "
                        "which keeps every upload)")
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
    # Errors (issue 10): user errors are one line; --debug shows the traceback as well.
    p.add_argument("--debug", action="store_true", help="on an error, also print the Python traceback")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Fail at once, with a one-line message naming the flag, on values that would fail later."""
    def fail(message: str) -> None:
        raise SystemExit(f"benchmark.py: error: {message}")

    check_locations(args)  # first: it turns file:// URIs into the paths the checks below look at
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
    if not args.use_synth_data and args.remote and not uri_scheme(args.remote) and not Path(args.remote, "index.json").is_file():
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
    if args.autoresume and not uri_scheme(args.save_folder) and Path(args.save_folder).is_dir():
        # Composer replaces `latest` by delete-then-link: a kill in between leaves checkpoints but no
        # `latest`, and autoresume would silently start over and overwrite them.
        saved = sorted(Path(args.save_folder).glob("ep*-ba*-rank0.pt"), key=lambda p: p.stat().st_mtime)
        if saved and not (Path(args.save_folder) / "latest-rank0.pt").exists():
            fail(f"--autoresume: {args.save_folder} holds checkpoints but no latest-rank0.pt; "
                 f"resume explicitly with --load_path {saved[-1]} (or move the old checkpoints away)")
    check_numbers(args)
    check_outputs(args)
    check_checkpoint(args)
    check_data(args)


# -----------------------------------------------------------------------------------------------
# Bad input (issue 10): what can be checked before the model, the data or the Trainer is built.
# Every check ends the run with one line that names the flag or file and says what to do.
# -----------------------------------------------------------------------------------------------

def fail(message: str) -> NoReturn:
    raise SystemExit(f"benchmark.py: error: {message}")


# Composer's object stores (checkpoints; Composer also fetches --load_path over http(s)).
CHECKPOINT_SCHEMES = ("s3", "gs", "oci", "azure", "dbfs")
# Time units the run counts: tokens are never counted here, and Composer refuses `dur` and
# wall-clock `sec` for max_duration and anything but ep/ba for the console log.
TIME_UNITS = {"max_duration": ("ba", "ep", "sp"), "save_interval": ("ba", "ep", "sp", "dur"),
              "log_interval": ("ba", "ep")}
# Written into a --remote's cache folder: the remote it holds (Streaming trusts any index.json there).
CACHE_RECORD = "remote.json"


def data_schemes() -> list[str]:
    """URI schemes Streaming can download --remote shards from (its own downloader table)."""
    from streaming.base.storage.download import DOWNLOADER_MAPPINGS
    return sorted(s for s in DOWNLOADER_MAPPINGS if s and s != "dbfs-uc")  # dbfs-uc is dbfs:/Volumes


def uri_scheme(location: str) -> str:
    """'s3' for s3://bucket/x, 'dbfs' for dbfs:/Volumes/x, '' for a local path."""
    if "://" in location:
        return location.split("://", 1)[0].lower()
    return "dbfs" if location.startswith("dbfs:/") else ""


def check_locations(args: argparse.Namespace) -> None:
    """file:// URIs become local paths; other URIs must use a scheme the flag supports."""
    supported = {"remote": data_schemes(), "save_folder": list(CHECKPOINT_SCHEMES),
                 "load_path": [*CHECKPOINT_SCHEMES, "http", "https"],
                 "local": [], "results_json": [], "ema_export_dir": []}
    for flag, schemes in supported.items():
        location = getattr(args, flag)
        if not location:
            continue
        scheme = uri_scheme(location)
        if scheme == "file":
            parsed = urllib.parse.urlparse(location)
            if parsed.netloc not in ("", "localhost"):
                fail(f"--{flag} {location}: a file:// URI names a path on this machine; write file:///path or the path")
            setattr(args, flag, urllib.parse.unquote(parsed.path))
        elif scheme and scheme not in schemes:
            if not schemes:
                fail(f"--{flag} takes a local path, not a URI ({location})")
            fail(f"--{flag} {location}: unsupported scheme '{scheme}://'; use a local path or one of "
                 + ", ".join("dbfs:/Volumes/" if s == "dbfs" else f"{s}://" for s in schemes))
        else:
            one_slash = re.match(r"([A-Za-z][\w+.-]*):/(?!/)", location)
            if one_slash and one_slash.group(1).lower() in [*schemes, "file"] and not scheme:
                fail(f"--{flag} {location} looks like a URI with one slash; write "
                     f"{one_slash.group(1)}://{location[one_slash.end():]}")


def check_numbers(args: argparse.Namespace) -> None:
    """Counts, rates and time strings: refuse values that hang, crash later or mean nothing."""
    if not 0 <= args.seed < 2**32:
        fail(f"--seed {args.seed} must be in 0..{2**32 - 1}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr {args.lr} must be a positive number, e.g. 1e-4")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        fail(f"--weight_decay {args.weight_decay} must be a number >= 0")
    if args.num_synthetic_samples <= 0:
        fail(f"--num_synthetic_samples {args.num_synthetic_samples} must be positive")
    if args.peak_tflops is not None and not math.isfinite(args.peak_tflops):
        fail(f"--peak_tflops {args.peak_tflops} must be a positive number (TFLOP/s of one device)")
    if args.predownload is not None and args.predownload < 1:
        fail(f"--predownload {args.predownload} must be >= 1 sample (leave it out for 8 x the per-device batch)")
    if args.download_retry < 0:
        fail(f"--download_retry {args.download_retry} must be >= 0")
    if not (math.isfinite(args.download_timeout) and args.download_timeout > 0):
        fail(f"--download_timeout {args.download_timeout} must be a positive number of seconds")
    if not 0 <= args.max_bad_fraction <= 1:
        fail(f"--max_bad_fraction {args.max_bad_fraction} must be a fraction between 0 and 1")
    if args.cache_limit is not None:
        from streaming.base.util import bytes_to_int
        try:
            limit = bytes_to_int(args.cache_limit)
        except ValueError:
            fail(f"--cache_limit '{args.cache_limit}' is not a size such as 500gb or 20mb")
        if limit <= 0:
            fail(f"--cache_limit '{args.cache_limit}' must be a positive size such as 500gb")
    if args.validate_hash is not None:
        from streaming.base.hashing import get_hashes
        if args.validate_hash not in get_hashes():
            fail(f"--validate_hash '{args.validate_hash}' is unknown; choose one of {sorted(get_hashes())} "
                 "(and one that index.json lists, as convert.py's sha1 and xxh64)")
    if args.save_num_checkpoints_to_keep < -1:
        fail(f"--save_num_checkpoints_to_keep {args.save_num_checkpoints_to_keep}: use -1 to keep all, or N >= 1")
    if args.save_num_checkpoints_to_keep == 0 and args.save_folder and not uri_scheme(args.save_folder):
        # Composer's 0 means "keep no local copy", which only makes sense when an object store keeps them.
        fail(f"--save_num_checkpoints_to_keep 0 keeps no checkpoint in the local --save_folder {args.save_folder}; "
             "use -1 to keep all, or N >= 1 to keep the newest N")
    for flag, units in TIME_UNITS.items():
        value = getattr(args, flag)
        time = Time.from_timestring(value)  # validate() has checked that it parses
        if time.unit.value not in units:
            fail(f"--{flag} {value}: unit '{time.unit.value}' is not counted here; use "
                 + " or ".join(units) + " (e.g. 20ba, 1ep)")
        if not time.value > 0 or (time.unit.value == "dur" and time.value > 1):
            fail(f"--{flag} {value} must be positive" + (" and at most 1dur" if time.unit.value == "dur" else ""))
        if flag == "max_duration" and time.unit.value == "sp" and time.value < args.batch_size:
            fail(f"--max_duration {value} is less than one global batch (--batch_size {args.batch_size}): "
                 "no step would run")
    if args.precision.startswith("amp_") and not torch.cuda.is_available():
        # Composer's CPU path runs amp_* steps in fp32 without saying so: the result would be mislabeled.
        fail(f"--precision {args.precision} needs a GPU (no CUDA device here); use fp32 or auto on CPU")


def unwritable(path: str, folder: bool) -> str | None:
    """Why `path` (a file, or a folder if `folder`) cannot be written, or None if it can.

    Probes by doing what the run will do, without leaving anything: a temporary file in the
    nearest existing folder, or opening an existing file for appending (which changes nothing).
    """
    target = Path(path).expanduser().absolute()
    if target.exists():
        if folder != target.is_dir():
            return f"is {'a file, not a folder' if folder else 'a folder, not a file'}"
        if not folder:
            try:
                with open(target, "a"):
                    pass
            except OSError as error:
                return f"cannot be written ({error.strerror})"
            return None
    parent = target if target.is_dir() else target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        return f"is not writable ({error.strerror})" if parent == target else \
            f"cannot be created in {parent} ({error.strerror})"
    return None


def check_outputs(args: argparse.Namespace) -> None:
    """Output locations are checked before training, not found unwritable after the last batch."""
    for flag, folder in (("results_json", False), ("ema_export_dir", True), ("save_folder", True)):
        location = getattr(args, flag)
        if location and not uri_scheme(location):
            why = unwritable(location, folder)
            if why:
                fail(f"--{flag} {location} {why}; choose a writable location")
    if args.save_folder and not uri_scheme(args.save_folder) and not (args.autoresume or args.load_path):
        # Composer refuses (at start) to save where a checkpoint of another run could be overwritten.
        saved = sorted(Path(args.save_folder).glob("ep*-ba*-rank*.pt"))
        if saved:
            fail(f"--save_folder {args.save_folder} holds checkpoints of an earlier run ({saved[0].name}...): "
                 "continue it with --autoresume --run_name NAME, start from one with --load_path, "
                 "or use a new --save_folder")


def check_checkpoint(args: argparse.Namespace) -> None:
    """A local --load_path must be a checkpoint file (Composer's: a torch zip archive, or compressed)."""
    if not args.load_path or uri_scheme(args.load_path):
        return
    path = Path(args.load_path)
    if not path.exists():
        fail(f"--load_path {path}: no such file; give a checkpoint written with --save_folder (e.g. latest-rank0.pt)")
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.pt"))[:3]
        fail(f"--load_path {path} is a folder; give a checkpoint file in it"
             + (f" (it holds {', '.join(found)})" if found else " (it holds no *.pt files)"))
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist()):
                return
    elif path.suffix in (".gz", ".bz2", ".xz", ".lz4", ".zst", ".lzma", ".tar") or tarfile.is_tarfile(path):
        return  # Composer's compressed and DeepSpeed checkpoints: Composer checks them when it loads
    fail(f"--load_path {path} is not a checkpoint (not a PyTorch checkpoint archive); "
         "give a file written with --save_folder, such as ep0-ba100-rank0.pt or latest-rank0.pt")


def read_index(index_file: Path, label: str) -> dict:
    """An MDS index.json, or a one-line error naming `label` (the flag and location)."""
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        fail(f"{label}: {index_file} is not a readable MDS index ({error}); re-create the dataset with convert.py")
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        fail(f"{label}: {index_file} is not an MDS index (no list of shards); re-create the dataset with convert.py")
    return index


def check_index(index: dict, label: str, args: argparse.Namespace) -> None:
    """Columns and size of an MDS dataset against the flags: the right kind of shards, enough samples."""
    shards = index["shards"]
    num_samples = sum(int(shard.get("samples", 0)) for shard in shards)
    columns = list(shards[0].get("column_names", [])) if shards else []
    if num_samples == 0:
        fail(f"{label} holds no samples; convert some data into it with convert.py")
    if args.precomputed and "latent_mean" not in columns:
        fail(f"--precomputed: {label} holds image shards (columns {columns}), not precomputed latents; "
             "drop --precomputed, or write latents from them with latents.py")
    if not args.precomputed and "latent_mean" in columns:
        fail(f"{label} holds precomputed latents (columns {columns}); add --precomputed to train from them")
    hashes = shards[0].get("hashes", []) if shards else []
    if args.validate_hash and args.validate_hash not in hashes:
        fail(f"--validate_hash {args.validate_hash}: the shards of {label} list no such hash (they have {hashes}); "
             + ("use one of them" if hashes else "leave the flag out"))
    if not args.precomputed:
        for flag in ("image_key", "caption_key"):
            if getattr(args, flag) not in columns:
                fail(f"--{flag} {getattr(args, flag)} is not a column of {label}; its columns are {columns}")
    check_dataset_size(num_samples, label, args)


def check_dataset_size(num_samples: int, label: str, args: argparse.Namespace) -> None:
    """Every rank drops its last partial batch: fewer samples than one global batch means no step at
    all (Composer then loops over empty epochs forever, or 'finishes' 1ep after 0 batches)."""
    if num_samples < args.batch_size:
        fail(f"{label} holds {num_samples} samples, fewer than one global batch (--batch_size {args.batch_size}): "
             f"no step could run; pass a --batch_size of at most {num_samples}, or use more data")


def cache_source(remote: str) -> str:
    """The form of a --remote recorded in its cache: absolute for paths, no trailing slash."""
    return remote.rstrip("/") if uri_scheme(remote) else os.path.abspath(remote)


def check_cache(local: str, remote: str) -> None:
    """Refuse a cache folder filled from another remote: Streaming would serve its samples silently."""
    record, index = Path(local, CACHE_RECORD), Path(local, "index.json")
    if record.is_file():
        try:
            cached = json.loads(record.read_text())["remote"]
        except (OSError, ValueError, KeyError, TypeError):
            cached = f"an unreadable {record}"
        if cached != cache_source(remote):
            fail(f"--local {local} is the cache of --remote {cached}, not {remote}: pass another --local "
                 "(or leave it out: the default cache is one folder per remote)")
    elif index.is_file():
        same = not uri_scheme(remote) and Path(remote, "index.json").is_file() \
            and Path(remote, "index.json").read_bytes() == index.read_bytes()
        # The default cache is named by a hash of the remote: an index there came from that remote.
        mine = os.path.abspath(local) in (cache_source(remote), os.path.abspath(default_local(remote)))
        if not same and not mine:
            fail(f"--local {local} already holds an MDS dataset that was not streamed from --remote {remote} "
                 f"(no {CACHE_RECORD}); Streaming would train on it instead: pass an empty or new --local")


def record_cache(local: str, remote: str) -> None:
    """Write the cache's remote (once per node, atomically: other ranks may be reading it)."""
    if os.path.abspath(local) == cache_source(remote) or dist.get_local_rank() != 0:
        return
    record = Path(local, CACHE_RECORD)
    if record.is_file():
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(f"{CACHE_RECORD}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"remote": cache_source(remote)}) + "\n")
    os.replace(partial, record)


def check_data(args: argparse.Namespace) -> None:
    """The dataset the flags name: it exists, is MDS, has the columns asked for and >= one global batch."""
    if args.use_synth_data and (args.remote or args.local):
        fail("--use_synth_data trains on random samples and would ignore " + ("--remote" if args.remote else "--local")
             + "; pass one or the other")
    if args.use_synth_data:
        check_dataset_size(args.num_synthetic_samples,
                           f"the synthetic dataset (--num_synthetic_samples {args.num_synthetic_samples})", args)
        return
    local = args.local or default_local(args.remote)
    if Path(local).exists() and not Path(local).is_dir():
        fail(f"--local {local} is a file, not a folder")
    if args.remote:
        check_cache(local, args.remote)
    elif Path(local, CACHE_RECORD).is_file():
        try:
            cached = json.loads(Path(local, CACHE_RECORD).read_text())["remote"]
        except (OSError, ValueError, KeyError, TypeError):
            cached = "that filled it"
        fail(f"--local {local} is the cache of --remote {cached}: pass --remote {cached} again "
             "(shards already cached are not downloaded again)")
    if Path(local, "index.json").is_file():  # Streaming reads the cached index rather than the remote's
        check_index(read_index(Path(local, "index.json"), local), f"--local {local}", args)
    elif not args.remote:
        fail(f"--local {local} holds no MDS dataset (no index.json): write one with convert.py, "
             "or pass --remote to stream one into it")
    elif not uri_scheme(args.remote):
        check_index(read_index(Path(args.remote, "index.json"), args.remote), f"--remote {args.remote}", args)
    else:
        # The index is small: fetch it with Streaming's own downloader to check it before anything
        # is built; credentials, endpoint and path errors surface here, as one line.
        from streaming.base.storage import CloudDownloader
        with tempfile.TemporaryDirectory() as folder:
            try:
                CloudDownloader.direct_download(f"{args.remote.rstrip('/')}/index.json", f"{folder}/index.json",
                                                args.download_timeout)
            except Exception as error:  # noqa: BLE001  any store's client error: reported, not hidden
                if getattr(args, "debug", False):
                    raise
                fail(f"--remote {args.remote}: cannot read index.json: {storage_error(error) or error}")
            check_index(read_index(Path(folder, "index.json"), args.remote), f"--remote {args.remote}", args)


def storage_error(error: BaseException) -> str | None:
    """One line for an object-store failure (credentials, endpoint, missing object), else None."""
    seen = error
    while seen is not None:
        module = type(seen).__module__
        if module.startswith(("botocore", "boto3", "google", "oci", "azure", "libcloud", "paramiko")):
            line = f"{type(seen).__name__}: {str(seen).splitlines()[0] if str(seen) else ''}"
            if type(seen).__name__ == "NoCredentialsError":
                line += " (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            elif type(seen).__name__ in ("EndpointConnectionError", "ConnectTimeoutError"):
                line += " (check S3_ENDPOINT_URL and the network)"
            return line
        seen = seen.__cause__ or seen.__context__
    return None


def user_error(error: BaseException) -> str | None:
    """One line for an exception caused by the input (data, storage, checkpoint), None for a bug."""
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    if isinstance(error, data.BadDataError):
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
            ema.export_unet(state.model, args.ema_export_dir)
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
    model = StableDiffusion(components.unet, components.vae, components.text_encoder, components.noise_scheduler)
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
    if args.remote and not args.use_synth_data:
        record_cache(args.local or default_local(args.remote), args.remote)
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
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    throughput = Throughput(args.warmup_batches, flops["total"], peak_flops)
    loggers = []
    if args.wandb_project or args.wandb_name:
        loggers.append(WandBLogger(project=args.wandb_project, name=args.wandb_name))
    algorithms = []
    if args.use_ema:
        from ema import EMA
        algorithms.append(EMA(half_life="1000ba", export_dir=args.ema_export_dir))

    trainer = Trainer(
        model=model,
        train_dataloader=train_dataloader,
        optimizers=optimizer,
        max_duration=args.max_duration,
        algorithms=algorithms,
        callbacks=[SpeedMonitor(window_size=10, gpu_flops_available=peak_flops), throughput,
                   StopOnNonFiniteLoss(args.load_path, args.save_folder), *(extra_callbacks or [])],
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
    trained_before = int(trainer.state.timestamp.batch)
    if not run_already_complete(trainer, args):
        trainer.fit()

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
        "final_loss": (float(trainer.state.loss.item())  # empty when nothing was trained (already complete)
                       if isinstance(trainer.state.loss, torch.Tensor) and trainer.state.loss.numel() == 1 else None),
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
    cli()
