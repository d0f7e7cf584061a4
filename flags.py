"""The command line of every command: one-line argparse errors and the range of every number.

Each numeric flag is declared with a `Range` as its argparse `type`, so its range lives next to the
flag, is checked before anything else runs, and refuses NaN and infinity (a check written `x <= 0`
lets NaN through: every comparison with NaN is false). `Parser` is argparse's parser with the
project's error format, `prog: error: <flag> <value> must be ...`, on one line, as a SystemExit
(status 1, no usage block), so `main(argv)` called in a test stops the same way as the CLI.
Ranges that depend on other flags or on the machine (a warm-up within the run, loader processes
per core) are checked in each command's `validate`, with `Range.problem` or `check_workers`.

    from flags import Parser, Range, POSITIVE_INT
    p = Parser(prog="benchmark.py")
    p.add_argument("--batch_size", type=POSITIVE_INT, default=2048)
    p.add_argument("--caption_drop_prob", type=Range(float, 0, 1, high_open=True), default=0.0)
"""
from __future__ import annotations

import argparse
import math
import os
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


class Parser(argparse.ArgumentParser):
    """argparse with the project's errors: one line `prog: error: --flag value must be ...`.

    Pass `prog` (the script's file name): run in-process, argparse would take the test runner's.
    """

    def _get_value(self, action: argparse.Action, arg_string: str):
        if isinstance(action.type, Range):
            try:
                return action.type(arg_string)
            except argparse.ArgumentTypeError as error:
                flag = max(action.option_strings, key=len) if action.option_strings else action.metavar or action.dest
                raise argparse.ArgumentError(None, f"{flag} {arg_string} {error}") from None
        return super()._get_value(action, arg_string)

    def error(self, message: str) -> NoReturn:
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
