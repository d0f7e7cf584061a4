"""Precomputed latents end to end on CPU: encode MDS image-caption shards with the tiny model (one and
two ranks), check the stored values against the encoders, resume an interrupted run, and train
benchmark.py --precomputed on synthetic and on precomputed data."""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import data  # noqa: E402
from model import scale_images  # noqa: E402
import latents  # noqa: E402

NUM_SAMPLES, BAD_INDEX, IMAGE_SIZE, CHUNK, SEED = 20, 7, 64, 6, 17
NUM_CHUNKS = -(-NUM_SAMPLES // CHUNK)  # 4: 6 + 6 + 6 + 2 samples
GOOD = [i for i in range(NUM_SAMPLES) if i != BAD_INDEX]
PRECOMPUTE = ["--model_config", "tiny", "--image_size", str(IMAGE_SIZE), "--batch_size", "4", "--chunk_size",
              str(CHUNK), "--num_workers", "0", "--seed", str(SEED), "--no_progress"]


def offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def precompute(source: Path, out: Path, *extra: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    return run((launcher or [sys.executable]) + [str(ROOT / "latents.py"), "--local", str(source), "--out", str(out),
                                                 *PRECOMPUTE, *extra])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_samples(out: Path) -> dict[int, dict]:
    """All samples of a precomputed dataset, by source index."""
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(out), batch_size=1, shuffle=False)
    samples = [dataset[i] for i in range(dataset.num_samples)]
    by_index = {int(s["index"]): s for s in samples}
    assert len(by_index) == len(samples), "a sample was written twice"
    return by_index


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """20 JPEG image-caption pairs (non-square, so they are cropped) in several MDS shards; sample 7 is corrupt."""
    from PIL import Image
    from streaming import MDSWriter

    out = tmp_path_factory.mktemp("source") / "mds"
    rng = np.random.default_rng(0)
    columns = {"jpg": "bytes", "caption": "str", "key": "str"}  # what convert.py writes
    with MDSWriter(out=str(out), columns=columns, compression="zstd", size_limit=20_000) as writer:
        for i in range(NUM_SAMPLES):
            height, width = (64, 80) if i % 2 else (72, 64)
            pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            image = b"not an image" if i == BAD_INDEX else buffer.getvalue()
            writer.write({"jpg": image, "caption": f"a photo of thing number {i}", "key": f"{i:03d}"})
    return out


@pytest.fixture(scope="module")
def single(source, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("single") / "latents"
    result = precompute(source, out)
    return out, result.stdout


@pytest.fixture(scope="module")
def reference(source):
    """The tiny encoders exactly as latents.py and benchmark.py build them (seeded, then built)."""
    from composer.utils import reproducibility
    from streaming import StreamingDataset

    from model import build_components

    reproducibility.seed_all(SEED)
    parts = build_components("tiny")
    raw = StreamingDataset(local=str(source), batch_size=1, shuffle=False)
    return parts, [raw[i] for i in range(NUM_SAMPLES)]


def test_sizes_and_columns():
    assert data.bytes_per_sample(512, 1024) == 2 * 4 * 64 * 64 * 2 + 77 * 1024 * 2 + 8 == 223_240
    assert data.bytes_per_sample(512, 1024, "fp32") == 2 * 4 * 64 * 64 * 4 + 77 * 1024 * 4 + 8
    columns = data.mds_columns(4, 64, 1024)
    assert columns["latent_mean"] == "ndarray:float16:4,64,64" and columns["text_states"] == "ndarray:float16:77,1024"
    assert "caption" not in data.mds_columns(4, 64, 1024, captions=False)


def test_precompute_stores_every_sample_once_as_the_encoders_compute_it(single, reference):
    import data
    from tokenizer import tokenize

    out, stdout = single
    assert sorted(p.name for p in out.glob("chunk*")) == [latents.chunk_name(k) for k in range(NUM_CHUNKS)]
    assert (out / "index.json").is_file() and (out / "precompute.json").is_file()
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["samples"] == NUM_SAMPLES - 1 and report["skipped"] == 1 and report["images_per_sec"] > 0
    samples = read_samples(out)
    assert sorted(samples) == GOOD  # every decodable sample exactly once, the corrupt one left out

    parts, raw = reference
    for index, sample in samples.items():
        assert sample["caption"] == raw[index]["caption"]
        assert sample["latent_mean"].dtype == np.float16 and sample["latent_mean"].shape == (4, 8, 8)
        assert sample["latent_logvar"].shape == (4, 8, 8) and sample["text_states"].shape == (77, 64)
        image = scale_images(data.decode_image(raw[index]["jpg"], IMAGE_SIZE))[None]
        with torch.no_grad():
            posterior = parts.vae.encode(image).latent_dist
            text_states = parts.text_encoder(tokenize(parts.tokenizer, [raw[index]["caption"]]))[0][0]
        for key, expected in (("latent_mean", posterior.mean[0]), ("latent_logvar", posterior.logvar[0]),
                              ("text_states", text_states)):
            stored = torch.from_numpy(sample[key].astype(np.float32))
            torch.testing.assert_close(stored, expected, rtol=1e-3, atol=1e-3)  # fp16 keeps 11 bits


def test_two_ranks_store_every_sample_exactly_once(source, single, tmp_path):
    out = tmp_path / "latents"
    launcher = ["composer", "-n", "2", "--master_port", str(free_port())]
    result = precompute(source, out, launcher=launcher)
    assert "over 2 rank(s)" in result.stdout
    samples, expected = read_samples(out), read_samples(single[0])
    assert sorted(samples) == GOOD
    for index in GOOD:
        for key in data.LATENT_KEYS:
            np.testing.assert_allclose(samples[index][key].astype(np.float32),
                                       expected[index][key].astype(np.float32), rtol=1e-3, atol=1e-3)


def test_interrupted_run_resumes_and_skips_complete_chunks(source, single, tmp_path, capsys):
    out = tmp_path / "latents"
    shutil.copytree(single[0], out)
    # A crash: chunk 3 never started, chunk 1 has shards but no index.json, nothing merged yet.
    shutil.rmtree(out / latents.chunk_name(3))
    (out / latents.chunk_name(1) / "index.json").unlink()
    (out / "index.json").unlink()
    kept = {p: p.stat().st_mtime_ns for k in (0, 2) for p in (out / latents.chunk_name(k)).iterdir()}

    # Stops again after one chunk (chunk 1). In this process, to save a start-up; the CLI follows.
    report = latents.main(["--local", str(source), "--out", str(out), *PRECOMPUTE, "--max_chunks", "1"])
    first = capsys.readouterr().out
    assert "2 already complete, 2 to do" in first and "1 of 4 chunk(s) left" in first
    assert report["written_this_run"] == CHUNK - 1 and report["skipped_this_run"] == 1  # sample 7 is in chunk 1
    assert report["chunks_left"] == 1
    assert not (out / "index.json").exists() and (out / latents.chunk_name(1) / "index.json").is_file()
    second = precompute(source, out)
    assert "3 already complete, 1 to do" in second.stdout and "done: 19 of 20 samples" in second.stdout
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # complete chunks were not rewritten

    samples, expected = read_samples(out), read_samples(single[0])
    assert sorted(samples) == GOOD
    for index in GOOD:
        for key in data.LATENT_KEYS:
            np.testing.assert_array_equal(samples[index][key], expected[index][key])


def test_other_settings_are_refused(single):
    existing = json.loads((single[0] / "precompute.json").read_text())
    assert latents.check_settings(existing, dict(existing)) is None
    assert latents.check_settings(None, existing) is None
    problem = latents.check_settings(existing, {**existing, "chunk_size": 5, "image_size": 128})
    assert "chunk_size" in problem and "image_size" in problem and "--overwrite" in problem


@pytest.mark.parametrize("storage, bad, error", [
    ("fp16", 1e5, OverflowError), ("fp32", 1e5, None), ("fp16", float("nan"), FloatingPointError),
    ("fp32", float("inf"), FloatingPointError)])
def test_values_that_cannot_be_stored_stop_the_run(storage, bad, error):
    mean, logvar, text = torch.zeros(3, 4, 8, 8), torch.zeros(3, 4, 8, 8), torch.zeros(3, 77, 16)
    mean[1, 2, 3, 4] = bad
    encoded = latents.Encoded([10, 11, 12], ["a", "b", "c"], (mean, logvar, text), storage, torch.device("cpu"))
    if error is None:
        arrays, ranges = encoded.arrays(storage, "fp32")
        assert arrays[0].dtype == np.float32 and ranges[0] == bad
        return
    with pytest.raises(error, match=r"latent_mean of samples \[11\]"):
        encoded.arrays(storage, "fp32")


def test_training_dataset_reads_the_shards_and_checks_their_shapes(single):
    loader = data.latents_dataloader(synthetic=False, remote=None, local=str(single[0]), image_size=IMAGE_SIZE, text_dim=64,
                                batch_size_per_device=4, num_workers=0, seed=SEED)
    batch = next(iter(loader))
    assert set(batch) == set(data.LATENT_KEYS)
    assert batch["latent_mean"].shape == batch["latent_logvar"].shape == (4, 4, 8, 8)
    assert batch["text_states"].shape == (4, 77, 64) and batch["latent_mean"].dtype == torch.float16
    with pytest.raises(ValueError, match="64x64 images, not 128x128"):
        data.StreamingLatents(remote=None, local=str(single[0]), batch_size=4, image_size=128)
    with pytest.raises(ValueError, match="another text encoder"):
        data.StreamingLatents(remote=None, local=str(single[0]), batch_size=4, text_dim=1024)


def test_synthetic_latents_are_deterministic_and_shaped_like_the_shards():
    dataset = data.SyntheticLatents(image_size=64, text_dim=32, num_samples=10, seed=3)
    a, b = dataset[4], dataset[4]
    assert all(torch.equal(a[k], b[k]) for k in data.LATENT_KEYS)
    assert not torch.equal(a["latent_mean"], dataset[5]["latent_mean"])
    loader = data.latents_dataloader(synthetic=True, remote=None, local=None, image_size=64, text_dim=32,
                                batch_size_per_device=4, num_workers=0, num_samples=10, seed=3)
    batches = list(loader)
    assert len(batches) == 2  # drop_last
    assert batches[0]["latent_mean"].shape == (4, 4, 8, 8) and batches[0]["text_states"].shape == (4, 77, 32)
    assert batches[0]["text_states"].dtype == torch.float16


@pytest.mark.parametrize("data_source", ["synthetic", "shards"])
def test_benchmark_trains_on_precomputed_latents(single, tmp_path, data_source):
    from model import sd2_meta_components
    from throughput import count_flops_per_image

    results = tmp_path / "results.json"
    shards = tmp_path / "latents"  # a copy: Streaming decompresses shards next to the ones it reads
    if data_source == "shards":
        shutil.copytree(single[0], shards)
    where = ["--use_synth_data"] if data_source == "synthetic" else ["--local", str(shards)]
    argv = ["--precomputed", "--model_config", "tiny", *where, "--image_size", str(IMAGE_SIZE), "--batch_size", "4",
            "--max_duration", "2ba", "--num_workers", "0", "--warmup_batches", "1", "--results_json", str(results)]
    if data_source == "synthetic":  # in this process (saves a start-up)
        import benchmark

        benchmark.main(argv)
    else:  # the command line, end to end
        run([sys.executable, str(ROOT / "benchmark.py"), *argv])
    r = json.loads(results.read_text())
    online = count_flops_per_image(*sd2_meta_components("tiny"), IMAGE_SIZE)
    assert r["precomputed"] is True and r["images_per_sec"] > 0 and r["measured_batches"] == 1
    assert r["flops_per_image"] == pytest.approx(online["unet_fwd_bwd"]) and r["flops_per_image"] < online["total"]
    assert r["data"] == ("synthetic" if data_source == "synthetic" else str(shards))
    assert np.isfinite(r["final_loss"])
