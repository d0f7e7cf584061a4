"""Writing a command's outputs so that no reader sees a part of one and no two commands write one:
atomic files, staged folders, exclusive holds on output folders, the one line for a failed write.
What each guards against: docs/errors.md.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from t2ibench.errors import fail
from t2ibench.locations import is_remote

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


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; when the block ends without an error it is
    flushed to disk and renamed to `path` (replacing the old one), else removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
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


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike, last: str | None = None) -> Iterator[Path]:
    """A staging folder inside `folder` to write its new content into. When the block ends without an
    error, every entry is moved into `folder` (replacing an entry of the same name: the folder holds
    only what its command writes), `last` after the others; on an error the staging folder is removed
    and `folder` keeps what it held."""
    folder = Path(folder)
    staging = folder / STAGING_FOLDER
    if staging.exists():
        shutil.rmtree(staging)  # left by a writer that was killed
    staging.mkdir(parents=True)
    try:
        yield staging
        names = sorted(os.listdir(staging), key=lambda name: name == last)
        for name in names:
            target = folder / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(staging / name, target)
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
