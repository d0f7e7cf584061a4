"""A dataset sorted into aspect-ratio buckets: one MDS folder per bucket (each with its own index.json)
and a small top-level record listing them (RECORD_FILE). convert.py and latents.py write it with
--aspect_buckets, sort_buckets.py sorts a dataset written without buckets into it, and benchmark.py
--aspect_buckets trains on it with one Streaming `Stream` per bucket folder (data.bucket_streams).
The layout and how a folder maps to a bucket: docs/data.md#aspect-ratio-buckets---aspect_buckets.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t2ibench.datasets.buckets import Bucket, nearest_bucket, parse_bucket
from t2ibench.core.errors import fail

RECORD_FILE = "buckets.json"  # top-level: the folders and their samples; written last, so it marks a whole dataset
FORMAT = "t2ibench-aspect-buckets"
VERSION = 1
IMAGES, LATENTS = "images", "latents"  # what the bucket folders hold
SORT_COMMAND = "sort_buckets.py"  # sorts an MDS folder written without buckets (images, or latents of before)


@dataclass(frozen=True)
class BucketFolder:
    """One bucket folder of a sorted dataset: the bucket its samples were sorted into and how many it holds."""

    bucket: Bucket
    samples: int

    @property
    def folder(self) -> str:
        return self.bucket.name


@dataclass(frozen=True)
class BucketRecord:
    """RECORD_FILE: what the folders hold, the list and image size they were sorted with, and each folder."""

    kind: str
    image_size: int
    folders: tuple[BucketFolder, ...]

    @property
    def num_samples(self) -> int:
        return sum(folder.samples for folder in self.folders)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "kind": self.kind, "image_size": self.image_size,
                           "samples": self.num_samples,
                           "buckets": [{"bucket": f.bucket.name, "folder": f.folder, "samples": f.samples}
                                       for f in self.folders]}, indent=1) + "\n"


def parse_record(text: str, where: str) -> BucketRecord:
    """RECORD_FILE's content; ValueError naming `where` when it is not one this project wrote."""
    try:
        raw = json.loads(text)
        if raw.get("format") != FORMAT or raw.get("version") != VERSION or raw.get("kind") not in (IMAGES, LATENTS):
            raise ValueError(f"not a {FORMAT} record of version {VERSION}")
        folders = []
        for entry in raw["buckets"]:
            bucket = parse_bucket(str(entry["bucket"]))
            if bucket is None or entry["folder"] != bucket.name or not isinstance(entry["samples"], int) \
                    or entry["samples"] < 0:
                raise ValueError(f"bad entry {entry!r}")
            folders.append(BucketFolder(bucket, entry["samples"]))
        if not isinstance(raw["image_size"], int):
            raise ValueError("no image_size")
        return BucketRecord(raw["kind"], raw["image_size"], tuple(folders))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{where} is not a readable bucket record ({error})") from None


def read_record(folder: str | os.PathLike) -> BucketRecord | None:
    """The record of a local sorted dataset, None when `folder` has none."""
    path = Path(folder, RECORD_FILE)
    if not path.is_file():
        return None
    return parse_record(path.read_text(), str(path))


def fetch_record(remote: str, local: str, timeout_s: float) -> BucketRecord | None:
    """The record of a remote sorted dataset, downloaded into its cache `local` (with Streaming's own
    downloader, as its index files are); None when the remote has none (an unsorted dataset)."""
    from streaming.base.storage import CloudDownloader

    target = Path(local, RECORD_FILE)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        CloudDownloader.direct_download(f"{remote.rstrip('/')}/{RECORD_FILE}", str(target), timeout_s)
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001  botocore's ClientError for a missing object
        if getattr(error, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey"):
            return None
        raise
    return parse_record(target.read_text(), f"{remote.rstrip('/')}/{RECORD_FILE}")


def run_bucket(folder: BucketFolder, record: BucketRecord, run_buckets: tuple[Bucket, ...], image_size: int
               ) -> Bucket | None:
    """The run's bucket a folder's samples train in. Images: the run's bucket nearest the folder's aspect
    ratio (its own bucket when the run has the conversion's list and --image_size; at another size the
    same shape scaled). Latents keep the shape they were stored at: the folder's bucket, which the run's
    list must hold (None otherwise)."""
    if record.kind == LATENTS:
        return folder.bucket if folder.bucket in run_buckets else None
    return nearest_bucket(folder.bucket.width, folder.bucket.height, run_buckets, image_size)


def unsorted_problem(flag: str, where: str, columns: list[str]) -> str:
    """The one line refusing an MDS dataset written without bucket folders for a bucketed run."""
    what = ("latents stored with a per-sample bucket column by an older latents.py" if "bucket" in columns
            else "images not sorted into aspect-ratio buckets")
    return (f"{flag} {where} holds {what} (an index.json, no {RECORD_FILE}): sort it once with "
            f"`python {SORT_COMMAND} {where} --out SORTED --aspect_buckets [FILE]` and train on SORTED, or train "
            "without --aspect_buckets")


def describe(record: BucketRecord) -> dict[str, Any]:
    """{bucket: samples} of a record, for messages and results."""
    return {folder.bucket.name: folder.samples for folder in record.folders}


class BucketWriters:
    """One MDSWriter per bucket folder under `root` (a local staging folder; with `sub`, a part of it,
    root/HxW/sub), opened at a bucket's first sample; `columns(bucket)` gives a folder's columns."""

    def __init__(self, root: str | os.PathLike, columns: Any, sub: str | None = None, **writer_kwargs: Any):
        self.root, self.columns, self.sub, self.writer_kwargs = Path(root), columns, sub, writer_kwargs
        self.writers: dict[Bucket, Any] = {}
        self.counts: dict[Bucket, int] = {}
        self.num_shards = 0  # written, once finished

    def write(self, bucket: Bucket, sample: dict[str, Any]) -> None:
        from t2ibench.core.mds import MDSWriter

        if bucket not in self.writers:
            folder = self.root / bucket.name / self.sub if self.sub else self.root / bucket.name
            self.writers[bucket] = MDSWriter(out=str(folder), columns=self.columns(bucket),
                                             **self.writer_kwargs)
            self.counts[bucket] = 0
        self.writers[bucket].write(sample)
        self.counts[bucket] += 1

    def finish(self) -> dict[Bucket, int]:
        """Each folder's index.json; returns the samples written per bucket."""
        for writer in self.writers.values():
            writer.finish()
        self.num_shards = sum(len(writer.shards) for writer in self.writers.values())
        self.writers.clear()
        return dict(self.counts)

    def cancel(self) -> None:
        for writer in self.writers.values():
            writer.cancel_future_jobs()
        self.writers.clear()


def record_of(kind: str, image_size: int, counts: dict[Bucket, int], order: tuple[Bucket, ...]) -> BucketRecord:
    """The record of folders written with `counts`, listed in the bucket list's order."""
    return BucketRecord(kind, image_size, tuple(BucketFolder(b, counts[b]) for b in order if counts.get(b)))


# -----------------------------------------------------------------------------------------------
# A run's streams: one per bucket folder of each source.
# -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedStream:
    """One bucket folder of one source as a Streaming stream: where it is, the run's bucket it trains in,
    its relative proportion (None: every sample once an epoch) and its samples per epoch."""

    remote: str | None
    local: str
    bucket: Bucket
    proportion: float | None
    samples_per_epoch: int
    label: str  # how a message names it: "<source>/<folder>"


def join(location: str, folder: str) -> str:
    return f"{location.rstrip('/')}/{folder}"


def plan_streams(sources: list[Any], records: list[BucketRecord], run_buckets: tuple[Bucket, ...], image_size: int,
                 epoch_size: int | None) -> list[PlannedStream]:
    """The streams of every folder of every source, with the samples each contributes to an epoch as
    Streaming draws them: a source's proportion is spread over its folders by their samples (so the
    sources mix as their proportions say and each keeps its own buckets' mix); without proportions every
    sample once, scaled to --epoch_size when given. A latents folder the run's list lacks: one line."""
    planned: list[tuple[Any, BucketRecord, BucketFolder, Bucket, float | None]] = []
    for source, record in zip(sources, records):
        for folder in record.folders:
            if not folder.samples:
                continue
            bucket = run_bucket(folder, record, run_buckets, image_size)
            if bucket is None:
                fail(f"{source.remote or source.local}: latents stored at {folder.bucket.name}, which the run's "
                     "--aspect_buckets list does not hold: pass the list they were computed with")
            share = None if source.proportion is None else source.proportion * folder.samples / record.num_samples
            planned.append((source, record, folder, bucket, share))
    total = sum(folder.samples for _, _, folder, _, _ in planned)
    shares = [share for *_, share in planned]
    if shares and shares[0] is not None:  # Streaming: each stream's proportion of the epoch, normalised
        epoch = epoch_size or total
        whole = sum(shares)
        counts = [round(epoch * share / whole) for share in shares]
    else:
        counts = [folder.samples if epoch_size is None else round(folder.samples * epoch_size / total)
                  for _, _, folder, _, _ in planned]
    return [PlannedStream(join(source.remote, folder.folder) if source.remote else None,
                          join(source.local, folder.folder), bucket, share, count,
                          join(source.remote or source.local, folder.folder))
            for (source, _, folder, bucket, share), count in zip(planned, counts)]


def stream_steps(samples: int, canonical_nodes: int, nodes: int, ranks_per_node: int, batch_size: int) -> int:
    """The global batches Streaming 0.13's per_stream batching makes of a stream of `samples` an epoch
    (partition "orig"): its samples spread over the canonical nodes (each padded to the longest, and
    tiled when there are fewer samples than canonical nodes), then over the physical nodes and their
    ranks (padded to a whole sample per rank), and only full global batches kept. Hand-written because
    Streaming's __len__ counts a square epoch's batches, and building the partition to count them holds
    8 bytes a sample of the epoch in every rank (tests/datasets/test_buckets.py checks it against Streaming's)."""
    if samples <= 0:
        return 0
    per_canonical = -(-samples // canonical_nodes)
    padding = 0
    if canonical_nodes < nodes:
        overflow = per_canonical % (nodes // canonical_nodes)
        padding = (nodes // canonical_nodes - overflow) if overflow else 0
    per_node = canonical_nodes * (per_canonical + padding) // nodes
    per_rank = -(-per_node // ranks_per_node)
    return per_rank // batch_size


def left_out(planned: list[PlannedStream], global_batch: int) -> tuple[list[PlannedStream], list[PlannedStream]]:
    """(kept, left out): a folder that holds fewer samples an epoch than one global batch is left out of
    training, named, rather than given to Streaming, which would tile it to its canonical nodes and train
    a few samples over and over (or drop it with a log line)."""
    kept = [stream for stream in planned if stream.samples_per_epoch >= global_batch]
    return kept, [stream for stream in planned if stream.samples_per_epoch < global_batch]


def left_out_line(dropped: list[PlannedStream], total: int, global_batch: int) -> str:
    """The one line naming the folders left out and the samples they hold."""
    samples = sum(stream.samples_per_epoch for stream in dropped)
    named = ", ".join(f"{stream.label} ({stream.samples_per_epoch})" for stream in dropped[:4])
    more = f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
    return (f"--aspect_buckets: {len(dropped)} bucket folder(s) hold fewer samples an epoch than one global batch of "
            f"{global_batch} (--batch_size): {named}{more}; left out of training, {samples:,} of {total:,} samples "
            f"({100 * samples / max(1, total):.2g}%)")
