"""Convert image-caption data to MDS shards, once, for `benchmark.py --remote` to stream.

    python convert.py INPUT [INPUT ...] --out OUT [--compression zstd] [--size_limit 64mb] [--workers N]

    python convert.py ~/photos --out /data/mds/photos                       # folder of images + .txt
    python convert.py /data/laion-wds --out s3://my-bucket/laion/mds        # img2dataset webdataset
    python convert.py /data/laion-parquet/*.parquet --out /data/mds/laion   # img2dataset parquet
    python convert.py ~/photos --out /data/mds/photos-bucketed --aspect_buckets  # one folder per bucket

INPUT: folders (searched recursively) or files of any mix of those kinds (`t2ibench.datasets.convert_inputs`
reads them). OUT: a new or empty local folder, or a URI MDSWriter uploads to (s3://, gs://, oci://,
azure://...). Columns `jpg` (image bytes), `caption`, `key`; what each input may hold, what is
skipped and why, and how to convert a large dataset in parts: docs/data.md. With --aspect_buckets
each image goes to the folder of the bucket nearest its aspect ratio (`t2ibench.datasets.bucket_folders`), for
benchmark.py --aspect_buckets.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from PIL import Image, ImageOps
from tqdm import tqdm

from t2ibench.core import errors
from t2ibench.core.cli import IMAGE_SIZE, NON_NEGATIVE_INT, POSITIVE_INT, Parser, Range
from t2ibench.datasets.convert_inputs import (EMPTY_CAPTION, FORMAT_CHOICES, MISSING_CAPTION, MISSING_IMAGE, PARQUET_CAPTION_COLUMNS,
                                     PARQUET_IMAGE_COLUMNS, STAGING, TOO_SMALL, UNDECODABLE, Candidate, ConvertError,
                                     Report, find_sources, iter_candidates)
from t2ibench.datasets.bucket_folders import IMAGES, RECORD_FILE, BucketWriters, read_record, record_of
from t2ibench.datasets.buckets import Bucket, nearest_bucket, resolve_buckets
from t2ibench.core.images import load_image, oriented_size, to_rgb
from t2ibench.core.locations import (check_output, is_remote, missing_upload_credentials, normalise, scheme,
                                upload_schemes)
from t2ibench.core.files import Hold, acquire
from t2ibench.core.workers import worker_pool
from t2ibench.core.mds import INDEX_FILE, SHARD_NAME, MDSWriter, codec_problem, missing_shard_files, size_limit_problem

COLUMNS = {"jpg": "bytes", "caption": "str", "key": "str"}  # the output's: what data.StreamingImageCaptions reads


# -----------------------------------------------------------------------------------------------
# Checking and encoding one sample (runs in worker processes when --workers > 1).
# -----------------------------------------------------------------------------------------------

def prepare(candidate: Candidate, min_size: int = 0, max_size: int = 0,
            quality: int = 95) -> tuple[Candidate, str | None, bool]:
    """Check a sample and produce what is stored: (sample, skip reason or None, re-encoded?)."""
    if candidate.skip:
        return candidate, candidate.skip, False
    if candidate.caption is None:
        return candidate, MISSING_CAPTION, False
    caption = candidate.caption.strip()
    if not caption:
        return candidate, EMPTY_CAPTION, False
    if not candidate.image:
        return candidate, MISSING_IMAGE, False
    try:
        image = load_image(candidate.image)  # full decode: a truncated file must fail here
    except Exception:  # noqa: BLE001  Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
        return candidate, UNDECODABLE, False
    if min(image.size) < min_size:
        return candidate, TOO_SMALL, False
    too_big = bool(max_size) and min(image.size) > max_size
    if image.format in ("JPEG", "MPO") and not too_big:  # MPO: a camera JPEG with extra frames
        return Candidate(candidate.key, candidate.image, caption), None, False
    ImageOps.exif_transpose(image, in_place=True)  # re-encoding drops EXIF: apply its rotation now
    image = to_rgb(image)
    if too_big:
        scale = max_size / min(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return Candidate(candidate.key, buffer.getvalue(), caption), None, True


def _batches(items: Iterator[Candidate], size: int) -> Iterator[list[Candidate]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# -----------------------------------------------------------------------------------------------
# The output.
# -----------------------------------------------------------------------------------------------

def _remote_index_exists(out: str) -> bool:
    """Whether the remote --out holds an index.json; a store that cannot be reached (no
    credentials, unknown bucket or endpoint) is an error now, not after the conversion."""
    from streaming.base.storage import CloudDownloader

    with tempfile.TemporaryDirectory() as tmp:
        try:
            CloudDownloader.direct_download(f"{out.rstrip('/')}/index.json", os.path.join(tmp, "index.json"), 60)
        except FileNotFoundError:
            return False
        except Exception as error:  # noqa: BLE001  botocore, google, oci... each has its own errors
            code = getattr(error, "response", {}).get("Error", {}).get("Code")
            if code in ("404", "NoSuchKey"):  # botocore's ClientError for a missing object
                return False
            detail = (str(error).strip().splitlines() or [""])[0][:300]
            raise ConvertError(f"--out {out} cannot be reached ({type(error).__name__}: {detail}); check the "
                               "store's credentials and endpoint (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                               "S3_ENDPOINT_URL)") from None
    return True


def _dataset_files(folder: Path) -> set[str]:
    """Names in `folder` that an MDS dataset written by this tool consists of: index.json, the shard
    files it lists and shard-named files (a staging folder's partial shards)."""
    owned = {name for name in os.listdir(folder) if SHARD_NAME.fullmatch(name)}
    try:
        index = json.loads((folder / "index.json").read_text())
        for shard in index.get("shards", []):
            owned.update(info["basename"] for info in (shard.get("raw_data"), shard.get("zip_data")) if info)
        owned.add("index.json")
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        pass  # no (readable) index: nothing else is ours
    try:  # a dataset sorted into bucket folders (--aspect_buckets): its record and its folders
        record = read_record(folder)
    except ValueError:
        record = None
    if record is not None:
        owned.add(RECORD_FILE)
        owned.update(entry.folder for entry in record.folders)
    return owned


@dataclass
class Output:
    """Where MDSWriter writes, and what publishing the result replaces (local --out only)."""

    out: str
    writer_out: str  # the staging folder for a local --out; --out itself for a remote one
    replaced: list[Path] = field(default_factory=list)  # the old dataset's files, deleted on publishing
    created: bool = False  # --out did not exist before


def prepare_output(out: str, overwrite: bool, created: bool | None = None) -> Output:
    """Refuse to mix a new dataset into existing files; with --overwrite, replace an MDS dataset
    only: its index.json and shard files, and nothing else (any other file: refused)."""
    if is_remote(out):
        if _remote_index_exists(out) and not overwrite:
            raise ConvertError(f"--out {out} already holds an MDS dataset (index.json); pass --overwrite to replace it")
        return Output(out, out)  # remote objects are overwritten shard by shard; index.json last, by MDSWriter
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConvertError(f"--out {out} is a file, not a folder")
    staging = path / STAGING
    if staging.is_dir():  # left by a conversion that was killed: ours, unless something else is in it
        staged = _dataset_files(staging)
        foreign = sorted(set(os.listdir(staging)) - staged)
        if foreign:
            raise ConvertError(f"--out {out}: {staging} holds files convert.py did not write ({foreign[0]}...): "
                               "move them away or choose another --out")
        # Killed while publishing (publish moves index.json last, after removing the old one): the
        # shards of its index already in --out are that conversion's too.
        if (staging / INDEX_FILE).is_file() and not (path / INDEX_FILE).exists():
            for name in sorted(staged & set(os.listdir(path)) - {INDEX_FILE}):
                if (path / name).is_file():
                    (path / name).unlink()
        shutil.rmtree(staging)
    created = not path.exists() if created is None else created  # the hold may have made the folder
    entries = set(os.listdir(path)) if path.is_dir() else set()
    replaced: list[Path] = []
    if entries:
        owned = _dataset_files(path)
        # Shard files alone: a dataset whose publishing was cut short (publish() removes index.json first).
        if not (path / "index.json").is_file() and not entries <= owned:
            raise ConvertError(f"--out {out} is not empty and holds no MDS dataset (no index.json): "
                               + ("refusing to delete it; " if overwrite else "") + "choose a new or empty folder")
        if not overwrite:
            raise ConvertError(f"--out {out} already holds an MDS dataset (index.json or shards); pass --overwrite "
                               "to replace it")
        foreign = sorted(entries - owned)
        if foreign:
            raise ConvertError(f"--out {out} holds files that are not part of its MDS dataset ({', '.join(foreign[:3])}"
                               f"{'...' if len(foreign) > 3 else ''}): --overwrite deletes only what convert.py "
                               "wrote; move them away or choose another --out")
        replaced = [path / name for name in sorted(entries)]
    try:
        staging.mkdir(parents=True)
    except OSError as error:
        raise ConvertError(f"--out {out} cannot be written ({error.strerror or error}): choose another folder") from None
    return Output(out, str(staging), replaced, created)


def publish(output: Output) -> None:
    """Move a finished local dataset out of the staging folder, replacing the old one; index.json last."""
    if output.writer_out == output.out:
        return
    staging, path = Path(output.writer_out), Path(output.writer_out).parent
    record = read_record(staging)  # --aspect_buckets: one dataset per bucket folder, the record last
    for folder in [staging / entry.folder for entry in record.folders] if record else [staging]:
        index = json.loads((folder / INDEX_FILE).read_text())
        missing = missing_shard_files(folder, index)
        if missing:  # never an index whose files are not all there
            raise ConvertError(f"--out {output.out}: {len(missing)} of the {len(index['shards'])} shard file(s) just "
                               f"written are gone from {folder} ({missing[0]}...): something else deleted them while "
                               "this ran; the old dataset, if any, is untouched; run the conversion again")
    for old in output.replaced:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    last = RECORD_FILE if record else "index.json"
    names = sorted(os.listdir(staging), key=lambda name: name == last)
    for name in names:
        os.replace(staging / name, path / name)
    staging.rmdir()


def discard(output: Output) -> None:
    """After a failure: remove the staging folder (and --out, if this run created it); the old
    dataset, if any, is untouched."""
    if output.writer_out == output.out:
        return
    staging = Path(output.writer_out)
    shutil.rmtree(staging, ignore_errors=True)
    if output.created:
        with contextlib.suppress(OSError):
            staging.parent.rmdir()  # only if empty


def convert(inputs: list[str], out: str, *, fmt: str = "auto", compression: str | None = "zstd",
            hashes: tuple[str, ...] = ("sha1", "xxh64"), size_limit: int | str = "64mb", min_size: int = 0,
            max_size: int = 0, quality: int = 95, overwrite: bool = False, workers: int = 1,
            image_column: str | None = None, caption_column: str | None = None, progress: bool = True,
            allow_truncated: bool = False, buckets: tuple[Bucket, ...] = (), image_size: int = 1024) -> Report:
    """Convert `inputs` to MDS shards in `out`; returns the report (also printed by main). With `buckets`,
    one MDS folder per bucket (images sorted by their aspect ratio at `image_size`) and the record."""
    inputs = [normalise("INPUT", name, ()) if scheme(name) == "file" else name for name in inputs]
    out = normalise("--out", out, upload_schemes())
    if fmt not in FORMAT_CHOICES:
        raise ConvertError(f"--format {fmt} is unknown; choose auto, folder, webdataset or parquet")
    if min_size < 0 or max_size < 0 or (max_size and max_size < min_size):
        raise ConvertError(f"--min_size {min_size} / --max_size {max_size}: need 0 <= min_size <= max_size (0: no limit)")
    if not 1 <= quality <= 100:
        raise ConvertError(f"--quality {quality} must be a JPEG quality from 1 to 100 (default 95)")
    if workers < 1:
        raise ConvertError(f"--workers {workers} must be at least 1")
    # Imported here: t2ibench.commands.flags loads the model families (diffusers), which converting never needs
    # otherwise; --help and the checks above stay fast.
    from t2ibench.core.cli import check_workers
    problem = check_workers("--workers", workers)
    if problem:
        raise ConvertError(problem)
    problem = codec_problem(compression, hashes, " (zstd:19 sets a level)") or size_limit_problem(size_limit)
    if problem:
        raise ConvertError(problem)
    if buckets and is_remote(out):
        # The bucket folders and their record are published together from a local staging folder.
        raise ConvertError(f"--aspect_buckets writes a local --out, not {out}: convert into a folder, then copy it to "
                           "the store whole (aws s3 sync FOLDER s3://...), the record buckets.json last")
    # --out probed before any input is read: writable, a folder, and not an input nor inside one
    # (nor holding one, which --overwrite would delete).
    problem = check_output("--out", out, folder=True, inputs=[("INPUT", name) for name in inputs])
    problem = problem or missing_upload_credentials("--out", out)
    if problem:
        raise ConvertError(problem)
    # Held from here to the end: a second conversion into the same --out is refused instead of
    # deleting this one's staging folder (and this one then publishing an index of missing shards).
    hold = None if is_remote(out) else acquire("--out", out)
    try:
        return _convert(inputs, out, hold, fmt=fmt, compression=compression, hashes=hashes, size_limit=size_limit,
                        min_size=min_size, max_size=max_size, quality=quality, overwrite=overwrite, workers=workers,
                        image_column=image_column, caption_column=caption_column, progress=progress,
                        allow_truncated=allow_truncated, buckets=buckets, image_size=image_size)
    finally:
        if hold is not None:
            hold.release()


def _convert(inputs: list[str], out: str, hold: Hold | None, *, fmt: str, compression: str | None,
             hashes: tuple[str, ...], size_limit: int | str, min_size: int, max_size: int, quality: int,
             overwrite: bool, workers: int, image_column: str | None, caption_column: str | None, progress: bool,
             allow_truncated: bool, buckets: tuple[Bucket, ...], image_size: int) -> Report:
    """The conversion itself, with --out checked and held (convert)."""
    report = Report(out=out)
    sources, total = find_sources(inputs, fmt, image_column, caption_column, report, allow_truncated)
    output = prepare_output(out, overwrite, created=hold.created if hold is not None else False)
    check = functools.partial(prepare, min_size=min_size, max_size=max_size, quality=quality)
    # Worker processes decode and re-encode; this process reads the inputs and writes shards in
    # input order. Batches bound the memory in flight (Pool.imap would read all inputs ahead).
    # The pool is started before MDSWriter and tqdm start threads, so forking is safe.
    pool = None
    writer = None
    try:
        if workers > 1:
            pool = worker_pool(workers)
        writer_kwargs = dict(compression=compression or None, hashes=sorted(hashes), size_limit=size_limit)
        writer = (BucketWriters(output.writer_out, lambda bucket: COLUMNS, **writer_kwargs) if buckets
                  else MDSWriter(out=output.writer_out, columns=COLUMNS, **writer_kwargs))
        with tqdm(total=total, unit=" img", desc="convert", disable=not progress,
                  mininterval=1.0, dynamic_ncols=True) as bar:
            candidates = iter_candidates(sources, report, image_column, caption_column)
            for batch in _batches(candidates, 64 * max(1, workers)):
                results = pool.map(check, batch, chunksize=8) if pool else map(check, batch)
                for sample, reason, reencoded in results:
                    if reason:
                        report.skipped[reason] += 1
                    else:
                        row = {"jpg": sample.image, "caption": sample.caption, "key": sample.key}
                        if buckets:  # the header alone: the image was decoded by `prepare` already
                            writer.write(nearest_bucket(*oriented_size(sample.image), buckets, image_size), row)
                        else:
                            writer.write(row)
                        report.written += 1
                        report.reencoded += reencoded
                bar.update(len(batch))
                bar.set_postfix(written=report.written, skipped=sum(report.skipped.values()), refresh=False)
        if report.written == 0:
            raise ConvertError("no sample could be converted (" + (", ".join(
                f"{n:,} {reason}" for reason, n in report.skipped.most_common()) or "no samples found") +
                "); nothing was written")
        counts = writer.finish()  # index.json last
        report.shards = writer.num_shards if buckets else len(writer.shards)
        writer = None
        if buckets:  # the record, listing every folder, is what makes the dataset whole
            (Path(output.writer_out) / RECORD_FILE).write_text(
                record_of(IMAGES, image_size, counts, buckets).to_json())
        publish(output)
        if pool is not None:
            pool.close()  # the workers finish their loop and exit; no signals needed
            pool.join()
            pool = None
    except BaseException:
        # No index.json for a dataset that is not whole: MDSWriter's context manager would write one.
        if writer is not None:
            writer.cancel() if buckets else writer.cancel_future_jobs()
        discard(output)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    return report


def build_parser() -> Parser:
    p = Parser("convert.py", description=__doc__)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image folders, .tar shards (or folders of them), .parquet files")
    p.add_argument("--out", required=True, help="output folder, or s3:// gs:// oci:// ... URI")
    p.add_argument("--format", dest="fmt", default="auto", choices=FORMAT_CHOICES,
                   help="how to read the inputs (auto: tar shards, else parquet files, else images)")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd, zstd:<level>, gz, br, none")
    p.add_argument("--hashes", default="sha1,xxh64", help="comma-separated hashes stored per shard ('' for none)")
    p.add_argument("--size_limit", default="64mb", help="shard size before compression, e.g. 64mb or 67108864")
    p.add_argument("--min_size", type=NON_NEGATIVE_INT, default=0, help="skip images whose shorter side is below this (pixels; 0: keep all)")
    p.add_argument("--max_size", type=NON_NEGATIVE_INT, default=0,
                   help="downscale images whose shorter side is above this to it, re-encoded as JPEG (0: never)")
    p.add_argument("--quality", type=Range(int, 1, 100), default=95, help="JPEG quality of re-encoded images")
    p.add_argument("--workers", type=POSITIVE_INT, default=os.cpu_count() or 1, help="processes decoding images (default: all cores)")
    p.add_argument("--image_column", default=None, help=f"parquet image column (default: first of {PARQUET_IMAGE_COLUMNS})")
    p.add_argument("--caption_column", default=None, help=f"parquet caption column (default: first of {PARQUET_CAPTION_COLUMNS})")
    p.add_argument("--overwrite", action="store_true", help="replace the MDS dataset already in --out")
    p.add_argument("--aspect_buckets", nargs="?", const="default", default=None, metavar="FILE",
                   help="one MDS folder per aspect-ratio bucket, each image in the bucket nearest its aspect ratio, for "
                        "benchmark.py --aspect_buckets. The bare flag: the default list at --image_size; FILE: one "
                        "HEIGHTxWIDTH a line")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=1024,
                   help="with --aspect_buckets: the side of the square whose pixels the default list's buckets hold")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    # Damaged input and debugging.
    p.add_argument("--allow_truncated", action="store_true",
                   help="convert the readable part of truncated tar shards instead of refusing (the loss is reported)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)  # file:// URIs are read as paths in `convert`, for callers too


def disk_error(error: BaseException) -> str | None:
    """One line for an OSError: a disk that fills up, an input that cannot be read."""
    return f"{type(error).__name__}: {error}" if isinstance(error, OSError) else None


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    compression = None if args.compression.lower() in ("", "none") else args.compression
    hashes = tuple(h for h in args.hashes.split(",") if h.strip())
    with errors.command("convert.py", debug=args.debug, explain=disk_error):
        if args.aspect_buckets is None and args.image_size != 1024:
            raise ConvertError("--image_size applies to --aspect_buckets only: add --aspect_buckets, or leave it out")
        # Sides in multiples of 8 px (SDXL's latent patch); a run maps each folder to its own list by aspect ratio.
        buckets = resolve_buckets(args.aspect_buckets, args.image_size, 8)
        report = convert(args.inputs, args.out, fmt=args.fmt, compression=compression, hashes=hashes,
                         size_limit=args.size_limit, min_size=args.min_size, max_size=args.max_size,
                         quality=args.quality, overwrite=args.overwrite, workers=args.workers,
                         image_column=args.image_column, caption_column=args.caption_column,
                         progress=not args.no_progress, allow_truncated=args.allow_truncated, buckets=buckets,
                         image_size=args.image_size)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(report.summary(), flush=True)
    return report


if __name__ == "__main__":
    main()
