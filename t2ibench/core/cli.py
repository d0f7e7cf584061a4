"""The argument parser of every command: argparse with flag files (`@FILE`), one-line errors, the
range of every number (`Range`, refusing NaN and infinity), the text a number is written in (ASCII:
`parse_number`, `NUMBER_TEXT`) and the one reader of a text file a user names (`read_text`: bounded,
a byte-order mark skipped). Light on purpose: convert.py and cost.py use it without loading any model
code. How it reads flag files and why ranges are types: docs/design.md; the input rules: docs/errors.md.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
from typing import NoReturn

from t2ibench.core.errors import UserError, fail
from t2ibench.core.locations import file_problem

# A text file a user names (a flag file, a bucket list, a prompt list, a results JSON) is read whole:
# the largest of them is a few kilobytes, so past this it is no such file but a mistake (--aspect_buckets
# /dev/zero read until the kernel killed the process), and reading stops here with one line.
MAX_TEXT_FILE_BYTES = 2**20
MAX_FLAG_FILE_DEPTH = 16  # @FILE inside @FILE: deeper is a file that names itself (it recursed until a traceback)


def parse_number(text: str, kind: type = float) -> int | float | None:
    """`text` as an int or a float, or None when it is not one. Only ASCII is a number here: Python's
    int() and float() also read other scripts' digits (an Arabic-Indic three is 3, fullwidth 64 is 64),
    which no flag or file documents. The one rule of a number's text."""
    if not text.isascii():
        return None
    try:
        return kind(text)
    except ValueError:
        return None


def parse_digits(text: str) -> int | None:
    """A whole number written in ASCII digits alone ('768'; no sign, space or '_'), or None: the sides
    of a size (HEIGHTxWIDTH). str.isdigit() alone passes a superscript two, which int() refuses."""
    return int(text) if text.isascii() and text.isdigit() else None


def read_text(path: str, name: str, hint: str, max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """The UTF-8 text of the file a user named, a leading byte-order mark skipped (Windows editors save
    one), read no further than `max_bytes`. Every problem is one line (`fail`) starting with `name`, how
    the command names the file ('--aspect_buckets my.txt'), and ending with `hint`, what to give instead.
    Only a regular file is opened (`locations.file_problem`: a FIFO would wait for a writer forever)."""
    problem = file_problem(name, path)
    if problem:
        fail(f"{problem}; {hint}")
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as error:
        fail(f"{name} cannot be read ({error.strerror or error}); {hint}")
    if len(data) > max_bytes:
        fail(f"{name} holds more than {max_bytes:,} bytes, not a file of this kind (they hold a few kilobytes); "
             f"{hint}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        fail(f"{name} is not UTF-8 text (byte {error.start}); save it as UTF-8")


class Range:
    """An argparse `type`: a finite int or float within [low, high] (either end open, or absent).

    Called with the flag's text it returns the number or raises argparse.ArgumentTypeError;
    `problem(value)` says why an already parsed value is out of range (None when it is in range).
    """

    def __init__(self, kind: type, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False):
        if kind not in (int, float):
            raise TypeError(f"Range of int or float, not {kind}")
        self.kind, self.low, self.high = kind, low, high
        self.low_open, self.high_open = low_open, high_open
        self.__name__ = kind.__name__  # argparse names the type by this in its own messages

    def describe(self) -> str:
        """'an integer from 0 to 4294967295', 'a finite number > 0', 'a finite number in [0, 1)'."""
        what = "an integer" if self.kind is int else "a finite number"
        low, high = (None if v is None else str(int(v)) if v == int(v) else f"{v:g}" for v in (self.low, self.high))
        if low is not None and high is not None:
            if not (self.low_open or self.high_open):
                return f"{what} from {low} to {high}"
            return f"{what} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{what} {'>' if self.low_open else '>='} {low}"
        if high is not None:
            return f"{what} {'<' if self.high_open else '<='} {high}"
        return what

    def problem(self, value: float) -> str | None:
        """Why `value` is not in this range ('must be ...'), or None."""
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or (
                self.kind is int and value != int(value)):
            return f"must be {self.describe()}"
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return f"must be {self.describe()}"
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return f"must be {self.describe()}"
        return None

    def __call__(self, text: str) -> int | float:
        value = parse_number(text, self.kind)
        if value is None:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}")
        why = self.problem(value)
        if why:
            raise argparse.ArgumentTypeError(why)
        return value

    def __repr__(self) -> str:
        return f"Range({self.describe()})"


POSITIVE_INT = Range(int, 1)
NON_NEGATIVE_INT = Range(int, 0)
POSITIVE_FLOAT = Range(float, 0, low_open=True)
NON_NEGATIVE_FLOAT = Range(float, 0)
FRACTION = Range(float, 0, 1)
SEED = Range(int, 0, 2**32 - 1)  # what numpy and Composer's reproducibility.seed_all accept
SECONDS = POSITIVE_FLOAT
# Image sides in pixels: 16 times SDXL's 1024. Beyond it (--image_size 1048576) sizes overflow deep in
# torch instead of meaning a run; no model here trains near it.
MAX_IMAGE_SIZE = 16_384
IMAGE_SIZE = Range(int, 1, MAX_IMAGE_SIZE)
# GPUs in one run or one row of cost.py's table (a results file's world_size of 10**400 overflowed a float).
MAX_GPUS = 1_000_000
GPU_COUNT = Range(int, 1, MAX_GPUS)
# Images in one batch of any kind: a global batch, a per-device batch, a microbatch, an encoder call.
# 2**20 images is 512 on each of 2,048 GPUs, far above any published run's batch; beyond it a number
# means no run, and tensors of its size overflow deep in torch.
MAX_BATCH_SIZE = 2**20
BATCH_SIZE = Range(int, 1, MAX_BATCH_SIZE)
# GPU memory in GiB as torch reports it (the largest GPUs today hold under 300).
MAX_GPU_MEMORY_GIB = 4096
GPU_MEMORY_GIB = Range(float, 1, MAX_GPU_MEMORY_GIB)
# Timed runs of one measurement (a benchmark's repeats, warm-up runs): a median of 1,000 is as good as
# any more, and a larger count only runs until it is killed.
MAX_REPEATS = 1000
REPEATS = Range(int, 1, MAX_REPEATS)
WARMUP_REPEATS = Range(int, 0, MAX_REPEATS)
# A bench script's time budget (--budget_s): above zero, at most a day; a longer one is a typo.
MAX_BUDGET_SECONDS = 86_400.0
BUDGET_SECONDS = Range(float, 0, MAX_BUDGET_SECONDS, low_open=True)


class NumberText:
    """An argparse `type` for a number written with a unit or a suffix (20ba, 200m, 64mb, 'auto' or 4),
    which its command's validation parses: the text as given, once it is ASCII. Composer's time strings
    and Streaming's sizes parse with Python's int() and float(), which read other scripts' digits."""

    __name__ = "str"

    def __call__(self, text: str) -> str:
        if not text.isascii():
            raise argparse.ArgumentTypeError("must be written in ASCII (digits 0-9)")
        return text


NUMBER_TEXT = NumberText()


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (it holds example commands); every flag with its default, unless it
    has none (None, or off) or its help already says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with @FILE flag files (several flags per line, # comments) and one-line errors."""

    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(prog=prog, fromfile_prefix_chars="@", **kwargs)

    def convert_arg_line_to_args(self, line: str) -> list[str]:
        return shlex.split(line, comments=True)

    def _read_args_from_files(self, arg_strings: list[str], depth: int = 0) -> list[str]:
        # argparse's own, with the file named in one line when it cannot be read (`read_text`: missing,
        # not UTF-8, larger than a flag file is), a line does not split (an unbalanced quote) or flag
        # files nest past MAX_FLAG_FILE_DEPTH: argparse 3.11 lets these through as tracebacks.
        expanded: list[str] = []
        for text in arg_strings:
            if not text or text[0] not in self.fromfile_prefix_chars:
                expanded.append(text)
                continue
            if depth == MAX_FLAG_FILE_DEPTH:
                self.error(f"flag file {text} is inside {depth} others; does one name itself?")
            try:
                content = read_text(text[1:], f"flag file {text}", "give a file of flags, several a line")
            except UserError as error:
                self.error(error.message)
            found: list[str] = []
            for number, line in enumerate(content.splitlines(), 1):
                try:
                    found += self.convert_arg_line_to_args(line)
                except ValueError as error:  # shlex: "No closing quotation", "No escaped character"
                    self.error(f"flag file {text}, line {number}: {error}; close the quote (or escape it with \\)")
            expanded += self._read_args_from_files(found, depth + 1)
        return expanded

    def _get_value(self, action: argparse.Action, arg_string: str):
        if isinstance(action.type, (Range, NumberText)):  # "--flag value must be ...", not "invalid int value"
            try:
                return action.type(arg_string)
            except argparse.ArgumentTypeError as error:
                flag = max(action.option_strings, key=len) if action.option_strings else action.metavar or action.dest
                raise argparse.ArgumentError(None, f"{flag} {arg_string} {error}") from None
        return super()._get_value(action, arg_string)

    def error(self, message: str) -> NoReturn:
        # As every other user error (errors.command): one line, exit status 1, no usage block (it is in
        # --help); a SystemExit carrying the line, so main(argv) called in-process stops the same way.
        raise SystemExit(f"{self.prog}: error: {message}")


# Loader and decoder processes: above this many per CPU core of the node they only add memory (each
# worker holds its own copy of the dataset state and prefetched batches) and contention.
WORKERS_PER_CORE = 4
WORKERS_ALWAYS_ALLOWED = 8  # the 2023 benchmark's default --num_workers, whatever the machine


def max_workers(processes_per_node: int = 1) -> int:
    """The most worker processes each of `processes_per_node` processes may start on this machine."""
    cores = os.cpu_count() or 1
    return max(WORKERS_ALWAYS_ALLOWED, WORKERS_PER_CORE * cores // max(1, processes_per_node))


def check_workers(flag: str, count: int, processes_per_node: int = 1) -> str | None:
    """Why `count` worker processes per process is too many for this machine, or None."""
    limit = max_workers(processes_per_node)
    if count <= limit:
        return None
    per = f" per rank ({processes_per_node} ranks on this node)" if processes_per_node > 1 else ""
    return (f"{flag} {count} is more than {WORKERS_PER_CORE} worker processes per CPU core ({os.cpu_count()} cores): "
            f"at most {limit}{per}; each worker is a process with its own memory")
