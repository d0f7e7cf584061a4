"""Precomputed VAE latents and text-encoder outputs: encode the dataset once, then train on them.

    python latents.py --local /data/mds/laion --out /data/mds/laion-latents-512 \
        --model_name /path/to/stable-diffusion-2-base --image_size 512 --batch_size 32
    composer -n 8 latents.py --remote s3://bucket/laion/mds --local /tmp/laion-cache \
        --out s3://bucket/laion/latents-512 --model_name /path/to/stable-diffusion-2-base
    composer benchmark.py --precomputed --remote s3://bucket/laion/latents-512 --local /tmp/latents-cache

Reads image-caption MDS shards (convert.py's), runs the frozen VAE (and, with --store_text_states,
the text encoders) once per sample, and writes MDS shards in the format of `t2ibench.datasets.precomputed`,
chunk by chunk, so that rerunning the same command resumes. The format, its sizes, the choice of
fp16 and how chunks are written and resumed are in docs/data.md.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from composer.utils import dist, reproducibility
from torch.utils.data import DataLoader, Dataset

import data
from t2ibench.core import errors
from t2ibench.commands import flags
from t2ibench.core.cli import BATCH_SIZE, NON_NEGATIVE_INT, NUMBER_TEXT, POSITIVE_INT, SECONDS
from t2ibench.core.errors import UserError, fail
from t2ibench.families import ModelFamily, require_pretrained
from t2ibench.core.files import hold_output, take_over
from t2ibench.core.locations import is_remote, missing_upload_credentials, normalise, overlap, \
    unwritable, upload_schemes
from t2ibench.datasets.buckets import Bucket, nearest_bucket, place, resolve_buckets
from t2ibench.core.images import GEOMETRY_KEYS, ImageGeometry, decode_pixels_placed, oriented_size
from t2ibench.commands.latent_encoding import Encoded, Stats, encode
from t2ibench.commands.latent_store import (check_settings, chunk_name, chunk_writer, clear_output, completed_chunks, join,
                                   read_json, write_json)
from t2ibench.core.mds import INDEX_FILE, MDSWriter, codec_problem, size_limit_problem
from t2ibench.datasets.precomputed import (BUCKET_KEY, RECORD_FILE, STORAGE_DTYPES, TEXT_STATES,
                                  default_format, TOKEN_IDS_DTYPE, TOKENS, mds_columns,
                                  token_column)
from t2ibench.costs.scale import SAMPLES as SAMPLES_AT_SCALE
from t2ibench.datasets.sources import Source, check_cache_current, parse_sources

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# -----------------------------------------------------------------------------------------------
# Reading the source: image-caption shards by sample index.
# -----------------------------------------------------------------------------------------------

class IndexedImageCaptions(data.StreamingImageCaptions):
    """data.StreamingImageCaptions read by index for encoding: yields the index, and flags bad samples.

    Training replaces an undecodable sample by the next one; here that would store one sample
    twice, so the sample is flagged (`ok` False) and left out of the output instead. Images and
    captions are prepared exactly as for online training (data.decode_image, the family's tokenize).
    """

    buckets: tuple[Bucket, ...] = ()  # --aspect_buckets: get_item takes (index, position in this list)

    def bucket_position(self, index: int) -> int:
        """The position in `buckets` of the bucket nearest sample `index`'s aspect ratio, from its header
        (0 when the header cannot be read: get_item then finds the sample bad and leaves it out)."""
        sample = self.read_sample(index)  # a shard that cannot be read is named (BadDataError), not a bad image
        try:
            width, height = oriented_size(sample[self.image_key])
        except Exception:  # noqa: BLE001  an undecodable image: reported where it is decoded (get_item)
            return 0
        return self.buckets.index(nearest_bucket(width, height, self.buckets, self.image_size))

    def get_item(self, key: int | tuple[int, int]) -> dict[str, Any]:
        index, position = key if isinstance(key, tuple) else (key, None)
        bucket = self.buckets[position] if position is not None else Bucket(self.image_size, self.image_size)
        sample = self.read_sample(index)  # the raw columns: a shard that cannot be read is named (BadDataError)
        caption = sample.get(self.caption_key)
        try:
            if not isinstance(caption, str):
                raise TypeError(f"caption is {type(caption).__name__}, not str")
            if position is None:
                image, geometry = data.decode_image_with_geometry(sample[self.image_key], self.image_size)
            else:  # latents are stored as they would train: centered, kohya's cached-latent crop
                encoded = sample[self.image_key]
                pixels, geometry = decode_pixels_placed(encoded, place(*oriented_size(encoded), bucket))
                image = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
            return {"index": index, "ok": True, "image": image, **self.token_ids(caption), "caption": caption,
                    **data.geometry_tensors(geometry)}
        except Exception as error:  # noqa: BLE001  Pillow raises OSError, ValueError, SyntaxError...
            log.warning("sample %d in %s cannot be used (%s: %s); left out of the precomputed data",
                        index, self.shard_name(index), type(error).__name__, error)
            return {"index": index, "ok": False,
                    "image": torch.zeros(3, bucket.height, bucket.width, dtype=torch.uint8),
                    **{key: torch.zeros_like(ids) for key, ids in self.token_ids("").items()}, "caption": "",
                    **data.geometry_tensors(ImageGeometry(0, 0, 0, 0))}

    def shards_of(self, start: int, stop: int) -> range:
        """Shard ids holding samples [start, stop)."""
        offsets = self.sample_offset_per_shard
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
        return range(first, last + 1)


class _ByIndex(Dataset):
    """Map-style view of a StreamingDataset (an IterableDataset) for a DataLoader with a batch sampler."""

    def __init__(self, source: IndexedImageCaptions):
        self.source = source

    def __len__(self) -> int:
        return self.source.num_samples

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        return self.source.get_item(key)


# -----------------------------------------------------------------------------------------------
# The output folder (t2ibench.commands.latent_store): held, checked and recorded by rank 0.
# -----------------------------------------------------------------------------------------------

def plan_work(args: argparse.Namespace, settings: dict, num_chunks: int, held: contextlib.ExitStack) -> list[int]:
    """Rank 0: hold --out until `held` closes (a second latents.py into it is refused; see main), check it,
    record the settings there, and return the chunks still to do."""
    held.enter_context(hold_output("--out", args.out))  # no hold for an object-store --out
    if not is_remote(args.out):
        take_over(args.out, files=(RECORD_FILE,))  # the record's temporary, left by a latents.py that was killed
    if args.overwrite and not is_remote(args.out):
        clear_output(args.out)
    existing = read_json(args.out, RECORD_FILE)
    if existing is None:
        # Never mix chunks into (and later replace the index.json of) some other dataset.
        path = Path(args.out)
        foreign = (path.is_dir() and any(path.iterdir())) if not is_remote(args.out) else \
            read_json(args.out, INDEX_FILE) is not None
        if foreign:
            fail(f"--out {args.out}: not empty and holds no precomputed latents (no {RECORD_FILE}); choose a new "
                 "or empty folder")
    elif not args.overwrite:
        problem = check_settings(existing, settings)
        if problem:
            fail(f"--out {args.out}: {problem}")
    write_json(args.out, RECORD_FILE, settings)
    done = set() if args.overwrite and is_remote(args.out) else completed_chunks(args.out, num_chunks)
    return [k for k in range(num_chunks) if k not in done]


# -----------------------------------------------------------------------------------------------
# The command: flags, checks, then the run (encoding: t2ibench.commands.latent_encoding).
# -----------------------------------------------------------------------------------------------

def build_parser() -> flags.Parser:
    p = flags.Parser("latents.py", description=__doc__)
    p.add_argument("--out", type=str, required=True, help="output folder, or s3:// gs:// oci:// ... URI")
    flags.add_source(p)
    flags.add_model(p)
    flags.add_run(p, "seeds randomly initialized encoders (as benchmark.py --seed)")
    g = p.add_argument_group("encoding and output")
    g.add_argument("--batch_size", type=BATCH_SIZE, default=32, help="images per encoder call on each device")
    g.add_argument("--dtype", type=str, default="bf16", choices=sorted(COMPUTE_DTYPES),
                   help="autocast dtype of the encoders on GPU (CPU: always fp32)")
    g.add_argument("--storage_dtype", type=str, default="fp16", choices=sorted(STORAGE_DTYPES),
                   help="dtype of the stored arrays (fp16: half the size, relative error < 5e-4)")
    g.add_argument("--store_text_states", action="store_true",
                   help="store the text encoder's output (77 x 1024 fp16, 157,696 bytes at SD2) instead of the 77 "
                        "token ids (154 bytes): 3.4x the storage at 512px, to save training 1.9%% of its FLOPs; "
                        "Flux's default (MLPerf's format: T5 states 256 x 4096 and CLIP pooled 768)")
    g.add_argument("--store_token_ids", action="store_true",
                   help="Flux: store the token ids instead of the text states (T5-XXL and CLIP then run in training, "
                        "12%% more FLOPs at 256px); SD2 stores token ids by default")
    g.add_argument("--chunk_size", type=POSITIVE_INT, default=10_000,
                   help="samples per chunk, the unit of work and of resumption (a chunk is redone if interrupted)")
    g.add_argument("--max_chunks", type=NON_NEGATIVE_INT, default=0,
                   help="do at most this many chunks per rank in this run, then stop (0: all); rerun to continue")
    g.add_argument("--no_captions", action="store_true", help="do not store the caption strings")
    flags.add_aspect_buckets(g, "store each image's latents at the shape of the bucket nearest its aspect ratio "
                                "(resized to cover it, center-cropped), with the bucket, for benchmark.py "
                                "--precomputed --aspect_buckets")
    g.add_argument("--compression", type=str, default="zstd", help="shard compression: zstd, zstd:<level>, gz, none")
    g.add_argument("--hashes", type=str, default="xxh64",
                   help="comma-separated shard hashes stored in the index ('' for none)")
    g.add_argument("--size_limit", type=NUMBER_TEXT, default="256mb",
                   help="shard size before compression (256mb: 4,081 samples at 512px, 490k shards for 2B samples, "
                        "whose index every training process holds; see bench/index_scale.py)")
    g.add_argument("--overwrite", action="store_true", help="start over: discard the chunks already in --out")
    g.add_argument("--dist_timeout", type=SECONDS, default=3 * 3600.0, help="seconds a rank may wait for the others")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def validate(parsed: argparse.Namespace) -> tuple[argparse.Namespace, ModelFamily, Source]:
    """One line naming the flag for every value that would fail later. Returns the flags with every
    default resolved, in a new namespace (the parsed one is left as it was parsed), the family and the source."""
    family, model_name, image_size = flags.shared_values(parsed)
    if parsed.aspect_buckets is not None and "aspect_buckets" in family.refused_flags:
        fail(f"--aspect_buckets does not apply to --model_config {parsed.model_config}: "
             f"{family.refused_flags['aspect_buckets']}")
    buckets = resolve_buckets(parsed.aspect_buckets, image_size, family.latent_downsample * family.patch_size)
    if parsed.store_text_states and parsed.store_token_ids:
        fail("--store_text_states and --store_token_ids: choose one")
    # The family's own format unless the user chose one (Flux.1 stores text states, as MLPerf does).
    store_text_states = parsed.store_text_states or (
        default_format(family) == TEXT_STATES and not parsed.store_token_ids)
    for flag in ("batch_size", "chunk_size"):
        if getattr(parsed, flag) <= 0:
            fail(f"--{flag} {getattr(parsed, flag)} must be positive")
    too_many = flags.check_workers("--num_workers", parsed.num_workers, dist.get_local_world_size())
    if too_many:
        fail(too_many)
    if not 0.0 < parsed.dist_timeout < math.inf:
        fail(f"--dist_timeout {parsed.dist_timeout} must be a positive number of seconds")
    compression = None if parsed.compression.lower() in ("", "none") else parsed.compression
    hashes = [h.strip() for h in parsed.hashes.split(",") if h.strip()]
    problem = size_limit_problem(parsed.size_limit) or codec_problem(compression, hashes)
    if problem:
        fail(problem)
    sources = parse_sources(parsed.remote, parsed.local)
    if not sources:
        fail("no input: pass --remote (with --local as cache) or --local with the image-caption MDS shards")
    if len(sources) > 1:
        fail(f"--remote: latents.py reads one source ({len(sources)} given); precompute each into its own --out "
             "and train on them together (benchmark.py --precomputed --remote 0.7=A,0.3=B)")
    source = sources[0]
    out = normalise("--out", parsed.out, upload_schemes())  # file:///path is the path /path
    if buckets and is_remote(out):  # the chunks are sorted into bucket folders at the end, on this machine
        fail(f"--aspect_buckets writes a local --out, not {out}: compute into a folder, then copy its bucket folders "
             "and buckets.json to the store (buckets.json last)")
    if not source.remote and not Path(source.local).is_dir():
        fail(f"--local {source.local} is not a folder; give --remote to stream shards into it")
    if not source.remote and not Path(source.local, INDEX_FILE).is_file():
        fail(f"--local {source.local} holds no MDS dataset (no {INDEX_FILE}): point it at the image-caption shards "
             "that convert.py wrote, or give --remote to stream them into it")
    problem = overlap("--out", out, [("--local", source.local), ("--remote", source.remote)]) \
        or missing_upload_credentials("--out", out)
    if not problem and not is_remote(out):
        problem = unwritable("--out", out, folder=True)
    if not problem and source.remote:  # the cache Streaming downloads the source shards into
        problem = unwritable("--local", source.local, folder=True)
    if problem:
        fail(problem)
    check_cache_current(source)  # a cache of an older version of the remote: refused, not read
    resolved = {"model_name": model_name, "image_size": image_size, "store_text_states": store_text_states,
                "compression": compression, "hashes": hashes, "out": out, "buckets": buckets}
    return argparse.Namespace(**{**vars(parsed), **resolved}), family, source


def source_fingerprint(source: IndexedImageCaptions) -> str:
    """SHA-256 of the source's index.json shard list (names, sizes, hashes, sample counts): a source
    replaced at the same path, even with the same number of samples, gets another fingerprint."""
    index = json.loads(Path(source.streams[0].local, INDEX_FILE).read_text())
    return hashlib.sha256(json.dumps(index["shards"], sort_keys=True).encode()).hexdigest()


def main(argv: list[str] | None = None) -> dict | None:
    """Encode the source into --out; rank 0 returns the report (None on the other ranks)."""
    parsed = parse_args(argv)
    # `held` keeps rank 0's hold on --out (taken in plan_work) to the end, past an error's message.
    with contextlib.ExitStack() as held, errors.command("latents.py", debug=parsed.debug, explain=bad_data):
        return run(parsed, held)


def run(parsed: argparse.Namespace, held: contextlib.ExitStack) -> dict | None:
    """main's body: validate, build, plan, encode, finish."""
    args, family, source_location = validate(parsed)
    device = start(args)
    vae, text_encoders, tokenizers, random_encoders = build_encoders(args, family, device)
    source, fingerprint = open_source(args, family, source_location, tokenizers)
    latent_size = None if args.buckets else args.image_size // family.latent_downsample  # None: per bucket
    columns = mds_columns(vae.config.latent_channels, latent_size, None,
                          args.storage_dtype, not args.no_captions, text_states=args.store_text_states,
                          family=family, config=args.model_config, micro_conditioning=family.micro_conditioning)
    num_chunks = math.ceil(source.num_samples / args.chunk_size)
    settings = {
        "source": source_location.remote or os.path.abspath(source_location.local),
        "source_samples": source.num_samples, "source_index_sha256": fingerprint,
        "chunk_size": args.chunk_size, "image_size": args.image_size, "model_config": args.model_config,
        "model_name": args.model_name if args.model_config in family.pretrained_configs else None,
        "random_encoders": random_encoders, "seed": args.seed if random_encoders else None,
        "columns": columns, "image_key": args.image_key, "caption_key": args.caption_key,
        "aspect_buckets": [bucket.name for bucket in args.buckets] or None,
    }
    mine = plan(args, settings, num_chunks, held)
    stats = Stats()
    started = time.perf_counter()
    if mine:
        encode_chunks(args, family, source, vae, text_encoders, device, columns, mine, stats,
                      show_progress=dist.get_global_rank() == 0)
    elapsed = time.perf_counter() - started
    dist.barrier()
    all_stats = dist.all_gather_object(vars(stats))
    if dist.get_global_rank() != 0:
        return None
    return finish(args, source.num_samples, num_chunks, all_stats, elapsed, dist.get_world_size(), device)


def bad_data(error: BaseException) -> str | None:
    """One line for bad data: a shard that cannot be read, or more of the source undecodable than
    --max_bad_fraction allows (raised here or in a loader worker)."""
    found = errors.worker_error(error, ("data.BadDataError",))  # raised in a loader worker
    if found is None and isinstance(error, data.BadDataError):
        return str(error).strip().splitlines()[-1]
    return found


def open_source(args: argparse.Namespace, family: ModelFamily, location: Source,
                tokenizers: dict[str, Any]) -> tuple[IndexedImageCaptions, str]:
    """The image-caption shards, read by index, and their fingerprint (source_fingerprint); a source
    that cannot be read (not MDS, a wrong column, no credentials, an unreachable store) is one line."""
    try:
        source = IndexedImageCaptions(sources=[location], tokenizer=tokenizers, family=family,
                                      image_size=args.image_size, batch_size=args.batch_size, shuffle=False,
                                      cache_limit=args.cache_limit, image_key=args.image_key,
                                      caption_key=args.caption_key)
        return source, source_fingerprint(source)
    except Exception as error:  # noqa: BLE001  any store's or format's error: reported, not hidden
        if args.debug:
            raise
        detail = (str(error).strip().splitlines() or [""])[0][:300]
        fail(f"cannot read the source {location.remote or location.local} ({type(error).__name__}: {detail})"
             + ("; check the store's credentials and endpoint" if location.remote else ""))


def start(args: argparse.Namespace) -> torch.device:
    """Logging, the device of this rank, the process group, the seeds."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Streaming warns on every run that a chunk folder already exists (MDSWriter is told it may) and
    # that merge_index made a temporary folder: neither tells the user anything.
    logging.getLogger("streaming.base.storage.upload").setLevel(logging.ERROR)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(dist.get_local_rank())  # before any CUDA work: one GPU per rank
    if dist.get_world_size() > 1:
        dist.initialize_dist("gpu" if on_gpu else "cpu", timeout=args.dist_timeout)
    reproducibility.seed_all(args.seed)  # the same seed as benchmark.py gives the same random encoders
    return torch.device("cuda", dist.get_local_rank()) if on_gpu else torch.device("cpu")


def build_encoders(args: argparse.Namespace, family: ModelFamily,
                   device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.nn.Module], dict[str, Any], list[str]]:
    """The frozen VAE, the text encoders (with --store_text_states), the tokenizers, and which are random."""
    parts = family.build(args.model_config, args.model_name, denoiser=False, text_encoders=args.store_text_states)
    require_pretrained(parts, needed=args.model_config in family.pretrained_configs,
                       allowed=args.allow_random_encoders, model_name=args.model_name)
    if parts.random_encoders and dist.get_global_rank() == 0:
        print(f"note: using randomly initialized {' and '.join(parts.random_encoders)} (seed {args.seed})",
              file=sys.stderr, flush=True)
    for module in (parts.vae, *parts.text_encoders.values()):
        module.requires_grad_(False).eval().to(device)
    vocabulary = max(len(tokenizer) for tokenizer in parts.tokenizers.values())
    if not args.store_text_states and vocabulary > np.iinfo(TOKEN_IDS_DTYPE).max + 1:
        fail(f"the tokenizer of --model_name {args.model_name} has {vocabulary:,} tokens, more than "
             f"{TOKEN_IDS_DTYPE} token ids hold: pass --store_text_states")
    return parts.vae, parts.text_encoders, parts.tokenizers, parts.random_encoders


def plan(args: argparse.Namespace, settings: dict, num_chunks: int, held: contextlib.ExitStack) -> list[int]:
    """This rank's chunks: rank 0 decides what is left to do (plan_work) and every rank gets the same
    list, or the same error."""
    world, rank = dist.get_world_size(), dist.get_global_rank()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = plan_work(args, settings, num_chunks, held)
        except UserError as error:
            box[0] = error.message
        except Exception as error:  # noqa: BLE001  e.g. no access to a remote --out: fail on every rank
            box[0] = f"--out {args.out}: {type(error).__name__}: {error}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        fail(box[0])
    todo: list[int] = box[0]
    if rank == 0:
        print(f"{settings['source_samples']:,} source samples in {num_chunks} chunk(s) of {args.chunk_size:,}: "
              f"{num_chunks - len(todo)} already complete, {len(todo)} to do over {world} rank(s)", flush=True)
    mine = todo[rank::world]
    return mine[:args.max_chunks] if args.max_chunks else mine


def encode_chunks(args: argparse.Namespace, family: ModelFamily, source: IndexedImageCaptions,
                  vae: torch.nn.Module, text_encoders: dict[str, torch.nn.Module], device: torch.device,
                  columns: dict[str, str], chunks: list[int], stats: Stats, show_progress: bool) -> None:
    """Encode `chunks` of the source, each into its own MDS dataset OUT/chunkNNNNNN."""
    from tqdm import tqdm

    n = source.num_samples
    ranges = {k: (k * args.chunk_size, min(n, (k + 1) * args.chunk_size)) for k in chunks}
    # Batches never cross a chunk boundary, so a chunk is finished by the batch that ends it.
    batches = [list(range(i, min(stop, i + args.batch_size))) for k in chunks
               for start, stop in [ranges[k]] for i in range(start, stop, args.batch_size)]
    if args.buckets:  # one bucket a batch: each chunk's samples grouped by bucket (their headers read first)
        source.buckets = args.buckets
        batches = []
        for k in chunks:
            groups: dict[int, list[int]] = {}
            for index in range(*ranges[k]):
                groups.setdefault(source.bucket_position(index), []).append(index)
            batches += [[(index, position) for index in group[i:i + args.batch_size]]
                        for position, group in sorted(groups.items()) for i in range(0, len(group), args.batch_size)]
    loader = DataLoader(_ByIndex(source), batch_sampler=batches, num_workers=args.num_workers,
                        pin_memory=device.type == "cuda", prefetch_factor=4 if args.num_workers else None)
    compute_dtype = COMPUTE_DTYPES[args.dtype]

    # Download the source shards of the next chunk while this one is encoded (remote sources).
    prefetcher = ThreadPoolExecutor(max_workers=2) if args.remote else None

    def prefetch(k: int) -> None:
        if prefetcher is not None:
            for shard_id in source.shards_of(*ranges[k]):
                prefetcher.submit(source.prepare_shard, shard_id, False)

    total = sum(stop - start for start, stop in ranges.values())
    bar = tqdm(total=total, unit=" img", desc="encode", disable=not show_progress or args.no_progress,
               mininterval=1.0, dynamic_ncols=True)
    writer: MDSWriter | None = None
    pending: Encoded | None = None  # the previous batch, written while the GPU encodes the next one
    current, position, seen, decoded = -1, 0, set(), 0

    def write(encoded: Encoded | None) -> None:
        if encoded is None:
            return
        arrays, value_ranges = encoded.arrays(args.storage_dtype, args.dtype)
        stats.update(value_ranges)
        for row, index in enumerate(encoded.indices):
            sample = {"index": index, **{key: array[row] for key, array in zip(encoded.keys, arrays)}}
            for key, ids in encoded.token_ids.items():  # the tokens format: text states are not stored
                sample[token_column(key, family)] = ids[row]
            for key in GEOMETRY_KEYS:
                if key in columns:  # the image's original size and crop (micro-conditioning)
                    sample[key] = encoded.geometry[key][row]
            if BUCKET_KEY in columns:  # the bucket, in pixels, of latents stored at its shape
                sample[BUCKET_KEY] = np.array(arrays[0][row].shape[-2:], np.int32) * family.latent_downsample
            if "caption" in columns:
                sample["caption"] = encoded.captions[row]
            writer.write(sample)
        stats.written += len(encoded.indices)

    def close_chunk() -> None:
        start, stop = ranges[current]
        if seen != set(range(start, stop)):
            raise RuntimeError(f"{chunk_name(current)}: expected samples {start}..{stop - 1} once each, "
                               f"got {len(seen)} distinct (missing: {sorted(set(range(start, stop)) - seen)[:10]})")
        writer.finish()  # writes the chunk's index.json last: from now on the chunk counts as complete

    try:
        for batch in loader:
            indices = batch["index"].tolist()
            k = indices[0] // args.chunk_size
            if k != current:
                write(pending)
                pending = None
                if writer is not None:
                    close_chunk()
                current, seen = k, set()
                writer = chunk_writer(args.out, chunk_name(k), columns, args.compression, args.hashes, args.size_limit)
                if position + 1 < len(chunks):
                    prefetch(chunks[position + 1])
                position += 1
            fresh = [i for i, index in enumerate(indices) if index not in seen]  # never write a sample twice
            seen.update(indices)
            ok = [i for i in fresh if bool(batch["ok"][i])]
            stats.bad += len(fresh) - len(ok)
            decoded += len(fresh)
            encoded = None
            if ok:
                rows = torch.tensor(ok)
                ids = {key: batch[key][rows] for key in family.text_input_keys}
                outputs = encode(family, vae, text_encoders, batch["image"][rows], ids, device, compute_dtype)
                encoded = Encoded([indices[i] for i in ok], [batch["caption"][i] for i in ok], outputs,
                                  args.storage_dtype, device, token_ids=None if text_encoders else ids,
                                  geometry={key: batch[key][rows] for key in GEOMETRY_KEYS})
            write(pending)  # on GPU this overlaps with the encoding just launched
            pending = encoded
            if decoded >= data.BAD_CHECK_AFTER and stats.bad > args.max_bad_fraction * decoded:
                raise data.BadDataError(
                    f"{stats.bad} of the {decoded} samples read by this rank could not be decoded (more than "
                    f"--max_bad_fraction {args.max_bad_fraction:g}); see the warnings above for which")
            bar.update(len(indices))
        if writer is not None:
            write(pending)
            close_chunk()
            writer = None
    except BaseException:
        if writer is not None:
            writer.cancel_future_jobs()  # no index.json: the chunk stays incomplete and is redone
        raise
    finally:
        bar.close()
        if prefetcher is not None:
            prefetcher.shutdown(wait=False, cancel_futures=True)


def sort_into_buckets(args: argparse.Namespace, index: dict) -> dict[str, int]:
    """The chunks' latents sorted by their bucket into OUT/HxW folders and OUT/buckets.json
    (t2ibench.datasets.bucket_sort, as sort_buckets.py sorts latents of before): what benchmark.py --aspect_buckets
    trains on. The chunks stay, so that a rerun with more --max_chunks or a new chunk resumes."""
    from t2ibench.datasets.bucket_sort import SortJob, sort_dataset

    job = SortJob(os.path.abspath(args.out), "latents", args.buckets, args.image_size, args.image_key, index)
    sorted_report = sort_dataset(job, args.out, args.out, 1, not args.no_progress,
                                 dict(compression=args.compression, hashes=args.hashes, size_limit=args.size_limit))
    return sorted_report["buckets"]


def finish(args: argparse.Namespace, num_samples: int, num_chunks: int, all_stats: list[dict], elapsed: float,
           world: int, device: torch.device) -> dict:
    """Rank 0, after every rank is done: merge the chunk indexes when all chunks are complete; report."""
    from streaming.base.util import bytes_to_int, merge_index

    written_now = sum(s["written"] for s in all_stats)
    report: dict[str, Any] = {"out": args.out, "source_samples": num_samples, "chunks": num_chunks,
                              "written_this_run": written_now, "skipped_this_run": sum(s["bad"] for s in all_stats),
                              "seconds": round(elapsed, 2), "world_size": world, "device": str(device.type)}
    seen = [s for s in all_stats if s["written"]]
    if seen:
        report.update(
            images_per_sec=round(written_now / max(elapsed, 1e-9), 2),
            max_abs_latent_mean=max(s["max_abs_mean"] for s in seen),
            latent_logvar_range=[min(s["min_logvar"] for s in seen), max(s["max_logvar"] for s in seen)],
            **({"max_abs_text_states": max(s["max_abs_text"] for s in seen)} if args.store_text_states else {}))
    left = num_chunks - len(completed_chunks(args.out, num_chunks))
    if left:
        if not args.max_chunks:
            raise RuntimeError(f"{left} chunk(s) of {args.out} are incomplete after every rank finished")
        report["chunks_left"] = left
        print(f"{left} of {num_chunks} chunk(s) left (--max_chunks {args.max_chunks}): run the same command "
              "again to continue", flush=True)
        print(json.dumps(report), flush=True)
        return report

    if not is_remote(args.out):
        Path(args.out, INDEX_FILE).unlink(missing_ok=True)  # merge_index will not replace an existing file
    root_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # merge_index logs its temporary folder as a warning
    try:
        merge_index([join(args.out, chunk_name(k), INDEX_FILE) for k in range(num_chunks)], args.out)
    finally:
        logging.getLogger().setLevel(root_level)
    index = read_json(args.out, INDEX_FILE) or {"shards": []}
    samples = sum(s["samples"] for s in index["shards"])
    stored = sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in index["shards"])
    per_sample_stored = stored / max(samples, 1)
    report.update(samples=samples, skipped=num_samples - samples, shards=len(index["shards"]),
                  format=TEXT_STATES if args.store_text_states else TOKENS,
                  bytes_per_sample_stored=round(per_sample_stored),
                  bytes_per_sample_raw=round(sum(s["raw_data"]["bytes"] for s in index["shards"]) / max(samples, 1)),
                  projected_samples=SAMPLES_AT_SCALE,
                  projected_tb_stored=round(per_sample_stored * SAMPLES_AT_SCALE / 1e12, 2),
                  # full shards of --size_limit (this dataset's last shard, maybe its only one, is partial)
                  projected_shards=math.ceil(SAMPLES_AT_SCALE / max(1, bytes_to_int(args.size_limit) // max(
                      1, math.ceil(sum(s["raw_data"]["bytes"] for s in index["shards"]) / max(samples, 1))))))
    if args.buckets:  # one MDS folder per bucket, each of one shape, for one Streaming stream each
        report["buckets"] = sort_into_buckets(args, index)
    print(f"done: {samples:,} of {num_samples:,} samples in {args.out} ({num_samples - samples:,} skipped: "
          f"undecodable), {report['bytes_per_sample_stored']:,} bytes per sample stored "
          f"({report['bytes_per_sample_raw']:,} before compression, format {report['format']}); "
          f"{SAMPLES_AT_SCALE:,} such samples: {report['projected_tb_stored']:,} TB in about "
          f"{report['projected_shards']:,} shards", flush=True)
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
