"""The inputs convert.py reads, each as Candidates (key, encoded image, caption) in a deterministic
order: folders of images with same-named caption files, webdataset tar shards and parquet files as
img2dataset writes them (`find_sources`, `iter_candidates`), and the report of what was read, written
and skipped. What each format may hold is in docs/data.md."""
from __future__ import annotations

import json
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from t2ibench.core.errors import UserError
from t2ibench.core.locations import file_kind, is_remote

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FORMAT_CHOICES = ("auto", "folder", "webdataset", "parquet")  # --format: every kind found, or one
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
        kind = None if path.is_dir() else file_kind(path)
        if kind:  # a FIFO opened waits for a writer forever
            raise ConvertError(f"input {name} is {kind}, not a file or folder of images, .tar shards or .parquet files")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files = [p for p in files if STAGING not in p.parts]  # an interrupted conversion's own output
        found = {
            "webdataset": [p for p in files if _is_tar(p)],
            "parquet": [p for p in files if p.suffix.lower() == ".parquet"],
            "folder": [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS],
        }
        if fmt == "auto":
            kinds = [k for k in found if found[k]]  # tar shards first, then parquet, then images
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
