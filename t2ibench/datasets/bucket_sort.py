"""Sorting a local MDS dataset written without bucket folders into one folder per aspect-ratio bucket
(`t2ibench.datasets.bucket_folders`): images by their header (the bucket nearest their aspect ratio), precomputed
latents of before by their stored `bucket` column. Each sample is read once, by worker processes, one
input shard a task; the output is written into OUT/.sorting (a shard's part is kept once its marker is
written, so a rerun resumes at the shards not done) and then published whole, the record last.
sort_buckets.py is the command; latents.py --aspect_buckets sorts its own chunks with it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from t2ibench.datasets.bucket_folders import LATENTS, RECORD_FILE, BucketWriters, record_of
from t2ibench.datasets.buckets import Bucket, nearest_bucket
from t2ibench.core.errors import fail
from t2ibench.core.files import staged_folder
from t2ibench.core.mds import INDEX_FILE
from t2ibench.core.workers import worker_pool

SORTING = ".sorting"  # OUT/.sorting: the sorted parts of the input shards done so far (a rerun resumes there)
DONE = "done"  # OUT/.sorting/done/NNNNN.json: input shard NNNNN sorted (its samples per bucket)
JOB_FILE = "job.json"  # OUT/.sorting/job.json: the input and list the parts were sorted with
BUCKET_COLUMN = "bucket"  # latents.py before bucket folders: (height, width) in pixels per sample


@dataclass(frozen=True)
class SortJob:
    """What decides the output: the input folder and its index, what it holds, the list and image size."""

    source: str
    kind: str
    buckets: tuple[Bucket, ...]
    image_size: int
    image_key: str
    index: dict

    def key(self) -> dict:
        return {"source": self.source, "kind": self.kind, "buckets": [b.name for b in self.buckets],
                "image_size": self.image_size, "image_key": self.image_key,
                "shards": json.dumps(self.index["shards"], sort_keys=True)}

    def columns(self) -> dict[str, str]:
        """A bucket folder's columns: the input's, less the per-sample bucket column of latents of before
        (their arrays keep MDS's per-sample shape: every sample of a folder has its bucket's)."""
        shard = self.index["shards"][0]
        return {key: encoding for key, encoding in zip(shard["column_names"], shard["column_encodings"])
                if not (self.kind == LATENTS and key == BUCKET_COLUMN)}


def shard_name(number: int) -> str:
    return f"s{number:05d}"


def _read_shard(folder: Path, shard: dict, scratch: Path) -> Iterator[dict[str, Any]]:
    """Every sample of one input shard, decompressed into `scratch` first when only its compressed file is there."""
    from streaming.base.compression import decompress
    from streaming.base.format import reader_from_json

    raw, zipped = shard.get("raw_data") or {}, shard.get("zip_data") or {}
    where = folder
    if not (folder / raw.get("basename", "")).is_file() and zipped:
        where = scratch
        (scratch / raw["basename"]).parent.mkdir(parents=True, exist_ok=True)
        data = decompress(shard["compression"], (folder / zipped["basename"]).read_bytes())
        (scratch / raw["basename"]).write_bytes(data)
    reader = reader_from_json(str(where), None, shard)
    try:
        for i in range(reader.samples):
            yield reader.get_item(i)
    finally:
        if where == scratch:
            (scratch / raw["basename"]).unlink(missing_ok=True)


def bucket_of(job: SortJob, sample: dict[str, Any]) -> Bucket | None:
    """The bucket a sample is sorted into; None for an image whose header cannot be read (left out, counted)."""
    if job.kind == LATENTS:
        height, width = (int(side) for side in sample[BUCKET_COLUMN])
        return Bucket(height, width)
    from t2ibench.core.images import oriented_size

    try:
        width, height = oriented_size(sample[job.image_key])
    except Exception:  # noqa: BLE001  Pillow raises OSError, ValueError, SyntaxError...
        return None
    return nearest_bucket(width, height, job.buckets, job.image_size)


def sort_shard(job: SortJob, folder: str, sorting: str, number: int, writer_kwargs: dict) -> dict[str, int]:
    """Sort input shard `number` into OUT/.sorting/HxW/sNNNNN and mark it done; returns its samples by bucket
    ("" counts the unreadable ones)."""
    sorting_path = Path(sorting)
    part = shard_name(number)
    for stale in sorting_path.glob(f"*/{part}"):  # what a killed attempt at this shard left
        shutil.rmtree(stale)
    writers = BucketWriters(sorting_path, lambda bucket: job.columns(), sub=part, **writer_kwargs)
    unreadable = 0
    with tempfile.TemporaryDirectory(prefix="sort-") as scratch:
        for sample in _read_shard(Path(folder), job.index["shards"][number], Path(scratch)):
            bucket = bucket_of(job, sample)
            if bucket is None:
                unreadable += 1
                continue
            if job.kind == LATENTS:
                sample = {key: value for key, value in sample.items() if key != BUCKET_COLUMN}
            writers.write(bucket, sample)
    counts = {bucket.name: n for bucket, n in writers.finish().items()}
    if unreadable:
        counts[""] = unreadable
    done = sorting_path / DONE / f"{part}.json"
    done.parent.mkdir(parents=True, exist_ok=True)
    tmp = done.with_suffix(".partial")
    tmp.write_text(json.dumps(counts))
    os.replace(tmp, done)  # the marker last: a part without it is redone
    return counts


def _sort_one(task: tuple) -> tuple[int, dict[str, int]]:
    job, folder, sorting, number, writer_kwargs = task
    return number, sort_shard(job, folder, sorting, number, writer_kwargs)


def start_sorting(out: Path, job: SortJob) -> tuple[Path, dict[int, dict[str, int]]]:
    """OUT/.sorting, kept from a run of the same job (its shards already done), else started afresh."""
    sorting = out / SORTING
    done: dict[int, dict[str, int]] = {}
    if sorting.is_dir():
        try:
            same = json.loads((sorting / JOB_FILE).read_text()) == job.key()
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(sorting)
        else:
            for marker in (sorting / DONE).glob("s*.json"):
                try:
                    done[int(marker.stem[1:])] = json.loads(marker.read_text())
                except (ValueError, OSError):
                    marker.unlink()
    if not sorting.is_dir():
        sorting.mkdir(parents=True)
        (sorting / JOB_FILE).write_text(json.dumps(job.key()))
    return sorting, done


def merge_bucket(sorting: Path, bucket: Bucket, parts: list[str]) -> None:
    """OUT/.sorting/HxW/index.json over its parts (Streaming's merge_index: shard names become sNNNNN/...)."""
    import logging

    from streaming.base.util import merge_index

    target = sorting / bucket.name
    (target / INDEX_FILE).unlink(missing_ok=True)  # merge_index does not replace one
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # merge_index logs its temporary folder as a warning
    try:
        merge_index([str(target / part / INDEX_FILE) for part in parts], str(target))
    finally:
        logging.getLogger().setLevel(level)


def sort_dataset(job: SortJob, folder: str, out: str, workers: int, progress: bool, writer_kwargs: dict,
                 say: Callable[[str], None] = print, extra_files: dict[str, str] | None = None) -> dict[str, Any]:
    """Sort `folder` (a local MDS dataset, `job.index` its index) into bucket folders in `out`, held by the
    caller, with `extra_files` ({name: text}) beside them; returns the report. A rerun after a kill resumes
    at the input shards not yet done."""
    from tqdm import tqdm

    out_path = Path(out)
    sorting, done = start_sorting(out_path, job)
    shards = job.index["shards"]
    todo = [n for n in range(len(shards)) if n not in done]
    samples = sum(shard["samples"] for shard in shards)
    if done:
        say(f"resuming: {len(done)} of {len(shards)} input shard(s) already sorted in {sorting}")
    tasks = [(job, folder, str(sorting), n, writer_kwargs) for n in todo]
    pool = None
    if workers > 1 and len(tasks) > 1:  # started before tqdm's thread, so forking is safe (as convert.py's)
        pool = worker_pool(min(workers, len(tasks)))
    bar = tqdm(total=samples, initial=sum(shards[n]["samples"] for n in done), unit=" sample", desc="sort",
               disable=not progress, mininterval=1.0, dynamic_ncols=True, file=sys.stderr)
    try:
        results = pool.imap_unordered(_sort_one, tasks) if pool is not None else map(_sort_one, tasks)
        for number, counts in results:
            done[number] = counts
            bar.update(shards[number]["samples"])
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    totals: dict[str, int] = {}
    for counts in done.values():
        for name, n in counts.items():
            totals[name] = totals.get(name, 0) + n
    unreadable = totals.pop("", 0)
    counts = {bucket: totals[bucket.name] for bucket in job.buckets if totals.get(bucket.name)}
    if not counts:
        fail(f"{folder}: no sample could be sorted ({unreadable} unreadable image(s)); nothing was written")
    for bucket in counts:
        parts = sorted(p.name for p in (sorting / bucket.name).iterdir() if p.is_dir())
        merge_bucket(sorting, bucket, parts)
    record = record_of(job.kind, job.image_size, counts, job.buckets)
    with staged_folder(out_path, last=RECORD_FILE) as staging:
        for bucket in counts:
            os.replace(sorting / bucket.name, staging / bucket.name)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        (staging / RECORD_FILE).write_text(record.to_json())
    shutil.rmtree(sorting)
    return {"out": out, "samples": record.num_samples, "unreadable": unreadable,
            "buckets": {bucket.name: n for bucket, n in counts.items()}, "resumed_shards": len(shards) - len(todo)}


def stored_buckets(index: dict, folder: str) -> tuple[Bucket, ...]:
    """The buckets old-format latents were stored in, from their precompute.json (sorted as a list is)."""
    from t2ibench.datasets.buckets import parse_bucket
    from t2ibench.datasets.precomputed import RECORD_FILE as PRECOMPUTE_RECORD

    try:
        names = json.loads(Path(folder, PRECOMPUTE_RECORD).read_text())["aspect_buckets"]
        buckets = tuple(parse_bucket(name) for name in names)
        if not buckets or any(b is None for b in buckets):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        fail(f"{folder}: latents with a bucket column but no readable {PRECOMPUTE_RECORD} listing their buckets: "
             "compute them again with latents.py --aspect_buckets")
    return tuple(sorted(buckets, key=lambda b: (b.aspect, -b.pixels)))
