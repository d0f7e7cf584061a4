"""What an MDS dataset consists of on disk, for the commands that write one (convert.py, latents.py)
and may delete only what they wrote (--overwrite), and for every reader of an index.json: the one
check of its fields' types (`index_problem`) and of the files it names (`missing_shard_files`); the
writers' options are checked once (`size_limit_problem`, `codec_problem`), and both write through
one `MDSWriter` (Streaming's, without the empty shard it can write)."""
from __future__ import annotations

import json
import os
import re
from typing import Any

from streaming import MDSWriter as StreamingMDSWriter
from streaming.base.compression import get_compressions
from streaming.base.hashing import get_hashes
from streaming.base.util import bytes_to_int

INDEX_FILE = "index.json"  # written last by MDSWriter: a folder with it holds a complete dataset
SHARD_NAME = re.compile(r"shard\.\d{5,}\.mds(\.[a-z0-9:]+)?")  # how MDSWriter names shard files


# The fields MDSWriter adds to each shard of index.json besides its shard's own configuration.
SHARD_ENTRY_KEYS = ("samples", "raw_data", "zip_data")
MDS_HEADER_BYTES = 4 + 4  # a shard file starts with its sample count and the first of its offsets (uint32)


class MDSWriter(StreamingMDSWriter):
    """Streaming's MDSWriter, which every dataset convert.py and latents.py write goes through, less its
    empty shard: Streaming 0.13's Writer.write flushes the samples it holds before a sample that would
    take them past size_limit, also when it holds none, so a first sample larger than --size_limit
    closed a shard of 0 samples (shard.00000) before its own. Holding it instead puts it alone in a
    shard larger than size_limit (as every other oversized sample already was); size_limit is a
    target, and MDS offsets stay 32-bit (size_limit_problem)."""

    def flush_shard(self) -> None:
        if self.new_samples:
            super().flush_shard()


def empty_shard_bytes(shard: dict) -> int:
    """The size of an MDS shard file of 0 samples with the configuration `shard` lists in index.json: its
    header, then the configuration as MDSWriter encodes it (the entry's fields other than SHARD_ENTRY_KEYS)."""
    config = {key: value for key, value in shard.items() if key not in SHARD_ENTRY_KEYS}
    return MDS_HEADER_BYTES + len(json.dumps(config, sort_keys=True).encode("utf-8"))


def holds_samples_it_does_not_list(shard: dict) -> bool:
    """Whether a shard that index.json lists with 0 samples has a shard file larger than an empty one:
    samples the index does not count (damage, or an index edited by hand). The empty shard Streaming
    0.13's MDSWriter wrote before a first sample larger than size_limit (convert.py and latents.py did
    before this release) holds nothing and is read as nothing."""
    return shard["samples"] == 0 and shard["raw_data"].get("bytes") != empty_shard_bytes(shard)


def _file_problem(info: Any, which: str) -> str | None:
    if info is None:
        return None
    if not isinstance(info, dict):
        return f"its {which} is {type(info).__name__}, not an object"
    basename = info.get("basename")
    # merge_index names the parts' shards by their subfolder ("part-000/shard.00000.mds"): relative paths only.
    if not isinstance(basename, str) or not basename or basename.startswith("/") or ".." in basename.split("/"):
        return f"its {which} has no file name ('basename': {basename!r})"
    size = info.get("bytes")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        return f"its {which} 'bytes' is {size!r}, not a size"
    return None


def index_problem(index: Any) -> str | None:
    """What makes a parsed index.json unusable (fields of the wrong type, a shard without a file
    name), or None. Streaming would fail on them deep in its reader, or count 'lots' of samples."""
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        return "it is not an MDS index (no list of 'shards')"
    for number, shard in enumerate(index["shards"]):
        where = f"shard {number}"
        if not isinstance(shard, dict):
            return f"{where} is {type(shard).__name__} ({str(shard)[:40]!r}), not an object"
        samples = shard.get("samples")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            return f"{where} has 'samples': {samples!r}, not a count"
        if shard.get("raw_data") is None:
            return f"{where} has no 'raw_data' (its shard file)"
        for which in ("raw_data", "zip_data"):
            problem = _file_problem(shard.get(which), which)
            if problem:
                return f"{where}: {problem}"
        names, encodings = shard.get("column_names", []), shard.get("column_encodings", [])
        if not (isinstance(names, list) and isinstance(encodings, list) and len(names) == len(encodings)
                and all(isinstance(x, str) for x in names + encodings)):
            return f"{where} has malformed 'column_names'/'column_encodings' (lists of names, of equal length)"
    return None


def shard_file(shard: dict) -> str:
    """The file a shard is stored in: the compressed one when there is one (MDSWriter keeps only it)."""
    return (shard.get("zip_data") or shard["raw_data"])["basename"]


def missing_shard_files(folder: str | os.PathLike, index: dict) -> list[str]:
    """The shard files `index` names that are not in `folder` (either the compressed or the raw file
    counts: a cache keeps the decompressed one)."""
    missing = []
    for shard in index["shards"]:
        names = [info["basename"] for info in (shard.get("zip_data"), shard.get("raw_data")) if info]
        if not any(os.path.isfile(os.path.join(folder, name)) for name in names):
            missing.append(names[0])
    return missing


def size_limit_problem(size_limit: int | str) -> str | None:
    """Why --size_limit cannot be MDSWriter's shard size (it stores offsets in 32 bits), or None."""
    try:
        if 0 < bytes_to_int(size_limit) < 2**32:
            return None
    except (ValueError, TypeError):
        pass
    return f"--size_limit {size_limit} must be a size such as 64mb, below 4gb"


def codec_problem(compression: str | None, hashes: list[str] | tuple[str, ...], level_hint: str = "") -> str | None:
    """Why --compression or --hashes are not Streaming's (the names Streaming 0.13 knows), or None;
    `level_hint` follows the list of compressions in the message."""
    unknown = [c for c in [compression] if c and c not in get_compressions()]
    unknown += [h for h in hashes if h not in get_hashes()]
    if not unknown:
        return None
    return (f"--compression / --hashes: unknown compression or hash {unknown}: compressions are "
            f"{sorted({c.split(':')[0] for c in get_compressions()})}{level_hint}, hashes are {sorted(get_hashes())}")
