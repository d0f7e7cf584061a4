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
    is missing), grouped by KEY over the whole tar (they need not be adjacent). A truncated tar
    (an interrupted download) is refused before anything is written; --allow_truncated converts
    its readable part and reports the loss;
  * parquet files that hold the images (img2dataset --output_format parquet: `jpg`/`png`/`webp` bytes
    and a `txt` caption, or an `image` struct with `bytes`); needs `pip install pyarrow`. The
    parquet files next to img2dataset's tar shards hold metadata only: a folder with tar shards is
    read as webdataset.
  A folder holding several kinds (tar shards and loose images, say) is converted whole; with
  --format only that kind is read, and the files left out are counted in the report.
  Caption files are UTF-8; any that is not is read as Windows-1252 and counted in the report.
OUT: a local folder (new or empty), or a URI MDSWriter uploads to (s3://bucket/path, gs://,
  oci://, azure://...) with the credentials Streaming uses (for S3: the AWS variables and
  S3_ENDPOINT_URL for other S3-compatible stores). It may not lie inside an INPUT, nor an INPUT
  inside it. --overwrite replaces an existing MDS dataset there: it deletes index.json and the
  shard files only, and refuses when the folder holds anything else. A local dataset is written
  in OUT/.convert-partial and moved into place when complete (index.json last), so a failed or
  interrupted run leaves no index.json behind (and the old dataset, with --overwrite, in place).

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
import contextlib
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

from t2ibench import errors
from t2ibench.cli import NON_NEGATIVE_INT, POSITIVE_INT, Parser, Range
from t2ibench.errors import UserError
from t2ibench.images import load_image, to_rgb
from t2ibench.locations import (check_output, is_remote, missing_upload_credentials, normalise, scheme,
                                upload_schemes)
from t2ibench.files import Hold, acquire
from t2ibench.mds import INDEX_FILE, SHARD_NAME, missing_shard_files

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
TRUNCATED = "cut off by the end of a truncated tar"

# The files MDSWriter names shards (shard.00000.mds, shard.00000.mds.zstd): with index.json, the
# only files --overwrite deletes. A local output is written in STAGING inside --out and moved into
# place when complete, so a failed or interrupted conversion never leaves a dataset that looks whole.
STAGING = ".convert-partial"


class ConvertError(UserError):
    """Bad input or output: printed as one line (`convert.py: error: ...`), no traceback."""


@dataclass
class Candidate:
    """One sample as found in the input, before any checking. `image` is the encoded bytes."""

    key: str
    image: bytes | None
    caption: str | None
    skip: str | None = None  # a reason to skip it found while reading (TRUNCATED)


@dataclass
class Report:
    """What a conversion wrote and skipped."""

    out: str
    written: int = 0
    reencoded: int = 0  # written samples whose image was not stored byte for byte (not JPEG, or resized)
    shards: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    not_read: Counter = field(default_factory=Counter)  # kind of input file left out -> files
    non_utf8_captions: int = 0  # caption files decoded as Windows-1252 (see _text)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in self.skipped.most_common())
        text = (f"wrote {self.written:,} samples in {self.shards} shard(s) to {self.out} "
                f"({self.written - self.reencoded:,} JPEGs stored as they were, {self.reencoded:,} re-encoded "
                f"as JPEG); skipped {skipped:,}" + (f": {reasons}" if reasons else ""))
        if self.not_read:
            text += "; not read: " + ", ".join(f"{n:,} {what}" for what, n in self.not_read.most_common())
        if self.non_utf8_captions:
            text += (f"; {self.non_utf8_captions:,} caption file(s) were not UTF-8 and were read as "
                     "Windows-1252 (cp1252)")
        return text


# -----------------------------------------------------------------------------------------------
# Reading the inputs: each source yields Candidates in a deterministic order.
# -----------------------------------------------------------------------------------------------

def _text(data: bytes, report: Report) -> str:
    """A caption file's text: UTF-8 (a byte-order mark is dropped); any other bytes are read as
    Windows-1252 (the usual legacy encoding of scraped captions; Latin-1 for its 5 undefined bytes),
    and counted in the report: never replaced silently."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        report.non_utf8_captions += 1
        try:
            return data.decode("cp1252")
        except UnicodeDecodeError:
            return data.decode("latin-1")


def folder_candidates(root: Path, images: list[Path], report: Report) -> Iterator[Candidate]:
    """Images under `root` with their same-named .txt captions (photos/cat.jpg + photos/cat.txt)."""
    for path in images:
        caption_path = path.with_suffix(".txt")
        caption = _text(_read(caption_path), report) if caption_path.is_file() else None
        # Without a caption the sample is skipped anyway: do not read the image.
        image = _read(path) if caption is not None else None
        key = path.relative_to(root).as_posix()
        yield Candidate(key, image, caption)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConvertError(f"cannot read {path}: {error.strerror or error}") from None


def _webdataset_sample(key: str, files: dict[str, bytes], report: Report) -> Candidate:
    image = next((files[ext] for ext in files if "." + ext in IMAGE_EXTENSIONS), None)
    caption = _text(files["txt"], report) if "txt" in files else None
    if caption is None and "json" in files:
        try:
            meta = json.loads(files["json"])
            caption = meta.get("caption") if isinstance(meta, dict) and isinstance(meta.get("caption"), str) else None
        except ValueError:
            pass  # a broken json only costs its caption fallback
    return Candidate(key, image, caption)


def _member_key(member: tarfile.TarInfo) -> tuple[str, str] | None:
    """(KEY, ext) of a webdataset member KEY.EXT (KEY: the name up to the first dot), or None."""
    if not member.isfile():
        return None
    folder, _, name = member.name.rpartition("/")
    stem, dot, ext = name.partition(".")
    if not stem or not dot:
        return None  # "._KEY.jpg" (macOS metadata) or a member without an extension
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


@dataclass
class TarScan:
    """A tar shard's members (headers only) and, if it is damaged, what is wrong with it."""

    members: list[tarfile.TarInfo]
    samples: int  # distinct keys
    problem: str | None


def scan_tar(path: Path) -> TarScan:
    """Read the headers of a tar shard (seeks past the data of an uncompressed tar) and check its end.

    tarfile stops without a word at a missing or partial header, which is how a tar cut at a
    member boundary looks (an interrupted download); a complete tar ends with a zero block after
    its last member, so its absence, or data cut short, means samples were lost.
    """
    members: list[tarfile.TarInfo] = []
    problem = None
    try:
        with tarfile.open(path, "r:*") as tar:
            while (member := tar.next()) is not None:  # not getmembers(): keep what came before an error
                members.append(member)
            tar.fileobj.seek(tar.offset)
            end = tar.fileobj.read(tarfile.BLOCKSIZE)
            if len(end) < tarfile.BLOCKSIZE or end.count(0) != tarfile.BLOCKSIZE:
                last = f"after member {members[-1].name}" if members else "before its first member"
                problem = f"is truncated {last} (no end-of-archive block)"
    except (tarfile.TarError, OSError, EOFError, ValueError) as error:
        problem = f"cannot be read to its end ({type(error).__name__}: {error})"
    keys = {k[0] for m in members if (k := _member_key(m)) is not None}
    return TarScan(members, len(keys), problem)


def webdataset_candidates(path: Path, report: Report) -> Iterator[Candidate]:
    """Samples of one webdataset tar: members KEY.EXT grouped by KEY over the whole tar.

    The headers are read first (scan_tar), then each sample is read once its last member is
    reached: the members of a sample need not be adjacent, and only one sample's data is in
    memory at a time. An adjacent tar (what webdataset writers produce) is read front to back.
    """
    scan = scan_tar(path)
    groups: dict[str, list[tuple[str, tarfile.TarInfo]]] = {}
    last: dict[str, int] = {}
    for position, member in enumerate(scan.members):
        if (found := _member_key(member)) is not None:
            groups.setdefault(found[0], []).append((found[1], member))
            last[found[0]] = position
    if scan.problem:
        report.warnings.append(f"{path} {scan.problem}: {scan.samples:,} sample key(s) were found before that "
                               "point; the samples after it are lost, and an incomplete last one is counted among "
                               "the skipped (re-download the file)")
    if not groups:
        return
    with tarfile.open(path, "r:*") as tar:
        for key in sorted(groups, key=last.__getitem__):
            files = {}
            try:
                for ext, member in groups[key]:
                    files[ext] = tar.extractfile(member).read()
            except (tarfile.TarError, OSError, EOFError, ValueError):
                yield Candidate(key, None, None, TRUNCATED)  # its data lies past the end of the file
                continue
            yield _webdataset_sample(key, files, report)


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConvertError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001  pyarrow.ArrowInvalid (not a parquet file), OSError...
        raise ConvertError(f"{path} is not a readable parquet file ({type(error).__name__}: {error})") from None


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
    batches = parquet.iter_batches(batch_size=256, columns=columns)
    while True:
        try:
            batch = next(batches, None)
        except Exception as error:  # noqa: BLE001  pyarrow.ArrowInvalid, OSError...: a damaged page of the user's file
            detail = (str(error).strip().splitlines() or [""])[0][:200]
            raise ConvertError(f"{path} cannot be read after row {row:,} ({type(error).__name__}: {detail}): the "
                               "file is damaged; download or write it again (nothing was written)") from None
        if batch is None:
            break
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
                 caption_column: str | None = None, report: Report | None = None,
                 allow_truncated: bool = False) -> tuple[list[Source], int | None]:
    """Resolve INPUT paths to sources and count their samples (None when unknown).

    --format auto reads every kind found: tar shards, parquet files and loose images (a folder
    may hold several); the parquet files next to tar shards are img2dataset's metadata and are
    left out. Files of a kind that is not read are counted in the report. Every tar's headers are
    read now, so a truncated shard is refused before anything is written (--allow_truncated
    converts its readable part instead, and reports it).
    Raises ConvertError when an input is missing or holds nothing to convert.
    """
    report = report if report is not None else Report(out="")
    resolved = [(name, Path(name).expanduser().resolve()) for name in inputs if not is_remote(name)]
    for i, (name, path) in enumerate(resolved):
        for other, other_path in resolved[i + 1:]:
            if path == other_path or path in other_path.parents or other_path in path.parents:
                raise ConvertError(f"inputs {name} and {other} overlap: their common files would be converted "
                                   "twice; give each folder once")
    sources: list[Source] = []
    total: int | None = 0
    damaged: list[str] = []
    names = {"webdataset": ".tar shard(s)", "parquet": ".parquet file(s)", "folder": "image(s)"}
    for name in inputs:
        if is_remote(name):
            raise ConvertError(f"input {name}: inputs are local files or folders (download remote data first)")
        path = Path(name).expanduser()
        if not path.exists():
            raise ConvertError(f"input {name} does not exist")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files = [p for p in files if STAGING not in p.parts]  # an interrupted conversion's own output
        found = {
            "webdataset": [p for p in files if _is_tar(p)],
            "parquet": [p for p in files if p.suffix.lower() == ".parquet"],
            "folder": [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS],
        }
        if fmt == "auto":
            kinds = [k for k in ("webdataset", "parquet", "folder") if found[k]]
            if found["webdataset"] and found["parquet"]:
                kinds.remove("parquet")
                report.not_read[f"{names['parquet']} next to tar shards (img2dataset metadata; "
                                "--format parquet reads them)"] += len(found["parquet"])
        else:
            kinds = [fmt] if found[fmt] else []
            for other in found:
                if other != fmt and found[other]:
                    report.not_read[f"{names[other]} (--format {fmt})"] += len(found[other])
        if not kinds:
            wanted = names[fmt] if fmt != "auto" else \
                f"images ({' '.join(sorted(IMAGE_EXTENSIONS))}), .tar shards or .parquet files"
            raise ConvertError(f"nothing to convert in {name}: no {wanted} found")
        if "webdataset" in kinds:
            for file in found["webdataset"]:
                scan = scan_tar(file)
                if scan.problem:
                    damaged.append(f"{file} {scan.problem}")
                sources.append(Source("webdataset", file))
                total = None if total is None else total + scan.samples
        if "parquet" in kinds:
            for file in found["parquet"]:
                sources.append(Source("parquet", file))
                _parquet_columns(file, image_column, caption_column)  # fail now, not after hours of work
                total = None if total is None else total + _parquet_file(file).metadata.num_rows
        if "folder" in kinds:
            images = found["folder"]
            sources.append(Source("folder", path if path.is_dir() else path.parent, images))
            total = None if total is None else total + len(images)
            stems = {p.with_suffix("") for p in images}
            orphans = [p for p in files if p.suffix == ".txt" and p.with_suffix("") not in stems]
            if orphans and path.is_dir():
                report.not_read[".txt file(s) without a same-named image"] += len(orphans)
    if damaged and not allow_truncated:
        raise ConvertError(f"{damaged[0]}" + (f" (and {len(damaged) - 1} more tar(s))" if len(damaged) > 1 else "")
                           + ": re-download it, or pass --allow_truncated to convert the readable part "
                           "(the loss is reported)")
    return sources, total


def iter_candidates(sources: list[Source], report: Report, image_column: str | None,
                    caption_column: str | None) -> Iterator[Candidate]:
    for source in sources:
        if source.kind == "folder":
            yield from folder_candidates(source.path, source.images, report)
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


def _default_sigterm() -> None:
    """Pool worker start: the default SIGTERM action (exit at once). Importing Composer (data.py
    does) installs a handler that raises SystemExit instead; a forked worker inherits it and was
    seen to outlive Pool.terminate(), which then waits for it forever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
        foreign = sorted(set(os.listdir(staging)) - _dataset_files(staging))
        if foreign:
            raise ConvertError(f"--out {out}: {staging} holds files convert.py did not write ({foreign[0]}...): "
                               "move them away or choose another --out")
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
    index = json.loads((staging / INDEX_FILE).read_text())
    missing = missing_shard_files(staging, index)
    if missing:  # never an index whose files are not all there
        raise ConvertError(f"--out {output.out}: {len(missing)} of the {len(index['shards'])} shard file(s) just "
                           f"written are gone from {staging} ({missing[0]}...): something else deleted them while "
                           "this ran; the old dataset, if any, is untouched; run the conversion again")
    for old in output.replaced:
        old.unlink()
    names = sorted(os.listdir(staging), key=lambda name: name == "index.json")
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
            allow_truncated: bool = False) -> Report:
    """Convert `inputs` to MDS shards in `out`; returns the report (also printed by main)."""
    inputs = [normalise("INPUT", name, ()) if scheme(name) == "file" else name for name in inputs]
    out = normalise("--out", out, upload_schemes())
    if fmt not in ("auto", "folder", "webdataset", "parquet"):
        raise ConvertError(f"--format {fmt} is unknown; choose auto, folder, webdataset or parquet")
    if min_size < 0 or max_size < 0 or (max_size and max_size < min_size):
        raise ConvertError(f"--min_size {min_size} / --max_size {max_size}: need 0 <= min_size <= max_size (0: no limit)")
    if not 1 <= quality <= 100:
        raise ConvertError(f"--quality {quality} must be a JPEG quality from 1 to 100 (default 95)")
    if workers < 1:
        raise ConvertError(f"--workers {workers} must be at least 1")
    # Imported here: t2ibench.flags loads the model families (diffusers), which converting never needs
    # otherwise; --help and the checks above stay fast.
    from t2ibench.cli import check_workers
    problem = check_workers("--workers", workers)
    if problem:
        raise ConvertError(problem)
    unknown = [c for c in [compression] if c and c not in get_compressions()]
    unknown += [h for h in hashes if h not in get_hashes()]
    if unknown:
        families = sorted({c.split(":")[0] for c in get_compressions()})
        raise ConvertError(f"--compression / --hashes: unknown compression or hash {unknown}: compressions are "
                           f"{families} (zstd:19 sets a level), hashes are {sorted(get_hashes())}")
    try:
        if not 0 < bytes_to_int(size_limit) < 2**32:
            raise ValueError
    except (ValueError, TypeError):
        raise ConvertError(f"--size_limit {size_limit} must be a size such as 64mb, below 4gb") from None
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
                        allow_truncated=allow_truncated)
    finally:
        if hold is not None:
            hold.release()


def _convert(inputs: list[str], out: str, hold: Hold | None, *, fmt: str, compression: str | None,
             hashes: tuple[str, ...], size_limit: int | str, min_size: int, max_size: int, quality: int,
             overwrite: bool, workers: int, image_column: str | None, caption_column: str | None, progress: bool,
             allow_truncated: bool) -> Report:
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
            context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            pool = context.Pool(workers, initializer=_default_sigterm)
        writer = MDSWriter(out=output.writer_out, columns=COLUMNS, compression=compression or None,
                           hashes=sorted(hashes), size_limit=size_limit)
        with tqdm(total=total, unit=" img", desc="convert", disable=not progress,
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
        if report.written == 0:
            raise ConvertError("no sample could be converted (" + (", ".join(
                f"{n:,} {reason}" for reason, n in report.skipped.most_common()) or "no samples found") +
                "); nothing was written")
        writer.finish()  # index.json last
        report.shards = len(writer.shards)
        writer = None
        publish(output)
        if pool is not None:
            pool.close()  # the workers finish their loop and exit; no signals needed
            pool.join()
            pool = None
    except BaseException:
        # No index.json for a dataset that is not whole: MDSWriter's context manager would write one.
        if writer is not None:
            writer.cancel_future_jobs()
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
    p.add_argument("--format", dest="fmt", default="auto", choices=("auto", "folder", "webdataset", "parquet"),
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
        report = convert(args.inputs, args.out, fmt=args.fmt, compression=compression, hashes=hashes,
                         size_limit=args.size_limit, min_size=args.min_size, max_size=args.max_size,
                         quality=args.quality, overwrite=args.overwrite, workers=args.workers,
                         image_column=args.image_column, caption_column=args.caption_column,
                         progress=not args.no_progress, allow_truncated=args.allow_truncated)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(report.summary(), flush=True)
    return report


if __name__ == "__main__":
    main()
