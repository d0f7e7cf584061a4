"""Checks of the locations given on the command line, before any work: URI schemes, inputs that an
output would overlap, output folders that cannot be written, and what a tool may delete.

Each check returns a problem as one sentence (or None); the calling script turns it into its own
`SystemExit("script.py: error: ...")`, so every message names the flag it is about.
"""
from __future__ import annotations

import tempfile
import urllib.parse
from pathlib import Path


def scheme(location: str) -> str:
    """The URI scheme of `location` ('' for a plain path)."""
    parsed = urllib.parse.urlparse(location)
    # "C:\\data" parses with scheme "c"; a one-letter scheme is a drive letter, not a URI.
    return parsed.scheme.lower() if len(parsed.scheme) > 1 else ""


def from_file_uri(flag: str, location: str) -> str:
    """`location` with a file:// URI turned into its path: every command reads file:///data/x as the
    path /data/x. Raises ValueError naming `flag` for file://host/..., which names another machine."""
    if scheme(location) != "file":
        return location
    parsed = urllib.parse.urlparse(location)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{flag} {location}: a file:// URI names a path on this machine; write file:///path or the path")
    return urllib.parse.unquote(parsed.path)


def same_source_key(location: str) -> str:
    """The form that two names of one source share, to compare sources: a local path resolved
    (file:// URI, ~, trailing slash, symlinks), an object-store URI with its scheme in lower case and
    no trailing slash. Never used to read or write: the location is used as given."""
    found = scheme(location)
    if found == "file":
        location, found = urllib.parse.unquote(urllib.parse.urlparse(location).path), ""
    if found:
        return f"{found}://{location.split('://', 1)[-1].rstrip('/')}" if "://" in location else location.rstrip("/")
    return str(Path(location).expanduser().resolve())


def output_schemes() -> list[str]:
    """Object stores Streaming's MDSWriter uploads to."""
    from streaming.base.storage.upload import UPLOADERS

    return sorted(s for s in UPLOADERS if s and "/" not in s)  # not '' (local) nor 'dbfs:/Volumes'


def input_schemes() -> list[str]:
    """Object stores Streaming downloads from (what --remote may be)."""
    from streaming.base.storage.download import DOWNLOADER_MAPPINGS

    return sorted(s for s in DOWNLOADER_MAPPINGS if s and s != "dbfs-uc")  # dbfs-uc is dbfs:/Volumes


def check_upload_credentials(flag: str, location: str) -> str | None:
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


def check_scheme(flag: str, location: str, supported: list[str]) -> str | None:
    """Why `location` is not a local path or a URI of a supported store, or None."""
    found = scheme(location)
    if not found or found in supported:
        return None
    if found == "file":
        return f"{flag} {location}: file:// URIs are not supported; give the path itself ({urllib.parse.urlparse(location).path})"
    return (f"{flag} {location}: unknown URI scheme '{found}://'; supported: "
            + ", ".join(f"{s}://" for s in supported) + " or a local path")


def _resolved(path: str) -> Path:
    return Path(path).expanduser().resolve()


def overlap(output_flag: str, output: str, inputs: list[tuple[str, str | None]],
            remedy: str = "write the output to a separate folder") -> str | None:
    """Why a local output cannot be written next to these local inputs ([(flag, path)]), or None.

    Refused both ways: an input inside the output would be mixed into it and deleted by
    --overwrite, and an output inside an input folder would be read back as input by a rerun.
    """
    if scheme(output):
        return None
    out = _resolved(output)
    for flag, path in inputs:
        if not path or scheme(path):
            continue
        source = _resolved(path)
        if source == out or source in out.parents:
            where = "is" if source == out else "lies inside"
            return f"{output_flag} {output} {where} the input ({flag} {path}): {remedy}"
        if out in source.parents:
            return (f"the input ({flag} {path}) lies inside {output_flag} {output}: write the output to a separate "
                    "folder (the input would be mixed into it, and deleted by --overwrite)")
    return None


def unwritable(path: str, folder: bool) -> str | None:
    """Why `path` (a file, or a folder if `folder`) cannot be written, or None if it can.

    Probes by doing what the run will do, without leaving anything: a temporary file in the
    nearest existing folder, or opening an existing file for appending (which changes nothing).
    """
    target = Path(path).expanduser().absolute()
    if target.exists():
        if folder != target.is_dir():
            return f"is {'a file, not a folder' if folder else 'a folder, not a file'}"
        if not folder:
            try:
                with open(target, "a"):
                    pass
            except OSError as error:
                return f"cannot be written ({error.strerror})"
            return None
    parent = target if target.is_dir() else target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        return f"cannot be written ({error.strerror}" + (")" if parent == target else f" in {parent})")
    return None


def check_output(flag: str, location: str | None, *, folder: bool,
                 inputs: list[tuple[str, str | None]] = ()) -> str | None:
    """The probe of every output of every command, before any work: why `location` (a file, or a
    folder if `folder`) cannot be this command's output, or None. A local output must be writable,
    of the right kind (not a file where a folder goes, nor the reverse), and may not be, contain or
    lie inside one of the local `inputs` ([(flag, path)]). Object-store URIs are not probed here."""
    if not location or scheme(location):
        return None
    why = unwritable(location, folder)
    if why:
        return f"{flag} {location} {why}; choose a writable location"
    return overlap(flag, location, [(f, p) for f, p in inputs if p],
                   "write the output to a separate folder" if folder else "write the output to another file")


def check_outputs_apart(outputs: list[tuple[str, str | None, str]]) -> str | None:
    """Why local outputs [(flag, path, kind)] would collide, or None. kind: 'file', 'folder', or
    'exclusive' (a folder that holds only what its command writes there, such as a pipeline export,
    and that a retried run rewrites): two outputs may share a path only if both are plain folders,
    and nothing may lie inside a file or an exclusive folder."""
    given = [(flag, _resolved(path), path, kind) for flag, path, kind in outputs if path and not scheme(path)]
    for i, (flag, where, path, kind) in enumerate(given):
        for other_flag, other, other_path, other_kind in given[i + 1:] + given[:i]:
            if where == other and not kind == other_kind == "folder":
                return f"{flag} {path} is also {other_flag}: give each output its own location"
            if other in where.parents and other_kind != "folder":
                return (f"{flag} {path} lies inside {other_flag} {other_path}, which holds only what it is written "
                        "with (a retried run rewrites it): choose a location outside it")
    return None


def check_writable_folder(flag: str, folder: str) -> str | None:
    """Why a local output folder cannot be created or written, or None (see check_output)."""
    return check_output(flag, folder, folder=True)
