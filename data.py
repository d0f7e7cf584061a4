"""Training data: every dataset `benchmark.py` reads, from one place (the 2023 benchmark's data.py):
LAION-style image-caption MDS shards streamed with MosaicML Streaming, the precomputed latents
latents.py writes (their format: `t2ibench.datasets.precomputed`), their aspect-ratio-bucketed forms
(one Streaming stream per bucket folder, `t2ibench.datasets.bucket_folders`), and synthetic images or latents (`t2ibench.datasets.synthetic_data`, re-exported).

The samples each dataset yields, and why images cross as uint8, are in docs/data.md. This file stays
at the root, where users of the 2023 benchmark import it from; the package never imports it.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from collections import Counter
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch
from composer.utils import dist
from streaming import Stream, StreamingDataLoader, StreamingDataset
from streaming.base.dataset import _ShardState
from torch.utils.data import DataLoader

from t2ibench.datasets.bucket_folders import (IMAGES, LATENTS, fetch_record, left_out, left_out_line, plan_streams,
                                     read_record, stream_steps, unsorted_problem)
from t2ibench.datasets.buckets import CROPS, Bucket, crop_generator, place
from t2ibench.core.errors import STORAGE_MODULES, fail
from t2ibench.families import FAMILIES, ModelFamily
from t2ibench.families.sd2 import LATENT_SCALE as SD2_LATENT_SCALE
from t2ibench.core.images import (CROP_KEY, GEOMETRY_KEYS, ORIGINAL_SIZE_KEY, ImageGeometry,  # noqa: F401
                             decode_pixels, decode_pixels_placed, decode_pixels_with_geometry, load_image,  # data's API
                             oriented_size, to_rgb)
from t2ibench.core.locations import is_remote
from t2ibench.datasets.precomputed import (DEFAULT_FAMILY, LATENT_KEYS, TEXT_FORMATS, TEXT_STATES, TOKENS,
                                       column_arrays, stored_shapes, text_format, token_column)
from t2ibench.families.family import TEXT_STATES_KEY
from t2ibench.datasets.sources import Source, parse_sources
from t2ibench.datasets.streaming import (BAD_CHECK_AFTER, MAX_BAD_FRACTION, ResumesAfterItsEpoch, StreamingSettings,
                                register_shm_prefixes_one_job_at_a_time)
from t2ibench.datasets.synthetic_data import (BucketBatchSampler, SyntheticBucketedImages, SyntheticImageCaptions,  # noqa: F401
                                     SyntheticLatents, geometry_tensors, loader_kwargs, sample_generator,  # data's API
                                     synthetic_dataloader)
from t2ibench.core.tokenizer import MAX_LENGTH

T = TypeVar("T")


# -----------------------------------------------------------------------------------------------
# LAION-style image-caption data: MDS shards streamed with MosaicML Streaming.
# (written by convert.py; the columns are in docs/data.md)
# -----------------------------------------------------------------------------------------------

log = logging.getLogger(__name__)


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
register_shm_prefixes_one_job_at_a_time()  # two jobs started together on one node (t2ibench.datasets.streaming)


_PREPARING = _ShardState.PREPARING  # Streaming's state of a shard being downloaded or decompressed


class BadDataError(RuntimeError):
    """Too many samples of the dataset could not be decoded: the data, not the run, needs fixing."""


class NamedShardErrors:
    """A StreamingDataset mix-in: a shard that cannot be read fails naming it, in one line.

    Streaming 0.13 reads a shard in a background thread; when that fails, the sample read only
    says "Background thread failed", and a shard cut short or corrupted fails deep in its reader
    (an IndexError on a sample offset) with no file named. The failing shard is remembered where it
    is prepared, and the read that fails raises BadDataError with its name (benchmark.py prints it
    as one line). Store errors are left alone: they are reported as such.
    """

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        before = self._shard_states[shard_id]
        try:
            super().prepare_shard(shard_id, blocking)
        except Exception as error:  # noqa: BLE001 - remembered, then raised as it was
            self._failed_shard = (self._shard_file(shard_id), error)
            # Every failure, not the last alone: Streaming's download and ready threads can both fail, one
            # shard each, and `on_exception` must know either thread's error as a shard's.
            self._shard_errors = [*getattr(self, "_shard_errors", []), error]
            # Streaming 0.13 leaves the shard PREPARING in the state it shares with the other loader
            # workers, which then wait for it forever (a hang with --num_workers 2). Put the state back,
            # so that each worker tries the shard itself, fails the same way and says so.
            if self._shard_states[shard_id] == _PREPARING:
                self._shard_states[shard_id] = before
            raise

    def resample_streams(self, epoch: int, stream_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Streaming's plan of an epoch, without numpy's divide-by-zero warnings for a shard of 0 samples:
        Streaming 0.13 divides the samples it takes from each shard by the shard's samples, and for such a
        shard gets 0 and 0, the right plan (nothing from it). Streaming's MDSWriter wrote one before a
        first sample larger than --size_limit (convert.py did until t2ibench.core.mds.MDSWriter); those
        datasets are read without two lines of "divide by zero" per epoch."""
        with np.errstate(divide="ignore"):
            return super().resample_streams(epoch, stream_id)

    def on_exception(self, future: Any) -> None:
        """Streaming's callback on its download threads: a shard failure is raised by the yield loop
        below, in one line; Streaming re-raises it here too, where concurrent.futures only logs a traceback."""
        error = future.exception()
        if error is not None and any(error is failed for failed in getattr(self, "_shard_errors", [])):
            self._event.set()  # what Streaming does, without the logged traceback
            return
        super().on_exception(future)

    def _each_sample_id(self, it: Any) -> Iterator[int]:
        """Streaming's yield loop, which ends the epoch without a word when its download thread
        failed: here the failure of a shard is raised instead (as BadDataError, naming it)."""
        yield from super()._each_sample_id(it)
        failed = getattr(self, "_failed_shard", None)
        if failed is not None and getattr(self, "_event", None) is not None and self._event.is_set():
            if type(failed[1]).__module__.startswith(STORAGE_MODULES):
                raise failed[1]  # the store's error (credentials, network), reported as such
            raise self._shard_error(*failed)

    def _shard_error(self, where: str, cause: BaseException) -> "BadDataError":
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        return BadDataError(f"shard {where} cannot be read ({type(cause).__name__}: {detail}): it is truncated or "
                            "corrupted; re-convert it, or delete it from the cache to download it again "
                            "(--validate_hash checks every shard file before training)")

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
            raise self._shard_error(*(failed if failed else (self._shard_file(self.spanner[index][0]), error))) \
                from error


def decode_image(data: bytes, size: int) -> torch.Tensor:
    """Encoded image bytes -> (3, size, size) uint8 tensor (`model.scale_images` makes it [-1, 1] on the
    device); the image prepared as `images.decode_pixels` says (EXIF, RGB, resize, center crop)."""
    return torch.from_numpy(decode_pixels(data, size)).permute(2, 0, 1).contiguous()  # channels first


# Micro-conditioning (GEOMETRY_KEYS): computed while decoding, so MDS shards converted before need
# no re-conversion.
def decode_image_with_geometry(data: bytes, size: int) -> tuple[torch.Tensor, ImageGeometry]:
    """`decode_image`'s tensor, and the original size and crop it came from (`images.ImageGeometry`)."""
    pixels, geometry = decode_pixels_with_geometry(data, size)
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), geometry


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


def stream_arguments(sources: list[Source]) -> dict[str, Any]:
    """StreamingDataset's location arguments: remote/local for one source without a proportion,
    else one `Stream` per source, each cached in its own folder (see `t2ibench.datasets.sources`)."""
    if len(sources) == 1 and sources[0].proportion is None:
        return {"remote": sources[0].remote, "local": sources[0].local, "streams": None}
    return {"remote": None, "local": None,
            "streams": [Stream(remote=s.remote, local=s.local, proportion=s.proportion) for s in sources]}


def resolve_sources(sources: list[Source] | None, remote: str | list[str] | None, local: str | None) -> list[Source]:
    """`sources` as benchmark.py parsed them, or, for a caller of this module, those `remote` and
    `local` name (see t2ibench.datasets.sources.parse_sources)."""
    if sources is not None:
        return sources
    if not remote and not local:
        raise ValueError("a streaming dataset needs remote (where the shards are) and/or local (the cache)")
    return parse_sources(remote, local)


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


class StreamingImageCaptions(ResumesAfterItsEpoch, NamedShardErrors, StreamingDataset):
    """Image-caption pairs streamed from MDS shards: yields {"image": (3,S,S) uint8, <token ids>}.

    Args:
        remote, local: where the shards live (s3://bucket/path, gs://, oci://, azure://, hf://, a
            local path...; several sources as --remote takes them) and the cache they are downloaded
            to (or the shards themselves without a remote); or `sources`, already parsed.
        tokenizer: the family's tokenizer (SD2's CLIP tokenizer), or a dict of them by name; it is
            pickled into every dataloader worker.
        image_size: output side S in pixels.
        batch_size: per-device batch size. Streaming partitions samples over ranks and workers
            batch by batch, which makes the order deterministic and resumable mid-epoch.
        family: the model family whose token ids the samples carry (default: SD2), and, for a family
            with micro-conditioning (SDXL), each image's original size and crop (GEOMETRY_KEYS).
        image_key, caption_key: MDS column names of the encoded image and of the caption.
        max_bad_fraction, bad_check_after: the bad-data policy (t2ibench.datasets.streaming.MAX_BAD_FRACTION).
        shuffle and **streaming_kwargs: StreamingDataset's (`StreamingSettings.dataset_kwargs`).

    A sample whose image cannot be decoded (or whose caption is not a string) is replaced by the
    next index (index + 1, wrapping around), which is the same on every rank and every run; each
    replacement is logged with the sample index and shard name, and counted in `bad_samples`.
    """

    def __init__(self, *, remote: str | None = None, local: str | None = None, tokenizer: Any, image_size: int,
                 batch_size: int, sources: list[Source] | None = None, family: ModelFamily | None = None,
                 image_key: str = "jpg", caption_key: str = "caption", max_bad_fraction: float = MAX_BAD_FRACTION,
                 bad_check_after: int = BAD_CHECK_AFTER, shuffle: bool = True, streams: list[Stream] | None = None,
                 **streaming_kwargs: Any):
        if streams is None:
            sources = resolve_sources(sources, remote, local)
            if len(sources) == 1 and not sources[0].remote:
                _check_local_only(sources[0].local)
        locations = stream_arguments(sources) if streams is None else {"remote": None, "local": None, "streams": streams}
        super().__init__(**locations, batch_size=batch_size, shuffle=shuffle, **streaming_kwargs)
        self.family = family or DEFAULT_FAMILY
        self.tokenizers = tokenizer if isinstance(tokenizer, dict) else {"tokenizer": tokenizer}
        self.image_size = image_size
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

    def token_ids(self, caption: str) -> dict[str, torch.Tensor]:
        """The caption's token ids, one tensor per batch key of the family (SD2: "captions" (77,))."""
        return {key: ids[0] for key, ids in self.family.tokenize(self.tokenizers, [caption]).items()}

    def shard_name(self, index: int) -> str:
        """Where sample `index` lives, for messages: '<remote or local>/shard.00012.mds.zstd'."""
        return self._shard_file(self.spanner[index][0])

    def _decode(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        caption = sample[self.caption_key]
        if not isinstance(caption, str):
            raise TypeError(f"caption is {type(caption).__name__}, not str")
        image, geometry = decode_image_with_geometry(sample[self.image_key], self.image_size)
        item = {"image": image, **self.token_ids(caption)}
        if self.family.micro_conditioning:
            item.update(geometry_tensors(geometry))
        return item

    def get_item(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index`, decoded; an undecodable one is replaced by the next index (see class doc)."""
        candidate, item = self.first_usable(index, lambda sample: self._decode(sample))
        return {**item, "sample_index": torch.tensor(candidate)}  # for the validation loss

    def first_usable(self, index: int, use: Callable[[dict[str, Any]], T], counted: bool = True) -> tuple[int, T]:
        """(candidate, use(sample)) for the first sample from `index` on that `use` does not fail on: an
        undecodable one is replaced by the next index, logged and counted against the bad-data policy.
        `counted` False: a second look at samples already counted (the header read of aspect buckets)."""
        for attempt in range(self.num_samples):  # at most every sample once; the policy stops us sooner
            candidate = (index + attempt) % self.num_samples
            sample = self.read_sample(candidate)  # download errors are not bad data: they propagate
            self.decoded += counted
            try:
                return candidate, use(sample)
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


class StreamBuckets:
    """A StreamingDataset mix-in for `--aspect_buckets`: one `Stream` per bucket folder
    (`t2ibench.datasets.bucket_folders`) and Streaming's `per_stream` batching, which puts every global batch (all
    ranks' samples of one step) in one stream, so every rank trains one bucket in every step, and resumes
    mid-epoch on a global batch. A sample's bucket is its stream's: nothing is read per sample before
    the first step but Streaming's index files.

    `__len__` is the epoch's true length: Streaming 0.13 counts a square epoch's samples, which would size
    `--max_duration Nep`'s schedule for batches per_stream batching does not make."""

    stream_buckets: tuple[Bucket, ...]  # the run's bucket of each stream
    epoch_steps: int  # global batches of an epoch (set by `_count_steps`)

    def bucket_of_sample(self, index: int) -> Bucket:
        return self.stream_buckets[int(self.stream_per_shard[self.spanner[index][0]])]

    def _count_steps(self) -> None:
        """The epoch's steps from each stream's samples an epoch as Streaming drew them (`choose`)."""
        world = self._parallel_rank_world
        # Streaming 0.13's default canonical nodes (StreamingDataset._resume), where the flag leaves them unset.
        canonical = self.num_canonical_nodes or (
            64 * world.num_nodes if self.shuffle_algo in ("py1s", "py2s") else world.num_nodes)
        self.epoch_steps = sum(stream_steps(int(stream.choose), canonical, world.num_nodes, world.ranks_per_node,
                                            self.batch_size) for stream in self.streams)

    def __len__(self) -> int:
        return self.epoch_steps * self.batch_size  # this rank's samples of an epoch

    def current_epoch(self) -> int:
        """The epoch being iterated (Streaming counts the next one from the start of `__iter__`)."""
        return max(0, self.next_epoch - 1)


class BucketedImageCaptions(StreamBuckets, StreamingImageCaptions):
    """Image-caption pairs in aspect-ratio buckets (`--aspect_buckets`, `StreamBuckets`): each sample is
    decoded into its stream's bucket, resized to cover it and cropped, at a random corner drawn from
    (seed, epoch, sample) or centered (`crop`)."""

    def __init__(self, *, streams: list[Stream], stream_buckets: tuple[Bucket, ...], crop: str = "random",
                 **kwargs: Any):
        if crop not in CROPS:
            raise ValueError(f"crop must be one of {CROPS}, not {crop!r}")
        super().__init__(**kwargs, streams=streams, batching_method="per_stream")
        self.stream_buckets, self.crop = tuple(stream_buckets), crop
        self._count_steps()

    def _check_caption(self, sample: dict[str, Any]) -> str:
        caption = sample[self.caption_key]
        if not isinstance(caption, str):
            raise TypeError(f"caption is {type(caption).__name__}, not str")
        return caption

    def get_item(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index` decoded into its stream's bucket (a replacement for an undecodable one goes into it too)."""
        bucket, epoch = self.bucket_of_sample(index), self.current_epoch()

        def decode(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
            caption = self._check_caption(sample)
            encoded = sample[self.image_key]
            rng = crop_generator(self.shuffle_seed, epoch, index) if self.crop == "random" else None
            pixels, geometry = decode_pixels_placed(encoded, place(*oriented_size(encoded), bucket, rng))
            item = {"image": torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), **self.token_ids(caption)}
            if self.family.micro_conditioning:
                item.update(geometry_tensors(geometry))
            return item
        candidate, item = self.first_usable(index, decode)
        return {**item, "sample_index": torch.tensor(candidate)}


class PartFilledBatches(logging.Filter):
    """Streaming 0.13's per_stream batching logs, for every stream of every epoch, that it drops the stream's
    last part-filled global batch: expected for every bucket, and said once by the run (bucket_streams)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "some batches with an inadequate number of samples" not in record.getMessage()


logging.getLogger("streaming.base.batching.per_stream").addFilter(PartFilledBatches())


def epoch_samples(settings: StreamingSettings) -> int | None:
    """--epoch_size in samples (Streaming's abbreviations: 200m), None when unset."""
    if settings.epoch_size is None:
        return None
    from streaming.base.util import number_abbrev_to_int
    return number_abbrev_to_int(settings.epoch_size)


def bucket_streams(sources: list[Source], buckets: tuple[Bucket, ...], image_size: int, kind: str,
                   global_batch: int, epoch_size: int | None, timeout_s: float = 60.0
                   ) -> tuple[list[Stream], tuple[Bucket, ...]]:
    """One `Stream` per bucket folder of each sorted source (`t2ibench.datasets.bucket_folders`) and the run's bucket
    of each. Only each source's small record is read (downloaded from a remote);
    a folder with fewer samples an epoch than one global batch is left out, named in one line on rank 0.
    An unsorted source, one of the other kind, or no folder of a global batch: one line (errors.fail), before
    anything is trained (benchmark.py's checks refuse the first two before the loader is built)."""
    records = []
    for source in sources:
        if source.remote and is_remote(source.remote):
            record = fetch_record(source.remote, source.local, timeout_s)
        else:
            record = read_record(source.remote or source.local)
        where = source.remote or source.local
        if record is None:
            fail(unsorted_problem("--remote" if source.remote else "--local", where, []))
        if record.kind != kind:
            fail(f"{where} holds {record.kind} sorted into buckets, not {kind}: "
                             + ("add --precomputed" if record.kind == LATENTS else "drop --precomputed"))
        records.append(record)
    planned = plan_streams(sources, records, buckets, image_size, epoch_size)
    kept, dropped = left_out(planned, global_batch)
    if dropped and dist.get_global_rank() == 0:
        print("note: " + left_out_line(dropped, sum(s.samples_per_epoch for s in planned), global_batch),
              file=sys.stderr, flush=True)
    if not kept:
        counts = ", ".join(f"{s.label}: {s.samples_per_epoch}" for s in planned[:6])
        fail(f"--aspect_buckets: no bucket folder holds one global batch of {global_batch} samples an epoch "
                         f"({counts}{', ...' if len(planned) > 6 else ''}): use more data or a smaller --batch_size")
    proportions = kept[0].proportion is not None
    streams = [Stream(remote=s.remote, local=s.local, proportion=s.proportion if proportions else None) for s in kept]
    return streams, tuple(s.bucket for s in kept)


def laion_dataloader(remote: str | None = None, local: str | None = None, tokenizer: Any = None, image_size: int = 512,
                     batch_size_per_device: int = 1, num_workers: int = 0, seed: int = 17, *,
                     sources: list[Source] | None = None, settings: StreamingSettings | None = None,
                     family: ModelFamily | None = None, image_key: str = "jpg", caption_key: str = "caption",
                     max_bad_fraction: float = MAX_BAD_FRACTION, bad_check_after: int = BAD_CHECK_AFTER,
                     buckets: tuple[Bucket, ...] = (), crop: str = "random",
                     **streaming_kwargs: Any) -> StreamingDataLoader:
    """LAION-style MDS shards as batches {"image": (B,3,S,S) uint8, "captions": (B,77)} for this rank.

    `remote` None means the shards are already in `local`. The loader is a StreamingDataLoader, so
    Composer checkpoints its position and resumes mid-epoch. `settings` (or single settings as
    keyword arguments) go to StreamingDataset; `seed` seeds the shuffle (the same on every rank, as
    Streaming requires). With `buckets`, every batch holds one aspect-ratio bucket (BucketedImageCaptions,
    cropped as `crop` says).
    """
    settings = settings or StreamingSettings()
    common = dict(tokenizer=tokenizer, image_size=image_size, batch_size=batch_size_per_device, family=family,
                  image_key=image_key, caption_key=caption_key, max_bad_fraction=max_bad_fraction,
                  bad_check_after=bad_check_after, **{**settings.dataset_kwargs(seed), **streaming_kwargs})
    if buckets:
        streams, stream_buckets = bucket_streams(
            resolve_sources(sources, remote, local), buckets, image_size, IMAGES,
            batch_size_per_device * dist.get_world_size(), epoch_samples(settings), settings.download_timeout)
        dataset = BucketedImageCaptions(streams=streams, stream_buckets=stream_buckets, crop=crop, **common)
    else:
        dataset = StreamingImageCaptions(remote=remote, local=local, sources=sources, **common)
    warn_about_large_epoch(dataset)
    return StreamingDataLoader(dataset, batch_size=batch_size_per_device, **loader_kwargs(num_workers))


# -----------------------------------------------------------------------------------------------
# Precomputed latents (written by latents.py; the format is t2ibench.datasets.precomputed's): training from them.
# -----------------------------------------------------------------------------------------------

def all_finite(array: np.ndarray) -> bool:
    """np.isfinite(array).all(), 3x faster for float16 (NumPy computes float16 in software): an element is
    NaN or infinite exactly when its 5 exponent bits are all set. 10 us per SD2 latent at 512 px."""
    if array.dtype == np.float16:
        return int((array.view(np.uint16) & 0x7C00).max(initial=0)) != 0x7C00
    return bool(np.isfinite(array).all())


class StreamingLatents(ResumesAfterItsEpoch, NamedShardErrors, StreamingDataset):
    """Precomputed shards (written by latents.py) streamed for training.

    Yields {"latent_mean": (4, S/8, S/8), "latent_logvar": (4, S/8, S/8)} in the stored dtype (fp16 by
    default: `t2ibench.train.model.DiffusionModel` casts them) plus, by the shards' format (`text_format`),
    "captions": (77,) int64 token ids or "text_states": (77, D). `image_size` and `text_dim`, when
    given, are checked against the shapes the shards were written with, so that a run at another
    resolution or with another text encoder fails at once with a clear message. `remote` may name
    several sources (see t2ibench.datasets.sources), or `sources` name them, parsed; they must all have the
    same format and shapes. In the text_states format the batches carry the family's
    `conditioning_keys` (SD2: text_states). A family with micro-conditioning requires and yields
    each image's original size and crop (GEOMETRY_KEYS), which latents.py stores for it. Other
    arguments are StreamingDataset's (batch_size, shuffle, shuffle_seed, cache_limit...).
    """

    def __init__(self, *, remote: str | None = None, local: str | None = None, batch_size: int,
                 sources: list[Source] | None = None, image_size: int | None = None, text_dim: int | None = None,
                 shuffle: bool = True, shuffle_seed: int = 9176, family: ModelFamily | None = None,
                 config: str | None = None, streams: list[Stream] | None = None, **streaming_kwargs: Any):
        locations = (stream_arguments(resolve_sources(sources, remote, local)) if streams is None
                     else {"remote": None, "local": None, "streams": streams})
        super().__init__(**locations, batch_size=batch_size, shuffle=shuffle, shuffle_seed=shuffle_seed,
                         **streaming_kwargs)
        self.family = family or DEFAULT_FAMILY
        self.vocabulary = self.family.vocabulary_sizes(config or self.family.configs[0])  # token ids must be below
        # The shapes the run expects: the family's at `config`; SD2 without one: text_dim only.
        self.expected = None if config is None else {
            fmt: stored_shapes(self.family, config, fmt == TEXT_STATES) for fmt in TEXT_FORMATS}
        formats = {}
        for where, shard in first_shards(self):
            formats[where] = self._check_shard(where, shard, image_size, text_dim)
            columns = list(getattr(shard, "column_names", []))
            missing = [key for key in GEOMETRY_KEYS if self.family.micro_conditioning and key not in columns]
            if missing:
                raise ValueError(f"{where} holds latents without {', '.join(missing)}, which this model is conditioned "
                                 "on: precompute them with latents.py for this --model_config")
        if len(set(formats.values())) > 1:
            raise ValueError(f"the sources mix precomputed formats ({formats}): precompute them all the same way "
                             "(with or without latents.py --store_text_states)")
        self.text_format = next(iter(formats.values()))

    def _value_problem(self, sample: dict[str, Any]) -> str | None:
        """Why a sample's values cannot be trained on (None when they can): latents or text states that are
        not finite, token ids beyond the text encoder's vocabulary. Shapes are checked per shard."""
        arrays = [*LATENT_KEYS, *(self.family.conditioning_keys if self.text_format == TEXT_STATES else ())]
        for key in arrays:
            if not all_finite(sample[key]):
                return (f"{key} is not finite (NaN or infinity): the latents were computed wrongly, not trained "
                        "wrongly; compute them again with latents.py (it stops on such values)")
        if self.text_format != TEXT_STATES:
            for key, size in self.vocabulary.items():
                ids = sample[token_column(key, self.family)]
                if ids.size and int(ids.max()) >= size:
                    return (f"{token_column(key, self.family)} holds token id {int(ids.max())}, beyond the {size:,} "
                            "of the text encoder: computed with another tokenizer; precompute them with latents.py "
                            "for this --model_config")
        return None

    def _check_shard(self, where: str, shard: Any, image_size: int | None, text_dim: int | None) -> str:
        """The format of the shards in `where`; raises ValueError if they do not fit the run."""
        columns = list(getattr(shard, "column_names", []))
        found = text_format(columns, self.family)
        other = [family.name for family in FAMILIES if family is not self.family and text_format(columns, family)]
        if found is None and other:
            raise ValueError(f"{where} holds precomputed latents of {other[0]} (its columns are {columns}), not of "
                             f"{self.family.name}: precompute them with latents.py --model_config of this run")
        if found is None:
            raise ValueError(f"{where} holds no precomputed latents (its columns are {columns}): write them with "
                             "`python latents.py --out ...`, or train without --precomputed")
        shapes = column_arrays(getattr(shard, "column_names", []), getattr(shard, "column_encodings", []))
        latent_shape = shapes.get("latent_mean", (None, None))[1]
        text_shape = shapes.get(TEXT_STATES_KEY, (None, None))[1]
        if image_size is not None and latent_shape is not None and latent_shape[1:] != (image_size // 8,) * 2:
            raise ValueError(f"{where} holds latents of {latent_shape[1] * 8}x{latent_shape[2] * 8} images, "
                             f"not {image_size}x{image_size}: precompute at --image_size {image_size} "
                             f"(or train at --image_size {latent_shape[1] * 8})")
        if self.expected is None and found == TEXT_STATES and text_dim is not None and text_shape is not None \
                and text_shape != (MAX_LENGTH, text_dim):
            raise ValueError(f"{where} holds text states of shape {text_shape}, but the UNet attends to "
                             f"({MAX_LENGTH}, {text_dim}): they were computed with another text encoder")
        for key, expected in (self.expected or {}).get(found, {}).items():
            stored = shapes.get(key if found == TEXT_STATES else token_column(key, self.family), (None, None))[1]
            if stored is not None and tuple(stored) != tuple(expected):
                raise ValueError(f"{where} holds {key} of shape {tuple(stored)}, but this model takes {tuple(expected)}: "
                                 "they were computed for another --model_config (or another text encoder)")
        return found

    def get_item(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.read_sample(index)
        problem = self._value_problem(sample)
        if problem:  # found by the loader (a worker, on the CPU), not as a NaN loss or an index error in the step
            raise BadDataError(f"shard {self._shard_file(self.spanner[index][0])}, sample {index}: {problem}")
        # MDS decodes arrays as read-only views of the shard: copy into tensors the batch can own.
        item = {key: torch.from_numpy(np.array(sample[key])) for key in LATENT_KEYS}
        if self.text_format == TEXT_STATES:
            for key in self.family.conditioning_keys:
                item[key] = torch.from_numpy(np.array(sample[key]))
        else:
            for key in self.family.text_input_keys:
                item[key] = torch.from_numpy(sample[token_column(key, self.family)].astype(np.int64))
        if self.family.micro_conditioning:
            item.update({key: torch.from_numpy(sample[key].astype(np.int64)) for key in GEOMETRY_KEYS})
        item["sample_index"] = torch.tensor(index)  # fixes its noise and timestep in the validation loss
        return item


class BucketedLatents(StreamBuckets, StreamingLatents):
    """Precomputed latents sorted into bucket folders (`latents.py --aspect_buckets`), one stream per
    folder, in batches of one bucket (`StreamBuckets`): each folder's latents have its bucket's shape."""

    def __init__(self, *, streams: list[Stream], stream_buckets: tuple[Bucket, ...], **kwargs: Any):
        super().__init__(**kwargs, streams=streams, batching_method="per_stream")
        self.stream_buckets = tuple(stream_buckets)
        self._count_steps()
        for (where, shard), bucket in zip(first_shards(self), self.stream_buckets):  # each folder at its bucket's shape
            shape = column_arrays(list(getattr(shard, "column_names", [])),
                                  list(getattr(shard, "column_encodings", []))).get("latent_mean", (None, None))[1]
            latent_side = self.family.latent_downsample
            if shape is not None and tuple(shape[1:]) != (bucket.height // latent_side, bucket.width // latent_side):
                raise ValueError(f"{where} holds latents of {shape[1] * latent_side}x{shape[2] * latent_side} images, "
                                 f"not of its bucket {bucket.name}: sort the latents again with latents.py "
                                 "--aspect_buckets")


def latents_dataloader(*, synthetic: bool, remote: str | None = None, local: str | None = None, image_size: int,
                       text_dim: int, batch_size_per_device: int, num_workers: int, num_samples: int = 100_000,
                       seed: int = 17, latent_channels: int = 4, shuffle: bool = True, synthetic_format: str = TOKENS,
                       sources: list[Source] | None = None, settings: StreamingSettings | None = None,
                       family: ModelFamily | None = None, config: str | None = None, latent_scale: float | None = None,
                       latent_shift: float = 0.0, buckets: tuple[Bucket, ...] = (),
                       **streaming_kwargs: Any) -> DataLoader:
    """Batches of precomputed latents for this rank (what benchmark.py --precomputed uses).

    synthetic: SyntheticLatents (in `synthetic_format`) sharded over ranks with Composer's
    distributed sampler. Otherwise the shards written by latents.py, streamed from `remote` (one or
    several sources, see t2ibench.datasets.sources; or `sources`, parsed) into `local` (or read from `local`
    when `remote` is None) by a StreamingDataLoader, which Composer checkpoints and resumes
    mid-epoch; `seed` seeds the shuffle. `settings` (or single settings as keyword arguments) go to
    StreamingDataset, as for laion_dataloader. The dataset's `text_format` says which text input
    the batches carry. `config` (with `family`) sets the shapes the shards must have, and with
    `latent_scale` and `latent_shift` those of synthetic latents. With `buckets`, the shards hold
    latents stored per bucket (latents.py --aspect_buckets) and every batch holds one (BucketedLatents).
    """
    kwargs = loader_kwargs(num_workers)
    settings = settings or StreamingSettings(shuffle=shuffle)
    if synthetic:
        dataset = SyntheticLatents(image_size, text_dim, num_samples, seed, latent_channels, text_format=synthetic_format,
                                   family=family, config=config, latent_scale=latent_scale or SD2_LATENT_SCALE,
                                   latent_shift=latent_shift)
        sampler = dist.get_sampler(dataset, shuffle=settings.shuffle, drop_last=True, seed=seed)
        return DataLoader(dataset, batch_size=batch_size_per_device, sampler=sampler, **kwargs)
    common = dict(batch_size=batch_size_per_device, text_dim=text_dim, family=family, config=config,
                  **{**settings.dataset_kwargs(seed), **streaming_kwargs})
    if buckets:
        streams, stream_buckets = bucket_streams(
            resolve_sources(sources, remote, local), buckets, image_size, LATENTS,
            batch_size_per_device * dist.get_world_size(), epoch_samples(settings), settings.download_timeout)
        dataset = BucketedLatents(streams=streams, stream_buckets=stream_buckets, **common)
    else:
        dataset = StreamingLatents(remote=remote, local=local, sources=sources, image_size=image_size, **common)
    warn_about_large_epoch(dataset)
    return StreamingDataLoader(dataset, batch_size=batch_size_per_device, **kwargs)
