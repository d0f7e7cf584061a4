"""Training data: everything `benchmark.py` reads, in one place.

- the synthetic dataset of the 2023 benchmark;
- LAION-style image-caption MDS shards (written by convert.py), streamed with MosaicML Streaming;
- precomputed VAE latents and text states (written by latents.py): their on-disk format, defined
  here once, and the datasets that train from them.

Image datasets yield dicts with `image` (3, S, S) uint8 pixels and `captions` (77,) int64
token ids (images cross from the loader workers as bytes, a quarter of float32's shared memory,
pinned memory and host-to-device traffic; `model.scale_images` maps them to [-1, 1] on the
device); precomputed ones `latent_mean`, `latent_logvar` and either `captions` (token ids, the
default format) or `text_states`. All are what `model.StableDiffusion` consumes.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections import Counter
from typing import Any

import numpy as np
import torch
from composer.utils import dist
from PIL import Image, ImageOps
from streaming import Stream, StreamingDataLoader, StreamingDataset
from torch.utils.data import DataLoader, Dataset

import paths
from model import LATENT_SCALE
from tokenizer import MAX_LENGTH, VOCAB_SIZE, tokenize


class SyntheticImageCaptions(Dataset):
    """Random images and random token ids: measures the model, not the data pipeline.

    Samples are generated from their index, so every epoch and every rank sees the same data for
    the same index, and no memory is spent storing them.
    """

    def __init__(self, image_size: int, num_samples: int = 100_000, seed: int = 0):
        self.image_size, self.num_samples, self.seed = image_size, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randint(0, 256, (3, self.image_size, self.image_size), generator=g, dtype=torch.uint8)
        captions = torch.randint(0, VOCAB_SIZE, (MAX_LENGTH,), generator=g)
        return {"image": image, "captions": captions}


def loader_kwargs(num_workers: int) -> dict:
    """DataLoader settings of the 2023 benchmark: pinned memory, persistent workers, drop_last."""
    return dict(
        num_workers=num_workers, pin_memory=torch.cuda.is_available(), drop_last=True,
        persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers > 0 else None,
    )


def synthetic_dataloader(image_size: int, batch_size_per_device: int, num_workers: int,
                         num_samples: int = 100_000, seed: int = 0) -> DataLoader:
    """Synthetic samples, each rank reading its own shard through Composer's distributed sampler."""
    dataset = SyntheticImageCaptions(image_size, num_samples, seed)
    sampler = dist.get_sampler(dataset, shuffle=True, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size_per_device, sampler=sampler, **loader_kwargs(num_workers))


# -----------------------------------------------------------------------------------------------
# LAION-style image-caption data: MDS shards streamed with MosaicML Streaming.
#
# `convert.py` writes the shards (columns `jpg`: encoded image bytes, `caption`: str, `key`: str).
# Every rank and every loader worker streams its own part of them from `remote` (s3://, gs://,
# oci://, a path...) into the `local` cache, decodes images by content (JPEG, PNG, WebP...), and
# turns each sample into the same dict the synthetic set yields.
# -----------------------------------------------------------------------------------------------

log = logging.getLogger(__name__)

# Bad data policy. A worker stops the run when more than this fraction of the images it decoded
# failed, once it has decoded at least BAD_CHECK_AFTER of them (the minimum keeps one bad image
# early in an epoch from counting as "100% bad"). Dataloader workers are separate processes, so
# the counts (and the check) are per worker: with 8 workers each sees about 1/8 of the samples.
MAX_BAD_FRACTION = 0.01
BAD_CHECK_AFTER = 1000
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}


class CompactSpanner:
    """Sample index -> (shard, index within the shard), by binary search over the shard boundaries.

    Replaces streaming.base.spanner.Spanner (Streaming 0.13), which every process that opens a
    dataset builds with an int64 per sample (np.repeat over all samples, 16 GB for 2 billion) and
    then keeps a small array per 1,024 samples (2 million arrays): seconds to minutes and gigabytes
    per rank at LAION scale (bench/index_scale.py). This keeps the shard boundaries only (8 bytes
    per shard) and answers in O(log shards), the same answers for every index.
    """

    def __init__(self, shard_sizes: np.ndarray, span_size: int = 1 << 10):
        self.shard_sizes = shard_sizes
        self.shard_bounds = np.concatenate([np.zeros(1, np.int64), np.cumsum(shard_sizes, dtype=np.int64)])
        self.num_samples = int(self.shard_bounds[-1])

    def __getitem__(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"Invalid sample index `{index}`: 0 <= {index} < {self.num_samples}")
        shard = int(np.searchsorted(self.shard_bounds, index, side="right")) - 1  # skips empty shards
        return shard, int(index - self.shard_bounds[shard])


def use_compact_spanner() -> None:
    """Make StreamingDataset (in this process) build CompactSpanner instead of Streaming's Spanner."""
    import streaming.base.dataset

    streaming.base.dataset.Spanner = CompactSpanner


use_compact_spanner()  # every dataset of this project, from the first one built


class BadDataError(RuntimeError):
    """Too many samples of the dataset could not be decoded: the data, not the run, needs fixing."""


# Object-store clients: their errors are about the store (credentials, network), not the shard's bytes.
STORAGE_MODULES = ("botocore", "boto3", "google", "oci", "azure", "libcloud", "paramiko")


class NamedShardErrors:
    """A StreamingDataset mix-in: a shard that cannot be read fails naming it, in one line.

    Streaming 0.13 reads a shard in a background thread; when that fails, the sample read only
    says "Background thread failed", and a shard cut short or corrupted fails deep in its reader
    (an IndexError on a sample offset) with no file named. The failing shard is remembered where it
    is prepared, and the read that fails raises BadDataError with its name (benchmark.py prints it
    as one line). Store errors are left alone: they are reported as such.
    """

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        try:
            super().prepare_shard(shard_id, blocking)
        except Exception as error:  # noqa: BLE001 - remembered, then raised as it was
            self._failed_shard = (self._shard_file(shard_id), error)
            raise

    def _shard_file(self, shard_id: int) -> str:
        shard = self.shards[shard_id]
        stream = self.streams[self.stream_per_shard[shard_id]]
        info = getattr(shard, "zip_data", None) or getattr(shard, "raw_data", None)
        name = info.basename if info is not None else f"shard {shard_id}"
        return f"{(stream.remote or stream.local).rstrip('/')}/{name}"

    def read_sample(self, index: int) -> dict[str, Any]:
        """StreamingDataset.get_item, with a failure to read a shard named."""
        try:
            return StreamingDataset.get_item(self, index)
        except Exception as error:
            if type(error).__module__.startswith(STORAGE_MODULES) or isinstance(error, BadDataError):
                raise
            failed = getattr(self, "_failed_shard", None)
            where, cause = failed if failed else (self._shard_file(self.spanner[index][0]), error)
            detail = (str(cause).strip().splitlines() or [""])[0][:200]
            raise BadDataError(f"shard {where} cannot be read ({type(cause).__name__}: {detail}): it is truncated or "
                               "corrupted; re-convert it, or delete it from the cache to download it again "
                               "(--validate_hash checks every shard file before training)") from error


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow image as 8-bit RGB: transparency composited on white, grayscale/CMYK/16-bit converted.

    Composite on white (not black, and not by dropping alpha) because transparent areas of logos
    and product photos are meant to be seen on a white page; dropping alpha would expose whatever
    colors the encoder left under the transparent pixels.
    """
    if image.mode == "I" or image.mode.startswith("I;16"):
        # 16-bit grayscale PNG/TIFF: Pillow's convert("RGB") clips at 255; scale 0..65535 to 0..255.
        image = Image.fromarray((np.asarray(image, dtype=np.float32) / 257.0).clip(0, 255).astype(np.uint8))
    if "transparency" in image.info and image.mode in ("P", "L", "RGB"):
        image = image.convert("RGBA")  # a palette entry or one gray/RGB value (PNG tRNS) is transparent
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        white.alpha_composite(rgba)
        return white.convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(data: bytes) -> Image.Image:
    """Decode encoded image bytes (format detected from the content, never from a file name)."""
    image = Image.open(io.BytesIO(data))
    image.load()  # decode now: a truncated or corrupt file fails here, not later in a resize
    return image


def decode_image(data: bytes, size: int) -> torch.Tensor:
    """Encoded image bytes -> (3, size, size) uint8 tensor (`model.scale_images` makes it [-1, 1]).

    The image is oriented by its EXIF tag, converted to RGB (`to_rgb`), resized so that its shorter
    side is `size` pixels (bicubic, antialiased: Pillow filters over the whole footprint when it
    downsamples) and center-cropped to a square. Resize and crop are one `resize(box=...)` call,
    which only resamples the pixels that survive the crop.
    """
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    if min(width, height) >= 4 * size:
        # A big JPEG can be decoded at 1/2, 1/4 or 1/8 scale by the IDCT itself, several times
        # faster. Stay at >= 2x the target so the bicubic filter still does the final antialiasing
        # (the same rule as Pillow's thumbnail(), reducing_gap=2).
        scale = 2 * size / min(width, height)
        image.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
    image.load()
    ImageOps.exif_transpose(image, in_place=True)  # phone photos are stored sideways plus a tag
    image = to_rgb(image)
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    image = image.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8))  # (size, size, 3), a writable copy
    return pixels.permute(2, 0, 1).contiguous()  # channels first


def _check_local_only(local: str) -> None:
    """Refuse a cache that a run with a remote filled, before Streaming deletes its shards.

    Streaming deletes each compressed shard after decompressing it into a remote's cache. Without
    a remote, Streaming expects the compressed shard next to the decompressed one (as convert.py's
    output has, once read), calls a decompressed shard without it inconsistent, deletes it, and
    then fails for lack of a remote to download it from.
    """
    index_path = os.path.join(local, "index.json")
    if not os.path.isfile(index_path):
        return  # Streaming says what is missing
    with open(index_path) as f:
        shards = json.load(f).get("shards", [])
    for shard in shards:
        raw, zipped = shard.get("raw_data") or {}, shard.get("zip_data") or {}
        if zipped and raw and not os.path.exists(os.path.join(local, zipped["basename"])) \
                and os.path.exists(os.path.join(local, raw["basename"])):
            raise ValueError(
                f"{local} is the cache of a run that streamed from a remote (it holds {raw['basename']} but not "
                f"{zipped['basename']}): pass that remote again (--remote; shards already cached are not "
                "downloaded again), or point --local at the converted dataset itself")


# Several sources, mixed. `--remote` takes one source or several (repeat the flag, or separate them
# by commas), each optionally prefixed by its proportion of every epoch: `0.7=s3://a/mds,0.3=gs://b/mds`.
# A prefix, not a ":0.7" suffix: a suffix could be part of a URI or path (s3://b/year=2023, C:\data),
# while no URI scheme and no Windows drive starts with "<number>=" (a relative path that does is
# written "./0.5=data"). Proportions are relative (Streaming normalizes them); give them for every
# source or for none (then each source contributes all its samples once per epoch).
_PROPORTION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)=(.+)$")


def parse_sources(remote: str | None) -> list[tuple[str, float | None]]:
    """'0.7=s3://a/mds,0.3=/data/b' -> [('s3://a/mds', 0.7), ('/data/b', 0.3)]; raises ValueError on bad input."""
    sources = []
    for item in (remote or "").split(","):
        item = item.strip()
        if not item:
            continue
        match = _PROPORTION.match(item)
        proportion, source = (float(match.group(1)), match.group(2)) if match else (None, item)
        if proportion is not None and proportion <= 0:
            raise ValueError(f"--remote {item}: the proportion must be positive")
        sources.append((source, proportion))
    given = [p is not None for _, p in sources]
    if any(given) and not all(given):
        raise ValueError(f"--remote {remote}: give a proportion to every source (0.7=s3://a,0.3=s3://b) or to none")
    seen: dict[str, str] = {}
    for source, _ in sources:
        key = paths.same_source_key(source)
        if key in seen:
            same = "twice" if seen[key] == source else f"as {seen[key]} and as {source}"
            raise ValueError(f"--remote {remote}: the source {source} is given {same}; give each source once "
                             "(a proportion sets its share of every epoch)")
        seen[key] = source
    return sources


def stream_local(local: str, remote: str) -> str:
    """The cache folder of one of several sources: its own subfolder of `local`, named by a hash of
    the source, so two sources never share (and overwrite) an index.json."""
    return os.path.join(local, hashlib.sha1(remote.encode()).hexdigest()[:12])


def make_streams(remote: str | None, local: str | None, **stream_kwargs: Any) -> list[Stream] | None:
    """Streaming `Stream`s for several sources (see parse_sources), each cached in its own folder;
    None for a single source without a proportion (StreamingDataset's remote/local, as before)."""
    sources = parse_sources(remote)
    if len(sources) <= 1 and all(p is None for _, p in sources):
        return None
    if not local:
        raise ValueError("several --remote sources need --local, the folder their caches go under")
    return [Stream(remote=source, local=stream_local(local, source), proportion=proportion, **stream_kwargs)
            for source, proportion in sources]


# Memory to start an epoch, per sample of the epoch (bench/index_scale.py, shuffle py1e): the node's
# partition builder (one process per node, the first worker of local rank 0) peaks at about 53 bytes,
# and the partition it shares with the node's workers takes 8. Above this many samples per epoch the
# start of every epoch costs one process more than 4 GiB: warn, naming the flag that bounds it.
EPOCH_BYTES_PER_SAMPLE = 61
LARGE_EPOCH_SAMPLES = 4 * 2**30 // EPOCH_BYTES_PER_SAMPLE  # about 70 million


def warn_about_large_epoch(dataset: StreamingDataset) -> None:
    """Log a warning (rank 0) when starting an epoch of `dataset` takes more than about 4 GiB."""
    if dataset.epoch_size > LARGE_EPOCH_SAMPLES and dist.get_global_rank() == 0:
        log.warning("an epoch of %s samples: each epoch starts by building its shuffled partition in one process "
                    "per node, about %.1f GiB (py1e); pass --epoch_size (e.g. 32m, with --sampling_granularity set to "
                    "the samples per shard) to bound it", f"{dataset.epoch_size:,}",
                    dataset.epoch_size * EPOCH_BYTES_PER_SAMPLE / 2**30)


def first_shards(dataset: StreamingDataset) -> list[tuple[str, Any]]:
    """(remote or local, first shard) of each stream of `dataset`: the columns every stream must have."""
    firsts = {}
    for shard_id, stream_id in enumerate(dataset.stream_per_shard):
        firsts.setdefault(int(stream_id), dataset.shards[shard_id])
    return [(dataset.streams[i].remote or dataset.streams[i].local, shard) for i, shard in sorted(firsts.items())]


class StreamingImageCaptions(NamedShardErrors, StreamingDataset):
    """Image-caption pairs streamed from MDS shards: yields {"image": (3,S,S) uint8, "captions": (77,)}.

    Args:
        remote: where the shards live (s3://bucket/path, gs://, oci://, azure://, hf://, a local
            path...), or None when `local` already holds them (index.json plus shards).
        local: cache folder the shards are downloaded to (or the shards themselves if remote is None).
        tokenizer: CLIP tokenizer; it is pickled into every dataloader worker.
        image_size: output side S in pixels.
        batch_size: per-device batch size. Streaming partitions samples over ranks and workers
            batch by batch, which makes the order deterministic and resumable mid-epoch.
        shuffle, shuffle_seed: shuffle every epoch (Streaming's py1e block shuffle), reproducibly.
        predownload: samples each worker downloads ahead of the one it yields (None: 8 x batch_size).
        download_retry, download_timeout: per-shard download attempts and seconds before failing.
        cache_limit: evict least-recently-used shards to keep `local` under this size ("500gb"),
            None to keep everything.
        validate_hash: check each downloaded shard against this hash from index.json ("xxh64").
        image_key, caption_key: MDS column names of the encoded image and of the caption.
        max_bad_fraction, bad_check_after: the bad-data policy (see MAX_BAD_FRACTION above).
        **streaming_kwargs: any other StreamingDataset argument (num_canonical_nodes, epoch_size...).

    A sample whose image cannot be decoded (or whose caption is not a string) is replaced by the
    next index (index + 1, wrapping around), which is the same on every rank and every run; each
    replacement is logged with the sample index and shard name, and counted in `bad_samples`.
    """

    def __init__(self, *, remote: str | None, local: str | None, tokenizer: Any, image_size: int,
                 batch_size: int, shuffle: bool = True, shuffle_seed: int = 9176, predownload: int | None = None,
                 download_retry: int = 2, download_timeout: float = 60.0, cache_limit: int | str | None = None,
                 validate_hash: str | None = None, image_key: str = "jpg", caption_key: str = "caption",
                 max_bad_fraction: float = MAX_BAD_FRACTION, bad_check_after: int = BAD_CHECK_AFTER,
                 **streaming_kwargs: Any):
        if not remote and local:
            _check_local_only(local)
        streams = make_streams(remote, local)
        if streams:
            remote = local = None  # StreamingDataset takes streams or remote/local, not both
        super().__init__(streams=streams, remote=remote, local=local, batch_size=batch_size, shuffle=shuffle,
                         shuffle_seed=shuffle_seed, predownload=predownload, download_retry=download_retry,
                         download_timeout=download_timeout, cache_limit=cache_limit,
                         validate_hash=validate_hash, **streaming_kwargs)
        self.tokenizer, self.image_size = tokenizer, image_size
        self.image_key, self.caption_key = image_key, caption_key
        self.max_bad_fraction, self.bad_check_after = max_bad_fraction, bad_check_after
        # Per process (the main process, or each dataloader worker after it gets its pickled copy).
        self.decoded = 0
        self.bad_samples: Counter[str] = Counter()  # shard name -> samples that failed to decode
        for where, shard in first_shards(self):
            columns = getattr(shard, "column_names", None)  # MDS readers list their columns
            if columns is not None and "latent_mean" in columns:
                raise ValueError(f"{where} holds precomputed latents, not images: train from them with "
                                 "--precomputed (benchmark.py) or latents_dataloader")
            for flag, key in (("image_key", image_key), ("caption_key", caption_key)):
                if columns is not None and key not in columns:
                    raise ValueError(f"{flag}={key!r} is not a column of the shards in {where}; "
                                     f"their columns are {columns}")

    def shard_name(self, index: int) -> str:
        """Where sample `index` lives, for messages: '<remote or local>/shard.00012.mds.zstd'."""
        return self._shard_file(self.spanner[index][0])

    def _decode(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        caption = sample[self.caption_key]
        if not isinstance(caption, str):
            raise TypeError(f"caption is {type(caption).__name__}, not str")
        image = decode_image(sample[self.image_key], self.image_size)
        return {"image": image, "captions": tokenize(self.tokenizer, [caption])[0]}

    def get_item(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index`, decoded; an undecodable one is replaced by the next index (see class doc)."""
        for attempt in range(self.num_samples):  # at most every sample once; the policy stops us sooner
            candidate = (index + attempt) % self.num_samples
            sample = self.read_sample(candidate)  # download errors are not bad data: they propagate
            self.decoded += 1
            try:
                return self._decode(sample)
            except Exception as error:  # noqa: BLE001  Pillow raises OSError, ValueError, SyntaxError...
                shard = self.shard_name(candidate)
                self.bad_samples[shard] += 1
                failed = sum(self.bad_samples.values())
                log.warning("sample %d in %s cannot be used (%s: %s); replaced by sample %d. "
                            "%d of %d samples decoded by this process failed.", candidate, shard,
                            type(error).__name__, error, (candidate + 1) % self.num_samples, failed, self.decoded)
                if self.decoded >= self.bad_check_after and failed > self.max_bad_fraction * self.decoded:
                    worst, worst_count = self.bad_samples.most_common(1)[0]
                    raise BadDataError(
                        f"{failed} of the {self.decoded} samples decoded by this data loader process failed "
                        f"(more than max_bad_fraction={self.max_bad_fraction:g}); most failures ({worst_count}) "
                        f"in shard {worst}; latest: sample {candidate} in shard {shard} ({type(error).__name__}: "
                        f"{error}). Check or re-convert that data (convert.py skips undecodable images).") from error
        raise BadDataError(f"none of the {self.num_samples} samples could be decoded "
                           f"(the first tried: sample {index} in {self.shard_name(index)})")


def laion_dataloader(remote: str | None, local: str | None, tokenizer: Any, image_size: int,
                     batch_size_per_device: int, num_workers: int, seed: int = 17, *,
                     image_key: str = "jpg", caption_key: str = "caption", shuffle: bool = True,
                     predownload: int | None = None, download_retry: int = 2, download_timeout: float = 60.0,
                     cache_limit: int | str | None = None, validate_hash: str | None = None,
                     max_bad_fraction: float = MAX_BAD_FRACTION, bad_check_after: int = BAD_CHECK_AFTER,
                     **streaming_kwargs: Any) -> StreamingDataLoader:
    """LAION-style MDS shards as batches {"image": (B,3,S,S) uint8, "captions": (B,77)} for this rank.

    `remote` None means the shards are already in `local`. The loader is a StreamingDataLoader, so
    Composer checkpoints its position and resumes mid-epoch. `seed` seeds the shuffle (the same on
    every rank, as Streaming requires).
    """
    if not remote and not local:
        raise ValueError("laion_dataloader needs remote (where the shards are) and/or local (the cache)")
    dataset = StreamingImageCaptions(
        remote=remote or None, local=local, tokenizer=tokenizer, image_size=image_size,
        batch_size=batch_size_per_device, shuffle=shuffle, shuffle_seed=seed, predownload=predownload,
        download_retry=download_retry, download_timeout=download_timeout, cache_limit=cache_limit,
        validate_hash=validate_hash, image_key=image_key, caption_key=caption_key,
        max_bad_fraction=max_bad_fraction, bad_check_after=bad_check_after, **streaming_kwargs)
    warn_about_large_epoch(dataset)
    return StreamingDataLoader(dataset, batch_size=batch_size_per_device, **loader_kwargs(num_workers))


# -----------------------------------------------------------------------------------------------
# Precomputed latents (written by latents.py): the on-disk format, and training from it.
# -----------------------------------------------------------------------------------------------

# Two formats, told apart by their columns (training reads either):
# - "tokens" (latents.py's default): the VAE posterior moments and the caption's token ids; the
#   frozen text encoder runs online during training. 65,698 bytes per sample at 512x512 in fp16.
# - "text_states" (latents.py --store_text_states): the moments and the text encoder's output
#   (77 x D); no encoder runs during training, for 3.4x the bytes (223,240) and 1.9% fewer FLOPs.
# Token ids are stored as uint16 (154 bytes): CLIP's vocabulary (49,408) fits, half of int32 and a
# quarter of int64; the dataset hands them to the model as int64, as the image datasets do.
LATENT_KEYS = ("latent_mean", "latent_logvar")  # the VAE posterior: in every precomputed sample
TEXT_STATES_KEY = "text_states"  # column and batch key of the text_states format
TOKEN_IDS_COLUMN = "token_ids"  # column of the tokens format; yielded as "captions", like image batches
TOKEN_IDS_DTYPE = "uint16"
TOKENS_KEY = "captions"
FORMATS = ("tokens", "text_states")
STORAGE_DTYPES = {"fp16": "float16", "fp32": "float32"}


def mds_columns(latent_channels: int, latent_size: int, text_dim: int | None, storage_dtype: str = "fp16",
                captions: bool = True, text_states: bool = False) -> dict[str, str]:
    """MDS columns of a precomputed dataset; the shapes are fixed, so no per-sample shape header."""
    dtype = STORAGE_DTYPES[storage_dtype]
    latent = f"ndarray:{dtype}:{latent_channels},{latent_size},{latent_size}"
    columns = {"index": "int64", "latent_mean": latent, "latent_logvar": latent}
    if text_states:
        columns[TEXT_STATES_KEY] = f"ndarray:{dtype}:{MAX_LENGTH},{text_dim}"
    else:
        columns[TOKEN_IDS_COLUMN] = f"ndarray:{TOKEN_IDS_DTYPE}:{MAX_LENGTH}"
    if captions:
        columns["caption"] = "str"
    return columns


def bytes_per_sample(image_size: int, text_dim: int = 1024, storage_dtype: str = "fp16", latent_channels: int = 4,
                     text_states: bool = False) -> int:
    """Bytes of one sample's arrays and index before compression (captions and MDS offsets not counted)."""
    itemsize = np.dtype(STORAGE_DTYPES[storage_dtype]).itemsize
    latent = latent_channels * (image_size // 8) ** 2
    text = MAX_LENGTH * text_dim * itemsize if text_states else MAX_LENGTH * np.dtype(TOKEN_IDS_DTYPE).itemsize
    return 2 * latent * itemsize + text + 8


def text_format(columns: list[str]) -> str | None:
    """"tokens" or "text_states" from a shard's column names; None if they are not precomputed latents."""
    if not all(k in columns for k in LATENT_KEYS):
        return None
    if TEXT_STATES_KEY in columns:
        return "text_states"
    return "tokens" if TOKEN_IDS_COLUMN in columns else None


# -----------------------------------------------------------------------------------------------

def _column_shapes(shard: Any) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """{column: (dtype, shape)} of the ndarray columns of an MDS shard, from their encodings."""
    shapes = {}
    for name, encoding in zip(getattr(shard, "column_names", []), getattr(shard, "column_encodings", [])):
        parts = encoding.split(":")
        if parts[0] == "ndarray" and len(parts) >= 2:
            shape = tuple(int(x) for x in parts[2].split(",")) if len(parts) == 3 else None
            shapes[name] = (parts[1], shape)
    return shapes


class StreamingLatents(NamedShardErrors, StreamingDataset):
    """Precomputed shards (written by latents.py) streamed for training.

    Yields {"latent_mean": (4, S/8, S/8), "latent_logvar": (4, S/8, S/8)} in the stored dtype (fp16 by
    default: `model.StableDiffusion.forward` casts them) plus, by the shards' format (`text_format`),
    "captions": (77,) int64 token ids or "text_states": (77, D). `image_size` and `text_dim`, when
    given, are checked against the shapes the shards were written with, so that a run at another
    resolution or with another text encoder fails at once with a clear message. `remote` may name
    several sources (see parse_sources), which must all have the same format and shapes. Other
    arguments are StreamingDataset's (local, batch_size, shuffle, shuffle_seed, cache_limit...).
    """

    def __init__(self, *, remote: str | None, local: str | None, batch_size: int, image_size: int | None = None,
                 text_dim: int | None = None, shuffle: bool = True, shuffle_seed: int = 9176, **streaming_kwargs: Any):
        streams = make_streams(remote, local)
        super().__init__(streams=streams, remote=None if streams else remote, local=None if streams else local,
                         batch_size=batch_size, shuffle=shuffle, shuffle_seed=shuffle_seed, **streaming_kwargs)
        formats = {}
        for where, shard in first_shards(self):
            formats[where] = self._check_shard(where, shard, image_size, text_dim)
        if len(set(formats.values())) > 1:
            raise ValueError(f"the sources mix precomputed formats ({formats}): precompute them all the same way "
                             "(with or without latents.py --store_text_states)")
        self.text_format = next(iter(formats.values()))

    @staticmethod
    def _check_shard(where: str, shard: Any, image_size: int | None, text_dim: int | None) -> str:
        """The format of the shards in `where`; raises ValueError if they do not fit the run."""
        columns = list(getattr(shard, "column_names", []))
        found = text_format(columns)
        if found is None:
            raise ValueError(f"{where} holds no precomputed latents (its columns are {columns}): write them with "
                             "`python latents.py --out ...`, or train without --precomputed")
        shapes = _column_shapes(shard)
        latent_shape = shapes.get("latent_mean", (None, None))[1]
        text_shape = shapes.get(TEXT_STATES_KEY, (None, None))[1]
        if image_size is not None and latent_shape is not None and latent_shape[1:] != (image_size // 8,) * 2:
            raise ValueError(f"{where} holds latents of {latent_shape[1] * 8}x{latent_shape[2] * 8} images, "
                             f"not {image_size}x{image_size}: precompute at --image_size {image_size} "
                             f"(or train at --image_size {latent_shape[1] * 8})")
        if found == "text_states" and text_dim is not None and text_shape is not None \
                and text_shape != (MAX_LENGTH, text_dim):
            raise ValueError(f"{where} holds text states of shape {text_shape}, but the UNet attends to "
                             f"({MAX_LENGTH}, {text_dim}): they were computed with another text encoder")
        return found

    def get_item(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.read_sample(index)
        # MDS decodes arrays as read-only views of the shard: copy into tensors the batch can own.
        item = {key: torch.from_numpy(np.array(sample[key])) for key in LATENT_KEYS}
        if self.text_format == "text_states":
            item[TEXT_STATES_KEY] = torch.from_numpy(np.array(sample[TEXT_STATES_KEY]))
        else:
            item[TOKENS_KEY] = torch.from_numpy(sample[TOKEN_IDS_COLUMN].astype(np.int64))
        return item


class SyntheticLatents(Dataset):
    """Random latent distributions and token ids or text states of the right shapes: the model without the data.

    Like SyntheticImageCaptions, samples are generated from their index (same data for the same
    index on every rank and epoch, nothing stored). Means have the spread of SD2's latents (unit
    variance after scaling by 0.18215), log-variances are around -10, in `dtype` (fp16, as the
    precomputed shards store them); then "captions" (random token ids, the default "tokens"
    format) or "text_states" (standard normal, in `dtype`) for `text_format="text_states"`.
    """

    def __init__(self, image_size: int, text_dim: int, num_samples: int = 100_000, seed: int = 0,
                 latent_channels: int = 4, dtype: torch.dtype = torch.float16, text_format: str = "tokens"):
        if text_format not in FORMATS:
            raise ValueError(f"text_format {text_format!r} is not one of {FORMATS}")
        self.latent_shape = (latent_channels, image_size // 8, image_size // 8)
        self.text_dim, self.num_samples, self.seed, self.dtype = text_dim, num_samples, seed, dtype
        self.text_format = text_format

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        mean = torch.randn(self.latent_shape, generator=g) / LATENT_SCALE
        logvar = torch.randn(self.latent_shape, generator=g) * 0.5 - 10.0
        item = {"latent_mean": mean.to(self.dtype), "latent_logvar": logvar.to(self.dtype)}
        if self.text_format == "text_states":
            item[TEXT_STATES_KEY] = torch.randn(MAX_LENGTH, self.text_dim, generator=g).to(self.dtype)
        else:
            item[TOKENS_KEY] = torch.randint(0, VOCAB_SIZE, (MAX_LENGTH,), generator=g)
        return item


def latents_dataloader(*, synthetic: bool, remote: str | None, local: str | None, image_size: int, text_dim: int,
               batch_size_per_device: int, num_workers: int, num_samples: int = 100_000, seed: int = 17,
               latent_channels: int = 4, shuffle: bool = True, synthetic_format: str = "tokens",
               **streaming_kwargs: Any) -> DataLoader:
    """Batches of precomputed latents for this rank (what benchmark.py --precomputed uses).

    synthetic: SyntheticLatents (in `synthetic_format`) sharded over ranks with Composer's
    distributed sampler. Otherwise the shards written by latents.py, streamed from `remote` (one or
    several sources, see parse_sources) into `local` (or read from `local` when `remote` is None)
    by a StreamingDataLoader, which Composer checkpoints and resumes mid-epoch; `seed` seeds the
    shuffle. Extra keyword arguments go to StreamingDataset (cache_limit, predownload, epoch_size...),
    as for laion_dataloader. The dataset's `text_format` says which text input the batches carry.
    """
    kwargs = loader_kwargs(num_workers)
    if synthetic:
        dataset = SyntheticLatents(image_size, text_dim, num_samples, seed, latent_channels, text_format=synthetic_format)
        sampler = dist.get_sampler(dataset, shuffle=shuffle, drop_last=True, seed=seed)
        return DataLoader(dataset, batch_size=batch_size_per_device, sampler=sampler, **kwargs)
    if not remote and not local:
        raise ValueError("latents_dataloader needs remote (where the precomputed shards are) and/or local (the cache)")
    dataset = StreamingLatents(remote=remote or None, local=local, batch_size=batch_size_per_device,
                               image_size=image_size, text_dim=text_dim, shuffle=shuffle, shuffle_seed=seed,
                               **streaming_kwargs)
    warn_about_large_epoch(dataset)
    return StreamingDataLoader(dataset, batch_size=batch_size_per_device, **kwargs)
