"""The progress line: one compact line per --log_interval in a log, one line redrawn in place on a terminal."""
from __future__ import annotations

import io
import re

import benchmark
from t2ibench.callbacks.progress import ConsoleProgress, format_seconds

LINE = re.compile(r"^batch (\d+)/(\d+) \(\s*\d+%\) \|\s+[\d.]+ images/s \| loss [\d.]+ \| elapsed \S+ \| left \S+$")


def test_format_seconds_is_short():
    assert [format_seconds(s) for s in (0, 42.4, 187, 3720, float("inf"))] == ["0s", "42s", "3m07s", "1h02m", "?"]


def test_log_lines_per_interval_and_terminal_line_in_place(capsys):
    terminal = io.StringIO()
    # 16 synthetic samples in batches of 4: max_duration 1ep is 4 batches, known from the loader.
    benchmark.main(["--model_config", "tiny", "--use_synth_data", "--batch_size", "4", "--image_size", "32",
                    "--num_synthetic_samples", "16", "--max_duration", "1ep", "--num_workers", "0",
                    "--warmup_batches", "1", "--log_interval", "2ba"],
                   extra_callbacks=[ConsoleProgress("2ba", stream=terminal, terminal=True)])
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("batch ")]
    assert [LINE.match(line).groups() for line in progress] == [("1", "4"), ("2", "4"), ("4", "4")], out
    assert "Train loss/train/total" not in out and "Config:" not in out  # Composer's dumps are gone
    assert "=== Stable Diffusion benchmark ===" in out  # the summary stays
    # On a terminal: redrawn in place (carriage return, clear line), one final newline before the summary.
    drawn = terminal.getvalue()
    assert drawn.count("\n") == 1 and drawn.endswith("\n")
    frames = [frame for frame in drawn.strip().split("\r\033[K") if frame]
    assert frames and LINE.match(frames[-1]).groups() == ("4", "4")
