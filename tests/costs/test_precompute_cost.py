"""cost.py --precompute: the one-time latents.py pass added to every row, so a precomputed run costs one figure."""
from __future__ import annotations

import pytest

import cost


def test_precompute_pass_is_added_to_every_row(capsys):
    plain = cost.main(["--gpus", "8", "--images_per_sec", "288", "--num_gpus", "8", "64"])
    with_pass = cost.main(["--gpus", "8", "--images_per_sec", "288", "--num_gpus", "8", "64", "--precompute",
                           "--precompute_images", "1e9", "--precompute_images_per_sec", "100"])
    out = capsys.readouterr().out
    pass_hours = 1e9 / 100 / 3600  # 2,778 GPU-hours, whatever the GPU count
    assert "includes the one-time latents.py pass: 1,000,000,000 images at 100.0 images/s per GPU = 2,778 GPU-hours" in out
    for a, b in zip(plain, with_pass):
        assert b.images_per_sec == a.images_per_sec  # training throughput unchanged
        assert b.gpu_hours == pytest.approx(a.gpu_hours + pass_hours)
        assert b.cost_usd == pytest.approx(a.cost_usd + 2.0 * pass_hours)
        assert b.days == pytest.approx(a.days + pass_hours / 24 / a.num_gpus)


def test_default_precompute_speed_comes_from_the_vae_flops():
    # 312 TFLOP/s x 40% MFU / 1,117 GFLOP per 512x512 image
    assert cost.PRECOMPUTE_IMAGES_PER_SEC == pytest.approx(111.73, abs=0.01)
