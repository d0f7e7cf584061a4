"""sdxl-tiny end to end on CPU: real image shards of several sizes (so the size/crop ids vary) trained
online on two ranks through Composer's launcher, with caption dropout, EMA, a sample grid and both
exports loaded by StableDiffusionXLPipeline; the same run SIGKILLed and resumed to the uninterrupted
run's weights, EMA and loss; latents.py in both formats with the size/crop columns, and training
from them."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import benchmark
import data
import export
import latents
from t2ibench.families import MODEL_CONFIGS
from t2ibench.datasets.precomputed import mds_columns
from tests.helpers import Launch, kill_and_resume, two_ranks

FAMILY = MODEL_CONFIGS["sdxl-tiny"]
SIZES = [(96, 64), (64, 96), (80, 80), (200, 120)]  # (width, height): landscape, portrait, square, wide
NUM_SAMPLES = 16
CAPTIONS = ["a red square", "a blue circle", "a green triangle", "a yellow star"]
XL = ["--model_config", "sdxl-tiny", "--num_workers", "0", "--seed", "17", "--warmup_batches", "1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """16 JPEG image-caption pairs of four sizes, as convert.py's columns."""
    from PIL import Image
    from streaming import MDSWriter

    out = tmp_path_factory.mktemp("xl-source") / "mds"
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(out), columns={"jpg": "bytes", "caption": "str", "key": "str"}, size_limit=30_000) as writer:
        for i in range(NUM_SAMPLES):
            width, height = SIZES[i % len(SIZES)]
            buffer = io.BytesIO()
            Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(buffer, format="JPEG")
            writer.write({"jpg": buffer.getvalue(), "caption": CAPTIONS[i % len(CAPTIONS)], "key": f"{i:03d}"})
    return out


def copy_of(shards: Path, where: Path) -> Path:
    """A private copy of the shards (Streaming decompresses next to what it reads; one live dataset per folder)."""
    shutil.copytree(shards, where)
    return where


# -----------------------------------------------------------------------------------------------
# Two ranks, one killed and resumed.
# -----------------------------------------------------------------------------------------------

RESUME = XL + ["--batch_size", "4", "--max_duration", "4ba", "--save_interval", "2ba", "--use_ema",
               "--caption_drop_prob", "0.5", "--run_name", "xl-resume", "--autoresume", "--log_interval", "1ba"]
# 16 samples, 4 a batch (2 per rank): an epoch of 4 batches, killed in its middle, after batch 2.
KILL_AFTER = "ep0-ba2-rank0.pt"


@pytest.fixture(scope="module")
def two_rank_runs(shards, tmp_path_factory) -> SimpleNamespace:
    """A reference run and a run SIGKILLed after its batch-2 checkpoint, then relaunched with --autoresume."""
    tmp = tmp_path_factory.mktemp("xl-resume")

    def launch(name: str, folder: str) -> Launch:
        data_dir = tmp / f"{folder}-data"
        if not data_dir.exists():
            copy_of(shards, data_dir)
        # The reference also draws a sample grid and exports its EMA as a pipeline at the end: what
        # the run without them computes must not change (the resumed run's weights are compared).
        extra = ["--sample_prompts", "shapes", "--sample_steps", "2", "--sample_interval", "4ba",
                 "--ema_export_dir", str(tmp / "ema-pipeline")] if name == "reference" else []
        args = RESUME + extra + ["--local", str(data_dir), "--save_folder", str(tmp / folder),
                                 "--results_json", str(tmp / f"{name}.json")]
        return Launch(two_ranks("benchmark.py", *args), tmp / f"{name}.log")

    return SimpleNamespace(tmp=tmp, **kill_and_resume(launch, tmp / "killed", KILL_AFTER))


# -----------------------------------------------------------------------------------------------
# One rank, in this process.
# -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def precomputed(shards, tmp_path_factory):
    """latents.py over the shards for sdxl-tiny, in the tokens and the text_states formats."""
    tmp = tmp_path_factory.mktemp("xl-latents")
    common = ["--model_config", "sdxl-tiny", "--batch_size", "4", "--chunk_size", "8", "--num_workers", "0",
              "--seed", "17", "--no_progress"]
    reports = {}
    for fmt, extra in (("tokens", []), ("text_states", ["--store_text_states"])):
        reports[fmt] = latents.main(["--local", str(copy_of(shards, tmp / f"src-{fmt}")), "--out", str(tmp / fmt),
                                     *common, *extra])
    return tmp, reports


def test_latents_store_each_image_size_and_crop_and_both_encoders_outputs(precomputed, shards):
    from streaming import StreamingDataset

    tmp, reports = precomputed
    raw = StreamingDataset(local=str(copy_of(shards, tmp / "raw")), batch_size=1, shuffle=False)
    widths = FAMILY.conditioning_shapes("sdxl-tiny")
    for fmt, report in reports.items():
        assert report["samples"] == NUM_SAMPLES and report["format"] == fmt
        stored = StreamingDataset(local=str(tmp / fmt), batch_size=1, shuffle=False)
        by_index = {int(s["index"]): s for s in (stored[i] for i in range(stored.num_samples))}
        for i in range(NUM_SAMPLES):
            _, geometry = data.decode_image_with_geometry(raw[i]["jpg"], 64)
            width, height = SIZES[i % len(SIZES)]
            assert by_index[i]["original_size"].tolist() == [height, width]
            assert by_index[i]["crop_top_left"].tolist() == [geometry.crop_top, geometry.crop_left]
        if fmt == "text_states":
            assert {k: tuple(by_index[0][k].shape) for k in widths} == widths
        else:
            assert by_index[0]["token_ids"].shape == (77,)
    assert [tuple(by_index[i]["crop_top_left"]) for i in range(4)] == [(0, 16), (16, 0), (0, 0), (0, 21)]


@pytest.mark.parametrize("fmt", ["tokens", "text_states"])
@pytest.mark.slow
def test_benchmark_trains_sdxl_on_precomputed_latents(precomputed, tmp_path, fmt):
    tmp, _ = precomputed
    save = ["--save_folder", str(tmp_path / "run"), "--save_interval", "1ba"] if fmt == "text_states" else []
    results = benchmark.main(XL + ["--precomputed", "--local", str(copy_of(tmp / fmt, tmp_path / "latents")),
                                   "--batch_size", "4", "--max_duration", "1ba", "--caption_drop_prob", "0.5", *save])
    flops = FAMILY.flops_per_image("sdxl-tiny", 64, vae=False, text_encoders=fmt == "tokens")
    assert results["precomputed_format"] == fmt and results["flops_per_image"] == pytest.approx(flops["total"])
    assert np.isfinite(results["final_loss"])
    if fmt == "text_states":  # no encoder in the step: export rebuilds them as latents.py did (--seed)
        out = export.main([str(tmp_path / "run" / "ep0-ba1-rank0.pt"), "--out", str(tmp_path / "pipe")])
        assert (out / "text_encoder_2" / "config.json").is_file() and (out / "tokenizer_2").is_dir()


def test_precomputed_sd2_latents_are_refused_for_sdxl(tmp_path):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "sd2"), columns=mds_columns(4, 8, None)) as writer:
        writer.write({"index": 0, "latent_mean": np.zeros((4, 8, 8), np.float16),
                      "latent_logvar": np.zeros((4, 8, 8), np.float16), "token_ids": np.zeros(77, np.uint16),
                      "caption": "c"})
    with pytest.raises(SystemExit, match="without original_size, crop_top_left, which --model_config sdxl-tiny"):
        benchmark.main(XL + ["--precomputed", "--local", str(tmp_path / "sd2"), "--batch_size", "1",
                             "--max_duration", "1ba"])


# -----------------------------------------------------------------------------------------------
# The two-rank runs' results.
# -----------------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_two_ranks_resume_after_sigkill_to_the_uninterrupted_weights_ema_and_loss(two_rank_runs):
    runs = two_rank_runs
    reference, killed, resumed = runs.reference, runs.killed, runs.resumed
    assert reference.proc.returncode == 0, reference.output()[-4000:]
    assert killed.proc.returncode == -signal.SIGKILL
    assert resumed.proc.returncode == 0, resumed.output()[-4000:]
    assert "batch 3/4 " in resumed.output() and "batch 1/4 " not in resumed.output()
    final = os.readlink(runs.tmp / "reference" / "latest-rank0.pt")
    assert "-ba4-" in final and os.readlink(runs.tmp / "killed" / "latest-rank0.pt") == final
    ref = torch.load(runs.tmp / "reference" / final, map_location="cpu", weights_only=False)["state"]
    res = torch.load(runs.tmp / "killed" / final, map_location="cpu", weights_only=False)["state"]
    assert ref["model"].keys() == res["model"].keys()
    assert all(torch.equal(ref["model"][k], res["model"][k]) for k in ref["model"]), "weights differ"
    ema_ref, ema_res = dict(ref["algorithms"])["EMA"]["shadow"], dict(res["algorithms"])["EMA"]["shadow"]
    assert all(torch.equal(ema_ref[k], ema_res[k]) for k in ema_ref), "EMA differs"
    summary = [json.loads((runs.tmp / f"{name}.json").read_text()) for name in ("reference", "resumed")]
    assert summary[0]["world_size"] == 2 and summary[0]["final_loss"] == summary[1]["final_loss"]
    assert {k.split(".")[0] for k in ref["model"]} == {"unet", "vae", "text_encoder", "text_encoder_2"}


@pytest.mark.multirank
def test_reference_run_samples_and_its_ema_loads_as_an_sdxl_pipeline(two_rank_runs, monkeypatch, tmp_path):
    from diffusers import StableDiffusionXLPipeline
    from PIL import Image

    runs = two_rank_runs
    results = json.loads((runs.tmp / "reference.json").read_text())
    assert results["model_config"] == "sdxl-tiny" and results["image_size"] == 64  # sdxl-tiny's default size
    assert results["flops_per_image"] == pytest.approx(FAMILY.flops_per_image("sdxl-tiny", 64)["total"])
    assert results["random_parts"] == ["vae", "text_encoder", "text_encoder_2"] and np.isfinite(results["final_loss"])
    assert Image.open(runs.tmp / "reference" / "samples" / "4.png").size == (3 * 64, 3 * 64)  # 8 prompts, 3 a row
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipeline = StableDiffusionXLPipeline.from_pretrained(runs.tmp / "ema-pipeline")
    image = pipeline("a red square", num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    # export.py: the same EMA weights from the final checkpoint, recognised as sdxl-tiny.
    final = runs.tmp / "reference" / os.readlink(runs.tmp / "reference" / "latest-rank0.pt")
    exported = StableDiffusionXLPipeline.from_pretrained(export.main([str(final), "--out", str(tmp_path / "x"), "--ema"]))
    for a, b in zip(exported.unet.state_dict().values(), pipeline.unet.state_dict().values()):
        assert torch.equal(a, b)
    assert exported.tokenizer.pad_token == "<|endoftext|>" and exported.tokenizer_2.pad_token == "!"
