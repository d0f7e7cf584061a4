"""Checks of the locations given on the command line, before any work: URI schemes, inputs that an
output would overlap, output folders that cannot be written, and what a tool may delete.

Each check returns a problem as one sentence (or None); the calling script turns it into its own
`SystemExit("script.py: error: ...")`, so every message names the flag it is about.
"""
from __future__ import annotations

import os
import tempfile
import urllib.parse
from pathlib import Path


def scheme(location: str) -> str:
    """The URI scheme of `location` ('' for a plain path)."""
    parsed = urllib.parse.urlparse(location)
    # "C:\\data" parses with scheme "c"; a one-letter scheme is a drive letter, not a URI.
    return parsed.scheme.lower() if len(parsed.scheme) > 1 else ""


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


def overlap(output_flag: str, output: str, inputs: list[tuple[str, str | None]]) -> str | None:
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
            return f"{output_flag} {output} {where} the input ({flag} {path}): write the output to a separate folder"
        if out in source.parents:
            return (f"the input ({flag} {path}) lies inside {output_flag} {output}: write the output to a separate "
                    "folder (the input would be mixed into it, and deleted by --overwrite)")
    return None


def check_writable_folder(flag: str, folder: str) -> str | None:
    """Why a local output folder cannot be created or written, or None. Leaves nothing behind: the
    test is a temporary folder made and removed in the nearest folder that exists."""
    path = _resolved(folder)
    if path.exists() and not path.is_dir():
        return f"{flag} {folder} is a file, not a folder"
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {folder}: {existing} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))
    except OSError as error:
        return f"{flag} {folder} cannot be written ({error.strerror or error}): choose another folder"
    return None
