"""One way to fail: a user error is one line naming the flag or file and what to do, no traceback
(`fail`, `command`); see docs/errors.md.
"""
from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterator, NoReturn


class UserError(SystemExit):
    """A mistake in the input, reported as one line; `message` names the flag or file."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def fail(message: str) -> NoReturn:
    """Stop with one line: `<command>: error: <message>` (see `command`)."""
    raise UserError(message)


@contextlib.contextmanager
def command(name: str, debug: bool = False,
            explain: Callable[[BaseException], str | None] | None = None) -> Iterator[None]:
    """Run a command's body: a `UserError` becomes `<name>: error: <message>` (exit status 1).

    `explain` turns other exceptions caused by the input into one line (None: a bug, re-raised
    with its traceback); with `debug` they all keep their traceback.
    """
    try:
        yield
    except UserError as error:
        raise SystemExit(f"{name}: error: {error.message}") from None
    except Exception as error:  # noqa: BLE001 - only what `explain` recognises is turned into a line
        line = explain(error) if explain is not None and not debug else None
        if line is None:
            raise
        raise SystemExit(f"{name}: error: {line} (--debug shows the traceback)") from None


# Object-store clients: their errors are about the store (credentials, network), not the data's bytes.
STORAGE_MODULES = ("botocore", "boto3", "google", "oci", "azure", "libcloud", "paramiko")


def storage_error(error: BaseException) -> str | None:
    """One line for an object-store failure (credentials, endpoint, missing object), else None."""
    seen = error
    while seen is not None:
        module = type(seen).__module__
        if module.startswith(STORAGE_MODULES):
            line = f"{type(seen).__name__}: {str(seen).splitlines()[0] if str(seen) else ''}"
            if type(seen).__name__ == "NoCredentialsError":
                line += " (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            elif type(seen).__name__ in ("EndpointConnectionError", "ConnectTimeoutError"):
                line += " (check S3_ENDPOINT_URL and the network)"
            return line
        seen = seen.__cause__ or seen.__context__
    return None


def worker_error(error: BaseException, own_types: tuple[str, ...]) -> str | None:
    """The last line of a DataLoader worker's exception when it is one of `own_types` (by name).

    PyTorch re-creates a worker's exception from its message: the original type and message are
    the last line of that message ("Caught X in DataLoader worker process 0 ...").
    """
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and text.startswith("Caught ") and " in DataLoader worker process " in lines[0]:
        names = "|".join(re.escape(name) for name in own_types)
        if own_types and re.match(rf"({names}): ", lines[-1]):
            return lines[-1].split(": ", 1)[1]  # the project's own message, as it reads without workers
        if re.match(rf"(botocore\.exceptions\.\w+|google\.\S+|FileNotFoundError): ", lines[-1]):
            return lines[-1]
    return None
