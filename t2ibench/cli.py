"""The argument parser of every command: argparse with flag files (`@FILE`), one-line errors and the
range of every number (`Range`, refusing NaN and infinity). Light on purpose: convert.py and cost.py
use it without loading any model code. How it reads flag files and why ranges are types: docs/design.md.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
from typing import NoReturn


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
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}") from None
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

    def _read_args_from_files(self, arg_strings: list[str]) -> list[str]:
        # argparse's own, with the file named in one line when it is not UTF-8 or a line does not split
        # (an unbalanced quote): argparse 3.11 lets both through as tracebacks.
        expanded: list[str] = []
        for text in arg_strings:
            if not text or text[0] not in self.fromfile_prefix_chars:
                expanded.append(text)
                continue
            name = text[1:]
            try:
                with open(name, encoding="utf-8") as handle:
                    content = handle.read()
            except OSError as error:
                self.error(f"flag file {text} cannot be read ({error.strerror or error})")
            except UnicodeDecodeError as error:
                self.error(f"flag file {text} is not UTF-8 text (byte {error.start}); save it as UTF-8")
            found: list[str] = []
            for number, line in enumerate(content.splitlines(), 1):
                try:
                    found += self.convert_arg_line_to_args(line)
                except ValueError as error:  # shlex: "No closing quotation", "No escaped character"
                    self.error(f"flag file {text}, line {number}: {error}; close the quote (or escape it with \\)")
            expanded += self._read_args_from_files(found)
        return expanded

    def _get_value(self, action: argparse.Action, arg_string: str):
        if isinstance(action.type, Range):  # "--flag value must be ...", not argparse's "invalid int value"
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
