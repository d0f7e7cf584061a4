"""MLPerf's validation loss for every model: SD2's tiny model evaluated every --eval_interval at its
DDPM steps k x 1000 / 8, in the progress line and the results, and the flags refused when incomplete."""
from __future__ import annotations

import json

import pytest
import torch

import benchmark
from t2ibench.families import family_of
from t2ibench.objectives import DDPMObjective
from tests.helpers import TINY_SYNTH

TINY = [*TINY_SYNTH, "--warmup_batches", "1", "--log_interval", "1ba"]


def test_sd2_validation_loss_every_interval_in_the_progress_line_and_results(tmp_path, capsys):
    benchmark.main(TINY + ["--max_duration", "4ba", "--eval_interval", "2ba", "--eval_samples", "16",
                           "--results_json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    assert [e["batch"] for e in r["eval_history"]] == [2, 4]
    assert all(e["held_out_samples"] == 16 and None not in e["per_timestep"] for e in r["eval_history"])
    assert f"eval loss {r['eval_history'][0]['loss']:.4f}" in out and "eval loss    " in out  # line and summary
    assert r["eval_target"] is None and r["eval_target_reached"] is None


def test_sd2_fixed_timesteps_span_the_schedule():
    objective = DDPMObjective(family_of("tiny").build("tiny", denoiser=False, vae=False, text_encoders=False,
                                                      tokenizers=False).noise_scheduler)
    assert objective.fixed_timesteps(torch.arange(8), 8).tolist() == [0, 125, 250, 375, 500, 625, 750, 875]


@pytest.mark.parametrize("flags, message", [
    (["--eval_samples", "8"], "--eval_samples needs --eval_interval"),
    (["--eval_interval", "0ba"], "--eval_interval '0ba' must be a positive"),
    (["--eval_interval", "2ba", "--eval_local", "/nonexistent"], "--use_synth_data evaluates on synthetic held-out"),
    (["--eval_interval", "2ba", "--eval_samples", "2"], "fewer than one global batch"),
])
def test_incomplete_validation_flags_fail_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit, match=message):
        benchmark.main(TINY + ["--max_duration", "2ba", *flags])
