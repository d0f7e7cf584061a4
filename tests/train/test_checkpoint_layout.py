"""Checkpoints of earlier releases still load: what benchmark.py saves for every family (tensor names
and shapes of the model, the optimizer's and the EMA's state, the callbacks' state keys) matches
the layout recorded from the release before the restructure of issue 32 (tests/data/
checkpoint_layouts.json, written by scripts/checkpoint_layout.py from that release's checkpoints)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmark
import checkpoint_layout
from t2ibench.train.checkpoints import layout, layout_digests

RECORDED = json.loads((Path(__file__).parents[1] / "data" / "checkpoint_layouts.json").read_text())


@pytest.mark.parametrize("config", sorted(RECORDED))
def test_saved_checkpoint_has_the_recorded_layout(config: str, tmp_path: Path) -> None:
    # The flags the recorded checkpoints were saved with: the callbacks in a checkpoint depend on them.
    benchmark.main(["--model_config", config, "--use_synth_data", "--batch_size", "4", "--image_size", "32",
                    "--max_duration", "1ba", "--num_workers", "0", "--use_ema", "--save_folder", str(tmp_path),
                    "--save_interval", "1ba", "--run_name", f"layout-{config}"])
    saved = layout_digests(layout(tmp_path / "ep0-ba1-rank0.pt"))
    assert saved == RECORDED[config]
    # The script that recorded the file writes the same for this checkpoint.
    checkpoint_layout.main(["--json", str(tmp_path / "layout.json"), f"{config}={tmp_path / 'ep0-ba1-rank0.pt'}"])
    assert json.loads((tmp_path / "layout.json").read_text()) == {config: RECORDED[config]}
