"""The output folder of latents.py, local or an object-store URI: one MDS dataset per chunk
(`chunkNNNNNN/`), the record of the settings (`precompute.json`), which chunks are complete (resume),
and --overwrite, which deletes only what latents.py writes. The layout is in docs/data.md."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any


from t2ibench.core.errors import fail
from t2ibench.core.files import partial_file_name, write_text
from t2ibench.core.locations import is_remote
from t2ibench.core.mds import INDEX_FILE, SHARD_NAME, MDSWriter
from t2ibench.datasets.precomputed import RECORD_FILE


def chunk_name(k: int) -> str:
    """The folder of chunk k in OUT: its own MDS dataset."""
    return f"chunk{k:06d}"


def join(out: str, *names: str) -> str:
    """OUT/names..., for a local folder or an object-store URI."""
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
    """OUT/name written whole (locally: replaced atomically; remote: one upload)."""
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
    if not (path / RECORD_FILE).is_file():  # an index.json alone could be any dataset, the source even
        fail(f"--out {out} is not empty and holds no precomputed latents (no {RECORD_FILE}): refusing to delete "
             "it; choose a new or empty folder")
    ours = {RECORD_FILE, f".{RECORD_FILE}.tmp", INDEX_FILE}
    chunk = re.compile(r"chunk\d{6}")
    # --aspect_buckets: the chunks sorted into bucket folders, their record, and a sort cut short
    from t2ibench.datasets.bucket_folders import RECORD_FILE as BUCKETS_RECORD, read_record
    from t2ibench.datasets.bucket_sort import SORTING
    from t2ibench.core.files import STAGING_FOLDER

    try:
        record = read_record(path)
    except ValueError:
        record = None
    sorted_folders = {entry.folder for entry in record.folders} if record else set()
    ours |= {BUCKETS_RECORD}
    partial = partial_file_name(RECORD_FILE)  # files.atomic_file's, left by a kill
    foreign = []
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and (entry.name in sorted_folders
                                                          or entry.name in (SORTING, STAGING_FOLDER)):
            continue
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


def chunk_writer(out: str, name: str, columns: dict[str, str], compression: str | None, hashes: list[str],
                 size_limit: int | str | None) -> MDSWriter:
    """The MDSWriter of one chunk's folder in OUT, local or remote."""
    kwargs: dict[str, Any] = dict(exist_ok=True)  # removes what an interrupted attempt left locally
    if is_remote(out):
        kwargs["max_workers"] = 1  # uploads in order: index.json strictly after the shards
    return MDSWriter(out=join(out, name), columns=columns, compression=compression,
                     hashes=hashes, size_limit=size_limit, **kwargs)
