"""Pre-flight checks of benchmark.py: everything that can be checked before the model, the data or
the Trainer is built, so that a mistake costs a second and one line, not a traceback after an hour.

Each check fails through `errors.fail` with the flag or file and what to do: dataset size against
the global batch (from the MDS index or the synthetic count), time-string units, counts and rates,
URI schemes, writable output locations, checkpoint files, the columns and kind of the shards,
caches filled from another remote, and object stores that cannot be read. `validate(args,
world_size)` runs them all, first thing in `benchmark.main`; it parses the data sources once into
`args.sources` (`sources.Source`), which the data loader then reads.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import torch
from composer.core import Time
from composer.utils import dist

from t2ibench import fp8
from t2ibench.checkpoints import resume_from, resume_point
from t2ibench.errors import fail, storage_error
from t2ibench.families import FAMILIES, ModelFamily, family_of
from t2ibench.images import GEOMETRY_KEYS
from t2ibench.cli import check_workers
from t2ibench.flags import check_shared
from t2ibench.parallel import resolve_mode
from t2ibench.mds import index_problem, shard_file
from t2ibench.locations import (CHECKPOINT_SCHEMES, LOAD_SCHEMES, check_output, check_outputs_apart, is_remote, normalise,
                                same_source_key)
from t2ibench.sources import Source, check_cache, parse_sources
from t2ibench.precision import PRECISION_CHOICES, resolve_precision
from t2ibench.weight_casts import weight_casts_problem

# Time units the run counts: tokens are never counted here, and Composer refuses `dur` and
# wall-clock `sec` for max_duration and anything but ep/ba for the console log.
TIME_UNITS = {"max_duration": ("ba", "ep", "sp"), "save_interval": ("ba", "ep", "sp", "dur"),
              "log_interval": ("ba", "ep")}


def validate(args: argparse.Namespace, world_size: int) -> ModelFamily:
    """Fail at once, with a one-line message naming the flag, on values that would fail later.

    Sets `args.sources` (the data sources, parsed and normalised once) and the other location
    flags to their normalised form (file:// URIs become paths); returns the model's family.
    """
    family = check_shared(args)
    check_locations(args)  # before the checks below: they look at the normalised locations
    check_run(args, world_size)
    check_parallelism(args, family, world_size)
    check_numbers(args)
    check_recipe(args, family)
    check_outputs(args)
    check_checkpoint(args)
    samples_per_epoch = check_data(args)
    check_evaluation(args)
    check_pretrained(args, family)
    check_run_length(args, samples_per_epoch)
    return family


def check_locations(args: argparse.Namespace) -> None:
    """file:// URIs become local paths; other URIs must use a scheme the flag supports."""
    supported = {"save_folder": CHECKPOINT_SCHEMES, "load_path": LOAD_SCHEMES, "results_json": (),
                 "ema_export_dir": (), "samples_dir": (), "profile_dir": ()}
    for flag, schemes in supported.items():
        if getattr(args, flag):
            setattr(args, flag, normalise(f"--{flag}", getattr(args, flag), schemes))
    args.sources = parse_sources(args.remote, args.local)
    args.eval_sources = parse_sources(args.eval_remote, args.eval_local)


def check_run(args: argparse.Namespace, world_size: int) -> None:
    """Precision, batch and microbatch against the world size, and flags that need other flags."""
    if args.precision not in PRECISION_CHOICES:
        fail(f"--precision '{args.precision}' is unknown; choose one of {PRECISION_CHOICES}")
    if args.precision == "amp_fp16" and not torch.cuda.is_available():
        # amp_bf16 runs on CPU under torch's CPU autocast (the model's); fp16 autocast has no CPU path here.
        fail(f"--precision {args.precision} needs a CUDA GPU (none here); on CPU use fp32, auto or amp_bf16 (CPU autocast)")
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
    if args.precomputed_format is not None and not (args.precomputed and args.use_synth_data):
        fail("--precomputed_format only applies with --precomputed --use_synth_data (shards carry their own format)")
    if args.xformers and importlib.util.find_spec("xformers") is None:
        fail("--xformers: xformers is not installed; on a GPU machine `pip install xformers==0.0.30`, or drop the flag")
    if args.ema_export_dir and not args.use_ema:
        fail("--ema_export_dir needs --use_ema")
    fp8.check(args.fp8, args.precision)
    too_many = check_workers("--num_workers", args.num_workers, dist.get_local_world_size())
    if too_many:
        fail(too_many)
    for flag in ("max_duration", "save_interval", "log_interval"):
        try:
            Time.from_timestring(getattr(args, flag))
        except (ValueError, TypeError):
            fail(f"--{flag} '{getattr(args, flag)}' is not a Composer time string such as 20ba, 1ep or 1000sp")
    if args.autoresume and not (args.save_folder and args.run_name):
        fail("--autoresume needs --save_folder and --run_name (the same on every restart) to find the latest checkpoint")
    if args.autoresume and not is_remote(args.save_folder) and Path(args.save_folder).is_dir():
        # Composer replaces `latest` by delete-then-link: a kill in between leaves checkpoints but no
        # `latest`, and autoresume would silently start over and overwrite them.
        saved = sorted(Path(args.save_folder).glob("ep*-ba*-rank0.pt"), key=lambda p: p.stat().st_mtime)
        if saved and not (Path(args.save_folder) / "latest-rank0.pt").exists():
            fail(f"--autoresume: {args.save_folder} holds checkpoints but no latest-rank0.pt; "
                 f"resume explicitly with --load_path {saved[-1]} (or move the old checkpoints away)")
        check_latest_checkpoint(args.save_folder)


def check_latest_checkpoint(save_folder: str) -> None:
    """--autoresume from a latest checkpoint that was cut short (a copy, a disk that filled up before
    checkpoints were written whole): resume from the newest complete one beside it, saying so."""
    found = resume_point(save_folder)
    if found is None:
        return
    latest, previous = found
    if previous is None:
        fail(f"--autoresume: the latest checkpoint {latest} is incomplete (cut short) and {save_folder} holds no "
             "complete one before it: move it away to start over, or restore it")
    if dist.get_global_rank() == 0:  # the other ranks read the folder once rank 0 has pointed it elsewhere
        kept = resume_from(latest, previous)
        print(f"note: --autoresume: the latest checkpoint {latest.name} is incomplete (cut short; kept as {kept.name}); "
              f"resuming from the newest complete one, {previous.name}", file=sys.stderr, flush=True)


def check_parallelism(args: argparse.Namespace, family: ModelFamily, world_size: int) -> None:
    """`--fsdp` resolved (auto: the family's default for this world size) and checked against the run."""
    args.fsdp = resolve_mode(args.fsdp, family.parallelism, world_size)
    if family.parallelism == "fsdp" and args.model_config == family.configs[0] and torch.cuda.is_available() \
            and args.fsdp == "none":
        # Fail in a second, not with an out-of-memory error after the model is built.
        fail(f"--model_config {args.model_config}: its training state (weights, gradients, AdamW moments: 16 bytes "
             "per parameter) fits no single GPU; launch several ranks (composer -n N benchmark.py ...), where "
             "--fsdp auto shards it (full_shard)")
    if args.fsdp != "none" and world_size == 1:
        fail(f"--fsdp {args.fsdp} shards the denoiser over the ranks and this run has one: drop the flag, or launch "
             "several ranks (composer -n N benchmark.py ...)")
    problem = weight_casts_problem(args.weight_casts, precision=resolve_precision(args.precision, torch.cuda.is_available()),
                                   world_size=world_size)
    if problem:
        fail(problem)
    if args.fsdp != "none" and args.channels_last:
        fail(f"--channels_last with --fsdp {args.fsdp}: torch 2.7's fully_shard refuses non-contiguous (channels-last) "
             "weights; drop one of the two")


def check_numbers(args: argparse.Namespace) -> None:
    """Counts, rates and time strings: refuse values that hang, crash later or mean nothing."""
    if args.epoch_size is not None:
        try:
            from streaming.base.util import number_abbrev_to_int
            epoch_samples = number_abbrev_to_int(args.epoch_size)
            if epoch_samples <= 0:
                raise ValueError
        except (ValueError, TypeError):
            fail(f"--epoch_size {args.epoch_size} must be a positive number of samples, such as 200000000 or 200m")
        if epoch_samples < args.batch_size:  # the data's own size is not checked then: this is the epoch
            fail(f"--epoch_size {args.epoch_size} is less than one global batch (--batch_size {args.batch_size}): "
                 f"no step could run; pass an --epoch_size of at least {args.batch_size}")
    for flag in ("shuffle_block_size", "num_canonical_nodes", "sampling_granularity"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            fail(f"--{flag} {getattr(args, flag)} must be positive")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        fail(f"--peak_tflops {args.peak_tflops} must be a positive number (TFLOP/s of one device)")
    if args.warmup_batches < 0:
        fail(f"--warmup_batches {args.warmup_batches} must be >= 0")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr {args.lr} must be a positive number, e.g. 1e-4")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        fail(f"--weight_decay {args.weight_decay} must be a number >= 0")
    if args.num_synthetic_samples <= 0:
        fail(f"--num_synthetic_samples {args.num_synthetic_samples} must be positive")
    if args.predownload is not None and args.predownload < 1:
        fail(f"--predownload {args.predownload} must be >= 1 sample (leave it out for 8 x the per-device batch)")
    if args.download_retry < 0:
        fail(f"--download_retry {args.download_retry} must be >= 0")
    if not (math.isfinite(args.download_timeout) and args.download_timeout > 0):
        fail(f"--download_timeout {args.download_timeout} must be a positive number of seconds")
    if args.validate_hash is not None:
        from streaming.base.hashing import get_hashes
        if args.validate_hash not in get_hashes():
            fail(f"--validate_hash '{args.validate_hash}' is unknown; choose one of {sorted(get_hashes())} "
                 "(and one that index.json lists, as convert.py's sha1 and xxh64)")
    if args.save_num_checkpoints_to_keep < -1:
        fail(f"--save_num_checkpoints_to_keep {args.save_num_checkpoints_to_keep}: use -1 to keep all, or N >= 1")
    if args.save_num_checkpoints_to_keep == 0 and args.save_folder and not is_remote(args.save_folder):
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
    if args.precision == "amp_fp16" and not torch.cuda.is_available():
        # amp_bf16 runs on CPU under torch's CPU autocast (see main); fp16 autocast has no CPU path here.
        fail(f"--precision {args.precision} needs a CUDA GPU (none here); on CPU use fp32, auto or amp_bf16 (CPU autocast)")


def run_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The local files and folders the run reads: no output may be, contain or lie inside them."""
    inputs = [("--remote", source.remote) for source in args.sources if source.remote and not is_remote(source.remote)]
    inputs += [("--local", args.local), ("--load_path", None if is_remote(args.load_path or "") else args.load_path)]
    inputs += [("--eval_remote", source.remote) for source in args.eval_sources
               if source.remote and not is_remote(source.remote)]
    inputs += [("--eval_local", args.eval_local)]
    if args.model_name and Path(args.model_name).is_dir():
        inputs.append(("--model_name", args.model_name))
    if getattr(args, "sample_prompts", None) and Path(args.sample_prompts).is_file():
        inputs.append(("--sample_prompts", args.sample_prompts))
    return inputs


def samples_folder(args: argparse.Namespace) -> str | None:
    """Where sample grids go: --samples_dir, or <--save_folder>/samples."""
    if not getattr(args, "sample_prompts", None):
        return None
    if args.samples_dir:
        return args.samples_dir
    return os.path.join(args.save_folder, "samples") if args.save_folder and not is_remote(args.save_folder) else None


def check_outputs(args: argparse.Namespace) -> None:
    """Every output is probed before training (locations.check_output): writable, of the right kind, apart
    from the inputs and from each other; not found unwritable after the last batch."""
    outputs = [("--results_json", args.results_json, "file"), ("--ema_export_dir", args.ema_export_dir, "exclusive"),
               ("--save_folder", args.save_folder, "folder"), ("--samples_dir", samples_folder(args), "folder"),
               ("--profile_dir", args.profile_dir if args.profile_batches else None, "folder")]
    inputs = run_inputs(args)
    for flag, location, kind in outputs:
        # Resuming reads a checkpoint of the --save_folder it writes to: Composer's own arrangement.
        read = [i for i in inputs if not (flag == "--save_folder" and i[0] == "--load_path")]
        why = check_output(flag, location, folder=kind != "file", inputs=read)
        if why:
            fail(why)
    why = check_outputs_apart(outputs)
    if why:
        fail(why)
    if args.save_folder and not is_remote(args.save_folder) and not (args.autoresume or args.load_path):
        # Composer refuses (at start) to save where a checkpoint of another run could be overwritten.
        saved = sorted(Path(args.save_folder).glob("ep*-ba*-rank*.pt"))
        if saved:
            fail(f"--save_folder {args.save_folder} holds checkpoints of an earlier run ({saved[0].name}...): "
                 "continue it with --autoresume --run_name NAME, start from one with --load_path, "
                 "or use a new --save_folder")


def check_pretrained(args: argparse.Namespace, family: ModelFamily) -> None:
    """Real images need the pretrained frozen encoders of a full-size model: refused in seconds when
    they cannot be had, before anything is built (benchmark.py refuses again if loading them fails)."""
    if args.use_synth_data or args.precomputed or args.model_config not in family.pretrained_configs \
            or args.allow_random_encoders:
        return
    from t2ibench.families.family import hub_reachable
    missing = family.pretrained_missing(args.model_name)
    if missing:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        why = ("HF_HUB_OFFLINE is set" if offline else
               "the hub could not be reached" if not Path(args.model_name).is_dir() and not hub_reachable() else
               "not in the folder")
        fail(f"pretrained {' and '.join(missing)} not found for --model_name {args.model_name} ({why}): training on "
             "real data needs them (download the model to a local folder and pass it), or pass "
             "--allow_random_encoders to measure throughput anyway")


def check_checkpoint(args: argparse.Namespace) -> None:
    """A local --load_path must be a checkpoint file (Composer's: a torch zip archive, or compressed)."""
    if not args.load_path or is_remote(args.load_path):
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
    problem = index_problem(index)  # fields of the wrong type: refused here, not deep in Streaming
    if problem:
        fail(f"{label}: {index_file} is not a usable MDS index: {problem}; re-create the dataset with convert.py")
    return index


def check_index(index: dict, label: str, args: argparse.Namespace) -> int:
    """Columns of an MDS dataset against the flags (the right kind of shards); returns its number of samples."""
    shards = index["shards"]
    num_samples = sum(shard["samples"] for shard in shards)  # read_index checked that they are counts
    columns = list(shards[0].get("column_names", [])) if shards else []
    if num_samples == 0:
        fail(f"{label} holds no samples; convert some data into it with convert.py")
    empty = [shard_file(shard) for shard in shards if shard["samples"] == 0]
    if empty:  # MDSWriter never writes one; Streaming would train around it, then blame the batch size
        fail(f"{label}: shard {empty[0]} holds no samples (index.json lists 0): the dataset is damaged; re-convert it")
    if args.precomputed and "latent_mean" not in columns:
        fail(f"--precomputed: {label} holds image shards (columns {columns}), not precomputed latents; "
             "drop --precomputed, or write latents from them with latents.py")
    if not args.precomputed and "latent_mean" in columns:
        fail(f"{label} holds precomputed latents (columns {columns}); add --precomputed to train from them")
    if args.precomputed:
        family = family_of(args.model_config)
        if not any(set(family.stored_text_columns(states)) <= set(columns) for states in (True, False)):
            others = [other.name for other in FAMILIES if other is not family and any(
                set(other.stored_text_columns(states)) <= set(columns) for states in (True, False))]
            fail(f"--precomputed: {label} holds " + (f"latents precomputed for {others[0]}" if others else
                 f"no text columns of {family.name}") + f" (columns {columns}), not for --model_config "
                 f"{args.model_config}; precompute them with latents.py --model_config {args.model_config}")
        missing = [key for key in GEOMETRY_KEYS if family.micro_conditioning and key not in columns]
        if missing:
            fail(f"--precomputed: {label} holds latents without {', '.join(missing)}, which --model_config "
                 f"{args.model_config} is conditioned on (precomputed for another model?); write them with "
                 f"latents.py --model_config {args.model_config}")
        for shard in shards:  # every shard: the parts of a merged index may differ
            problem = precomputed_shard_problem(shard, family, args.model_config, args.image_size)
            if problem:
                fail(f"--precomputed: {label}: shard {shard_file(shard)} {problem}")
    hashes = shards[0].get("hashes", []) if shards else []
    if args.validate_hash and args.validate_hash not in hashes:
        fail(f"--validate_hash {args.validate_hash}: the shards of {label} list no such hash (they have {hashes}); "
             + ("use one of them" if hashes else "leave the flag out"))
    if not args.precomputed:
        for flag in ("image_key", "caption_key"):
            if getattr(args, flag) not in columns:
                fail(f"--{flag} {getattr(args, flag)} is not a column of {label}; its columns are {columns}")
    return num_samples


def check_shard_files(folder: Path, index: dict, label: str, args: argparse.Namespace, every_shard: bool) -> None:
    """The shard files on this machine against index.json, before training: each present file has the
    size listed (a truncated copy is named here, not found by a loader thread mid-epoch), and with
    --validate_hash its hash. Streaming validates only what it downloads; files already here (local
    data, or a filled cache) it uses as they are, so they are read and hashed here, once. With
    `every_shard` (the data itself, not a cache) each shard must have its file."""
    from streaming.base.hashing import get_hash
    for shard in index["shards"]:
        infos = [info for info in (shard.get("raw_data"), shard.get("zip_data")) if isinstance(info, dict)]
        present = [(info, Path(folder, info["basename"])) for info in infos if Path(folder, info["basename"]).is_file()]
        if every_shard and infos and not present:
            fail(f"{label}: shard {infos[-1]['basename']} listed in index.json is missing; re-convert the dataset "
                 "(or copy it again)")
        for info, path in present:
            size = path.stat().st_size
            if isinstance(info.get("bytes"), int) and size != info["bytes"]:
                fail(f"{label}: shard {path} holds {size:,} bytes where index.json lists {info['bytes']:,}: it is "
                     "truncated or altered; re-convert the dataset, or delete the file to download it again")
            expected = (info.get("hashes") or {}).get(args.validate_hash) if args.validate_hash else None
            if expected and get_hash(args.validate_hash, path.read_bytes()) != expected:
                fail(f"--validate_hash {args.validate_hash}: shard {path} does not match its hash in index.json: it is "
                     "corrupted; re-convert the dataset, or delete the file to download it again")


# What a precomputed column may be stored as (latents.py: fp16 or fp32 arrays, uint16 token ids).
LATENT_DTYPES = ("float16", "float32")
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")


def precomputed_shard_problem(shard: dict, family: ModelFamily, config: str, image_size: int) -> str | None:
    """What makes one shard of precomputed latents unfit for this run (from its column encodings in
    index.json: no data read), or None: latents of another size or channel count, arrays without a
    fixed shape, float token ids, text columns of other shapes."""
    encodings = dict(zip(shard.get("column_names", []), shard.get("column_encodings", [])))
    fixed = "latents.py stores every array with a fixed shape (ndarray:float16:4,64,64): write them with latents.py"

    def array(key: str) -> tuple[str, tuple[int, ...] | None] | None:
        parts = encodings.get(key, "").split(":")
        if parts[0] != "ndarray" or len(parts) < 2:
            return None
        try:
            return parts[1], tuple(int(x) for x in parts[2].split(",")) if len(parts) == 3 else None
        except ValueError:
            return parts[1], None

    channels, side = family.latent_channels(config), image_size // family.latent_downsample
    for key in ("latent_mean", "latent_logvar"):
        found = array(key)
        if found is None or found[1] is None:
            return f"stores {key} as {encodings.get(key)!r}, without a fixed shape; {fixed}"
        dtype, shape = found
        if dtype not in LATENT_DTYPES or len(shape) != 3:
            return f"stores {key} as {encodings[key]!r}: latents are {' or '.join(LATENT_DTYPES)} arrays (C, H, W)"
        if shape[0] != channels:
            return (f"holds {shape[0]}-channel latents; the VAE of --model_config {config} makes {channels}: "
                    f"precompute them with latents.py --model_config {config}")
        if shape[1:] != (side, side):
            made = "x".join(str(n * family.latent_downsample) for n in shape[1:])
            return (f"holds latents of {made} images, not --image_size {image_size}: train at --image_size "
                    f"{shape[1] * family.latent_downsample}, or precompute at --image_size {image_size} with latents.py")
    states = all(key in encodings for key in family.stored_text_columns(True))
    expected = family.conditioning_shapes(config) if states else family.text_input_shapes(config)
    for key, shape in expected.items():
        column = key if states else family.token_columns.get(key, key)
        found = array(column)
        if found is None or found[1] is None:
            return f"stores {column} as {encodings.get(column)!r}, without a fixed shape; {fixed}"
        if tuple(found[1]) != tuple(shape):
            return (f"holds {column} of shape {found[1]}, but --model_config {config} takes {tuple(shape)}: computed for "
                    "another model or text encoder; precompute them with latents.py --model_config " + config)
        if not states and found[0] not in TOKEN_DTYPES:
            return f"stores the token ids {column} as {found[0]}, not integers; write them with latents.py"
    return None


def check_dataset_size(num_samples: int, label: str, args: argparse.Namespace) -> None:
    """Every rank drops its last partial batch: fewer samples than one global batch means no step at
    all (Composer then loops over empty epochs forever, or 'finishes' 1ep after 0 batches)."""
    if num_samples < args.batch_size:
        fail(f"{label} holds {num_samples} samples, fewer than one global batch (--batch_size {args.batch_size}): "
             f"no step could run; pass a --batch_size of at most {num_samples}, or use more data")


def check_data(args: argparse.Namespace) -> int:
    """The dataset the flags name: it exists, is MDS, has the columns asked for and >= one global batch.
    Returns the samples of one epoch."""
    if args.use_synth_data and args.sources:
        fail("--use_synth_data trains on random samples and would ignore " + ("--remote" if args.remote else "--local")
             + "; pass one or the other")
    if args.use_synth_data:
        check_dataset_size(args.num_synthetic_samples,
                           f"the synthetic dataset (--num_synthetic_samples {args.num_synthetic_samples})", args)
        return args.num_synthetic_samples
    if not args.sources:
        fail("no data: pass --use_synth_data, or --remote (with --local as cache), or --local with MDS shards "
             "already there")
    if not args.remote and not Path(args.sources[0].local).is_dir():
        fail(f"--local {args.local} is not a folder; give --remote to stream shards into it")
    for source in args.sources:
        if source.remote and not is_remote(source.remote) and not Path(source.remote, "index.json").is_file():
            fail(f"--remote {source.remote} holds no MDS dataset (no index.json); write one with convert.py first")
    num_samples = sum(check_source(source, args) for source in args.sources)
    if args.epoch_size is None:
        # With --epoch_size, Streaming draws that many samples whatever the sources hold.
        check_dataset_size(num_samples, " + ".join(source.label for source in args.sources), args)
        return num_samples
    from streaming.base.util import number_abbrev_to_int
    return number_abbrev_to_int(args.epoch_size)


def check_source(source: Source, args: argparse.Namespace) -> int:
    """One source's cache and index (see check_data); returns its number of samples."""
    local, remote = source.local, source.remote
    if Path(local).exists() and not Path(local).is_dir():
        fail(f"--local {local} is a file, not a folder")
    check_cache(source, timeout=args.download_timeout)
    if args.precomputed and (not remote or not is_remote(remote)):
        check_precompute_record(Path(remote or local, PRECOMPUTE_RECORD), args)
    if remote and not is_remote(remote) and Path(remote, "index.json").is_file():
        check_shard_files(Path(remote), read_index(Path(remote, "index.json"), remote), f"--remote {remote}", args,
                          every_shard=True)
    if Path(local, "index.json").is_file():  # Streaming reads the cached index rather than the remote's
        index = read_index(Path(local, "index.json"), local)
        samples = check_index(index, f"--local {local}", args)
        check_shard_files(Path(local), index, f"--local {local}", args, every_shard=not remote)
        return samples
    if not remote:
        fail(f"--local {local} holds no MDS dataset (no index.json): write one with convert.py, "
             "or pass --remote to stream one into it")
    if not is_remote(remote):
        return check_index(read_index(Path(remote, "index.json"), remote), f"--remote {remote}", args)
    # The index is small: fetch it with Streaming's own downloader to check it before anything
    # is built; credentials, endpoint and path errors surface here, as one line.
    from streaming.base.storage import CloudDownloader
    with tempfile.TemporaryDirectory() as folder:
        try:
            CloudDownloader.direct_download(f"{remote.rstrip('/')}/index.json", f"{folder}/index.json",
                                            args.download_timeout)
        except Exception as error:  # noqa: BLE001  any store's client error: reported, not hidden
            if getattr(args, "debug", False):
                raise
            fail(f"--remote {remote}: cannot read index.json: {storage_error(error) or error}")
        if args.precomputed:
            try:  # written by latents.py next to its index.json; latents from elsewhere have none
                CloudDownloader.direct_download(f"{remote.rstrip('/')}/{PRECOMPUTE_RECORD}",
                                                f"{folder}/{PRECOMPUTE_RECORD}", args.download_timeout)
            except Exception:  # noqa: BLE001  absent: nothing recorded to compare
                pass
            check_precompute_record(Path(folder, PRECOMPUTE_RECORD), args, f"{remote.rstrip('/')}/{PRECOMPUTE_RECORD}")
        return check_index(read_index(Path(folder, "index.json"), remote), f"--remote {remote}", args)


def check_evaluation(args: argparse.Namespace) -> None:
    """The validation-loss flags, and the held-out data they name (as check_data checks the training data)."""
    given = [flag for flag in ("eval_remote", "eval_local", "eval_samples", "eval_target") if getattr(args, flag) is not None]
    if not args.eval_interval:
        if given:
            fail(f"--{given[0]} needs --eval_interval (how often to compute the validation loss, e.g. 1000ba)")
        return
    try:
        unit = Time.from_timestring(args.eval_interval).unit.value
    except (ValueError, TypeError):
        unit = None
    if unit not in ("ba", "ep") or not Time.from_timestring(args.eval_interval).value > 0:
        fail(f"--eval_interval '{args.eval_interval}' must be a positive Composer time string in ba or ep (e.g. 1000ba)")
    if args.eval_samples is not None and args.eval_samples <= 0:
        fail(f"--eval_samples {args.eval_samples} must be positive")
    if args.eval_target is not None and not (math.isfinite(args.eval_target) and args.eval_target > 0):
        fail(f"--eval_target {args.eval_target} must be a positive loss, e.g. 0.586")
    if args.use_synth_data:
        if args.eval_sources:
            fail("--use_synth_data evaluates on synthetic held-out samples and would ignore --eval_remote/--eval_local; "
                 "pass one or the other")
        check_dataset_size(args.eval_samples or 256, f"the synthetic held-out set (--eval_samples {args.eval_samples or 256})",
                           args)
        return
    if not args.eval_sources:
        fail("--eval_interval needs held-out data: --eval_remote (with --eval_local as cache) or --eval_local with MDS "
             "shards in the training data's format")
    for source in args.eval_sources:
        if source.remote and not is_remote(source.remote) and not Path(source.remote, "index.json").is_file():
            fail(f"--eval_remote {source.remote} holds no MDS dataset (no index.json)")
        if not source.remote and not Path(source.local, "index.json").is_file():
            fail(f"--eval_local {source.local} holds no MDS dataset (no index.json); pass --eval_remote to stream one")
    num_samples = sum(check_source(source, args) for source in args.eval_sources)
    check_dataset_size(min(num_samples, args.eval_samples or num_samples),
                       "the held-out data (--eval_remote/--eval_local)", args)
# Written by latents.py next to the latents' index.json: the settings they were computed with.
PRECOMPUTE_RECORD = "precompute.json"


def check_precompute_record(record: Path, args: argparse.Namespace, name: str | None = None) -> None:
    """Compare what latents.py recorded in precompute.json with this run. A different --model_config or
    --image_size, or other pretrained encoders (--model_name), is refused: the latents were made by other
    encoders than the run uses. Random encoders (the tiny model, --allow_random_encoders) are rebuilt
    from the recorded seed, whatever --seed is (it still seeds the UNet, noise and data order): the run
    follows the record and sets `args.encoders_seed`."""
    name = name or str(record)
    if not record.is_file():
        return
    try:
        recorded = json.loads(record.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        fail(f"--precomputed: {name} is not readable ({error}); it records how the latents were computed: "
             "restore it, or compute the latents again with latents.py")
    for key, flag in (("model_config", "model_config"), ("image_size", "image_size")):
        if recorded.get(key) is not None and recorded[key] != getattr(args, flag):
            fail(f"--{flag} {getattr(args, flag)}: the latents were computed with --{flag} {recorded[key]} "
                 f"({name}); pass --{flag} {recorded[key]}, or compute latents for this setting with latents.py")
    made_with = recorded.get("model_name")
    if made_with and same_source_key(made_with) != same_source_key(args.model_name) \
            and not Path(args.model_name).is_dir():
        fail(f"--model_name {args.model_name}: the latents were computed with --model_name {made_with} ({name}); "
             f"pass --model_name {made_with} (or a local folder holding that model)")
    seed = recorded.get("seed") if recorded.get("random_encoders") else None
    if seed is not None:
        previous = getattr(args, "encoders_seed", None)
        if previous is not None and previous != seed:
            fail(f"--remote: the sources were precomputed with random encoders of different seeds ({previous} and "
                 f"{seed}, {name}): no one set of encoders fits both; precompute them with the same --seed")
        args.encoders_seed = seed


def check_recipe(args: argparse.Namespace, family: ModelFamily) -> None:
    """The training-recipe, sampling and export flags; flags the model family does not take are refused by name."""
    for flag, why in family.refused_flags.items():
        value = getattr(args, flag)
        if value not in (None, False, 0, 0.0):
            fail(f"--{flag} does not apply to --model_config {args.model_config}: {why}")
    if args.timestep_sampling not in family.timestep_samplings:
        fail(f"--timestep_sampling {args.timestep_sampling} does not apply to --model_config {args.model_config}; "
             f"it trains with {', '.join(family.timestep_samplings)}")
    if args.sampler is None:
        args.sampler = next(iter(family.samplers))
    elif args.sampler not in family.samplers:
        fail(f"--sampler {args.sampler} does not sample --model_config {args.model_config}; choose "
             f"{' or '.join(family.samplers)}")
    if args.precomputed and args.use_synth_data and args.precomputed_format is None:
        args.precomputed_format = family.default_precomputed_format
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
    ema_start = Time.from_timestring(args.ema_start)
    if ema_start.value < 0 or (ema_start.unit.value == "dur" and ema_start.value > 1):
        fail(f"--ema_start {args.ema_start} must be >= 0" + (" and at most 1dur" if ema_start.unit.value == "dur" else ""))
    if Time.from_timestring(args.sample_interval).value <= 0:
        fail(f"--sample_interval {args.sample_interval} must be positive, e.g. 1000ba")
    if (args.ema_start != "0ba" or args.ema_half_life != "1000ba") and not args.use_ema:
        fail("--ema_start and --ema_half_life need --use_ema")
    if Time.from_timestring(args.ema_half_life).value <= 0:
        fail(f"--ema_half_life {args.ema_half_life} must be positive")
    if args.sample_prompts:
        from t2ibench.sampling import load_prompts
        try:
            load_prompts(args.sample_prompts)
        except ValueError as e:
            fail(f"--sample_prompts {e}")
        if not args.samples_dir and not args.save_folder:
            fail("--sample_prompts needs --samples_dir or --save_folder (samples go to <save_folder>/samples)")
        if not args.samples_dir and is_remote(args.save_folder):
            fail(f"--sample_prompts: --save_folder {args.save_folder} is an object store; give a local --samples_dir")
        if args.sample_steps <= 0:
            fail(f"--sample_steps {args.sample_steps} must be positive")
    if args.samples_dir and not args.sample_prompts:
        fail("--samples_dir needs --sample_prompts (a prompt file or a built-in set: default, shapes)")
    if args.ema_export_dir and Path(args.ema_export_dir).is_dir() and any(Path(args.ema_export_dir).iterdir()):
        entries = {p.name for p in Path(args.ema_export_dir).iterdir()}
        # A resumed or retried job finds the pipeline it exported before: that one it may rewrite.
        own_export = entries <= {"model_index.json", *family.pipeline_parts} and (args.autoresume or args.load_path)
        if not own_export:
            fail(f"--ema_export_dir {args.ema_export_dir} is not empty; choose a new folder (nothing is overwritten)")


def run_batches(args: argparse.Namespace, samples_per_epoch: int) -> int:
    """Batches the whole run trains, from --max_duration (every rank drops its last partial batch)."""
    duration = Time.from_timestring(args.max_duration)
    if duration.unit.value == "ba":
        return int(duration.value)
    if duration.unit.value == "sp":
        return math.ceil(duration.value / args.batch_size)
    return int(duration.value) * (samples_per_epoch // args.batch_size)


def check_run_length(args: argparse.Namespace, samples_per_epoch: int) -> None:
    """Flags that must fall within the run: a learning-rate warm-up that ends before the run does,
    and an EMA that starts in time for --ema_export_dir to get something."""
    total = run_batches(args, samples_per_epoch)
    length = f"--max_duration {args.max_duration} is {total} batch{'es' if total != 1 else ''}"
    if args.lr_warmup_batches > total or (args.lr_schedule == "cosine" and args.lr_warmup_batches and
                                          args.lr_warmup_batches >= total):
        fail(f"--lr_warmup_batches {args.lr_warmup_batches} does not end before the run does ({length}): the "
             "learning rate would never reach --lr" + (" or decay" if args.lr_schedule == "cosine" else "")
             + "; shorten the warm-up or lengthen the run")
    if args.profile_batches and args.warmup_batches + args.profile_batches >= total:
        fail(f"--profile_batches {args.profile_batches} after --warmup_batches {args.warmup_batches} leaves no batch "
             f"to measure ({length}); profile fewer batches or lengthen the run")
    if args.use_ema and args.ema_export_dir:
        start = Time.from_timestring(args.ema_start)
        # The average starts at the first batch end at or after --ema_start; epochs count up after
        # their last batch, so Nep starts with the first batch of epoch N + 1.
        first = {"ba": max(1, int(start.value)), "ep": int(start.value) * (samples_per_epoch // args.batch_size) + 1,
                 "dur": max(1, math.ceil(start.value * total))}[start.unit.value]
        if first > total:
            fail(f"--ema_start {args.ema_start} starts the average after the run ends ({length}): --ema_export_dir "
                 "would get nothing; start it earlier (e.g. 0.5dur) or lengthen the run")
