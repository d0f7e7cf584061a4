"""Convert image-caption data to MDS shards, once, for `benchmark.py --remote` to stream.

    python convert.py INPUT [INPUT ...] --out OUT [--compression zstd] [--size_limit 64mb] [--workers N]

    python convert.py ~/photos --out /data/mds/photos                       # folder of images + .txt
    python convert.py /data/laion-wds --out s3://my-bucket/laion/mds        # img2dataset webdataset
    python convert.py /data/laion-parquet/*.parquet --out /data/mds/laion   # img2dataset parquet

INPUT, any mix of (folders are searched recursively):
  * images with same-named caption files: photos/cat.jpg + photos/cat.txt
    (.jpg .jpeg .png .webp .bmp .gif .tif .tiff);
  * webdataset tar shards as img2dataset writes them (--output_format webdataset): a folder of
    *.tar or .tar files, members KEY.jpg + KEY.txt (+ KEY.json, whose "caption" is used when KEY.txt
    is missing); the members of one sample must be adjacent, as webdataset requires;
  * parquet files that hold the images (img2dataset --output_format parquet: `jpg`/`png`/`webp` bytes
    and a `txt` caption, or an `image` struct with `bytes`); needs `pip install pyarrow`. The
    parquet files next to img2dataset's tar shards hold metadata only: a folder with tar shards is
    read as webdataset.
OUT: a local folder (new or empty), or a URI MDSWriter uploads to (s3://bucket/path, gs://,
  oci://, azure://...) with the credentials Streaming uses (for S3: the AWS variables and
  S3_ENDPOINT_URL for other S3-compatible stores). --overwrite replaces an existing dataset.

Output columns: `jpg` (encoded image bytes), `caption` (str), `key` (str: the source file or key).
Every image is decoded once to check it. JPEG bytes are stored unchanged (no second lossy
compression); other formats are converted to RGB (transparency composited on white) and stored as
JPEG quality 95, so every sample decodes the same way and shards stay small (PNG photos are 3-10x
larger). The column keeps the name `jpg` for compatibility; the training side detects the format
from the bytes, never from the column name. Samples with an undecodable image, no image, no caption
or an empty caption are skipped, and counted per reason in the final report.

Large datasets: --workers decodes on all cores, and separate jobs can convert separate groups of
input shards, each into its own folder under one root (--out ROOT/part-000, ROOT/part-001...);
then one index for the whole root, which is what --remote ROOT streams:
    python -c "from streaming.base.util import merge_index; merge_index('ROOT')"   # ROOT may be s3://...
"""
from __future__ import annotations

import argparse
import functools
import io
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from PIL import Image, ImageOps
from streaming import MDSWriter
from streaming.base.compression import get_compressions
from streaming.base.hashing import get_hashes
from streaming.base.util import bytes_to_int
from tqdm import tqdm

from data import load_image, to_rgb

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
COLUMNS = {"jpg": "bytes", "caption": "str", "key": "str"}
# Column names tried, in order, when reading parquet files (img2dataset writes `jpg` and `txt`;
# Hugging Face datasets write an `image` struct and often `caption` or `text`).
PARQUET_IMAGE_COLUMNS = ("jpg", "jpeg", "png", "webp", "image", "img")
PARQUET_CAPTION_COLUMNS = ("txt", "caption", "text", "TEXT", "CAPTION")

# Reasons a sample is skipped, as printed in the report.
MISSING_CAPTION = "missing caption"
EMPTY_CAPTION = "empty caption"
MISSING_IMAGE = "missing image"
UNDECODABLE = "undecodable image"
TOO_SMALL = "smaller than --min_size"


class ConvertError(Exception):
    """Bad input or output: printed as one line, no traceback."""


@dataclass
class Candidate:
    """One sample as found in the input, before any checking. `image` is the encoded bytes."""

    key: str
    image: bytes | None
    caption: str | None


@dataclass
class Report:
    """What a conversion wrote and skipped."""

    out: str
    written: int = 0
    reencoded: int = 0  # written samples whose image was not stored byte for byte (not JPEG, or resized)
    shards: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in self.skipped.most_common())
        return (f"wrote {self.written:,} samples in {self.shards} shard(s) to {self.out} "
                f"({self.written - self.reencoded:,} JPEGs stored as they were, {self.reencoded:,} re-encoded "
                f"as JPEG); skipped {skipped:,}" + (f": {reasons}" if reasons else ""))


# -----------------------------------------------------------------------------------------------
# Reading the inputs: each source yields Candidates in a deterministic order.
# -----------------------------------------------------------------------------------------------

def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")  # a stray byte should not cost us the sample


def folder_candidates(root: Path, images: list[Path]) -> Iterator[Candidate]:
    """Images under `root` with their same-named .txt captions (photos/cat.jpg + photos/cat.txt)."""
    for path in images:
        caption_path = path.with_suffix(".txt")
        caption = _text(caption_path.read_bytes()) if caption_path.is_file() else None
        # Without a caption the sample is skipped anyway: do not read the image.
        image = path.read_bytes() if caption is not None else None
        key = path.relative_to(root).as_posix()
        yield Candidate(key, image, caption)


def _webdataset_sample(key: str, files: dict[str, bytes]) -> Candidate:
    image = next((files[ext] for ext in files if "." + ext in IMAGE_EXTENSIONS), None)
    caption = _text(files["txt"]) if "txt" in files else None
    if caption is None and "json" in files:
        try:
            meta = json.loads(files["json"])
            caption = meta.get("caption") if isinstance(meta, dict) and isinstance(meta.get("caption"), str) else None
        except ValueError:
            pass  # a broken json only costs its caption fallback
    return Candidate(key, image, caption)


def webdataset_candidates(path: Path, report: Report) -> Iterator[Candidate]:
    """Samples of one webdataset tar: members KEY.EXT grouped by KEY (the name up to the first dot).

    The tar is read as a stream (`r|*`, gzip allowed), so a 10 GB shard never sits in memory;
    that is why a sample's members must be adjacent, which webdataset writers guarantee.
    """
    key, files = None, {}
    try:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, name = member.name.rpartition("/")
                stem, dot, ext = name.partition(".")
                if not stem or not dot:
                    continue  # "._KEY.jpg" (macOS metadata) or a member without an extension
                member_key = f"{folder}/{stem}" if folder else stem
                if member_key != key:
                    if key is not None:
                        yield _webdataset_sample(key, files)
                    key, files = member_key, {}
                files[ext.lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as error:
        # A truncated last shard is common after an interrupted download: keep what was read.
        report.warnings.append(f"{path}: stopped reading ({type(error).__name__}: {error}); "
                               f"the samples before that point were converted")
    if key is not None:
        yield _webdataset_sample(key, files)


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConvertError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    return pq.ParquetFile(path)


def _parquet_columns(path: Path, image_column: str | None, caption_column: str | None) -> tuple[str, str]:
    names = _parquet_file(path).schema_arrow.names
    image = image_column or next((c for c in PARQUET_IMAGE_COLUMNS if c in names), None)
    caption = caption_column or next((c for c in PARQUET_CAPTION_COLUMNS if c in names), None)
    if image not in names:
        raise ConvertError(
            f"{path} has no image column ({image_column or ' / '.join(PARQUET_IMAGE_COLUMNS)}; it has {names}). "
            "img2dataset stores images in parquet only with --output_format parquet; with webdataset "
            "output convert the .tar files instead (or name the column with --image_column)")
    if caption not in names:
        raise ConvertError(f"{path} has no caption column ({caption_column or ' / '.join(PARQUET_CAPTION_COLUMNS)}; "
                           f"it has {names}); name it with --caption_column")
    return image, caption


def parquet_candidates(path: Path, image_column: str | None, caption_column: str | None) -> Iterator[Candidate]:
    """Rows of a parquet file that stores image bytes, read in batches of 256 rows."""
    image_col, caption_col = _parquet_columns(path, image_column, caption_column)
    parquet = _parquet_file(path)
    columns = [image_col, caption_col] + (["key"] if "key" in parquet.schema_arrow.names else [])
    row = 0
    for batch in parquet.iter_batches(batch_size=256, columns=columns):
        for record in batch.to_pylist():
            image = record[image_col]
            if isinstance(image, dict):  # Hugging Face `Image` feature: {"bytes": ..., "path": ...}
                image = image.get("bytes")
            caption = record[caption_col]
            key = record.get("key") or f"{path.name}:{row}"
            yield Candidate(str(key), image if isinstance(image, bytes) else None,
                            caption if isinstance(caption, str) else None)
            row += 1


@dataclass
class Source:
    """One input to read: a folder of images (with its file list), a tar shard or a parquet file."""

    kind: str  # "folder", "webdataset" or "parquet"
    path: Path
    images: list[Path] = field(default_factory=list)  # for "folder": the image files, sorted


def _is_tar(path: Path) -> bool:
    return path.name.lower().endswith(TAR_SUFFIXES)


def find_sources(inputs: list[str], fmt: str, image_column: str | None = None,
                 caption_column: str | None = None) -> tuple[list[Source], int | None]:
    """Resolve INPUT paths to sources and count their samples (None when unknown, as for tars).

    Raises ConvertError when an input is missing or holds nothing to convert.
    """
    sources: list[Source] = []
    total: int | None = 0
    for name in inputs:
        path = Path(name).expanduser()
        if not path.exists():
            raise ConvertError(f"input {name} does not exist")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found = {
            "webdataset": [p for p in files if _is_tar(p)],
            "parquet": [p for p in files if p.suffix.lower() == ".parquet"],
            "folder": [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS],
        }
        kind = fmt if fmt != "auto" else next((k for k in ("webdataset", "parquet", "folder") if found[k]), None)
        if kind is None or not found[kind]:
            wanted = {"webdataset": ".tar shards", "parquet": ".parquet files", "folder": "images"}.get(
                kind, f"images ({' '.join(sorted(IMAGE_EXTENSIONS))}), .tar shards or .parquet files")
            raise ConvertError(f"nothing to convert in {name}: no {wanted} found")
        if kind == "folder":
            sources.append(Source("folder", path if path.is_dir() else path.parent, found["folder"]))
            total = None if total is None else total + len(found["folder"])
            continue
        for file in found[kind]:
            sources.append(Source(kind, file))
            if kind == "parquet":
                _parquet_columns(file, image_column, caption_column)  # fail now, not after hours of work
                total = None if total is None else total + _parquet_file(file).metadata.num_rows
            else:
                total = None  # a tar's sample count is only known after reading it
    return sources, total


def iter_candidates(sources: list[Source], report: Report, image_column: str | None,
                    caption_column: str | None) -> Iterator[Candidate]:
    for source in sources:
        if source.kind == "folder":
            yield from folder_candidates(source.path, source.images)
        elif source.kind == "webdataset":
            yield from webdataset_candidates(source.path, report)
        else:
            yield from parquet_candidates(source.path, image_column, caption_column)


# -----------------------------------------------------------------------------------------------
# Checking and encoding one sample (runs in worker processes when --workers > 1).
# -----------------------------------------------------------------------------------------------

def prepare(candidate: Candidate, min_size: int = 0, max_size: int = 0,
            quality: int = 95) -> tuple[Candidate, str | None, bool]:
    """Check a sample and produce what is stored: (sample, skip reason or None, re-encoded?)."""
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

def is_remote(out: str) -> bool:
    return urllib.parse.urlparse(out).scheme not in ("", "file")


def _remote_index_exists(out: str) -> bool:
    from streaming.base.storage import CloudDownloader

    with tempfile.TemporaryDirectory() as tmp:
        try:
            CloudDownloader.direct_download(f"{out.rstrip('/')}/index.json", os.path.join(tmp, "index.json"), 60)
        except Exception:  # noqa: BLE001  not found (or not reachable: then the upload will say why)
            return False
    return True


def prepare_output(out: str, overwrite: bool) -> None:
    """Refuse to mix a new dataset into existing files; with --overwrite, replace an MDS dataset only."""
    if is_remote(out):
        if _remote_index_exists(out) and not overwrite:
            raise ConvertError(f"--out {out} already holds an MDS dataset (index.json); pass --overwrite to replace it")
        return  # remote objects are overwritten shard by shard; index.json last, by MDSWriter
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConvertError(f"--out {out} is a file, not a folder")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ConvertError(f"--out {out} is not empty; pass --overwrite to replace the dataset in it")
        if not (path / "index.json").is_file():
            raise ConvertError(f"--out {out} is not empty and holds no MDS dataset (no index.json): "
                               "refusing to delete it; choose a new or empty folder")
        shutil.rmtree(path)


def convert(inputs: list[str], out: str, *, fmt: str = "auto", compression: str | None = "zstd",
            hashes: tuple[str, ...] = ("sha1", "xxh64"), size_limit: int | str = "64mb", min_size: int = 0,
            max_size: int = 0, quality: int = 95, overwrite: bool = False, workers: int = 1,
            image_column: str | None = None, caption_column: str | None = None, progress: bool = True) -> Report:
    """Convert `inputs` to MDS shards in `out`; returns the report (also printed by main)."""
    if fmt not in ("auto", "folder", "webdataset", "parquet"):
        raise ConvertError(f"--format {fmt} is unknown; choose auto, folder, webdataset or parquet")
    if min_size < 0 or max_size < 0 or (max_size and max_size < min_size):
        raise ConvertError(f"--min_size {min_size} / --max_size {max_size}: need 0 <= min_size <= max_size (0: no limit)")
    unknown = [c for c in [compression] if c and c not in get_compressions()]
    unknown += [h for h in hashes if h not in get_hashes()]
    if unknown:
        families = sorted({c.split(":")[0] for c in get_compressions()})
        raise ConvertError(f"unknown compression or hash {unknown}: compressions are {families} (zstd:19 sets "
                           f"a level), hashes are {sorted(get_hashes())}")
    try:
        if not 0 < bytes_to_int(size_limit) < 2**32:
            raise ValueError
    except (ValueError, TypeError):
        raise ConvertError(f"--size_limit {size_limit} must be a size such as 64mb, below 4gb") from None
    sources, total = find_sources(inputs, fmt, image_column, caption_column)
    prepare_output(out, overwrite)
    report = Report(out=out)
    check = functools.partial(prepare, min_size=min_size, max_size=max_size, quality=quality)
    # Worker processes decode and re-encode; this process reads the inputs and writes shards in
    # input order. Batches bound the memory in flight (Pool.imap would read all inputs ahead).
    # The pool is started before MDSWriter and tqdm start threads, so forking is safe.
    pool = None
    if workers > 1:
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        pool = context.Pool(workers, initializer=_pool_worker_init)
    try:
        writer = MDSWriter(out=out, columns=COLUMNS, compression=compression or None,
                           hashes=sorted(hashes), size_limit=size_limit)
        with writer, tqdm(total=total, unit=" img", desc="convert", disable=not progress,
                          mininterval=1.0, dynamic_ncols=True) as bar:
            candidates = iter_candidates(sources, report, image_column, caption_column)
            for batch in _batches(candidates, 64 * max(1, workers)):
                results = pool.map(check, batch, chunksize=8) if pool else map(check, batch)
                for sample, reason, reencoded in results:
                    if reason:
                        report.skipped[reason] += 1
                    else:
                        writer.write({"jpg": sample.image, "caption": sample.caption, "key": sample.key})
                        report.written += 1
                        report.reencoded += reencoded
                bar.update(len(batch))
                bar.set_postfix(written=report.written, skipped=sum(report.skipped.values()), refresh=False)
        report.shards = len(writer.shards)
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        if pool is not None:
            pool.terminate()
    return report


def _pool_worker_init() -> None:
    """Pool workers die on SIGTERM and leave Ctrl-C to the parent.

    Composer, imported through data.py, turns SIGTERM into sys.exit(), which a worker blocked on the
    pool's task queue never reaches: Pool.terminate() then waits for it forever.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image folders, .tar shards (or folders of them), .parquet files")
    p.add_argument("--out", required=True, help="output folder, or s3:// gs:// oci:// ... URI")
    p.add_argument("--format", dest="fmt", default="auto", choices=("auto", "folder", "webdataset", "parquet"),
                   help="how to read the inputs (auto: tar shards, else parquet files, else images)")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd, zstd:<level>, gz, br, none")
    p.add_argument("--hashes", default="sha1,xxh64", help="comma-separated hashes stored per shard ('' for none)")
    p.add_argument("--size_limit", default="64mb", help="shard size before compression, e.g. 64mb or 67108864")
    p.add_argument("--min_size", type=int, default=0, help="skip images whose shorter side is below this (pixels; 0: keep all)")
    p.add_argument("--max_size", type=int, default=0,
                   help="downscale images whose shorter side is above this to it, re-encoded as JPEG (0: never)")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality of re-encoded images")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes decoding images (default: all cores)")
    p.add_argument("--image_column", default=None, help=f"parquet image column (default: first of {PARQUET_IMAGE_COLUMNS})")
    p.add_argument("--caption_column", default=None, help=f"parquet caption column (default: first of {PARQUET_CAPTION_COLUMNS})")
    p.add_argument("--overwrite", action="store_true", help="replace the MDS dataset already in --out")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    compression = None if args.compression.lower() in ("", "none") else args.compression
    hashes = tuple(h for h in args.hashes.split(",") if h.strip())
    try:
        report = convert(args.inputs, args.out, fmt=args.fmt, compression=compression, hashes=hashes,
                         size_limit=args.size_limit, min_size=args.min_size, max_size=args.max_size,
                         quality=args.quality, overwrite=args.overwrite, workers=args.workers,
                         image_column=args.image_column, caption_column=args.caption_column,
                         progress=not args.no_progress)
    except ConvertError as error:
        raise SystemExit(f"convert.py: error: {error}") from None
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(report.summary(), flush=True)
    if report.written == 0:
        raise SystemExit("convert.py: error: no sample could be converted (see the skip reasons above)")
    return report


if __name__ == "__main__":
    main()
