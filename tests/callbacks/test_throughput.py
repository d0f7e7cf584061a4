"""FLOPs per image and the Throughput callback: warm-up excluded, data wait measured; on two ranks, the
seconds one rank compiles left out of every rank's window and bucket figures (multirank).

This file is also the training script of that two-rank test: `composer -n 2 tests/callbacks/test_throughput.py
--rank-worker OUT <benchmark.py flags>` runs benchmark.py on each rank with rank 1 compiling a graph
inside one batch of the window (`CompileOnOneRank`), and each rank writes `OUT/rank<R>.json`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from composer import Trainer
from composer.core import Callback, State
from composer.loggers import Logger
from composer.models import ComposerClassifier
from composer.utils import dist

from t2ibench.callbacks.throughput import Pauses, Throughput
from t2ibench.families import MODEL_CONFIGS
from tests.helpers import ROOT, Launch, composer_launcher, supervise


@pytest.mark.slow
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


@pytest.mark.slow
def test_warmup_batches_are_left_out():
    # 3 slow warm-up batches (2 s each), then 10 fast ones: the figure must be the fast rate. (A fast batch
    # took up to ~50 ms on a loaded 2-core CI machine: 2 s leaves a margin of 4.)
    summary = fit(SlowLoader(13, slow_batches=3, slow_s=2.0), Throughput(warmup_batches=3, flops_per_image=1e6,
                                                                        peak_flops_per_device=1e9,
                                                                        trained_flops_per_image=4e5))
    assert summary["warmup_batches"] == 3 and summary["measured_batches"] == 10
    assert summary["measured_seconds"] < 2.0  # none of the slow batches inside
    assert summary["images_per_sec"] == pytest.approx(40 / summary["measured_seconds"])
    assert summary["mfu"] == pytest.approx(summary["images_per_sec_per_device"] * 1e6 / 1e9)
    assert summary["mfu_trained_network"] == pytest.approx(0.4 * summary["mfu"])  # the trained network's FLOPs only


def test_data_wait_fraction_measures_a_slow_loader():
    # The loader sleeps 0.1 s before each of the 5 measured batches: those seconds are data wait, whatever
    # the step itself costs on a loaded machine (a fixed fraction failed once in CI at 0.69).
    summary = fit(SlowLoader(6, slow_batches=0, slow_s=0.0, every_s=0.1), Throughput(warmup_batches=1))
    wait_seconds = summary["data_wait_fraction"] * summary["measured_seconds"]
    assert summary["measured_batches"] == 5
    assert 0.95 * 5 * 0.1 <= wait_seconds <= summary["measured_seconds"]
    assert summary["images_per_sec"] < 4 / 0.1  # bounded by the loader
    assert summary["peak_memory_bytes"] > 0 and summary["mfu"] is None  # no FLOPs given: no MFU


def test_short_run_excludes_only_the_first_batch():
    summary = fit(SlowLoader(3, slow_batches=1, slow_s=1.0), Throughput(warmup_batches=5))
    assert summary["warmup_batches"] == 1 and summary["measured_batches"] == 2
    assert summary["measured_seconds"] < 1.0


@pytest.mark.slow
def test_pauses_recorded_inside_the_window_are_left_out():
    # A callback that draws samples (here: sleeps 2 s) at batch 6 records the pause in the run's
    # Pauses; Throughput leaves it out of the measured seconds. A pause before the window does not count.
    from composer.core import Callback

    pauses = Pauses()

    class Pause(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) in (1, 6):
                start = time.perf_counter()
                time.sleep(2.0)
                pauses.record(start, time.perf_counter() - start)

    throughput = Throughput(warmup_batches=2, pauses=pauses)
    model = ComposerClassifier(torch.nn.Linear(8, 2), num_classes=2)
    Trainer(model=model, train_dataloader=SlowLoader(10, slow_batches=0, slow_s=0.0), max_duration="10ba",
            callbacks=[throughput, Pause()], optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            progress_bar=False).fit()
    assert throughput.summary["measured_seconds"] < 1.9  # the 2 s pause at batch 6 is not training time
    assert pauses.seconds_within(0.0, time.perf_counter()) >= 4.0  # both pauses were recorded


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
                time.sleep(1.5)
                pauses.record(start, time.perf_counter() - start)

    throughput = Throughput(warmup_batches=2, pauses=pauses)
    model = ComposerClassifier(torch.nn.Linear(8, 2), num_classes=2)
    Trainer(model=model, train_dataloader=SlowLoader(6, slow_batches=0, slow_s=0.0), max_duration="6ba",
            callbacks=[throughput, PauseAtTheEnd()], optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            progress_bar=False).fit()
    assert 0.0 < throughput.summary["measured_seconds"] < 1.4
    assert throughput.summary["images_per_sec"] > 0


# -- Two ranks, one of which compiles ----------------------------------------------------------

COMPILING_RANK, COMPILE_BATCH, COMPILE_S = 1, 3, 2.0  # rank 1 compiles for 2 s inside batch 3 (of 4; 1 warm-up)
RANK_RUN = ["--model_config", "sdxl-tiny", "--use_synth_data", "--num_workers", "0", "--image_size", "32",
            "--batch_size", "4", "--max_duration", "4ba", "--warmup_batches", "1", "--aspect_buckets", "default",
            "--seed", "5"]


class CompileOnOneRank(Callback):
    """From outside: on rank `rank` only, a graph compiled inside batch `batch` by a backend that takes
    `seconds` (the others wait for it at the step's gradient all-reduce); on every rank, the end of every
    batch by this callback's clock and each batch's bucket."""

    def __init__(self, rank: int, batch: int, seconds: float) -> None:
        self.rank, self.batch, self.seconds = rank, batch, seconds
        self.ends: list[float] = []
        self.buckets: list[str] = []

    def slow_backend(self, graph: torch.fx.GraphModule, inputs: list) -> object:
        time.sleep(self.seconds)
        return graph.forward

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self.buckets.append("x".join(str(side) for side in state.batch["image"].shape[-2:]))

    def after_forward(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) + 1 == self.batch and dist.get_global_rank() == self.rank:
            torch.compile(lambda x: x * 2 + 1, backend=self.slow_backend)(torch.ones(3))

    def batch_end(self, state: State, logger: Logger) -> None:
        self.ends.append(time.perf_counter())


def rank_worker(out: str, *flags: str) -> None:
    """One rank of the two-rank test: benchmark.py with `CompileOnOneRank`, its figures to OUT/rank<R>.json."""
    import benchmark
    probe = CompileOnOneRank(COMPILING_RANK, COMPILE_BATCH, COMPILE_S)
    results = benchmark.main(list(flags), extra_callbacks=[probe])
    kept = {key: results[key] for key in ("measured_seconds", "warmup_batches", "compile_seconds",
                                          "compile_seconds_in_window", "images_per_sec_per_device_by_bucket")}
    Path(out, f"rank{dist.get_global_rank()}.json").write_text(json.dumps({**kept, "ends": probe.ends,
                                                                            "buckets": probe.buckets}))


@pytest.mark.multirank
def test_the_seconds_another_rank_compiles_are_left_out_of_rank_0s_window(tmp_path):
    # Rank 0 compiles nothing in the window, but waits the 2 s rank 1 compiles in batch 3: its figures (the
    # ones reported) leave out, batch by batch, the most any rank compiled, as rank 1's do.
    launch = Launch([*composer_launcher(2), str(ROOT / "tests" / "callbacks" / "test_throughput.py"), "--rank-worker",
                     str(tmp_path), *RANK_RUN], tmp_path / "ranks.log")
    supervise([launch])
    assert launch.proc.returncode == 0, launch.tail()
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    first, second = ranks
    assert first["compile_seconds_in_window"] >= COMPILE_S and first["compile_seconds"] < COMPILE_S  # not its own
    assert first["compile_seconds_in_window"] == second["compile_seconds_in_window"]
    assert first["buckets"] == second["buckets"]  # synthetic buckets: one per step, the same on every rank
    warmup = first["warmup_batches"]
    for rank in ranks:  # the window by the rank's own clock, less the seconds left out
        window = rank["ends"][-1] - rank["ends"][warmup - 1]
        assert rank["measured_seconds"] == pytest.approx(window - rank["compile_seconds_in_window"], abs=0.2)
    # Each bucket's seconds, summed over the ranks, are parts of the batches inside each rank's window: with
    # the compiling left out of both, no more than twice the window (rank 0 keeping its wait would exceed it).
    rates = first["images_per_sec_per_device_by_bucket"]
    images = {}
    for rank in ranks:
        for bucket in rank["buckets"][warmup:]:
            images[bucket] = images.get(bucket, 0) + 2  # 4 images a batch, 2 a rank
    assert set(rates) == set(images)
    bucket_seconds = sum(count / rates[name] for name, count in images.items())
    assert bucket_seconds <= first["measured_seconds"] + second["measured_seconds"]


if __name__ == "__main__" and sys.argv[1:2] == ["--rank-worker"]:
    rank_worker(*sys.argv[2:])
