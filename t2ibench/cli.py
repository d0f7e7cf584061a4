"""The argument parser of every command: argparse with flag files and one-line errors.

A flag file is read where `@FILE` stands (`benchmark.py @recipes/sd2-stage1.args --remote s3://...`;
flags later on the line win, so a recipe's value can be overridden): one or more flags per line,
`#` starts a comment. An error is one line, `<command>: error: <message>` (exit status 2, as
argparse's), like every other user error (`errors.fail`). Light on purpose: convert.py and cost.py
use it without loading any model code.
"""
from __future__ import annotations

import argparse
import shlex


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

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")  # the full usage is in --help
