"""Precomputed VAE latents and text-encoder outputs: encode the dataset once, then train on them.

    python latents.py --local /data/mds/laion --out /data/mds/laion-latents-512 \
        --model_name /path/to/stable-diffusion-2-base --image_size 512 --batch_size 32
    composer -n 8 latents.py --remote s3://bucket/laion/mds --local /tmp/laion-cache \
        --out s3://bucket/laion/latents-512 --model_name /path/to/stable-diffusion-2-base
    composer benchmark.py --precomputed --remote s3://bucket/laion/latents-512 --local /tmp/latents-cache

The UNet is the only part of Stable Diffusion that trains; the VAE encoder and the text encoder are
frozen, yet online training runs both on every image of every epoch. The VAE encoder is the costly
one (1,117 GFLOP per 512x512 image, against 2,409 for the UNet's training step); the text encoder
costs 45 GFLOP (1.9%) but its output is 77 x 1024 values, 157,696 bytes in fp16, where the token
ids it reads are 154. So by default this script runs the VAE once over image-caption MDS shards
(the `jpg`/`caption` columns that convert.py writes and data.StreamingImageCaptions reads) and
writes MDS shards with, per sample (the format is defined in data.py, which training reads):

    index          int64                  position of the sample in the source dataset
    latent_mean    ndarray (4, S/8, S/8)  the VAE posterior's mean (unscaled, before x 0.18215)
    latent_logvar  ndarray (4, S/8, S/8)  the VAE posterior's log-variance (clamped to [-30, 20])
    token_ids      ndarray uint16 (77,)   the caption's CLIP token ids (training runs the text encoder)
    caption        str                    the caption (left out with --no_captions)

65,698 bytes per sample at 512x512 before compression (188 TB for 2.9 billion samples). With
--store_text_states, `token_ids` is replaced by

    text_states    ndarray (77, D)        the text encoder's last hidden state (what the UNet attends to)

and training runs no encoder at all, for 3.4x the storage (223,240 bytes, 640 TB). Training
(benchmark.py --precomputed) tells the two formats apart by their columns. The final report
prints the bytes per sample stored and what 2,867,200,000 such samples take.

Flux.1 (`--model_config flux1-schnell`, `flux1-tiny`) stores text states by default, MLPerf's format:
`latent_mean` and `latent_logvar` (16, S/8, S/8), `t5_states` (256, 4096: T5-XXL's last hidden states)
and `clip_pooled` (768: CLIP-L's pooled output), 2,164,232 bytes per 256x256 sample in fp16;
`--store_token_ids` stores `clip_ids` (77) and `t5_ids` (256) instead (66,210 bytes), and T5-XXL and
CLIP then run in every training step (docs/flux.md).

Why the distribution and not a latent: the VAE encoder outputs a Gaussian, and online training
draws a fresh latent from it every time it sees the image. Storing the mean and log-variance lets
`t2ibench.model.DiffusionModel` do the same draw (mean + exp(logvar / 2) * noise) each epoch, so
training on precomputed data is the same training, not training on one frozen noise sample.

Storage dtype (--storage_dtype, default fp16). fp16 keeps 11 significant bits (relative error
below 5e-4) up to +-65504; bf16 keeps only 8 bits (4e-3), its wider range is not needed here, and
NumPy, hence MDS, has no bfloat16 (it would have to be stored as raw bytes). The values fit fp16
with a wide margin: the log-variance is clamped to [-30, 20] by the VAE itself (fp16 spacing there
is 1/64 or finer: at most 0.4% on the standard deviation, itself tiny), the latent means
have a spread of about 1/0.18215 = 5.5, and the text states come out of a final layer norm. That
is the expectation for the pretrained SD2 encoders; what was measured (tiny random-weight model:
|mean| < 1.1, logvar in [-1.3, 1], |text| < 3.3) says little about them, so the run checks every
value and stops, naming --storage_dtype fp32, if one is not finite or would overflow fp16; its
final report prints the largest magnitudes it saw. At 512x512 with SD2 (D = 1024) a sample is
2 x 4 x 64 x 64 x 2 + 77 x 2 + 8 = 65,698 bytes before compression (plus the caption), 131,234 in
fp32; with --store_text_states 2 x 4 x 64 x 64 x 2 + 77 x 1024 x 2 + 8 = 223,240, 446,472 in
fp32. Training batches keep the stored dtype, so fp16 also halves the host-to-device
copy; the model casts the inputs itself (to fp32, then autocast).

Every sample is encoded exactly once. The source is cut into chunks of --chunk_size consecutive
sample indices; chunk k holds samples [k * chunk_size, (k + 1) * chunk_size) and is written as its
own MDS dataset `OUT/chunk{k:06d}/` (shards plus index.json, which MDSWriter writes last). The
chunks still to do are dealt round-robin to the ranks, which read their samples by index (no
shuffling, no padding of ranks to equal lengths, so nothing is repeated; each chunk also checks
that it got every index of its range once). A chunk with a readable index.json is complete and is
skipped on a rerun, so an interrupted job is resumed by running the same command again (on any
number of GPUs: chunks do not depend on the world size). When all chunks are complete, rank 0
merges their indexes into `OUT/index.json` (streaming.base.util.merge_index). The settings that
decide the content (source, chunk size, image size, model...) and a fingerprint of the source
(SHA-256 of its index.json shard list) are kept in `OUT/precompute.json`; a rerun with other
settings, or over a source replaced at the same path, is refused. --out may not overlap --local
or a local --remote, and --overwrite deletes only what this script writes there. Samples whose
image cannot be decoded (or whose caption is not a string) are skipped and logged; more than
--max_bad_fraction of them stops the run.
With several nodes, --out must be a shared folder or an object-store URI (s3://, gs://, oci://...).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from composer.utils import dist, reproducibility
from streaming import MDSWriter
from streaming.base.compression import get_compressions
from streaming.base.hashing import get_hashes
from streaming.base.util import bytes_to_int
from torch.utils.data import DataLoader, Dataset

import data
from data import (GEOMETRY_DTYPE, GEOMETRY_KEYS, LATENT_KEYS, STORAGE_DTYPES, TOKEN_IDS_DTYPE, mds_columns,
                  token_column)
from t2ibench import errors, flags
from t2ibench.cli import NON_NEGATIVE_INT, POSITIVE_INT, SECONDS
from t2ibench.errors import UserError, fail
from t2ibench.families import ModelFamily, require_pretrained
from t2ibench.files import acquire, write_text
from t2ibench.locations import is_remote, missing_upload_credentials, normalise, overlap, \
    unwritable, upload_schemes
from t2ibench.mds import INDEX_FILE, SHARD_NAME
from t2ibench.images import ImageGeometry
from t2ibench.model import scale_images, vae_overflows_in
from t2ibench.scale import SAMPLES as SAMPLES_AT_SCALE
from t2ibench.sources import Source, check_cache_current, parse_sources

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP16_MAX = float(np.finfo(np.float16).max)  # 65504
SETTINGS_FILE = "precompute.json"


def chunk_name(k: int) -> str:
    return f"chunk{k:06d}"


# -----------------------------------------------------------------------------------------------
# Reading the source: image-caption shards by sample index.
# -----------------------------------------------------------------------------------------------

class IndexedImageCaptions(data.StreamingImageCaptions):
    """data.StreamingImageCaptions read by index for encoding: yields the index, and flags bad samples.

    Training replaces an undecodable sample by the next one; here that would store one sample
    twice, so the sample is flagged (`ok` False) and left out of the output instead. Images and
    captions are prepared exactly as for online training (data.decode_image, the family's tokenize).
    """

    def get_item(self, index: int) -> dict[str, Any]:
        sample = self.read_sample(index)  # the raw columns: a shard that cannot be read is named (BadDataError)
        caption = sample.get(self.caption_key)
        try:
            if not isinstance(caption, str):
                raise TypeError(f"caption is {type(caption).__name__}, not str")
            image, geometry = data.decode_image_with_geometry(sample[self.image_key], self.image_size)
            return {"index": index, "ok": True, "image": image, **self.token_ids(caption), "caption": caption,
                    **data.geometry_tensors(geometry)}
        except Exception as error:  # noqa: BLE001  Pillow raises OSError, ValueError, SyntaxError...
            log.warning("sample %d in %s cannot be used (%s: %s); left out of the precomputed data",
                        index, self.shard_name(index), type(error).__name__, error)
            return {"index": index, "ok": False,
                    "image": torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8),
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

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.source.get_item(index)


# -----------------------------------------------------------------------------------------------
# The output folder: local path or object-store URI.
# -----------------------------------------------------------------------------------------------

def join(out: str, *names: str) -> str:
    return "/".join([out.rstrip("/"), *names]) if is_remote(out) else os.path.join(out, *names)


def read_json(out: str, name: str) -> dict | None:
    """OUT/name parsed, or None if it is missing or not valid JSON (an interrupted write)."""
    try:
        if not is_remote(out):
            return json.loads(Path(out, name).read_text())
        from streaming.base.storage import CloudDownloader

        with tempfile.TemporaryDirectory() as tmp:
            CloudDownloader.direct_download(join(out, name), os.path.join(tmp, "file.json"), 60)
            return json.loads(Path(tmp, "file.json").read_text())
    except Exception:  # noqa: BLE001  missing (local or remote) or truncated
        return None


def write_json(out: str, name: str, obj: dict) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    if not is_remote(out):
        write_text(Path(out, name), text)  # atomic: never a half-written file
        return
    from streaming.base.storage.upload import CloudUploader

    uploader = CloudUploader.get(out, keep_local=False, exist_ok=True)
    try:
        Path(uploader.local, name).write_text(text)
        uploader.upload_file(name)
    finally:
        shutil.rmtree(uploader.local, ignore_errors=True)


def completed_chunks(out: str, num_chunks: int) -> set[int]:
    """Chunks whose MDS dataset is complete: index.json readable (local: and all its shard files there)."""
    names = {chunk_name(k): k for k in range(num_chunks)}
    if not is_remote(out):
        done = set()
        for name, k in names.items():
            index = read_json(join(out, name), INDEX_FILE)
            if index is None:
                continue
            # MDSWriter keeps the compressed file when it compresses, else the raw one.
            files = [(s.get("zip_data") or s["raw_data"])["basename"] for s in index.get("shards", [])]
            if all(Path(out, name, f).is_file() for f in files):
                done.add(k)
        return done
    from streaming.base.storage.upload import CloudUploader

    # One listing instead of one request per chunk. MDSWriter uploads index.json after the shards
    # (this script uses one upload thread for remote output, so it is strictly last).
    uploader = CloudUploader.get(out, keep_local=False, exist_ok=True)
    try:
        keys = uploader.list_objects() or []
    except NotImplementedError:
        return {k for name, k in names.items() if read_json(join(out, name), INDEX_FILE) is not None}
    finally:
        shutil.rmtree(uploader.local, ignore_errors=True)
    done = set()
    for key in keys:
        parts = key.rstrip("/").split("/")
        if len(parts) >= 2 and parts[-1] == INDEX_FILE and parts[-2] in names:
            done.add(names[parts[-2]])
    return done


def check_settings(existing: dict | None, settings: dict) -> str | None:
    """Why `settings` cannot continue the precompute recorded in `existing`, or None if it can."""
    if existing is None:
        return None
    keys = sorted(set(existing) | set(settings))
    diffs = [f"{k}: {existing.get(k)!r} there, {settings.get(k)!r} now" for k in keys if existing.get(k) != settings.get(k)]
    if not diffs:
        return None
    if existing.get("source_index_sha256") != settings.get("source_index_sha256") and len(diffs) == 1:
        return ("the output folder holds latents of another version of the source: its index.json (shard names, "
                "sizes, hashes) changed since they were computed, so resuming would mix two datasets: use "
                "another --out, or --overwrite to start over")
    return ("the output folder holds latents computed with other settings (" + "; ".join(diffs) +
            "): use another --out, the same settings, or --overwrite")


def clear_output(out: str) -> None:
    """--overwrite on a local folder: delete a precomputed dataset there, and only what this script
    writes (precompute.json, index.json, chunkNNNNNN folders of MDS files); anything else: refuse."""
    path = Path(out)
    if not path.is_dir() or not any(path.iterdir()):
        return
    if not (path / SETTINGS_FILE).is_file():  # an index.json alone could be any dataset, the source even
        fail(f"--out {out} is not empty and holds no precomputed latents (no {SETTINGS_FILE}): refusing to delete "
             "it; choose a new or empty folder")
    ours = {SETTINGS_FILE, f".{SETTINGS_FILE}.tmp", INDEX_FILE}
    chunk = re.compile(r"chunk\d{6}")
    partial = re.compile(rf"\.{re.escape(SETTINGS_FILE)}\.\w+\.partial")  # files.atomic_file's, left by a kill
    foreign = []
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and chunk.fullmatch(entry.name):
            foreign += [f"{entry.name}/{f.name}" for f in sorted(entry.iterdir())
                        if not (f.is_file() and (f.name == INDEX_FILE or SHARD_NAME.fullmatch(f.name)))]
        elif not (entry.is_file() and (entry.name in ours or partial.fullmatch(entry.name))):
            foreign.append(entry.name)
    if foreign:
        fail(f"--out {out} holds files latents.py did not write ({', '.join(foreign[:3])}"
             f"{'...' if len(foreign) > 3 else ''}): --overwrite deletes only precomputed latents; move them away "
             "or choose another --out")
    for entry in path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def plan_work(args: argparse.Namespace, settings: dict, num_chunks: int) -> list[int]:
    """Rank 0: hold --out (a second latents.py into it is refused; see main), check it, record the settings
    there, and return the chunks still to do."""
    if not is_remote(args.out) and getattr(args, "out_hold", None) is None:
        args.out_hold = acquire("--out", args.out)
    if args.overwrite and not is_remote(args.out):
        clear_output(args.out)
    existing = read_json(args.out, SETTINGS_FILE)
    if existing is None:
        # Never mix chunks into (and later replace the index.json of) some other dataset.
        path = Path(args.out)
        foreign = (path.is_dir() and any(path.iterdir())) if not is_remote(args.out) else \
            read_json(args.out, INDEX_FILE) is not None
        if foreign:
            fail(f"--out {args.out}: not empty and holds no precomputed latents (no {SETTINGS_FILE}); choose a new "
                 "or empty folder")
    elif not args.overwrite:
        problem = check_settings(existing, settings)
        if problem:
            fail(f"--out {args.out}: {problem}")
    write_json(args.out, SETTINGS_FILE, settings)
    done = set() if args.overwrite and is_remote(args.out) else completed_chunks(args.out, num_chunks)
    return [k for k in range(num_chunks) if k not in done]


# -----------------------------------------------------------------------------------------------
# Encoding.
# -----------------------------------------------------------------------------------------------

@torch.no_grad()
def encode(family: ModelFamily, vae: torch.nn.Module, text_encoders: dict[str, torch.nn.Module], images: torch.Tensor,
           ids: dict[str, torch.Tensor], device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """VAE posterior mean and log-variance, and the text states (the family's conditioning by key,
    SD2: text_states, Flux: t5_states and clip_pooled; empty without text encoders: the token ids
    are stored instead), as float32 on `device`."""
    images = scale_images(images.to(device, non_blocking=True))  # uint8 pixels -> [-1, 1] on the device
    ids = {key: value.to(device, non_blocking=True) for key, value in ids.items()}
    # Contiguous, not channels-last: eager CUDA GroupNorm returns contiguous tensors, so in a
    # channels-last VAE every convolution after a norm would convert its input back.
    autocast = (torch.autocast("cuda", dtype=dtype) if device.type == "cuda" and dtype != torch.float32
                else contextlib.nullcontext())
    vae_autocast = contextlib.nullcontext() if not vae_overflows_in(vae, dtype) else \
        torch.autocast(device.type, enabled=False)  # SDXL's own VAE overflows in fp16: fp32 for it
    with autocast:
        with vae_autocast:
            posterior = vae.encode(images).latent_dist
        text_states = ({key: value.float() for key, value in family.encode_text(text_encoders, ids).items()}
                       if text_encoders else {})
    return posterior.mean.float(), posterior.logvar.float(), text_states


STAT_NAMES = ("max_abs_mean", "min_logvar", "max_logvar", "max_abs_text")


class Stats:
    """What this rank wrote, and the value ranges it saw (evidence that the storage dtype fits)."""

    def __init__(self):
        self.written = self.bad = 0
        self.max_abs_mean = self.max_abs_text = 0.0
        self.min_logvar, self.max_logvar = math.inf, -math.inf

    def update(self, values: list[float]) -> None:
        for name, value in zip(STAT_NAMES, values):
            pick = min if name.startswith("min") else max
            setattr(self, name, pick(getattr(self, name), value))


class Encoded:
    """One batch's outputs on their way to the host: copied asynchronously (pinned memory on GPU),
    so that the GPU encodes the next batch while this process writes this one."""

    def __init__(self, indices: list[int], captions: list[str], outputs: tuple[Any, ...],
                 storage_dtype: str, device: torch.device, token_ids: dict[str, torch.Tensor] | None = None,
                 geometry: dict[str, torch.Tensor] | None = None):
        mean, logvar, text = outputs  # text {}: the token ids are stored instead of text states
        self.indices, self.captions = indices, captions
        self.token_ids = {key: ids.numpy().astype(TOKEN_IDS_DTYPE) for key, ids in (token_ids or {}).items()}
        self.geometry = {key: value.numpy().astype(GEOMETRY_DTYPE) for key, value in (geometry or {}).items()}
        self.keys = [*LATENT_KEYS, *text]  # the stored arrays, in order
        dtype = getattr(torch, STORAGE_DTYPES[storage_dtype])
        text_max = (torch.stack([t.abs().amax() for t in text.values()]).amax() if text
                    else torch.zeros((), device=mean.device))
        ranges = torch.stack([mean.abs().amax(), logvar.amin(), logvar.amax(), text_max])
        pinned = device.type == "cuda"
        tensors = [mean, logvar, *text.values(), ranges]
        self.host = [torch.empty(t.shape, dtype=t.dtype if t is ranges else dtype, pin_memory=pinned) for t in tensors]
        for host, tensor in zip(self.host, tensors):
            host.copy_(tensor.to(host.dtype), non_blocking=pinned)
        self.event = None
        if pinned:
            self.event = torch.cuda.Event()
            self.event.record()

    def arrays(self, storage_dtype: str, compute_dtype: str) -> tuple[list[np.ndarray], list[float]]:
        """Wait for the copies; the arrays (mean, logvar[, conditioning]) and the value ranges. Stops on
        a value that is not finite or does not fit the storage dtype (it would be stored as inf)."""
        if self.event is not None:
            self.event.synchronize()
        arrays = [t.numpy() for t in self.host[:-1]]
        ranges = self.host[-1].tolist()
        for key, array in zip(self.keys, arrays):
            rows = ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
            if not rows.any():
                continue
            which = [self.indices[i] for i in np.flatnonzero(rows)][:10]
            if np.isfinite(ranges).all():  # finite in float32, so too big for the storage dtype
                raise OverflowError(f"{key} of samples {which} exceeds the {storage_dtype} range "
                                    f"(+-{FP16_MAX:g}): rerun with --storage_dtype fp32")
            raise FloatingPointError(f"{key} of samples {which} is not finite (computed in {compute_dtype}): "
                                     "rerun with --dtype bf16 or --dtype fp32")
        return arrays, ranges


def _writer(out: str, name: str, columns: dict[str, str], args: argparse.Namespace) -> MDSWriter:
    kwargs: dict[str, Any] = dict(exist_ok=True)  # removes what an interrupted attempt left locally
    if is_remote(out):
        kwargs["max_workers"] = 1  # uploads in order: index.json strictly after the shards
    return MDSWriter(out=join(out, name), columns=columns, compression=args.compression,
                     hashes=args.hashes, size_limit=args.size_limit, **kwargs)


def build_parser() -> flags.Parser:
    p = flags.Parser("latents.py", description=__doc__)
    p.add_argument("--out", type=str, required=True, help="output folder, or s3:// gs:// oci:// ... URI")
    flags.add_source(p)
    flags.add_model(p)
    flags.add_run(p, "seeds randomly initialized encoders (as benchmark.py --seed)")
    g = p.add_argument_group("encoding and output")
    g.add_argument("--batch_size", type=POSITIVE_INT, default=32, help="images per encoder call on each device")
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
    g.add_argument("--compression", type=str, default="zstd", help="shard compression: zstd, zstd:<level>, gz, none")
    g.add_argument("--hashes", type=str, default="xxh64",
                   help="comma-separated shard hashes stored in the index ('' for none)")
    g.add_argument("--size_limit", type=str, default="256mb",
                   help="shard size before compression (256mb: 4,081 samples at 512px, 490k shards for 2B samples, "
                        "whose index every training process holds; see bench/index_scale.py)")
    g.add_argument("--overwrite", action="store_true", help="start over: discard the chunks already in --out")
    g.add_argument("--dist_timeout", type=SECONDS, default=3 * 3600.0, help="seconds a rank may wait for the others")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.compression = None if args.compression.lower() in ("", "none") else args.compression
    args.hashes = [h.strip() for h in args.hashes.split(",") if h.strip()]
    return args


def validate(args: argparse.Namespace) -> tuple[ModelFamily, Source]:
    """One line naming the flag for every value that would fail later; the family and the source."""
    family = flags.check_shared(args)
    if args.store_text_states and args.store_token_ids:
        fail("--store_text_states and --store_token_ids: choose one")
    args.store_text_states = args.store_text_states or (
        family.default_precomputed_format == "text_states" and not args.store_token_ids)
    for flag in ("batch_size", "chunk_size"):
        if getattr(args, flag) <= 0:
            fail(f"--{flag} {getattr(args, flag)} must be positive")
    too_many = flags.check_workers("--num_workers", args.num_workers, dist.get_local_world_size())
    if too_many:
        fail(too_many)
    if not 0.0 < args.dist_timeout < math.inf:
        fail(f"--dist_timeout {args.dist_timeout} must be a positive number of seconds")
    try:
        if not 0 < bytes_to_int(args.size_limit) < 2**32:
            raise ValueError
    except (ValueError, TypeError):
        fail(f"--size_limit {args.size_limit} must be a size such as 64mb, below 4gb")
    unknown = [c for c in [args.compression] if c and c not in get_compressions()]
    unknown += [h for h in args.hashes if h not in get_hashes()]
    if unknown:
        fail(f"--compression / --hashes: unknown compression or hash {unknown}: compressions are "
             f"{sorted({c.split(':')[0] for c in get_compressions()})}, hashes are {sorted(get_hashes())}")
    sources = parse_sources(args.remote, args.local)
    if not sources:
        fail("no input: pass --remote (with --local as cache) or --local with the image-caption MDS shards")
    if len(sources) > 1:
        fail(f"--remote: latents.py reads one source ({len(sources)} given); precompute each into its own --out "
             "and train on them together (benchmark.py --precomputed --remote 0.7=A,0.3=B)")
    source = sources[0]
    args.out = normalise("--out", args.out, upload_schemes())
    if not source.remote and not Path(source.local).is_dir():
        fail(f"--local {source.local} is not a folder; give --remote to stream shards into it")
    if not source.remote and not Path(source.local, INDEX_FILE).is_file():
        fail(f"--local {source.local} holds no MDS dataset (no {INDEX_FILE}): point it at the image-caption shards "
             "that convert.py wrote, or give --remote to stream them into it")
    problem = overlap("--out", args.out, [("--local", source.local), ("--remote", source.remote)]) \
        or missing_upload_credentials("--out", args.out)
    if not problem and not is_remote(args.out):
        problem = unwritable("--out", args.out, folder=True)
    if not problem and source.remote:  # the cache Streaming downloads the source shards into
        problem = unwritable("--local", source.local, folder=True)
    if problem:
        fail(problem)
    check_cache_current(source)  # a cache of an older version of the remote: refused, not read
    return family, source


def source_fingerprint(source: IndexedImageCaptions) -> str:
    """SHA-256 of the source's index.json shard list (names, sizes, hashes, sample counts): a source
    replaced at the same path, even with the same number of samples, gets another fingerprint."""
    index = json.loads(Path(source.streams[0].local, INDEX_FILE).read_text())
    return hashlib.sha256(json.dumps(index["shards"], sort_keys=True).encode()).hexdigest()


def main(argv: list[str] | None = None) -> dict | None:
    """Encode the source into --out; rank 0 returns the report (None on the other ranks)."""
    args = parse_args(argv)
    try:
        with errors.command("latents.py", debug=args.debug, explain=bad_data):
            return run(args)
    finally:
        if getattr(args, "out_hold", None) is not None:
            args.out_hold.release()  # held by rank 0 from plan_work to the end


def run(args: argparse.Namespace) -> dict | None:
    """main's body: validate, build, plan, encode, finish."""
    family, source_location = validate(args)
    device = start(args)
    vae, text_encoders, tokenizers, random_encoders = build_encoders(args, family, device)
    source, fingerprint = open_source(args, family, source_location, tokenizers)
    columns = mds_columns(vae.config.latent_channels, args.image_size // family.latent_downsample, None,
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
    }
    mine = plan(args, settings, num_chunks)
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


def plan(args: argparse.Namespace, settings: dict, num_chunks: int) -> list[int]:
    """This rank's chunks: rank 0 decides what is left to do (plan_work) and every rank gets the same
    list, or the same error."""
    world, rank = dist.get_world_size(), dist.get_global_rank()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = plan_work(args, settings, num_chunks)
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
                writer = _writer(args.out, chunk_name(k), columns, args)
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
                  format="text_states" if args.store_text_states else "tokens",
                  bytes_per_sample_stored=round(per_sample_stored),
                  bytes_per_sample_raw=round(sum(s["raw_data"]["bytes"] for s in index["shards"]) / max(samples, 1)),
                  projected_samples=SAMPLES_AT_SCALE,
                  projected_tb_stored=round(per_sample_stored * SAMPLES_AT_SCALE / 1e12, 2),
                  # full shards of --size_limit (this dataset's last shard, maybe its only one, is partial)
                  projected_shards=math.ceil(SAMPLES_AT_SCALE / max(1, bytes_to_int(args.size_limit) // max(
                      1, math.ceil(sum(s["raw_data"]["bytes"] for s in index["shards"]) / max(samples, 1))))))
    print(f"done: {samples:,} of {num_samples:,} samples in {args.out} ({num_samples - samples:,} skipped: "
          f"undecodable), {report['bytes_per_sample_stored']:,} bytes per sample stored "
          f"({report['bytes_per_sample_raw']:,} before compression, format {report['format']}); "
          f"{SAMPLES_AT_SCALE:,} such samples: {report['projected_tb_stored']:,} TB in about "
          f"{report['projected_shards']:,} shards", flush=True)
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
