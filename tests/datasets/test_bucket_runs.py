"""--aspect_buckets end to end on CPU with real photographs of mixed aspect ratios (a panorama, a 3000 x 1
line and its tall twin, an EXIF-rotated phone portrait, landscapes, portraits, squares) converted by
convert.py --aspect_buckets into one MDS folder per bucket: sdxl-tiny trained on one Streaming stream per
folder (per_stream batching) on loader workers, every batch one bucket with each image's own size and
crop; the run on two ranks and two workers each SIGKILLed off a worker boundary and resumed with
--autoresume to the uninterrupted run's weights and EMA, bit for bit; sort_buckets.py on the shards of
before, killed and resumed; the refusals, each one line before anything is built."""
from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from composer.core import Callback
from PIL import Image

import benchmark
import convert
import latents
import sort_buckets
from t2ibench.datasets.bucket_folders import RECORD_FILE, read_record
from t2ibench.datasets.buckets import Bucket, default_buckets, nearest_bucket, read_buckets
from tests.helpers import (MIXED_ASPECT_PHOTOS, Launch, error_of, kill_and_resume, killed_in_child,
                           mixed_aspect_folder, two_ranks)

NUM_PHOTOS = 64
NUM_KINDS = len(MIXED_ASPECT_PHOTOS)
XL = ["--model_config", "sdxl-tiny", "--seed", "17", "--warmup_batches", "1", "--aspect_buckets"]


@pytest.fixture(scope="module")
def flat_shards(tmp_path_factory) -> Path:
    """NUM_PHOTOS photos cycling through MIXED_ASPECT_PHOTOS, converted by convert.py into small shards
    without buckets (the datasets users have)."""
    tmp = tmp_path_factory.mktemp("bucket-photos")
    out = tmp / "mds"
    report = convert.convert([str(mixed_aspect_folder(tmp / "photos", NUM_PHOTOS))], str(out), size_limit="16kb",
                             workers=1, progress=False)
    assert report.written == NUM_PHOTOS and report.shards >= 3
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The same photos converted by convert.py --aspect_buckets: one folder per bucket of the default list at 64."""
    tmp = tmp_path_factory.mktemp("bucket-folders")
    out = tmp / "mds"
    report = convert.convert([str(mixed_aspect_folder(tmp / "photos", NUM_PHOTOS))], str(out), size_limit="16kb",
                             workers=1, progress=False, buckets=default_buckets(64, 8), image_size=64)
    assert report.written == NUM_PHOTOS and report.shards >= 8
    return out


def copy_of(shards: Path, where: Path) -> Path:
    """A private copy (Streaming decompresses next to what it reads; one live dataset per folder)."""
    shutil.copytree(shards, where)
    return where


# -----------------------------------------------------------------------------------------------
# Two ranks of two loader workers, one run killed mid-epoch and resumed.
# -----------------------------------------------------------------------------------------------

# 64 photos in 8 buckets of 8, 2 a rank: an epoch of 16 steps; killed after batch 3 of 6, so that the next
# batch is loader worker 1's (off a worker boundary: the old planner resumed those to other weights).
RESUME = XL + ["--batch_size", "4", "--num_workers", "2", "--max_duration", "6ba", "--save_interval", "3ba",
               "--use_ema", "--run_name", "bucket-resume", "--autoresume", "--log_interval", "1ba"]
KILL_AFTER = "ep0-ba3-rank0.pt"


@pytest.fixture(scope="module")
def two_rank_runs(shards, tmp_path_factory) -> SimpleNamespace:
    """A reference run and a run SIGKILLed after its batch-3 checkpoint, then relaunched with --autoresume."""
    tmp = tmp_path_factory.mktemp("bucket-resume")

    def launch(name: str, folder: str) -> Launch:
        data_dir = tmp / f"{folder}-data"
        if not data_dir.exists():
            copy_of(shards, data_dir)
        args = RESUME + ["--local", str(data_dir), "--save_folder", str(tmp / folder),
                         "--results_json", str(tmp / f"{name}.json")]
        if name == "reference":  # each rank's batch shapes (tests/fault_run.py's report)
            return Launch(two_ranks("tests/fault_run.py", "--report", str(tmp / "report"), *args), tmp / f"{name}.log")
        return Launch(two_ranks("benchmark.py", *args), tmp / f"{name}.log")

    return SimpleNamespace(tmp=tmp, **kill_and_resume(launch, tmp / "killed", KILL_AFTER))


# -----------------------------------------------------------------------------------------------
# One rank, in this process.
# -----------------------------------------------------------------------------------------------

class EpochLength(Callback):
    """The batches Composer counted in an epoch of the loader (what --max_duration Nep's schedule is sized from)."""

    dataloader_len: int | None = None

    def fit_start(self, state, logger) -> None:
        self.dataloader_len = int(state.dataloader_len) if state.dataloader_len is not None else None


class Batches(EpochLength):
    """Every batch the run trained on: image shape, original sizes, crops and sample indices."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def after_dataloader(self, state, logger) -> None:
        batch = state.batch
        geometry = {"original_size": batch["original_size"].tolist(), "crop": batch["crop_top_left"].tolist()} \
            if "original_size" in batch else {}  # SDXL's
        self.seen.append({"shape": tuple(batch["image"].shape), "index": batch["sample_index"].tolist(), **geometry})


@pytest.fixture(scope="module")
def one_rank_epoch(shards, tmp_path_factory):
    """One epoch of 64 photos, 4 a batch, on two loader workers: its batches and results."""
    tmp = tmp_path_factory.mktemp("bucket-epoch")
    batches = Batches()
    results = benchmark.main(XL + ["--local", str(copy_of(shards, tmp / "mds")), "--batch_size", "4",
                                   "--num_workers", "2", "--max_duration", "1ep"], extra_callbacks=[batches])
    return batches.seen, results, batches.dataloader_len


@pytest.mark.slow
def test_every_batch_holds_one_bucket_with_each_images_own_size_and_crop(one_rank_epoch):
    seen, results, dataloader_len = one_rank_epoch
    assert len(seen) == NUM_PHOTOS // 4 == dataloader_len  # 8 buckets of 8: nothing lost; the length Composer read
    indices = [i for batch in seen for i in batch["index"]]
    assert len(set(indices)) == len(indices) == NUM_PHOTOS  # every photo once
    listed = default_buckets(64, 8)
    shown = {(h, w) if orientation == 6 else (w, h) for name, w, h, orientation in MIXED_ASPECT_PHOTOS}
    shapes = Counter()
    for batch in seen:
        _, channels, height, width = batch["shape"]
        shapes[(height, width)] += 1
        for original, crop in zip(batch["original_size"], batch["crop"]):
            height_shown, width_shown = original  # SDXL's time ids: the size as shown (EXIF applied)
            assert (width_shown, height_shown) in shown
            # Every image in the bucket nearest its aspect ratio: a bucket folder is one stream, a step one stream.
            assert nearest_bucket(width_shown, height_shown, listed, 64) == Bucket(height, width)
            assert crop[0] >= 0 and crop[1] >= 0 and (crop[0] == 0 or crop[1] == 0)  # cropped along one side only
    assert len(shapes) >= 6  # portraits, squares, landscapes, the line and the column
    assert results["final_loss"] is not None and results["images_per_sec"] > 0


def test_the_results_count_the_images_of_each_bucket(one_rank_epoch):
    seen, results, _ = one_rank_epoch
    counted = Counter()
    for batch in seen:
        counted[f"{batch['shape'][2]}x{batch['shape'][3]}"] += batch["shape"][0]
    assert results["images_per_bucket"] == dict(counted) and sum(counted.values()) == NUM_PHOTOS
    assert results["aspect_buckets"] == "default" and results["bucket_crop"] == "random"
    rates = results["images_per_sec_per_device_by_bucket"]
    assert rates and set(rates) <= set(counted) and all(rate > 0 for rate in rates.values())


@pytest.mark.parametrize("model_config", ["sdxl-tiny", "flux1-tiny"])
@pytest.mark.slow
def test_synthetic_batches_are_drawn_from_the_bucket_weights(model_config):
    batches = Batches()
    weights = "32x128=3,64x64=1"
    results = benchmark.main(["--model_config", model_config, "--image_size", "64", "--use_synth_data", "--batch_size",
                              "2", "--num_workers", "0", "--max_duration", "12ba", "--warmup_batches", "1",
                              "--aspect_buckets", "--synthetic_bucket_weights", weights], extra_callbacks=[batches])
    shapes = Counter(batch["shape"][2:] for batch in batches.seen)
    assert set(shapes) <= {(32, 128), (64, 64)} and shapes[(32, 128)] > shapes[(64, 64)] > 0
    assert results["images_per_bucket"] == {f"{h}x{w}": 2 * n for (h, w), n in shapes.items()}
    assert results["synthetic_bucket_weights"] == weights and results["bucket_crop"] is None
    if model_config != "sdxl-tiny":
        return
    uniform = benchmark.main(["--model_config", model_config, "--image_size", "64", "--use_synth_data", "--batch_size",
                              "2", "--num_workers", "0", "--max_duration", "12ba", "--warmup_batches", "1",
                              "--aspect_buckets"])
    assert len(uniform["images_per_bucket"]) >= 4  # the list's buckets alike: most of them in 12 batches


SYNTHETIC = ["--image_size", "64", "--use_synth_data", "--batch_size", "2", "--num_workers", "0",
             "--max_duration", "8ba", "--warmup_batches", "2", "--peak_tflops", "0.5"]


@pytest.mark.parametrize("model_config", ["sdxl-tiny", "flux1-tiny"])
@pytest.mark.slow
def test_flops_per_image_and_mfu_are_those_of_the_buckets_the_window_trained(model_config, tmp_path):
    from t2ibench.families import MODEL_CONFIGS

    family = MODEL_CONFIGS[model_config]
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("32x64\n64x64\n")  # half the square's pixels, and the square
    batches = Batches()
    results = benchmark.main(["--model_config", model_config, *SYNTHETIC, "--aspect_buckets", str(buckets),
                              "--synthetic_bucket_weights", "32x64=3,64x64=1"], extra_callbacks=[batches])
    counted = {name: family.flops_per_image(model_config, (height, width))
               for name, height, width in (("32x64", 32, 64), ("64x64", 64, 64))}
    assert results["flops_per_image_by_bucket"] == {name: flops["total"] for name, flops in counted.items()}
    assert counted["32x64"]["total"] < 0.9 * counted["64x64"]["total"]
    # The window: the batches after the warm-up, each of one bucket, each image at its bucket's FLOPs.
    window = Counter(f"{batch['shape'][2]}x{batch['shape'][3]}" for batch in batches.seen[results["warmup_batches"]:])
    assert set(window) == {"32x64", "64x64"}, window  # both buckets in the window (this seed's draw)
    images = 2 * sum(window.values())
    mean = sum(2 * n * counted[name]["total"] for name, n in window.items()) / images
    trained = sum(2 * n * counted[name]["denoiser_fwd_bwd"] for name, n in window.items()) / images
    assert results["flops_per_image"] == pytest.approx(mean, rel=1e-12)
    assert results["flops_per_image_trained_network"] == pytest.approx(trained, rel=1e-12)
    assert results["mfu"] == pytest.approx(results["images_per_sec_per_device"] * mean / 0.5e12, rel=1e-12)
    assert results["mfu_trained_network"] == pytest.approx(
        results["images_per_sec_per_device"] * trained / 0.5e12, rel=1e-12)
    assert results["flops_per_image_breakdown"] == counted["64x64"]  # the square's (--image_size), as before


@pytest.mark.slow
def test_a_square_runs_flops_per_image_and_mfu_are_the_squares():
    from t2ibench.families import MODEL_CONFIGS

    results = benchmark.main(["--model_config", "sdxl-tiny", *SYNTHETIC])
    flops = MODEL_CONFIGS["sdxl-tiny"].flops_per_image("sdxl-tiny", 64)
    assert results["flops_per_image_breakdown"] == flops and results["flops_per_image_by_bucket"] is None
    assert results["flops_per_image"] == flops["total"]  # as counted, not a mean
    assert results["flops_per_image_trained_network"] == flops["denoiser_fwd_bwd"]
    assert results["mfu"] == results["images_per_sec_per_device"] * flops["total"] / 0.5e12
    assert results["mfu_trained_network"] == results["images_per_sec_per_device"] * flops["denoiser_fwd_bwd"] / 0.5e12


@pytest.mark.parametrize("weights, expected", [
    ("64x64", "'64x64' is not HEIGHTxWIDTH=WEIGHT"),
    ("64x64=-1", "'64x64=-1' is not HEIGHTxWIDTH=WEIGHT"),
    ("64x64=nan", "'64x64=nan' is not HEIGHTxWIDTH=WEIGHT"),
    ("60x60=1", "60x60 is not one of the run's buckets"),
    ("64x64=0", "the weights add up to 0"),
    ("64x64=1,64x64=2", "64x64 is given twice"),
])
def test_bad_bucket_weights_are_one_line(weights, expected):
    argv = ["--model_config", "sdxl-tiny", "--use_synth_data", "--batch_size", "2", "--max_duration", "1ba",
            "--aspect_buckets", "--synthetic_bucket_weights", weights]
    message = error_of(benchmark.main, argv)
    assert f"--synthetic_bucket_weights {weights}: {expected}" in message, message


def test_buckets_are_refused_in_one_line_where_they_do_not_apply(shards, tmp_path):
    local = ["--local", str(shards), "--batch_size", "4", "--max_duration", "1ba"]
    message = error_of(benchmark.main, ["--model_config", "tiny", "--image_size", "64", "--aspect_buckets", *local])
    assert "--aspect_buckets does not apply to --model_config tiny: SD2 trains on squares" in message
    bad = tmp_path / "buckets.txt"
    bad.write_text("64x64\n60x64\n")
    message = error_of(benchmark.main, [*XL, str(bad), *local])
    assert f"--aspect_buckets {bad}, line 2: 60x64 must have both sides multiples of 8" in message
    message = error_of(benchmark.main, [*XL, "--precomputed", "--use_synth_data", "--batch_size", "2",
                                        "--max_duration", "1ba"])
    assert "--aspect_buckets with --precomputed --use_synth_data: synthetic latents are square" in message
    message = error_of(benchmark.main, [*XL, "--precomputed", *local])  # image shards, not latents
    assert "holds images sorted into bucket folders: drop --precomputed" in message
    message = error_of(benchmark.main, ["--model_config", "sdxl-tiny", "--synthetic_bucket_weights", "64x64=1",
                                        "--use_synth_data", "--batch_size", "2", "--max_duration", "1ba"])
    assert "--synthetic_bucket_weights needs --aspect_buckets" in message
    message = error_of(benchmark.main, [*XL, "--synthetic_bucket_weights", "64x64=1", *local])
    assert "--synthetic_bucket_weights applies to --use_synth_data only" in message


SAMPLING = ["--sample_steps", "2", "--sample_interval", "2ba"]  # + --sample_prompts, --samples_dir


@pytest.mark.parametrize("model_config", ["sdxl-tiny", "flux1-tiny"])
@pytest.mark.slow
def test_samples_at_sample_size_and_exported_pipelines_generate_at_a_bucket(model_config, tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline

    import export

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle\n")
    benchmark.main(["--model_config", model_config, "--image_size", "64", "--use_synth_data", "--batch_size", "2",
                    "--num_workers", "0", "--max_duration", "2ba", "--warmup_batches", "1", "--aspect_buckets",
                    "--sample_prompts", str(prompts), "--samples_dir", str(tmp_path / "samples"), *SAMPLING,
                    "--sample_size", "32x96", "--use_ema", "--ema_export_dir", str(tmp_path / "ema"),
                    "--save_folder", str(tmp_path / "run"), "--save_interval", "2ba"])
    grid = Image.open(tmp_path / "samples" / "2.png")
    assert grid.size == (2 * 96, 32)  # two prompts side by side, each 96 px wide and 32 px high
    # The EMA export at the end of the run and export.py on its checkpoint: both list the trained buckets
    # (readable as --aspect_buckets FILE) and generate at a bucket that is not square.
    export.main([str(tmp_path / "run" / "ep0-ba2-rank0.pt"), "--out", str(tmp_path / "export")])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    patch_px = 16 if model_config == "flux1-tiny" else 8
    for folder in (tmp_path / "ema", tmp_path / "export"):
        assert read_buckets(str(folder / "aspect_buckets.txt"), 64, patch_px) == default_buckets(64, patch_px)
        pipeline = DiffusionPipeline.from_pretrained(folder, local_files_only=True)
        flux = {"max_sequence_length": pipeline.tokenizer_2.model_max_length} if model_config == "flux1-tiny" else {}
        images = pipeline("a red square", height=32, width=128, num_inference_steps=2, output_type="np",
                          generator=torch.Generator().manual_seed(0), **flux).images
        assert images.shape == (1, 32, 128, 3) and np.isfinite(images).all()


@pytest.mark.parametrize("model_config, extra, size, expected", [
    ("sdxl-tiny", [], "64", "--sample_size 64: not HEIGHTxWIDTH in pixels"),
    ("sdxl-tiny", [], "64x-8", "--sample_size 64x-8: not HEIGHTxWIDTH in pixels"),
    ("sdxl-tiny", [], "60x64", "--sample_size 60x64: 60x64 must have both sides multiples of 8"),
    ("flux1-tiny", [], "40x64", "--sample_size 40x64: 40x64 must have both sides multiples of 16"),
    ("sdxl-tiny", [], "64x72", "--sample_size 64x72: 4,608 pixels, more than training's largest shape 64x64"),
    ("sdxl-tiny", ["--aspect_buckets"], "72x72", "more than training's largest shape 64x64 (4,096)"),
    ("tiny", [], "32x32", "--sample_size needs --sample_prompts"),
])
def test_a_bad_sample_size_is_one_line(model_config, extra, size, expected, tmp_path):
    sampling = ["--sample_prompts", "shapes", "--samples_dir", str(tmp_path / "samples")] if model_config != "tiny" else []
    argv = ["--model_config", model_config, "--image_size", "64", "--use_synth_data", "--batch_size", "2",
            "--max_duration", "1ba", *extra, *sampling, "--sample_size", size]
    message = error_of(benchmark.main, argv)
    assert expected in message, message
    assert not (tmp_path / "samples").exists()


def test_a_users_list_is_what_the_run_trains_on(shards, tmp_path):
    listed = tmp_path / "two.txt"
    listed.write_text("# tall and wide only\n96x40\n40x96\n64x64\n")
    batches = Batches()
    benchmark.main([*XL, str(listed), "--local", str(copy_of(shards, tmp_path / "mds")), "--batch_size", "4",
                    "--num_workers", "0", "--max_duration", "4ba", "--bucket_crop", "center"],
                   extra_callbacks=[batches])
    assert {batch["shape"][2:] for batch in batches.seen} <= {(96, 40), (40, 96), (64, 64)}
    assert len(batches.seen) == 4


# -----------------------------------------------------------------------------------------------
# The two-rank runs' results.
# -----------------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_two_ranks_resume_mid_epoch_after_sigkill_to_the_uninterrupted_weights_and_ema(two_rank_runs):
    runs = two_rank_runs
    reference, killed, resumed = runs.reference, runs.killed, runs.resumed
    assert reference.proc.returncode == 0, reference.output()[-4000:]
    assert killed.proc.returncode == -signal.SIGKILL
    assert resumed.proc.returncode == 0, resumed.output()[-4000:]
    assert "batch 4/6 " in resumed.output() and "batch 1/6 " not in resumed.output()
    final = os.readlink(runs.tmp / "reference" / "latest-rank0.pt")
    assert final == "ep0-ba6-rank0.pt" and os.readlink(runs.tmp / "killed" / "latest-rank0.pt") == final
    ref = torch.load(runs.tmp / "reference" / final, map_location="cpu", weights_only=False)["state"]
    res = torch.load(runs.tmp / "killed" / final, map_location="cpu", weights_only=False)["state"]
    assert ref["model"].keys() == res["model"].keys()
    assert all(torch.equal(ref["model"][k], res["model"][k]) for k in ref["model"]), "weights differ"
    ema_ref, ema_res = dict(ref["algorithms"])["EMA"]["shadow"], dict(res["algorithms"])["EMA"]["shadow"]
    assert all(torch.equal(ema_ref[k], ema_res[k]) for k in ema_ref), "EMA differs"
    # One bucket per step: both ranks trained the same bucket in every step.
    shapes = [json.loads((runs.tmp / "report" / f"rank{rank}.json").read_text())["batch_shapes"] for rank in (0, 1)]
    assert len(shapes[0]) == 6 and shapes[0] == shapes[1]
    summary = [json.loads((runs.tmp / f"{name}.json").read_text()) for name in ("reference", "resumed")]
    assert summary[0]["world_size"] == 2 and summary[0]["final_loss"] == summary[1]["final_loss"]
    # Each rank counted half the list's FLOPs; both hold all of them, and the resumed run the same.
    assert list(summary[0]["flops_per_image_by_bucket"]) == summary[0]["bucket_list"]
    assert summary[1]["flops_per_image_by_bucket"] == summary[0]["flops_per_image_by_bucket"]


# -----------------------------------------------------------------------------------------------
# Precomputed: latents.py --aspect_buckets, then --precomputed --aspect_buckets.
# -----------------------------------------------------------------------------------------------

THREE = "96x40\n64x64\n40x96\n"  # tall, square, wide: few buckets, so that each worker fills them


@pytest.fixture(scope="module")
def bucketed_latents(flat_shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bucket-latents")
    listed = tmp / "three.txt"
    listed.write_text(THREE)
    source = copy_of(flat_shards, tmp / "mds")
    latents.main(["--model_config", "sdxl-tiny", "--local", str(source), "--out", str(tmp / "lat"),
                  "--batch_size", "4", "--chunk_size", "32", "--num_workers", "0", "--no_progress",
                  "--aspect_buckets", str(listed)])
    return tmp, listed


@pytest.mark.slow
def test_latents_are_stored_in_one_folder_per_bucket_and_train_one_bucket_a_batch(bucketed_latents, tmp_path):
    from streaming import StreamingDataset

    tmp, listed = bucketed_latents
    assert json.loads((tmp / "lat" / "precompute.json").read_text())["aspect_buckets"] == ["96x40", "64x64", "40x96"]
    record = read_record(tmp / "lat")
    three = (Bucket(96, 40), Bucket(64, 64), Bucket(40, 96))
    names = Counter()
    for folder in record.folders:
        stored = StreamingDataset(local=str(tmp / "lat" / folder.folder), batch_size=1, shuffle=False)
        assert stored.num_samples == folder.samples and "bucket" not in stored[0]  # the folder is the bucket
        for i in range(stored.num_samples):
            sample = stored[i]
            names[folder.folder] += 1
            assert sample["latent_mean"].shape == (4, folder.bucket.height // 8, folder.bucket.width // 8)
            _, stored_width, stored_height, orientation = MIXED_ASPECT_PHOTOS[int(sample["index"]) % NUM_KINDS]
            shown = (stored_height, stored_width) if orientation == 6 else (stored_width, stored_height)
            assert nearest_bucket(*shown, three, 64) == folder.bucket  # the nearest of the list, centered
    assert set(names) == {"96x40", "64x64", "40x96"} and sum(names.values()) == NUM_PHOTOS
    class Latents(EpochLength):
        seen: list = []

        def after_dataloader(self, state, logger) -> None:
            self.seen.append(tuple(state.batch["latent_mean"].shape))

    batches = Latents()

    # 3 a batch, which no bucket's count divides: the epoch is each bucket's full batches, and Composer's
    # epoch length says so (the old planner's loader reported a square epoch's, 22, to the LR schedule).
    results = benchmark.main(["--model_config", "sdxl-tiny", "--precomputed", "--local",
                              str(copy_of(tmp / "lat", tmp_path / "lat")), "--batch_size", "3", "--num_workers", "0",
                              "--max_duration", "1ep", "--warmup_batches", "1", "--aspect_buckets", str(listed)],
                             extra_callbacks=[batches])
    full = sum(count // 3 for count in names.values())
    assert len(batches.seen) == full == batches.dataloader_len and full < -(-NUM_PHOTOS // 3)
    assert {shape[2:] for shape in batches.seen} <= {(12, 5), (8, 8), (5, 12)}
    assert sum(results["images_per_bucket"].values()) == 3 * full and results["largest_bucket"]["bucket"] == "64x64"


def test_a_bucket_with_fewer_samples_than_a_global_batch_is_named_and_left_out(bucketed_latents, tmp_path, capsys):
    tmp, listed = bucketed_latents
    counts = {folder.folder: folder.samples for folder in read_record(tmp / "lat").folders}
    data = copy_of(tmp / "lat", tmp_path / "lat")
    run = ["--model_config", "sdxl-tiny", "--precomputed", "--local", str(data), "--num_workers", "0",
           "--max_duration", "1ep", "--warmup_batches", "0", "--aspect_buckets", str(listed)]
    batch = min(counts.values()) + 1  # the smallest buckets hold less than one batch: left out, named
    small = sorted(name for name, count in counts.items() if count < batch)
    capsys.readouterr()
    results = benchmark.main([*run, "--batch_size", str(batch)])
    line = capsys.readouterr().err
    left = sum(counts[name] for name in small)
    assert f"note: --aspect_buckets: {len(small)} bucket folder(s) hold fewer samples an epoch than one global " \
           f"batch of {batch} (--batch_size): " in line and all(f"{name} ({counts[name]})" in line for name in small)
    assert f"left out of training, {left:,} of {NUM_PHOTOS:,} samples" in line
    assert set(results["images_per_bucket"]) == set(counts) - set(small)
    # Larger than every bucket: refused before training, saying what the data holds.
    message = error_of(benchmark.main, [*run, "--batch_size", str(max(counts.values()) + 1)])
    assert f"no bucket folder holds one global batch of {max(counts.values()) + 1} samples an epoch" in message
    assert "use more data or a smaller --batch_size" in message


def test_latents_of_other_buckets_and_unsorted_data_are_refused_in_one_line(bucketed_latents, flat_shards, tmp_path):
    tmp, listed = bucketed_latents
    local = ["--model_config", "sdxl-tiny", "--precomputed", "--local", str(tmp / "lat"), "--batch_size", "2",
             "--max_duration", "1ba"]
    message = error_of(benchmark.main, [*local, "--aspect_buckets"])
    assert "--aspect_buckets default: the latents were stored in other buckets" in message
    assert "3 buckets, 96x40 ... 40x96" in message and "this run: 11 buckets" in message
    message = error_of(benchmark.main, local)
    assert "is sorted into aspect-ratio bucket folders (buckets.json): train on it with --aspect_buckets" in message
    message = error_of(latents.main, ["--model_config", "tiny", "--local", str(tmp / "mds"), "--out",
                                      str(tmp_path / "sd2"), "--aspect_buckets"], prog="latents.py")
    assert "--aspect_buckets does not apply to --model_config tiny: SD2 trains on squares" in message
    # Images converted without buckets, and latents of the per-sample bucket column before bucket folders: one
    # line naming the command that sorts them.
    message = error_of(benchmark.main, [*XL, "--local", str(flat_shards), "--batch_size", "4", "--max_duration", "1ba"])
    assert f"--local {flat_shards} holds images not sorted into aspect-ratio buckets" in message
    assert "sort it once with `python sort_buckets.py" in message
    old = tmp_path / "old"
    sorted_parts = {RECORD_FILE, *(folder.folder for folder in read_record(tmp / "lat").folders)}
    shutil.copytree(tmp / "lat", old, ignore=lambda folder, names: [name for name in names if name in sorted_parts])
    message = error_of(benchmark.main, [*local[:3], "--local", str(old), *local[5:], "--aspect_buckets", str(listed)])
    assert "holds latents stored with a per-sample bucket column by an older latents.py" in message
    assert "sort it once with `python sort_buckets.py" in message
    # ... and sort_buckets.py sorts them into what latents.py writes now.
    sort_buckets.main([str(old), "--out", str(tmp_path / "sorted"), "--workers", "1", "--no_progress"])
    assert read_record(tmp_path / "sorted") == read_record(tmp / "lat")


@pytest.mark.multirank  # forks the killed sort
def test_sort_buckets_sorts_images_once_and_resumes_after_a_kill(flat_shards, shards, tmp_path, capsys):
    out = tmp_path / "sorted"
    argv = [str(flat_shards), "--out", str(out), "--image_size", "64", "--no_progress", "--size_limit", "16kb"]
    # SIGKILLed as it marks the third input shard done: two are kept, the rest is redone.
    killed_in_child(lambda: sort_buckets.main([*argv, "--workers", "1"]), "replace", "s00002.partial")
    assert not (out / RECORD_FILE).exists()
    capsys.readouterr()
    report = sort_buckets.main([*argv, "--workers", "2"])
    assert "resuming: 2 of" in capsys.readouterr().err and report["resumed_shards"] == 2
    assert read_record(out) == read_record(shards)  # convert.py --aspect_buckets' folders, the same counts
    assert sorted(os.listdir(out)) == sorted([RECORD_FILE, *(f.folder for f in read_record(shards).folders)])
    message = error_of(sort_buckets.main, argv, prog="sort_buckets.py")
    assert "is not empty" in message


# -----------------------------------------------------------------------------------------------
# Resuming with settings that decide the samples of a step (t2ibench.train.data_order): refused mid-epoch,
# with a note at an epoch's start.
# -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_mid_epoch(shards, tmp_path_factory) -> tuple[list[str], Path]:
    """The flags of a run of a three-bucket list that saved a checkpoint 2 batches into an epoch of 16, and
    its folder."""
    tmp = tmp_path_factory.mktemp("bucket-saved")
    listed = tmp / "three.txt"
    listed.write_text("96x40\n40x96\n64x64\n")
    run = [*XL, str(listed), "--local", str(copy_of(shards, tmp / "mds")), "--batch_size", "4", "--num_workers", "0",
           "--save_folder", str(tmp / "ckpt"), "--save_interval", "2ba", "--run_name", "order"]
    benchmark.main([*run, "--max_duration", "2ba"])
    return run, tmp


@pytest.mark.parametrize("change, expected", [
    (["--batch_size", "8", "--bucket_crop", "center", "--image_size", "72"],
     "--batch_size 4 then, 8 now; --image_size 64 then, 72 now; --bucket_crop random then, center now"),
    (["--aspect_buckets"], "--aspect_buckets 96x40,64x64,40x96 then, 11 buckets, 128x32 ... 32x128 now"),
])  # the flag left out: the bucket folders are refused first (test_latents_of_other_buckets_..._refused)
@pytest.mark.slow
def test_a_mid_epoch_resume_that_would_change_the_samples_of_a_step_is_refused_in_one_line(saved_mid_epoch, change,
                                                                                            expected):
    run, tmp = saved_mid_epoch
    saved = sorted(os.listdir(tmp / "ckpt"))
    message = error_of(benchmark.main, [*run, *change, "--max_duration", "4ba", "--autoresume"])
    assert f"{expected}: the checkpoint stopped mid-epoch (epoch 0, after its batch 2), so the rest of the epoch " \
           "would repeat some of its samples and skip others; resume with the checkpoint's values, from a checkpoint " \
           "saved at an epoch's start (--save_interval in ep), or start a new run" in message, message
    assert sorted(os.listdir(tmp / "ckpt")) == saved  # refused before any batch: nothing trained or saved


def test_a_seed_other_than_the_checkpoints_is_refused_even_at_an_epochs_start(saved_mid_epoch):
    run, _ = saved_mid_epoch
    message = error_of(benchmark.main, [*run, "--seed", "18", "--max_duration", "4ba", "--autoresume"])
    assert "--seed 17 then, 18 now: Composer and Streaming resume with the checkpoint's seed; resume with the " \
           "checkpoint's values or start a new run" in message


SYNTHETIC_DEFAULT_LIST = ["--model_config", "sdxl-tiny", "--seed", "17", "--use_synth_data", "--aspect_buckets",
                          "--num_workers", "0", "--num_synthetic_samples", "8", "--batch_size", "4",
                          "--warmup_batches", "0"]


@pytest.fixture(scope="module")
def saved_at_an_epochs_start(tmp_path_factory) -> Path:
    """The folder of a synthetic run of the default list (11 buckets at 64) that saved ep1-ba2-rank0.pt,
    at epoch 1's start (epochs of 2 batches)."""
    folder = tmp_path_factory.mktemp("bucket-epoch-start") / "ckpt"
    benchmark.main([*SYNTHETIC_DEFAULT_LIST, "--save_folder", str(folder), "--run_name", "weights",
                    "--max_duration", "1ep", "--save_interval", "1ep"])
    return folder


@pytest.mark.slow
def test_synthetic_bucket_weights_change_at_an_epochs_start_saying_so_and_are_refused_mid_epoch(
        saved_at_an_epochs_start, tmp_path, capsys):
    run = SYNTHETIC_DEFAULT_LIST
    shutil.copytree(saved_at_an_epochs_start, tmp_path / "ckpt", symlinks=True)
    saving = ["--save_folder", str(tmp_path / "ckpt"), "--run_name", "weights", "--autoresume"]
    capsys.readouterr()
    resumed = benchmark.main([*run, *saving, "--synthetic_bucket_weights", "64x64=1", "--max_duration", "3ba",
                              "--save_interval", "1ba"])
    assert "note: resuming at the start of epoch 1 with --synthetic_bucket_weights uniform then, 64x64=1 now: the " \
           "new values decide this epoch's samples from its first" in capsys.readouterr().err
    assert resumed["images_per_bucket"] == {"64x64": 4}  # the new weights drew batch 3
    # ep1-ba3-rank0.pt, mid-epoch: the weights it drew with, or none.
    message = error_of(benchmark.main, [*run, *saving, "--max_duration", "4ba"])
    assert "--synthetic_bucket_weights 64x64=1 then, uniform now: the checkpoint stopped mid-epoch (epoch 1, after " \
           "its batch 1)" in message
    # A checkpoint saved before the data order was recorded (issue 45): what it holds is compared, the rest named.
    legacy = tmp_path / "legacy.pt"
    checkpoint = torch.load(tmp_path / "ckpt" / "ep1-ba3-rank0.pt", map_location="cpu", weights_only=False)
    del checkpoint["state"]["callbacks"]["RunRecord"]["data_order"]
    torch.save(checkpoint, legacy)
    square = [flag for flag in run if flag != "--aspect_buckets"]
    message = error_of(benchmark.main, [*square, "--load_path", str(legacy), "--max_duration", "4ba"])
    assert "--aspect_buckets 11 buckets, 128x32 ... 32x128 then, none (square) now: the checkpoint stopped mid-epoch" \
           in message
    benchmark.main([*run, "--load_path", str(legacy), "--max_duration", "4ba"])
    assert "note: the checkpoint resumed mid-epoch was saved before checkpoints recorded the data order: " \
           "--use_synth_data, --seed, --batch_size, --num_synthetic_samples, --synthetic_bucket_weights cannot be " \
           "compared" in capsys.readouterr().err


@pytest.mark.parametrize("recorded, expected", [
    ("64x64", "its recorded aspect_buckets is '64x64', not a list of HEIGHTxWIDTH names"),  # was an AttributeError
    (["64x64", "8x99999992"], "its recorded aspect_buckets holds '8x99999992', not HEIGHTxWIDTH in pixels, each side "
                              "1 to 16,384"),  # was exported into aspect_buckets.txt
])
def test_export_checks_the_recorded_bucket_list_by_the_rules_of_aspect_buckets(saved_at_an_epochs_start, tmp_path,
                                                                               recorded, expected):
    import export

    checkpoint = torch.load(saved_at_an_epochs_start / "ep1-ba2-rank0.pt", map_location="cpu", weights_only=False)
    checkpoint["state"]["callbacks"]["RunRecord"]["aspect_buckets"] = recorded
    edited = tmp_path / "edited.pt"
    torch.save(checkpoint, edited)
    message = error_of(export.main, [str(edited), "--out", str(tmp_path / "out")], prog="export.py")
    assert f"CHECKPOINT {edited}: {expected}" in message and "nothing was written" in message, message
    assert not (tmp_path / "out").exists()
