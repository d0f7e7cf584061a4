"""benchmark.py's checks of its flags, before anything is built: `validate` turns the parsed flags
into the run's `Settings` or stops with one line naming the flag and what to do. The data the flags
name is checked by `t2ibench.commands.data_checks`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import sys
import tarfile
import zipfile
from pathlib import Path

import torch
from composer.core import Time
from composer.utils import dist

from t2ibench.train import cpu_threads, fp8
from t2ibench.commands import flags
from t2ibench.datasets.buckets import EXPORT_FILE, UNIFORM, Bucket, parse_size, resolve_buckets, synthetic_weights
from t2ibench.callbacks.profile import profile_fits
from t2ibench.train.checkpoints import LATEST, gone_latest, resume_from, resume_point
from t2ibench.core.cli import check_workers, parse_number
from t2ibench.commands.data_checks import check_data, check_evaluation
from t2ibench.core.errors import fail
from t2ibench.eval.eval_curve import curve_path
from t2ibench.core.files import killed_writer_leftovers
from t2ibench.commands.flags import shared_values
from t2ibench.core.locations import (CHECKPOINT_SCHEMES, LOAD_SCHEMES, check_output, check_outputs_apart, file_problem,
                                is_remote, normalise)
from t2ibench.train.parallel import resolve_mode
from t2ibench.train.precision import PRECISION_CHOICES, resolve_precision
from t2ibench.datasets.precomputed import default_format
from t2ibench.train.settings import Settings
from t2ibench.datasets.sources import parse_sources
from t2ibench.train.weight_casts import resolve_weight_casts, weight_casts_problem

# Time units the run counts: tokens are never counted here, and Composer refuses `dur` and
# wall-clock `sec` for max_duration and anything but ep/ba for the console log.
TIME_UNITS = {"max_duration": ("ba", "ep", "sp"), "save_interval": ("ba", "ep", "sp", "dur"),
              "log_interval": ("ba", "ep")}
# The location flags and the URI schemes each takes besides a local path (file:// is read as one).
LOCATION_SCHEMES = {"save_folder": CHECKPOINT_SCHEMES, "load_path": LOAD_SCHEMES, "results_json": (),
                    "ema_export_dir": (), "samples_dir": (), "profile_dir": ()}


MLPERF_LOG_SUFFIX = ".mlperf.log"  # the MLPerf log beside a results JSON, NAME.json: NAME.mlperf.log


def validate(args: argparse.Namespace, world_size: int) -> Settings:
    """The run's settings from the parsed flags, or one line naming the flag on a value that would
    fail later. The checks run in this order, each on the settings resolved before it."""
    settings = resolve(args)
    settings = dataclasses.replace(settings, device_train_microbatch_size=check_run(settings, world_size))
    settings = dataclasses.replace(settings, fsdp=check_parallelism(settings, world_size))
    check_numbers(settings)
    sampler, precomputed_format = check_recipe(settings)
    buckets, bucket_weights = check_buckets(settings)
    settings = dataclasses.replace(settings, sampler=sampler, precomputed_format=precomputed_format,
                                   buckets=buckets, bucket_weights=bucket_weights)
    settings = dataclasses.replace(settings, sample_shape=check_sample_size(settings))
    check_flags_that_act(args, settings)
    check_outputs(settings)
    check_checkpoint(settings)
    samples_per_epoch, recorded_seed = check_data(settings)
    recorded_seed = check_evaluation(settings, recorded_seed)
    check_pretrained(settings)
    check_run_length(settings, samples_per_epoch)
    return settings if recorded_seed is None else dataclasses.replace(settings, encoders_seed=recorded_seed)


def resolve(args: argparse.Namespace) -> Settings:
    """The flags as settings, before the checks: the family's defaults for --model_name and --image_size,
    locations normalised (file:// URIs become paths; other URIs must use a scheme the flag supports),
    the data sources parsed; the shared groups checked (flags.shared_values). bench/blocks.py builds
    its loader from this alone."""
    family, model_name, image_size = shared_values(args)
    locations = {flag: normalise(f"--{flag}", getattr(args, flag), schemes)
                 for flag, schemes in LOCATION_SCHEMES.items() if getattr(args, flag)}
    return Settings.from_args(args, **locations, family=family, model_name=model_name, image_size=image_size,
                              sources=tuple(parse_sources(args.remote, args.local)),
                              eval_sources=tuple(parse_sources(args.eval_remote, args.eval_local)),
                              encoders_seed=args.seed, buckets=(), bucket_weights=(),
                              sample_shape=Bucket(image_size, image_size),
                              mlperf_log=mlperf_log_path(args, locations.get("results_json")))


def mlperf_log_path(args: argparse.Namespace, results_json: str | None) -> str | None:
    """Where the MLPerf log goes: --mlperf_log, else beside the results JSON (NAME.json: NAME.mlperf.log)
    when the run evaluates; None for `off` or a run with neither."""
    if args.mlperf_log == "off":
        return None
    if args.mlperf_log is not None:
        if not args.eval_interval:
            fail(f"--mlperf_log {args.mlperf_log} needs --eval_interval: MLPerf's log is of a run that evaluates")
        return normalise("--mlperf_log", args.mlperf_log, ())
    if results_json and args.eval_interval:
        return str(Path(results_json).with_suffix("")) + MLPERF_LOG_SUFFIX
    return None


def check_run(settings: Settings, world_size: int) -> int | str:
    """Precision, batch and microbatch against the world size, and flags that need other flags;
    returns the microbatch: images per device, or "auto"."""
    if settings.precision not in PRECISION_CHOICES:
        fail(f"--precision '{settings.precision}' is unknown; choose one of {PRECISION_CHOICES}")
    if settings.precision == "amp_fp16" and not torch.cuda.is_available():
        # amp_bf16 runs on CPU under torch's CPU autocast (the model's); fp16 autocast has no CPU path here.
        fail(f"--precision {settings.precision} needs a CUDA GPU (none here); on CPU use fp32, auto or amp_bf16 "
             "(CPU autocast)")
    if settings.batch_size <= 0 or settings.batch_size % world_size:
        fail(f"--batch_size {settings.batch_size} must be a positive multiple of the world size {world_size}")
    per_device = settings.batch_size // world_size
    microbatch = settings.device_train_microbatch_size
    if microbatch != "auto":
        microbatch = micro = parse_number(settings.device_train_microbatch_size, int)
        if micro is None:
            fail(f"--device_train_microbatch_size '{settings.device_train_microbatch_size}' must be an integer or 'auto'")
        if micro <= 0 or per_device % micro:
            fail(f"--batch_size {settings.batch_size} over {world_size} device(s) gives {per_device} per device, "
                 f"which --device_train_microbatch_size {micro} does not divide")
    if settings.precomputed_format is not None and not (settings.precomputed and settings.use_synth_data):
        fail("--precomputed_format only applies with --precomputed --use_synth_data (shards carry their own format)")
    if settings.xformers and importlib.util.find_spec("xformers") is None:
        fail("--xformers: xformers is not installed; on a GPU machine `pip install xformers==0.0.30`, or drop the flag")
    if settings.ema_export_dir and not settings.use_ema:
        fail("--ema_export_dir needs --use_ema")
    fp8.check(settings.fp8, settings.precision)
    too_many = check_workers("--num_workers", settings.num_workers, dist.get_local_world_size())
    if too_many:
        fail(too_many)
    threads_problem = cpu_threads.flag_problem(settings.cpu_threads, torch.cuda.is_available())
    if threads_problem:
        fail(threads_problem)
    for flag in ("max_duration", "save_interval", "log_interval"):
        try:
            Time.from_timestring(getattr(settings, flag))
        except (ValueError, TypeError):
            fail(f"--{flag} '{getattr(settings, flag)}' is not a Composer time string such as 20ba, 1ep or 1000sp")
    if settings.autoresume and not (settings.save_folder and settings.run_name):
        fail("--autoresume needs --save_folder and --run_name (the same on every restart) to find the latest checkpoint")
    if settings.autoresume and not is_remote(settings.save_folder) and Path(settings.save_folder).is_dir():
        gone = gone_latest(settings.save_folder)
        if gone is not None:
            fail(f"--autoresume: {Path(settings.save_folder, LATEST)} points at {gone}, which is gone (moved or "
                 "deleted), and the run would start over from batch 0: put that checkpoint back, or delete the link "
                 "to start over")
        # Composer replaces `latest` by delete-then-link: a kill in between leaves checkpoints but no
        # `latest`, and autoresume would silently start over and overwrite them.
        saved = sorted(Path(settings.save_folder).glob("ep*-ba*-rank0.pt"), key=lambda p: p.stat().st_mtime)
        if saved and not Path(settings.save_folder, LATEST).exists():
            fail(f"--autoresume: {settings.save_folder} holds checkpoints but no latest-rank0.pt; "
                 f"resume explicitly with --load_path {saved[-1]} (or move the old checkpoints away)")
        check_latest_checkpoint(settings.save_folder)
    return microbatch


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


def check_parallelism(settings: Settings, world_size: int) -> str:
    """`--fsdp` resolved (auto: the family's default for this world size) and checked against the run,
    with what depends on it (the weight casts, float8's need of --compile and of bf16 weights);
    returns the mode the run applies."""
    family = settings.family
    fsdp = resolve_mode(settings.fsdp, family.parallelism, world_size)
    if family.parallelism == "fsdp" and settings.model_config == family.configs[0] and torch.cuda.is_available() \
            and fsdp == "none":
        # Fail in a second, not with an out-of-memory error after the model is built.
        fail(f"--model_config {settings.model_config}: its training state (weights, gradients, AdamW moments: 16 bytes "
             "per parameter) fits no single GPU; launch several ranks (composer -n N benchmark.py ...), where "
             "--fsdp auto shards it (full_shard)")
    if fsdp != "none" and world_size == 1:
        fail(f"--fsdp {fsdp} shards the denoiser over the ranks and this run has one: drop the flag, or launch "
             "several ranks (composer -n N benchmark.py ...)")
    precision = resolve_precision(settings.precision, torch.cuda.is_available())
    problem = weight_casts_problem(settings.weight_casts, precision=precision, world_size=world_size)
    if problem:
        fail(problem)
    weight_casts = resolve_weight_casts(settings.weight_casts, on_gpu=torch.cuda.is_available(), precision=precision,
                                        world_size=world_size)
    fp8.check_compiled(settings.fp8, settings.compile, fp32_weights_under_autocast=precision != "fp32"
                       and weight_casts == "microbatch" and fsdp == "none",
                       sharded_under_autocast=precision != "fp32" and fsdp != "none")
    if fsdp != "none" and settings.channels_last:
        fail(f"--channels_last with --fsdp {fsdp}: torch 2.7's fully_shard refuses non-contiguous (channels-last) "
             "weights; drop one of the two")
    return fsdp


def check_numbers(settings: Settings) -> None:
    """Counts, rates and time strings: refuse values that hang, crash later or mean nothing."""
    if settings.epoch_size is not None:
        try:
            from streaming.base.util import number_abbrev_to_int
            epoch_samples = number_abbrev_to_int(settings.epoch_size)
            if epoch_samples <= 0:
                raise ValueError
        except (ValueError, TypeError):
            fail(f"--epoch_size {settings.epoch_size} must be a positive number of samples, such as 200000000 or 200m")
        if epoch_samples < settings.batch_size:  # the data's own size is not checked then: this is the epoch
            fail(f"--epoch_size {settings.epoch_size} is less than one global batch (--batch_size {settings.batch_size}): "
                 f"no step could run; pass an --epoch_size of at least {settings.batch_size}")
    for flag in ("shuffle_block_size", "num_canonical_nodes", "sampling_granularity"):
        if getattr(settings, flag) is not None and getattr(settings, flag) <= 0:
            fail(f"--{flag} {getattr(settings, flag)} must be positive")
    if settings.peak_tflops is not None and not (math.isfinite(settings.peak_tflops) and settings.peak_tflops > 0):
        fail(f"--peak_tflops {settings.peak_tflops} must be a positive number (TFLOP/s of one device)")
    if settings.warmup_batches < 0:
        fail(f"--warmup_batches {settings.warmup_batches} must be >= 0")
    if not (math.isfinite(settings.lr) and settings.lr > 0):
        fail(f"--lr {settings.lr} must be a positive number, e.g. 1e-4")
    if not (math.isfinite(settings.weight_decay) and settings.weight_decay >= 0):
        fail(f"--weight_decay {settings.weight_decay} must be a number >= 0")
    if settings.num_synthetic_samples <= 0:
        fail(f"--num_synthetic_samples {settings.num_synthetic_samples} must be positive")
    if settings.predownload is not None and settings.predownload < 1:
        fail(f"--predownload {settings.predownload} must be >= 1 sample (leave it out for 8 x the per-device batch)")
    if settings.download_retry < 0:
        fail(f"--download_retry {settings.download_retry} must be >= 0")
    if not (math.isfinite(settings.download_timeout) and settings.download_timeout > 0):
        fail(f"--download_timeout {settings.download_timeout} must be a positive number of seconds")
    if settings.validate_hash is not None:
        from streaming.base.hashing import get_hashes
        if settings.validate_hash not in get_hashes():
            fail(f"--validate_hash '{settings.validate_hash}' is unknown; choose one of {sorted(get_hashes())} "
                 "(and one that index.json lists, as convert.py's sha1 and xxh64)")
    if settings.save_num_checkpoints_to_keep < -1:
        fail(f"--save_num_checkpoints_to_keep {settings.save_num_checkpoints_to_keep}: use -1 to keep all, or N >= 1")
    if settings.save_num_checkpoints_to_keep == 0 and settings.save_folder and not is_remote(settings.save_folder):
        # Composer's 0 means "keep no local copy", which only makes sense when an object store keeps them.
        fail(f"--save_num_checkpoints_to_keep 0 keeps no checkpoint in the local --save_folder {settings.save_folder}; "
             "use -1 to keep all, or N >= 1 to keep the newest N")
    for flag, units in TIME_UNITS.items():
        value = getattr(settings, flag)
        time = Time.from_timestring(value)  # validate() has checked that it parses
        if time.unit.value not in units:
            fail(f"--{flag} {value}: unit '{time.unit.value}' is not counted here; use "
                 + " or ".join(units) + " (e.g. 20ba, 1ep)")
        if not time.value > 0 or (time.unit.value == "dur" and time.value > 1):
            fail(f"--{flag} {value} must be positive" + (" and at most 1dur" if time.unit.value == "dur" else ""))
        if flag == "max_duration" and time.unit.value == "sp" and time.value < settings.batch_size:
            fail(f"--max_duration {value} is less than one global batch (--batch_size {settings.batch_size}): "
                 "no step would run")


def run_inputs(settings: Settings) -> list[tuple[str, str | None]]:
    """The local files and folders the run reads: no output may be, contain or lie inside them."""
    inputs = [("--remote", source.remote) for source in settings.sources if source.remote and not is_remote(source.remote)]
    load_path = None if is_remote(settings.load_path or "") else settings.load_path
    inputs += [("--local", settings.local), ("--load_path", load_path)]
    inputs += [("--eval_remote", source.remote) for source in settings.eval_sources
               if source.remote and not is_remote(source.remote)]
    inputs += [("--eval_local", settings.eval_local)]
    if settings.model_name and Path(settings.model_name).is_dir():
        inputs.append(("--model_name", settings.model_name))
    if settings.sample_prompts and Path(settings.sample_prompts).is_file():
        inputs.append(("--sample_prompts", settings.sample_prompts))
    return inputs


def samples_folder(settings: Settings) -> str | None:
    """Where sample grids go: --samples_dir, or <--save_folder>/samples."""
    if not settings.sample_prompts:
        return None
    if settings.samples_dir:
        return settings.samples_dir
    if settings.save_folder and not is_remote(settings.save_folder):
        return os.path.join(settings.save_folder, "samples")
    return None


def check_outputs(settings: Settings) -> None:
    """Every output is probed before training (locations.check_output): writable, of the right kind, apart
    from the inputs and from each other; not found unwritable after the last batch."""
    # The validation curve's picture beside the results JSON (t2ibench.eval.eval_curve), written after it.
    curve = curve_path(settings.results_json) if settings.results_json and settings.eval_interval else None
    outputs = [("--results_json", settings.results_json, "file"), ("--results_json's validation curve", curve, "file"),
               ("--mlperf_log", settings.mlperf_log, "file"),
               ("--ema_export_dir", settings.ema_export_dir, "exclusive"),
               ("--save_folder", settings.save_folder, "folder"), ("--samples_dir", samples_folder(settings), "folder"),
               ("--profile_dir", settings.profile_dir if settings.profile_batches else None, "folder")]
    inputs = run_inputs(settings)
    for flag, location, kind in outputs:
        # Resuming reads a checkpoint of the --save_folder it writes to: Composer's own arrangement.
        read = [i for i in inputs if not (flag == "--save_folder" and i[0] == "--load_path")]
        why = check_output(flag, location, folder=kind != "file", inputs=read)
        if why:
            fail(why)
    why = check_outputs_apart(outputs)
    if why:
        fail(why)
    if settings.save_folder and not is_remote(settings.save_folder) and not (settings.autoresume or settings.load_path):
        # Composer refuses (at start) to save where a checkpoint of another run could be overwritten.
        saved = sorted(Path(settings.save_folder).glob("ep*-ba*-rank*.pt"))
        if saved:
            fail(f"--save_folder {settings.save_folder} holds checkpoints of an earlier run ({saved[0].name}...): "
                 "continue it with --autoresume --run_name NAME, start from one with --load_path, "
                 "or use a new --save_folder")


def check_pretrained(settings: Settings) -> None:
    """Real images need the pretrained frozen encoders of a full-size model: refused in seconds when
    they cannot be had, before anything is built (benchmark.py refuses again if loading them fails)."""
    family = settings.family
    if settings.use_synth_data or settings.precomputed or settings.model_config not in family.pretrained_configs \
            or settings.allow_random_encoders:
        return
    from t2ibench.families.family import hub_reachable
    missing = family.pretrained_missing(settings.model_name)
    if missing:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        why = ("HF_HUB_OFFLINE is set" if offline else
               "the hub could not be reached" if not Path(settings.model_name).is_dir() and not hub_reachable() else
               "not in the folder")
        fail(f"pretrained {' and '.join(missing)} not found for --model_name {settings.model_name} ({why}): training on "
             "real data needs them (download the model to a local folder and pass it), or pass "
             "--allow_random_encoders to measure throughput anyway")


def check_checkpoint(settings: Settings) -> None:
    """A local --load_path must be a checkpoint file (Composer's: a torch zip archive, or compressed)."""
    if not settings.load_path or is_remote(settings.load_path):
        return
    path = Path(settings.load_path)
    if not path.exists():
        fail(f"--load_path {path}: no such file; give a checkpoint written with --save_folder (e.g. latest-rank0.pt)")
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.pt"))[:3]
        fail(f"--load_path {path} is a folder; give a checkpoint file in it"
             + (f" (it holds {', '.join(found)})" if found else " (it holds no *.pt files)"))
    problem = file_problem(f"--load_path {path}", path)  # a FIFO or a device: read by nothing below
    if problem:
        fail(f"{problem}; give a checkpoint written with --save_folder")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist()):
                return
    elif path.suffix in (".gz", ".bz2", ".xz", ".lz4", ".zst", ".lzma", ".tar") or tarfile.is_tarfile(path):
        return  # Composer's compressed and DeepSpeed checkpoints: Composer checks them when it loads
    fail(f"--load_path {path} is not a checkpoint (not a PyTorch checkpoint archive); "
         "give a file written with --save_folder, such as ep0-ba100-rank0.pt or latest-rank0.pt")


def check_recipe(settings: Settings) -> tuple[str, str | None]:
    """The training-recipe, sampling and export flags; flags the model family does not take are refused by name.
    Returns the sampler and the format of synthetic precomputed batches, with the family's defaults."""
    family = settings.family
    for flag, why in family.refused_flags.items():
        value = getattr(settings, flag)
        if value not in (None, False, 0, 0.0):
            fail(f"--{flag} does not apply to --model_config {settings.model_config}: {why}")
    if settings.timestep_sampling not in family.timestep_samplings:
        fail(f"--timestep_sampling {settings.timestep_sampling} does not apply to --model_config {settings.model_config}; "
             f"it trains with {', '.join(family.timestep_samplings)}")
    sampler = next(iter(family.samplers)) if settings.sampler is None else settings.sampler
    if sampler not in family.samplers:
        fail(f"--sampler {settings.sampler} does not sample --model_config {settings.model_config}; choose "
             f"{' or '.join(family.samplers)}")
    precomputed_format = settings.precomputed_format
    if settings.precomputed and settings.use_synth_data and precomputed_format is None:
        precomputed_format = default_format(family)
    if settings.lr_warmup_batches < 0:
        fail(f"--lr_warmup_batches {settings.lr_warmup_batches} must be >= 0")
    if settings.grad_clip_norm is not None and settings.grad_clip_norm <= 0:
        fail(f"--grad_clip_norm {settings.grad_clip_norm} must be positive")
    if not 0.0 <= settings.caption_drop_prob < 1.0:
        fail(f"--caption_drop_prob {settings.caption_drop_prob} must be in [0, 1)")
    if settings.snr_gamma is not None and settings.snr_gamma <= 0:
        fail(f"--snr_gamma {settings.snr_gamma} must be positive")
    if settings.offset_noise < 0:
        fail(f"--offset_noise {settings.offset_noise} must be >= 0")
    if settings.loss_bins < 0:
        fail(f"--loss_bins {settings.loss_bins} must be >= 0")
    for flag, units in (("ema_start", ("ba", "ep", "dur")), ("ema_half_life", ("ba",)), ("sample_interval", ("ba", "ep"))):
        try:
            unit = Time.from_timestring(getattr(settings, flag)).unit.value
        except (ValueError, TypeError):
            unit = None
        if unit not in units:
            fail(f"--{flag} '{getattr(settings, flag)}' must be a Composer time string in {', '.join(units)} (e.g. 1000ba)")
    ema_start = Time.from_timestring(settings.ema_start)
    if ema_start.value < 0 or (ema_start.unit.value == "dur" and ema_start.value > 1):
        fail(f"--ema_start {settings.ema_start} must be >= 0"
             + (" and at most 1dur" if ema_start.unit.value == "dur" else ""))
    if Time.from_timestring(settings.sample_interval).value <= 0:
        fail(f"--sample_interval {settings.sample_interval} must be positive, e.g. 1000ba")
    if (settings.ema_start != "0ba" or settings.ema_half_life != "1000ba") and not settings.use_ema:
        fail("--ema_start and --ema_half_life need --use_ema")
    if Time.from_timestring(settings.ema_half_life).value <= 0:
        fail(f"--ema_half_life {settings.ema_half_life} must be positive")
    if settings.sample_prompts:
        from t2ibench.eval.sampling import load_prompts
        try:
            load_prompts(settings.sample_prompts)
        except ValueError as e:
            fail(f"--sample_prompts {e}")
        if not settings.samples_dir and not settings.save_folder:
            fail("--sample_prompts needs --samples_dir or --save_folder (samples go to <save_folder>/samples)")
        if not settings.samples_dir and is_remote(settings.save_folder):
            fail(f"--sample_prompts: --save_folder {settings.save_folder} is an object store; give a local --samples_dir")
        if settings.sample_steps <= 0:
            fail(f"--sample_steps {settings.sample_steps} must be positive")
    if settings.samples_dir and not settings.sample_prompts:
        fail("--samples_dir needs --sample_prompts (a prompt file or a built-in set: default, shapes)")
    export_dir = settings.ema_export_dir
    if export_dir and Path(export_dir).is_dir():
        # What a killed export left (a preempted job) is taken over when the pipeline is written (staged_folder).
        entries = set(os.listdir(export_dir)) - killed_writer_leftovers(export_dir)
        # A resumed or retried job finds the pipeline it exported before: that one it may rewrite.
        own_export = entries <= {"model_index.json", EXPORT_FILE, *family.pipeline_parts} and (
            settings.autoresume or settings.load_path)
        if entries and not own_export:
            fail(f"--ema_export_dir {settings.ema_export_dir} is not empty; choose a new folder (nothing is overwritten)")
    return sampler, precomputed_format


def check_buckets(settings: Settings) -> tuple[tuple[Bucket, ...], tuple[float, ...]]:
    """--aspect_buckets' list (the family refuses it first, check_recipe) and the synthetic batches'
    share of each bucket, or none; what buckets do not train from yet is refused by name."""
    if settings.aspect_buckets is None:
        if settings.synthetic_bucket_weights != UNIFORM:
            fail("--synthetic_bucket_weights needs --aspect_buckets (and --use_synth_data)")
        return (), ()
    family = settings.family
    patch_px = family.latent_downsample * family.patch_size
    buckets = resolve_buckets(settings.aspect_buckets, settings.image_size, patch_px)
    if settings.precomputed and settings.use_synth_data:
        fail("--aspect_buckets with --precomputed --use_synth_data: synthetic latents are square; draw synthetic "
             "buckets with images (without --precomputed), or precompute real images with latents.py --aspect_buckets")
    if settings.synthetic_bucket_weights != UNIFORM and not settings.use_synth_data:
        fail("--synthetic_bucket_weights applies to --use_synth_data only: real data has the buckets its images have")
    return buckets, synthetic_weights(settings.synthetic_bucket_weights, buckets)


# Flags that act only beside another (by their dests), refused where given without it (check_flags_that_act).
STREAMING_FLAGS = ("cache_limit", "shuffle", "predownload", "download_retry", "download_timeout", "validate_hash",
                   "shuffle_algo", "shuffle_block_size", "epoch_size", "num_canonical_nodes", "sampling_granularity")
IMAGE_SHARD_FLAGS = ("image_key", "caption_key", "max_bad_fraction", "bucket_crop")  # read by the image loader alone
SAMPLE_FLAGS = ("sampler", "sample_steps", "guidance_scale")  # how images are drawn: grids, FID and CLIP alike


@functools.cache
def parser_defaults() -> tuple[dict[str, object], dict[str, str]]:
    """benchmark.py's parser's defaults and each flag's name, by dest (`--no_shuffle` for shuffle)."""
    parser = flags.benchmark_parser("")
    actions = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    return ({action.dest: action.default for action in actions},
            {action.dest: max(action.option_strings, key=len) for action in actions})


def check_flags_that_act(args: argparse.Namespace, settings: Settings) -> None:
    """Refuse a flag given where it would do nothing, in one line naming it and what it needs, as
    --synthetic_bucket_weights without --aspect_buckets is (check_buckets): a run that ignored it, and
    whose results still recorded it, would be taken for one that used it. A flag given at its default
    value cannot be told from one left out, and changes nothing either way."""
    defaults, names = parser_defaults()

    def given(*dests: str) -> list[str]:
        return [names[dest] + ("" if isinstance(getattr(args, dest), bool) else f" {getattr(args, dest)}")
                for dest in dests if getattr(args, dest) != defaults[dest]]

    precision = resolve_precision(settings.precision, torch.cuda.is_available())
    rules = (
        (settings.aspect_buckets is None, given("bucket_crop"),
         "images are squares without --aspect_buckets, and no bucket is cropped; add --aspect_buckets or leave {them} "
         "out"),
        (settings.use_synth_data, given(*STREAMING_FLAGS, *IMAGE_SHARD_FLAGS),
         "--use_synth_data draws random samples and reads no real data (Streaming, image shards); leave {them} out or "
         "drop --use_synth_data"),
        (settings.precomputed and not settings.use_synth_data, given(*IMAGE_SHARD_FLAGS),
         "--precomputed reads latents.py's shards, not images (their crops chosen when latents.py wrote them); leave "
         "{them} out, or give {them} to latents.py"),
        (not settings.use_synth_data, given("num_synthetic_samples"),
         "this run reads real data, and only --use_synth_data draws synthetic samples (--epoch_size sizes a real "
         "epoch); leave {them} out"),
        (not settings.sample_prompts and not settings.fid_weights and not settings.clip_model, given(*SAMPLE_FLAGS),
         "no sample grid is drawn without --sample_prompts, nor any image scored without --fid_weights or "
         "--clip_model; add one or leave {them} out"),
        (not settings.sample_prompts, given("sample_interval"),
         "no sample grid is drawn without --sample_prompts (FID and CLIP score draw at each evaluation); add "
         "--sample_prompts or leave {them} out"),
        (not settings.save_folder, given("save_interval", "save_num_checkpoints_to_keep"),
         "no checkpoint is saved without --save_folder; add --save_folder or leave {them} out"),
        (not settings.profile_batches, given("profile_dir"),
         "no batch is profiled without --profile_batches N, so no trace is written; add --profile_batches or "
         "leave {them} out"),
        (precision == "fp32", given("norm_precision"),
         "this run is fp32, without autocast, so its norms are fp32 anyway; leave {them} out or train under "
         "--precision amp_bf16"),
    )
    for does_nothing, shown, why in rules:
        if does_nothing and shown:
            fail(f"{', '.join(shown)} would do nothing: " + why.format(them="them" if len(shown) > 1 else "it"))


def check_sample_size(settings: Settings) -> Bucket:
    """--sample_size as height x width in pixels, after --aspect_buckets' list (check_buckets); without
    it, the square at --image_size, bucketed run or not (grids comparable across runs and with the
    square path's). Any shape on the latent grid is taken, a bucket of the list or not, up to as many
    pixels as training's largest shape: samples are drawn in the training microbatch, which the memory
    model sized for that shape, so a larger one might not fit where training did."""
    square = Bucket(settings.image_size, settings.image_size)
    if settings.sample_size is None:
        return square
    if not settings.sample_prompts:
        fail("--sample_size needs --sample_prompts (a prompt file or a built-in set: default, shapes)")
    family = settings.family
    size = parse_size(settings.sample_size, family.latent_downsample * family.patch_size, "--sample_size")
    largest = max((square, *settings.buckets), key=lambda bucket: bucket.pixels)
    if size.pixels > largest.pixels:
        fail(f"--sample_size {settings.sample_size}: {size.pixels:,} pixels, more than training's largest shape "
             f"{largest.name} ({largest.pixels:,}), whose microbatch samples are drawn in; give at most that many")
    return size


def run_batches(settings: Settings, samples_per_epoch: int) -> int:
    """Batches the whole run trains, from --max_duration (every rank drops its last partial batch)."""
    duration = Time.from_timestring(settings.max_duration)
    if duration.unit.value == "ba":
        return int(duration.value)
    if duration.unit.value == "sp":
        return math.ceil(duration.value / settings.batch_size)
    return int(duration.value) * (samples_per_epoch // settings.batch_size)


def check_run_length(settings: Settings, samples_per_epoch: int) -> None:
    """Flags that must fall within the run: a learning-rate warm-up that ends before the run does,
    and an EMA that starts in time for --ema_export_dir to get something."""
    total = run_batches(settings, samples_per_epoch)
    length = f"--max_duration {settings.max_duration} is {total} batch{'es' if total != 1 else ''}"
    warmup = settings.lr_warmup_batches
    if warmup > total or (settings.lr_schedule == "cosine" and warmup and warmup >= total):
        fail(f"--lr_warmup_batches {settings.lr_warmup_batches} does not end before the run does ({length}): the "
             "learning rate would never reach --lr" + (" or decay" if settings.lr_schedule == "cosine" else "")
             + "; shorten the warm-up or lengthen the run")
    if settings.profile_batches and not profile_fits(settings.warmup_batches, settings.profile_batches, total):
        fail(f"--profile_batches {settings.profile_batches} after --warmup_batches {settings.warmup_batches} leaves no "
             f"batch to measure ({length}); profile fewer batches or lengthen the run")
    if settings.use_ema and settings.ema_export_dir:
        start = Time.from_timestring(settings.ema_start)
        # The average starts at the first batch end at or after --ema_start; epochs count up after
        # their last batch, so Nep starts with the first batch of epoch N + 1.
        first = {"ba": max(1, int(start.value)), "ep": int(start.value) * (samples_per_epoch // settings.batch_size) + 1,
                 "dur": max(1, math.ceil(start.value * total))}[start.unit.value]
        if first > total:
            fail(f"--ema_start {settings.ema_start} starts the average after the run ends ({length}): --ema_export_dir "
                 "would get nothing; start it earlier (e.g. 0.5dur) or lengthen the run")
