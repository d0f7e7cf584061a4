"""Where training data comes from: `--remote`/`--local` parsed once into `Source`s, each with its cache
folder, and the record of the remote a cache holds. The syntax of several sources (`0.7=s3://a,0.3=s3://b`)
and the cache rule: docs/design.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from composer.utils import dist

from t2ibench.core.errors import fail, storage_error
from t2ibench.core.locations import DEFAULT_CACHE_ROOT, cache_folder, data_schemes, is_remote, normalise, same_source_key

# A proportion is ASCII digits (re.ASCII: \d alone matches other scripts' digits, which float() reads).
_PROPORTION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)=(.+)$", re.ASCII)
# Written into a --remote's cache folder: the remote it holds (Streaming trusts any index.json there).
CACHE_RECORD = "remote.json"


@dataclass(frozen=True)
class Source:
    """One dataset to read: shards at `remote` (None: already in `local`) cached in `local`."""

    remote: str | None
    local: str
    proportion: float | None = None

    @property
    def label(self) -> str:
        """How messages name it: by the flag the user gave."""
        return f"--remote {self.remote}" if self.remote else f"--local {self.local}"

    @property
    def spec(self) -> str:
        """The source as --remote writes it (with its proportion), or the --local path."""
        where = self.remote or self.local
        return where if self.proportion is None else f"{self.proportion:g}={where}"


class JoinSources(argparse.Action):
    """A repeated --remote adds sources: args.remote is the list of the flag's values, in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])


def parse_sources(remote: list[str] | str | None, local: str | None,
                  default_cache_root: str = DEFAULT_CACHE_ROOT) -> list[Source]:
    """The sources the flags name, each location normalised (locations.normalise) and cached.

    `remote`: the values of --remote (each may hold several sources, comma-separated); `local`: the
    cache folder (several sources: the folder their caches go under), or the shards themselves
    when there is no remote. Fails, naming the flag, on a bad proportion or scheme.
    """
    items = [item.strip() for text in ([remote] if isinstance(remote, str) else remote or [])
             for item in text.split(",") if item.strip()]
    if local:
        local = normalise("--local", local, [])
    if not items:
        return [Source(None, local)] if local else []
    parsed = []
    for item in items:
        match = _PROPORTION.match(item)
        proportion, location = (float(match.group(1)), match.group(2)) if match else (None, item)
        if proportion is not None and proportion <= 0:
            fail(f"--remote {item}: the proportion must be positive")
        parsed.append((normalise("--remote", location, data_schemes()), proportion))
    given = [p is not None for _, p in parsed]
    if any(given) and not all(given):
        fail(f"--remote {','.join(items)}: give a proportion to every source (0.7=s3://a,0.3=s3://b) or to none")
    seen: dict[str, str] = {}
    for location, _ in parsed:
        key = same_source_key(location)  # A and A/ (or file:///A) are one source
        if key in seen:
            same = "twice" if seen[key] == location else f"as {seen[key]} and as {location}"
            fail(f"--remote {','.join(items)}: the source {location} is given {same}; give each source once "
                 "(a proportion sets its share of every epoch)")
        seen[key] = location
    if len(parsed) == 1 and parsed[0][1] is None:
        return [Source(parsed[0][0], local or cache_folder(default_cache_root, parsed[0][0]))]
    if not local:
        fail("several --remote sources need --local, the folder their caches go under")
    return [Source(location, cache_folder(local, location), proportion) for location, proportion in parsed]


def cached_remote(source: Source) -> str:
    """The form of a --remote recorded in its cache: absolute for paths, no trailing slash."""
    return source.remote.rstrip("/") if is_remote(source.remote) else os.path.abspath(source.remote)


def recorded_remote(local: str) -> str | None:
    """The remote a cache folder says it holds (None: no record; a marker for an unreadable one)."""
    record = Path(local, CACHE_RECORD)
    if not record.is_file():
        return None
    try:
        return json.loads(record.read_text())["remote"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"an unreadable {record}"


def check_cache(source: Source, default_cache_root: str = DEFAULT_CACHE_ROOT, timeout: float = 60.0) -> None:
    """Refuse a cache folder filled from another remote, or from an older version of this one:
    Streaming would serve its samples silently (`timeout`: seconds to fetch the remote's index).

    Without a remote, a folder that is a remote's cache is refused too: Streaming would delete its
    decompressed shards (expecting the compressed ones beside them) and then fail for lack of a
    remote to download them from.
    """
    cached = recorded_remote(source.local)
    if not source.remote:
        if cached is not None:
            fail(f"--local {source.local} is the cache of --remote {cached}: pass --remote {cached} again "
                 "(shards already cached are not downloaded again)")
        return
    if cached is not None:
        if cached != cached_remote(source):
            fail(f"--local {source.local} is the cache of --remote {cached}, not {source.remote}: pass another "
                 "--local (or leave it out: the default cache is one folder per remote)")
    elif Path(source.local, "index.json").is_file():
        index = Path(source.local, "index.json")
        same = not is_remote(source.remote) and Path(source.remote, "index.json").is_file() \
            and Path(source.remote, "index.json").read_bytes() == index.read_bytes()
        # The default cache is named by a hash of the remote: an index there came from that remote.
        mine = os.path.abspath(source.local) in (cached_remote(source),
                                                 os.path.abspath(cache_folder(default_cache_root, source.remote)))
        if not same and not mine:
            fail(f"--local {source.local} already holds an MDS dataset that was not streamed from --remote "
                 f"{source.remote} (no {CACHE_RECORD}); Streaming would train on it instead: pass an empty or "
                 "new --local")
    check_cache_current(source, timeout)


def remote_index(source: Source, timeout: float) -> dict | None:
    """The index.json of `source.remote` as it is now (a local path read, an object store downloaded
    with Streaming's own downloader); None if it is not readable there (other checks say so)."""
    if not is_remote(source.remote):
        path = Path(source.remote, "index.json")
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            return None
    from streaming.base.storage import CloudDownloader

    with tempfile.TemporaryDirectory() as folder:
        try:
            CloudDownloader.direct_download(f"{source.remote.rstrip('/')}/index.json", f"{folder}/index.json", timeout)
            return json.loads(Path(folder, "index.json").read_text())
        except ValueError:
            return None
        except Exception as error:  # noqa: BLE001  any store's client error: reported, not hidden
            fail(f"--remote {source.remote}: cannot read index.json: {storage_error(error) or error}")


def check_cache_current(source: Source, timeout: float = 60.0) -> None:
    """Refuse a cache that holds an older version of its remote (re-converted in place since it was
    cached): Streaming reads the cached index.json and would train on the old samples without a word."""
    cached = Path(source.local, "index.json")
    if not source.remote or not cached.is_file() or os.path.abspath(source.local) == cached_remote(source):
        return
    try:
        held = json.loads(cached.read_text())
    except (OSError, ValueError):
        return  # an unreadable index is refused, naming it, where it is read
    now = remote_index(source, timeout)
    if isinstance(now, dict) and isinstance(held, dict) and now.get("shards") != held.get("shards"):
        fail(f"--local {source.local} holds an older copy of --remote {source.remote} (its index.json differs from "
             "the remote's: the dataset was written again since it was cached), and Streaming would train on the old "
             f"samples: delete the cache folder {source.local} to stream the new version, or pass another --local")


def record_cache(source: Source) -> None:
    """Write the cache's remote (once per node, atomically: other ranks may be reading it)."""
    if not source.remote or os.path.abspath(source.local) == cached_remote(source) or dist.get_local_rank() != 0:
        return
    record = Path(source.local, CACHE_RECORD)
    if record.is_file():
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(f"{CACHE_RECORD}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"remote": cached_remote(source)}) + "\n")
    os.replace(partial, record)
