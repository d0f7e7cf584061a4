"""FLOPs per image and the Throughput callback: warm-up excluded, data wait measured."""
from __future__ import annotations

import time

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier

from t2ibench.callbacks.throughput import Pauses, Throughput
from t2ibench.families import MODEL_CONFIGS


def test_sd2_base_flops_per_512_image_match_the_reference():
    family = MODEL_CONFIGS["sd2-base"]
    flops = family.flops_per_image("sd2-base", image_size=512)
    # Reference (torch.utils.flop_counter on the SD2-base configs): 2,409 GFLOP UNet fwd+bwd,
    # 1,117 VAE encoder, 45 text encoder, 3,570 online total.
    assert flops["denoiser_fwd_bwd"] == pytest.approx(2409e9, rel=0.02)
    assert flops["denoiser_fwd"] == pytest.approx(804e9, rel=0.02)
    assert flops["vae_encoder"] == pytest.approx(1117e9, rel=0.02)
    assert flops["total"] == pytest.approx(3570e9, rel=0.02)
    precomputed = family.flops_per_image("sd2-base", image_size=512, vae=False, text_encoders=False)
    assert precomputed["total"] == precomputed["denoiser_fwd_bwd"] == pytest.approx(flops["denoiser_fwd_bwd"])


class SlowLoader:
    """Batches of 4 tiny images; sleeps `slow_s` before each of the first `slow_batches`, then `every_s`."""

    def __init__(self, num_batches: int, slow_batches: int, slow_s: float, every_s: float = 0.0):
        self.num_batches, self.slow_batches, self.slow_s, self.every_s = num_batches, slow_batches, slow_s, every_s
        self.batch_size = 4

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        for i in range(self.num_batches):
            time.sleep(self.slow_s if i < self.slow_batches else self.every_s)
            yield torch.randn(4, 8), torch.randint(0, 2, (4,))


def fit(loader: SlowLoader, callback: Throughput) -> dict:
    model = ComposerClassifier(torch.nn.Linear(8, 2), num_classes=2)
    Trainer(model=model, train_dataloader=loader, max_duration=f"{loader.num_batches}ba", callbacks=[callback],
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1), progress_bar=False).fit()
    return callback.summary


def test_warmup_batches_are_left_out():
    # 3 slow warm-up batches (1 s each), then 10 fast ones: the figure must be the fast rate.
    summary = fit(SlowLoader(13, slow_batches=3, slow_s=1.0), Throughput(warmup_batches=3, flops_per_image=1e6,
                                                                        peak_flops_per_device=1e9,
                                                                        trained_flops_per_image=4e5))
    assert summary["warmup_batches"] == 3 and summary["measured_batches"] == 10
    assert summary["measured_seconds"] < 1.0  # none of the slow batches inside
    assert summary["images_per_sec"] == pytest.approx(40 / summary["measured_seconds"])
    assert summary["mfu"] == pytest.approx(summary["images_per_sec_per_device"] * 1e6 / 1e9)
    assert summary["mfu_trained_network"] == pytest.approx(0.4 * summary["mfu"])  # the trained network's FLOPs only


def test_data_wait_fraction_measures_a_slow_loader():
    summary = fit(SlowLoader(6, slow_batches=0, slow_s=0.0, every_s=0.1), Throughput(warmup_batches=1))
    assert 0.7 < summary["data_wait_fraction"] <= 1.0
    assert summary["images_per_sec"] < 4 / 0.1  # bounded by the loader
    assert summary["peak_memory_bytes"] > 0 and summary["mfu"] is None  # no FLOPs given: no MFU


def test_short_run_excludes_only_the_first_batch():
    summary = fit(SlowLoader(3, slow_batches=1, slow_s=0.3), Throughput(warmup_batches=5))
    assert summary["warmup_batches"] == 1 and summary["measured_batches"] == 2
    assert summary["measured_seconds"] < 0.3


def test_pauses_recorded_inside_the_window_are_left_out():
    # A callback that draws samples (here: sleeps 1 s) at batch 6 records the pause in the run's
    # Pauses; Throughput leaves it out of the measured seconds. A pause before the window does not count.
    from composer.core import Callback

    pauses = Pauses()

    class Pause(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) in (1, 6):
                start = time.perf_counter()
                time.sleep(1.0)
                pauses.record(start, time.perf_counter() - start)

    throughput = Throughput(warmup_batches=2, pauses=pauses)
    model = ComposerClassifier(torch.nn.Linear(8, 2), num_classes=2)
    Trainer(model=model, train_dataloader=SlowLoader(10, slow_batches=0, slow_s=0.0), max_duration="10ba",
            callbacks=[throughput, Pause()], optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            progress_bar=False).fit()
    assert throughput.summary["measured_seconds"] < 0.9  # the 1 s pause at batch 6 is not training time
    assert pauses.seconds_within(0.0, time.perf_counter()) >= 2.0  # both pauses were recorded


def test_a_pause_after_the_last_batch_is_not_taken_from_the_window():
    # Composer evaluates at the end of training after the last batch's BATCH_END, where the window
    # closes: that evaluation's seconds are outside the window and must not shorten it (they once made
    # images/s negative when the evaluation outlasted a short window).
    from composer.core import Callback

    pauses = Pauses()

    class PauseAtTheEnd(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 6:
                start = time.perf_counter()
                time.sleep(0.5)
                pauses.record(start, time.perf_counter() - start)

    throughput = Throughput(warmup_batches=2, pauses=pauses)
    model = ComposerClassifier(torch.nn.Linear(8, 2), num_classes=2)
    Trainer(model=model, train_dataloader=SlowLoader(6, slow_batches=0, slow_s=0.0), max_duration="6ba",
            callbacks=[throughput, PauseAtTheEnd()], optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            progress_bar=False).fit()
    assert 0.0 < throughput.summary["measured_seconds"] < 0.4
    assert throughput.summary["images_per_sec"] > 0
