"""Writing a command's outputs so that no reader sees a part of one and no two commands write one:
atomic files, staged folders, exclusive holds on output folders, the one line for a failed write, and
what a killed writer left, which the next one takes over. What each guards against: docs/errors.md.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from t2ibench.core.errors import fail
from t2ibench.core.locations import is_remote

# Errors that mean "no room": the disk, a quota, or a file-size limit (RLIMIT_FSIZE).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room(error: BaseException) -> OSError | None:
    """The OSError saying the disk is full behind `error`, if any: torch.save, for one, reports a full
    disk as a RuntimeError ('unexpected pos') raised while the OSError is handled."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NO_ROOM:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def write_error(what: str, error: OSError) -> str:
    """One line for an OSError while writing `what` (a flag and its location), saying what to do."""
    reason = error.strerror or type(error).__name__
    if error.errno in NO_ROOM:
        return (f"{what} could not be written ({reason}): free space there or choose another location; "
                "nothing was left half-written")
    return f"{what} could not be written ({reason}); nothing was left half-written"


PARTIAL_SUFFIX = ".partial"


def partial_file_name(name: str) -> re.Pattern:
    """The names atomic_file gives the temporary beside a file `name` (a kill leaves one): "." + name +
    "." + mkstemp's 8 random characters + PARTIAL_SUFFIX."""
    return re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}{re.escape(PARTIAL_SUFFIX)}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; when the block ends without an error it is
    flushed to disk and renamed to `path` (replacing the old one), else removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.chmod(temporary, 0o666 & ~UMASK)  # mkstemp's 0600 is not what open() would have made
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a path, not a file (the torch profiler's
    trace): when the block ends without an error the file is flushed to disk and renamed to `path`;
    else it, and whatever the writer made from its name (its own `.tmp`), are removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.chmod(temporary, 0o666 & ~UMASK)
        os.replace(temporary, target)
    except BaseException:
        for made in os.scandir(target.parent):
            if made.name.startswith(temporary.name):
                with contextlib.suppress(OSError):
                    os.unlink(made.path)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once, at import (before any thread starts): reading it means setting it for a moment.
UMASK = _umask()


def write_text(path: str | os.PathLike, text: str) -> None:
    """`path` replaced by `text` at once (atomic_file)."""
    with atomic_file(path, "w", encoding="utf-8") as handle:
        handle.write(text)


# Inside a folder being written: its new content until complete. Never a name a command writes itself.
STAGING_FOLDER = ".partial"
# Written into a staging folder before anything else: proof that a staging folder found later is this
# project's, left by a writer that was killed (and, while its entries are moved out, their names).
STAGING_MARKER = ".t2ibench-staging.json"


def _moving(staging: Path) -> list[str]:
    """The entries a staging folder's marker says were being moved out of it ([]: none yet, or unreadable:
    a kill while it was first written)."""
    try:
        moving = json.loads((staging / STAGING_MARKER).read_text()).get("moving", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in moving if isinstance(name, str) and name and "/" not in name
            and name not in (".", "..", STAGING_FOLDER)] if isinstance(moving, list) else []


def killed_writer_leftovers(folder: str | os.PathLike, files: tuple[str, ...] = ()) -> set[str]:
    """The entries of `folder` that a writer of this project left when it was killed (SIGKILL, a
    preempted job), which the next writer holding the folder takes over (take_over): a staging
    folder (staged_folder) that holds its marker, or nothing (killed before writing it), with the
    entries its marker says were being moved out of it; and atomic_file's temporaries of the `files`
    written there. Anything else is not this project's to remove. A writer that is still running
    holds the folder (hold_output): the next one is refused before it takes anything over."""
    path = Path(folder)
    try:
        names = set(os.listdir(path))
    except OSError:
        return set()
    patterns = [partial_file_name(name) for name in files]
    found = {name for name in names if any(p.fullmatch(name) for p in patterns)
             and (path / name).is_file() and not (path / name).is_symlink()}
    staging = path / STAGING_FOLDER
    if staging.is_dir() and not staging.is_symlink():
        inside = os.listdir(staging)
        if not inside or STAGING_MARKER in inside:
            found.add(STAGING_FOLDER)
            found.update(name for name in _moving(staging) if name in names)
    return found


def take_over(folder: str | os.PathLike, files: tuple[str, ...] = ()) -> None:
    """Remove what a killed writer left in `folder` (killed_writer_leftovers); call only while holding it."""
    path = Path(folder)
    for name in killed_writer_leftovers(path, files):
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike, last: str | None = None) -> Iterator[Path]:
    """A staging folder inside `folder` to write its new content into. When the block ends without an
    error, every entry is moved into `folder` (replacing an entry of the same name: the folder holds
    only what its command writes), `last` after the others; on an error the staging folder is removed
    and `folder` keeps what it held. A staging folder a killed writer left is taken over; one that is
    not this project's is refused. Call while holding `folder` (hold_output)."""
    folder = Path(folder)
    staging = folder / STAGING_FOLDER
    if staging.exists() or staging.is_symlink():
        if STAGING_FOLDER not in killed_writer_leftovers(folder):
            fail(f"{folder} holds a {STAGING_FOLDER} that this project did not write (no {STAGING_MARKER} in it): "
                 "move it away or choose another folder")
        take_over(folder)
    staging.mkdir(parents=True)
    try:
        (staging / STAGING_MARKER).write_text(json.dumps({"moving": []}) + "\n")
        yield staging
        names = sorted((name for name in os.listdir(staging) if name != STAGING_MARKER), key=lambda name: name == last)
        # Named before any is moved: a kill while moving leaves them recognisable as this writer's.
        write_text(staging / STAGING_MARKER, json.dumps({"moving": names}) + "\n")
        for name in names:
            target = folder / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(staging / name, target)
        os.unlink(staging / STAGING_MARKER)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@dataclass
class Hold:
    """An exclusive hold on an output folder (see hold_output)."""

    folder: Path
    created: bool  # the folder did not exist before this command
    fd: int = -1

    def release(self) -> None:
        """Let go of the folder; one this command created and left empty (it failed, or was refused) is removed."""
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = -1
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only if empty


def acquire(flag: str, folder: str | os.PathLike) -> Hold:
    """Hold the local output `folder` (created if absent) for this process, or fail in one line when
    another process holds it. Release with `Hold.release` (or let the process end)."""
    path = Path(folder).expanduser()
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        fail(f"{flag} {folder} is being written by another command that is still running: wait for it to end, "
             f"or choose another {flag}")
    except OSError:  # a file system without locks (some network mounts): written as before
        pass
    return Hold(path, created, fd)


@contextlib.contextmanager
def hold_output(flag: str, folder: str | os.PathLike | None) -> Iterator[Hold | None]:
    """`acquire` for the duration of the block; None (and no hold) for no folder or an object-store URI."""
    if not folder or is_remote(str(folder)):
        yield None
        return
    hold = acquire(flag, folder)
    try:
        yield hold
    finally:
        hold.release()
