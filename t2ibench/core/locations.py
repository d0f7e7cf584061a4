"""Location rules, once for every command: what is a URI and what is a path (`file://` included), which
stores a flag supports, where caches go, and whether an output can be written, before any work starts.
The rules in full: docs/design.md.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import urllib.parse
from pathlib import Path

from t2ibench.core.errors import fail

# Composer's object stores for checkpoints (Composer also fetches --load_path over http(s)).
CHECKPOINT_SCHEMES = ("s3", "gs", "oci", "azure", "dbfs")
LOAD_SCHEMES = (*CHECKPOINT_SCHEMES, "http", "https")
# Where a --remote is cached when --local is not given: one folder per remote (see cache_folder).
DEFAULT_CACHE_ROOT = "/tmp/mds-cache"


def scheme(location: str) -> str:
    """'s3' for s3://bucket/x, 'file' for file:///x, 'dbfs' for dbfs:/Volumes/x, '' for a local path."""
    if "://" in location:
        return location.split("://", 1)[0].lower()
    return "dbfs" if location.startswith("dbfs:/") else ""


def is_remote(location: str) -> bool:
    """Whether `location` is on an object store (after `normalise`, file:// URIs are paths)."""
    return scheme(location) not in ("", "file")


def data_schemes() -> list[str]:
    """Stores Streaming downloads shards from (what --remote may name)."""
    from streaming.base.storage.download import DOWNLOADER_MAPPINGS

    return sorted(s for s in DOWNLOADER_MAPPINGS if s and s != "dbfs-uc")  # dbfs-uc is dbfs:/Volumes


def upload_schemes() -> list[str]:
    """Stores Streaming's MDSWriter uploads to (what convert.py and latents.py --out may name)."""
    from streaming.base.storage.upload import UPLOADERS

    return sorted(s for s in UPLOADERS if s and "/" not in s)  # not '' (local) nor 'dbfs:/Volumes'


def normalise(flag: str, location: str, schemes: list[str] | tuple[str, ...]) -> str:
    """`location` as the run will use it: a file:// URI becomes its path; a URI whose scheme the
    flag does not support, a file:// URI of another host or a one-slash URI fails, naming `flag`."""
    found = scheme(location)
    if found == "file":
        parsed = urllib.parse.urlparse(location)
        if parsed.netloc not in ("", "localhost"):
            fail(f"{flag} {location}: a file:// URI names a path on this machine; write file:///path or the path")
        return urllib.parse.unquote(parsed.path)
    if found and found not in schemes:
        if not schemes:
            fail(f"{flag} takes a local path, not a URI ({location})")
        fail(f"{flag} {location}: unknown URI scheme '{found}://'; supported: "
             + ", ".join("dbfs:/Volumes/" if s == "dbfs" else f"{s}://" for s in schemes) + " or a local path")
    one_slash = re.match(r"([A-Za-z][\w+.-]*):/(?!/)", location)
    if one_slash and one_slash.group(1).lower() in [*schemes, "file"] and not found:
        fail(f"{flag} {location} looks like a URI with one slash; write "
             f"{one_slash.group(1)}://{location[one_slash.end():]}")
    return location


# What a path is when it is not a regular file, in the words a refusal uses.
FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(path: str | os.PathLike) -> str | None:
    """What `path` is when it exists and is no regular file ('a FIFO (named pipe)'), else None (a symlink
    is followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in FILE_KINDS if test(mode)), "not a file")


def file_problem(name: str, path: str | os.PathLike, must_exist: bool = True) -> str | None:
    """The one rule of every file a user names, read or written, checked before anything opens it: why
    `path` is not a regular file, in one line starting with `name` (how the command names it:
    '--aspect_buckets my.txt'), or None (absent is fine where not `must_exist`, for an output). A folder,
    a FIFO, a device (/dev/zero) or a socket is called what it is: opening a FIFO waits for its other end
    forever, and a device reads without end."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return f"{name}: no such file" if must_exist else None
    except NotADirectoryError:
        return f"{name}: a part of its path is a file, not a folder"
    except OSError as error:
        return f"{name} cannot be read ({error.strerror or error})"
    kind = file_kind(path)
    return f"{name} is {kind}, not a regular file" if kind else None


def cache_folder(root: str, remote: str) -> str:
    """The cache of `remote` under `root`: a folder named by a hash of the remote. Streaming trusts
    an index.json already in a cache, so two remotes sharing one folder would silently serve the
    first one's samples."""
    return os.path.join(root, hashlib.sha1(remote.encode()).hexdigest()[:12])


def unwritable(flag: str, location: str, folder: bool) -> str | None:
    """Why the local `location` (a file, or a folder if `folder`) cannot be written, or None.

    Probes by doing what the run will do, leaving nothing behind: a temporary file in the nearest
    existing folder, or opening an existing file for appending (which changes nothing).
    """
    target = Path(location).expanduser().absolute()
    if target.exists():
        if folder and not target.is_dir():
            return f"{flag} {location} is {file_kind(target) or 'a file'}, not a folder"
        if not folder:
            problem = file_problem(f"{flag} {location}", target)  # a FIFO opened to probe it waits forever
            if problem:
                return f"{problem}; give a file path"
            try:
                with open(target, "a"):
                    pass
            except OSError as error:
                return f"{flag} {location} cannot be written ({error.strerror}); choose a writable location"
            return None
    parent = target if target.is_dir() else target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{flag} {location} cannot be created: {parent} is a file"
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        where = "" if parent == target else f" in {parent}"
        return f"{flag} {location} cannot be written{where} ({error.strerror}); choose a writable location"
    return None


def overlap(output_flag: str, output: str, inputs: list[tuple[str, str | None]]) -> str | None:
    """Why a local output cannot be written next to these local inputs ([(flag, path)]), or None.

    Refused both ways: an input inside the output would be mixed into it and deleted by
    --overwrite, and an output inside an input folder would be read back as input by a rerun.
    """
    if is_remote(output):
        return None
    out = Path(output).expanduser().resolve()
    for flag, path in inputs:
        if not path or is_remote(path):
            continue
        source = Path(path).expanduser().resolve()
        if source == out or source in out.parents:
            where = "is" if source == out else "lies inside"
            return f"{output_flag} {output} {where} the input ({flag} {path}): write the output to a separate folder"
        if out in source.parents:
            return (f"the input ({flag} {path}) lies inside {output_flag} {output}: write the output to a separate "
                    "folder (the input would be mixed into it, and deleted by --overwrite)")
    return None


def missing_upload_credentials(flag: str, location: str) -> str | None:
    """Why writing to `location` cannot work for lack of credentials, or None. Only S3 is checked
    here (boto3's own lookup: environment, profile, instance role); Streaming reads public buckets
    anonymously, but nothing can be uploaded without credentials."""
    if scheme(location) != "s3":
        return None
    import boto3

    if boto3.session.Session().get_credentials() is None:
        return (f"{flag} {location}: no AWS credentials found to upload with: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and S3_ENDPOINT_URL for a non-AWS store")
    return None


def same_source_key(location: str) -> str:
    """The form two names of one source share, to compare sources (never to read or write): a local
    path resolved (file:// URI, ~, trailing slash, symlinks), an object-store URI with its scheme in
    lower case and no trailing slash."""
    found = scheme(location)
    if found == "file":
        location, found = urllib.parse.unquote(urllib.parse.urlparse(location).path), ""
    if found:
        return f"{found}://{location.split('://', 1)[-1].rstrip('/')}" if "://" in location else location.rstrip("/")
    return str(Path(location).expanduser().resolve())


def check_output(flag: str, location: str | None, *, folder: bool,
                 inputs: list[tuple[str, str | None]] = ()) -> str | None:
    """The probe of every output of every command, before any work: why `location` (a file, or a
    folder if `folder`) cannot be this command's output, or None. A local output must be writable,
    of the right kind (not a file where a folder goes, nor the reverse), and may not be, contain or
    lie inside one of the local `inputs` ([(flag, path)]). Object-store URIs are not probed here."""
    if not location or is_remote(location):
        return None
    return unwritable(flag, location, folder) or overlap(flag, location, [(f, p) for f, p in inputs if p])


def check_outputs_apart(outputs: list[tuple[str, str | None, str]]) -> str | None:
    """Why local outputs [(flag, path, kind)] would collide, or None. kind: 'file', 'folder', or
    'exclusive' (a folder that holds only what its command writes there, such as a pipeline export,
    and that a retried run rewrites): two outputs may share a path only if both are plain folders,
    and nothing may lie inside a file or an exclusive folder."""
    given = [(flag, Path(path).expanduser().resolve(), path, kind) for flag, path, kind in outputs
             if path and not is_remote(path)]
    for i, (flag, where, path, kind) in enumerate(given):
        for other_flag, other, other_path, other_kind in given[i + 1:] + given[:i]:
            if where == other and not kind == other_kind == "folder":
                return f"{flag} {path} is also {other_flag}: give each output its own location"
            if other in where.parents and other_kind != "folder":
                return (f"{flag} {path} lies inside {other_flag} {other_path}, which holds only what it is written "
                        "with (a retried run rewrites it): choose a location outside it")
    return None
