"""Precomputed latents end to end on CPU: encode MDS image-caption shards with the tiny model (one and
two ranks), check the stored values against the encoders, resume an interrupted run, and train
benchmark.py --precomputed on synthetic and on precomputed data."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from composer.core import Callback

import data
from t2ibench.commands import latent_encoding, latent_store
from t2ibench.datasets import precomputed
from t2ibench.core.locations import cache_folder
from t2ibench.train.model import scale_images
from t2ibench.datasets.sources import parse_sources
import latents
from tests import preloaded
from tests.helpers import ROOT, composer_launcher, offline_env

NUM_SAMPLES, BAD_INDEX, IMAGE_SIZE, CHUNK, SEED = 20, 7, 64, 6, 17
NUM_CHUNKS = -(-NUM_SAMPLES // CHUNK)  # 4: 6 + 6 + 6 + 2 samples
GOOD = [i for i in range(NUM_SAMPLES) if i != BAD_INDEX]
PRECOMPUTE = ["--model_config", "tiny", "--image_size", str(IMAGE_SIZE), "--batch_size", "4", "--chunk_size",
              str(CHUNK), "--num_workers", "0", "--seed", str(SEED), "--no_progress"]


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    result = preloaded.run(cmd, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def precompute(source: Path, out: Path, *extra: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    return run((launcher or [sys.executable]) + [str(ROOT / "latents.py"), "--local", str(source), "--out", str(out),
                                                 *PRECOMPUTE, *extra])


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
def states(source, tmp_path_factory) -> tuple[Path, str]:
    """The same source precomputed with --store_text_states (the text encoder's output stored)."""
    out = tmp_path_factory.mktemp("states") / "latents"
    result = precompute(source, out, "--store_text_states")
    return out, result.stdout


@pytest.fixture(scope="module")
def reference(source):
    """The tiny encoders exactly as latents.py and benchmark.py build them (seeded, then built)."""
    from composer.utils import reproducibility
    from streaming import StreamingDataset

    from t2ibench.families import MODEL_CONFIGS

    reproducibility.seed_all(SEED)
    parts = MODEL_CONFIGS["tiny"].build("tiny")
    raw = StreamingDataset(local=str(source), batch_size=1, shuffle=False)
    return parts, [raw[i] for i in range(NUM_SAMPLES)]


def test_sizes_and_columns():
    assert precomputed.bytes_per_sample(512, 1024) == 2 * 4 * 64 * 64 * 2 + 77 * 2 + 8 == 65_698
    assert precomputed.bytes_per_sample(512, 1024, text_states=True) == 2 * 4 * 64 * 64 * 2 + 77 * 1024 * 2 + 8 == 223_240
    assert precomputed.bytes_per_sample(512, 1024, "fp32", text_states=True) == 2 * 4 * 64 * 64 * 4 + 77 * 1024 * 4 + 8
    columns = precomputed.mds_columns(4, 64, 1024)
    assert columns["latent_mean"] == "ndarray:float16:4,64,64" and columns["token_ids"] == "ndarray:uint16:77"
    assert "text_states" not in columns and precomputed.text_format(list(columns)) == "tokens"
    states = precomputed.mds_columns(4, 64, 1024, text_states=True)
    assert states["text_states"] == "ndarray:float16:77,1024" and "token_ids" not in states
    assert precomputed.text_format(list(states)) == "text_states" and precomputed.text_format(["jpg", "caption"]) is None
    assert "caption" not in precomputed.mds_columns(4, 64, 1024, captions=False)


@pytest.mark.parametrize("fmt", ["tokens", "text_states"])
def test_precompute_stores_every_sample_once_as_the_encoders_compute_it(single, states, reference, fmt):
    import data
    from t2ibench.core.tokenizer import tokenize

    out, stdout = single if fmt == "tokens" else states
    assert sorted(p.name for p in out.glob("chunk*")) == [latent_store.chunk_name(k) for k in range(NUM_CHUNKS)]
    assert (out / "index.json").is_file() and (out / "precompute.json").is_file()
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["samples"] == NUM_SAMPLES - 1 and report["skipped"] == 1 and report["images_per_sec"] > 0
    # The final report: bytes per sample (arrays + index + caption + MDS offsets) and the projection.
    expected_raw = precomputed.bytes_per_sample(IMAGE_SIZE, 64, text_states=fmt == "text_states")
    assert report["format"] == fmt and expected_raw < report["bytes_per_sample_raw"] < expected_raw + 150
    assert report["projected_tb_stored"] == pytest.approx(report["bytes_per_sample_stored"] * 2_867_200_000 / 1e12, abs=0.01)
    assert f"2,867,200,000 such samples: {report['projected_tb_stored']:,} TB" in stdout
    full_shard = 256 * 2**20 // report["bytes_per_sample_raw"]  # samples in a full shard of the default 256mb
    assert report["projected_shards"] == pytest.approx(2_867_200_000 / full_shard, rel=0.01)
    samples = read_samples(out)
    assert sorted(samples) == GOOD  # every decodable sample exactly once, the corrupt one left out

    parts, raw = reference
    for index, sample in samples.items():
        assert sample["caption"] == raw[index]["caption"]
        assert sample["latent_mean"].dtype == np.float16 and sample["latent_mean"].shape == (4, 8, 8)
        assert sample["latent_logvar"].shape == (4, 8, 8)
        image = scale_images(data.decode_image(raw[index]["jpg"], IMAGE_SIZE))[None]
        ids = tokenize(parts.tokenizer, [raw[index]["caption"]])
        with torch.no_grad():
            posterior = parts.vae.encode(image).latent_dist
            text_states = parts.text_encoder(ids)[0][0]
        expected = {"latent_mean": posterior.mean[0], "latent_logvar": posterior.logvar[0]}
        if fmt == "tokens":
            assert "text_states" not in sample and sample["token_ids"].dtype == np.uint16
            np.testing.assert_array_equal(sample["token_ids"].astype(np.int64), ids[0].numpy())
        else:
            assert "token_ids" not in sample and sample["text_states"].shape == (77, 64)
            expected["text_states"] = text_states
        for key, value in expected.items():
            stored = torch.from_numpy(sample[key].astype(np.float32))
            torch.testing.assert_close(stored, value, rtol=1e-3, atol=1e-3)  # fp16 keeps 11 bits


@pytest.mark.multirank
def test_two_ranks_store_every_sample_exactly_once(source, single, tmp_path):
    out = tmp_path / "latents"
    result = precompute(source, out, launcher=composer_launcher(2))
    assert "over 2 rank(s)" in result.stdout
    samples, expected = read_samples(out), read_samples(single[0])
    assert sorted(samples) == GOOD
    for index in GOOD:
        np.testing.assert_array_equal(samples[index]["token_ids"], expected[index]["token_ids"])
        for key in precomputed.LATENT_KEYS:
            np.testing.assert_allclose(samples[index][key].astype(np.float32),
                                       expected[index][key].astype(np.float32), rtol=1e-3, atol=1e-3)


def test_interrupted_run_resumes_and_skips_complete_chunks(source, single, tmp_path, capsys):
    out = tmp_path / "latents"
    shutil.copytree(single[0], out)
    # A crash: chunk 3 never started, chunk 1 has shards but no index.json, nothing merged yet.
    shutil.rmtree(out / latent_store.chunk_name(3))
    (out / latent_store.chunk_name(1) / "index.json").unlink()
    (out / "index.json").unlink()
    kept = {p: p.stat().st_mtime_ns for k in (0, 2) for p in (out / latent_store.chunk_name(k)).iterdir()}

    # Stops again after one chunk (chunk 1). In this process, to save a start-up; the CLI follows.
    report = latents.main(["--local", str(source), "--out", str(out), *PRECOMPUTE, "--max_chunks", "1"])
    first = capsys.readouterr().out
    assert "2 already complete, 2 to do" in first and "1 of 4 chunk(s) left" in first
    assert report["written_this_run"] == CHUNK - 1 and report["skipped_this_run"] == 1  # sample 7 is in chunk 1
    assert report["chunks_left"] == 1
    assert not (out / "index.json").exists() and (out / latent_store.chunk_name(1) / "index.json").is_file()
    second = precompute(source, out)
    assert "3 already complete, 1 to do" in second.stdout and "done: 19 of 20 samples" in second.stdout
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # complete chunks were not rewritten

    samples, expected = read_samples(out), read_samples(single[0])
    assert sorted(samples) == GOOD
    for index in GOOD:
        np.testing.assert_array_equal(samples[index]["token_ids"], expected[index]["token_ids"])
        for key in precomputed.LATENT_KEYS:  # CPU convolutions may differ in the last fp32 bit between processes
            np.testing.assert_allclose(samples[index][key].astype(np.float32),
                                       expected[index][key].astype(np.float32), rtol=1e-3, atol=1e-3)


def test_other_settings_are_refused(single):
    existing = json.loads((single[0] / "precompute.json").read_text())
    assert latent_store.check_settings(existing, dict(existing)) is None
    assert latent_store.check_settings(None, existing) is None
    problem = latent_store.check_settings(existing, {**existing, "chunk_size": 5, "image_size": 128})
    assert "chunk_size" in problem and "image_size" in problem and "--overwrite" in problem


@pytest.mark.parametrize("storage, bad, error", [
    ("fp16", 1e5, OverflowError), ("fp32", 1e5, None), ("fp16", float("nan"), FloatingPointError),
    ("fp32", float("inf"), FloatingPointError)])
def test_values_that_cannot_be_stored_stop_the_run(storage, bad, error):
    mean, logvar, text = torch.zeros(3, 4, 8, 8), torch.zeros(3, 4, 8, 8), torch.zeros(3, 77, 16)
    mean[1, 2, 3, 4] = bad
    encoded = latent_encoding.Encoded([10, 11, 12], ["a", "b", "c"], (mean, logvar, {"text_states": text}), storage,
                              torch.device("cpu"))
    if error is None:
        arrays, ranges = encoded.arrays(storage, "fp32")
        assert arrays[0].dtype == np.float32 and ranges[0] == bad
        return
    with pytest.raises(error, match=r"latent_mean of samples \[11\]"):
        encoded.arrays(storage, "fp32")


def test_training_dataset_reads_either_format_and_checks_the_shapes(single, states):
    for out, text_key in ((single[0], "captions"), (states[0], "text_states")):
        loader = data.latents_dataloader(synthetic=False, remote=None, local=str(out), image_size=IMAGE_SIZE,
                                         text_dim=64, batch_size_per_device=4, num_workers=0, seed=SEED)
        assert loader.dataset.text_format == ("tokens" if text_key == "captions" else "text_states")
        batch = next(iter(loader))
        assert set(batch) == {*precomputed.LATENT_KEYS, text_key, "sample_index"}  # the index: validation-loss noise
        assert batch["latent_mean"].shape == batch["latent_logvar"].shape == (4, 4, 8, 8)
        assert batch["latent_mean"].dtype == torch.float16
        if text_key == "captions":  # token ids, as image batches carry them
            assert batch["captions"].shape == (4, 77) and batch["captions"].dtype == torch.int64
        else:
            assert batch["text_states"].shape == (4, 77, 64) and batch["text_states"].dtype == torch.float16
    with pytest.raises(ValueError, match="64x64 images, not 128x128"):
        data.StreamingLatents(remote=None, local=str(single[0]), batch_size=4, image_size=128)
    with pytest.raises(ValueError, match="another text encoder"):
        data.StreamingLatents(remote=None, local=str(states[0]), batch_size=4, text_dim=1024)
    data.StreamingLatents(remote=None, local=str(single[0]), batch_size=4, text_dim=1024)  # tokens: any encoder


def test_synthetic_latents_are_deterministic_and_shaped_like_the_shards():
    dataset = data.SyntheticLatents(image_size=64, text_dim=32, num_samples=10, seed=3)
    a, b = dataset[4], dataset[4]
    assert set(a) == {*precomputed.LATENT_KEYS, "captions", "sample_index"} and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["latent_mean"], dataset[5]["latent_mean"])
    loader = data.latents_dataloader(synthetic=True, remote=None, local=None, image_size=64, text_dim=32,
                                     batch_size_per_device=4, num_workers=0, num_samples=10, seed=3,
                                     synthetic_format="text_states")
    batches = list(loader)
    assert len(batches) == 2  # drop_last
    assert batches[0]["latent_mean"].shape == (4, 4, 8, 8) and batches[0]["text_states"].shape == (4, 77, 32)
    assert batches[0]["text_states"].dtype == torch.float16


@pytest.mark.parametrize("data_source, ranks", [("synthetic", 1), ("tokens", 1),
                                                 pytest.param("tokens", 2, marks=pytest.mark.multirank),
                                                 ("text_states", 1)])
@pytest.mark.slow
def test_benchmark_trains_on_precomputed_latents(single, states, tmp_path, data_source, ranks):
    from t2ibench.families import MODEL_CONFIGS

    results = tmp_path / "results.json"
    shards = tmp_path / "latents"  # a copy: Streaming decompresses shards next to the ones it reads
    if data_source != "synthetic":
        shutil.copytree((single if data_source == "tokens" else states)[0], shards)
    where = ["--use_synth_data"] if data_source == "synthetic" else ["--local", str(shards)]
    argv = ["--precomputed", "--model_config", "tiny", *where, "--image_size", str(IMAGE_SIZE), "--batch_size", "4",
            "--max_duration", "2ba", "--num_workers", "0", "--warmup_batches", "1", "--results_json", str(results)]
    if data_source == "tokens":  # the command line, end to end, on one and two ranks, with EMA
        launcher = composer_launcher(ranks) if ranks > 1 else [sys.executable]
        run([*launcher, str(ROOT / "benchmark.py"), *argv, "--use_ema"])
    else:  # in this process (saves a start-up)
        import benchmark

        benchmark.main(argv)
    r = json.loads(results.read_text())
    online = MODEL_CONFIGS["tiny"].flops_per_image("tiny", IMAGE_SIZE)
    assert r["precomputed"] is True and r["images_per_sec"] > 0 and r["measured_batches"] == 1
    assert r["world_size"] == ranks and r["use_ema"] == (data_source == "tokens")
    # Tokens (also the synthetic default): the text encoder runs, the VAE does not.
    text_flops = online["text_encoder"] if data_source != "text_states" else 0.0
    assert r["precomputed_format"] == ("text_states" if data_source == "text_states" else "tokens")
    assert r["flops_per_image"] == pytest.approx(online["denoiser_fwd_bwd"] + text_flops)
    assert r["flops_per_image"] < online["total"]
    assert r["random_parts"] == (["text_encoder"] if text_flops else [])  # the tiny text encoder, built; no VAE
    assert r["data"] == ("synthetic" if data_source == "synthetic" else str(shards))
    assert np.isfinite(r["final_loss"])


def test_text_states_computed_online_from_stored_tokens_equal_the_stored_ones(single, states):
    """Training on the tokens format runs the text encoder that benchmark.py builds for it: its output
    equals, to fp16 precision, what latents.py --store_text_states stored."""
    from composer.utils import reproducibility

    from t2ibench.families import MODEL_CONFIGS
    from t2ibench.train.model import DiffusionModel

    reproducibility.seed_all(SEED)  # as benchmark.py --precomputed on tokens builds its parts
    family = MODEL_CONFIGS["tiny"]
    parts = family.build("tiny", vae=False, tokenizers=False)
    assert parts.vae is None and parts.tokenizer is None and parts.text_encoder is not None
    model = DiffusionModel(family, parts)
    tokens, stored = read_samples(single[0]), read_samples(states[0])
    ids = torch.from_numpy(np.stack([tokens[i]["token_ids"].astype(np.int64) for i in GOOD]))
    online = model.encode_text({"captions": ids})["text_states"]
    expected = torch.from_numpy(np.stack([stored[i]["text_states"] for i in GOOD]).astype(np.float32))
    assert online.shape == expected.shape == (len(GOOD), 77, 64)
    torch.testing.assert_close(online, expected, rtol=1e-3, atol=1e-3)  # fp16 keeps 11 bits
    assert not torch.allclose(online[0], online[1], atol=1e-2)  # distinct captions, distinct states


def test_sources_syntax():
    from t2ibench.core.errors import UserError
    from t2ibench.datasets.sources import Source

    def pairs(remote):
        return [(s.remote, s.proportion) for s in parse_sources(remote, "/tmp/x")]

    assert parse_sources(None, None) == [] and pairs("s3://a/mds") == [("s3://a/mds", None)]
    assert pairs("0.7=s3://a/mds, .3=C:\\data\\b") == [("s3://a/mds", 0.7), ("C:\\data\\b", 0.3)]
    assert pairs(["0.7=s3://a/mds", ".3=gs://b"]) == [("s3://a/mds", 0.7), ("gs://b", 0.3)]  # --remote repeated
    # '=' elsewhere is part of the URI (Hive-style keys); a path starting with "<number>=" is written "./...".
    assert pairs("s3://b/year=2023,./1=x") == [("s3://b/year=2023", None), ("./1=x", None)]
    with pytest.raises(UserError, match="to every source .* or to none"):
        parse_sources("0.5=s3://a,s3://b", "/tmp/x")
    with pytest.raises(UserError, match="must be positive"):
        parse_sources("0=s3://a,1=s3://b", "/tmp/x")
    with pytest.raises(UserError, match="need --local"):
        parse_sources("s3://a,gs://b", None)
    # One source streams into --local, or by default into one cache folder per remote.
    assert parse_sources("s3://a/mds", "/tmp/x") == [Source("s3://a/mds", "/tmp/x")]
    assert parse_sources("s3://a/mds", None)[0].local == cache_folder("/tmp/mds-cache", "s3://a/mds")
    assert parse_sources("file:///data/mds", None)[0].remote == "/data/mds"  # file:// is the path
    assert data.stream_arguments(parse_sources("s3://a/mds", "/tmp/x"))["streams"] is None
    streams = data.stream_arguments(parse_sources("s3://a/mds,gs://b/mds", "/tmp/x"))["streams"]
    assert [s.local for s in streams] == [cache_folder("/tmp/x", "s3://a/mds"), cache_folder("/tmp/x", "gs://b/mds")]
    assert len({s.local for s in streams}) == 2 and all(s.local.startswith("/tmp/x/") for s in streams)


def test_bad_sources_fail_before_training(single, capsys):
    import benchmark

    base = ["--precomputed", "--model_config", "tiny", "--batch_size", "4", "--local", "/tmp/unused"]
    for remote, message in (([f"0.5={single[0]}", str(single[0])], "to every source"),
                            ([str(single[0]), "/no/such/dataset"], "--remote /no/such/dataset holds no MDS dataset"),
                            ([str(single[0]), "--epoch_size", "lots"], "--epoch_size lots must be a positive"),
                            ([str(single[0]), "--precomputed_format", "text_states"], "only applies with")):
        argv = base + [x for r in remote for x in (["--remote", r] if r.startswith(("/", "0")) else [r])]
        with pytest.raises(SystemExit) as error:
            benchmark.validate(benchmark.parse_args(argv), 1)
        assert "benchmark.py: error:" in str(error.value) and message in str(error.value)
    args = benchmark.parse_args(base + ["--remote", "0.3=s3://a", "--remote", "0.7=s3://b,0.5=s3://c"])
    sources = parse_sources(args.remote, args.local)  # repeating the flag adds sources
    assert [s.spec for s in sources] == ["0.3=s3://a", "0.7=s3://b", "0.5=s3://c"]


class Inspect(Callback):
    """Records the training dataset the Trainer got (built by benchmark.py)."""

    def __init__(self):
        self.datasets = []

    def fit_start(self, state, logger) -> None:
        self.datasets.append(state.train_dataloader.dataset)


def test_streaming_flags_reach_the_precomputed_loader(single, tmp_path):
    import benchmark
    from streaming.base.util import bytes_to_int

    inspect = Inspect()
    argv = ["--precomputed", "--model_config", "tiny", "--remote", str(single[0]), "--local", str(tmp_path / "cache"),
            "--image_size", str(IMAGE_SIZE), "--batch_size", "4", "--max_duration", "2ba", "--num_workers", "0",
            "--warmup_batches", "0", "--cache_limit", "10mb", "--predownload", "16", "--download_retry", "3",
            "--download_timeout", "33", "--validate_hash", "xxh64", "--no_shuffle", "--shuffle_algo", "py1br",
            "--shuffle_block_size", "1000", "--epoch_size", "12", "--num_canonical_nodes", "2",
            "--sampling_granularity", "5"]
    benchmark.main(argv, extra_callbacks=[inspect])
    dataset = inspect.datasets[-1]
    assert isinstance(dataset, data.StreamingLatents) and dataset.text_format == "tokens"
    assert dataset.cache_limit == bytes_to_int("10mb") and dataset.predownload == 16
    assert dataset.shuffle is False and dataset.shuffle_algo == "py1br" and dataset.shuffle_block_size == 1000
    assert dataset.epoch_size == 12 and dataset.num_canonical_nodes == 2 and dataset.shuffle_seed == SEED
    assert dataset.sampling_granularity == 5
    [stream] = dataset.streams
    assert (stream.remote, stream.local) == (str(single[0]), str(tmp_path / "cache"))
    assert stream.download_retry == 3 and stream.download_timeout == 33 and stream.validate_hash == "xxh64"


def test_two_sources_mixed_in_one_run(single, states, source, tmp_path):
    import benchmark

    other = tmp_path / "other"  # a second tokens-format dataset
    shutil.copytree(single[0], other)
    cache, inspect = tmp_path / "cache", Inspect()
    results = tmp_path / "results.json"
    argv = ["--precomputed", "--model_config", "tiny", "--remote", f"0.25={single[0]}", "--remote", f"0.75={other}",
            "--local", str(cache), "--image_size", str(IMAGE_SIZE), "--batch_size", "4", "--epoch_size", "16",
            "--max_duration", "1ep", "--num_workers", "0", "--warmup_batches", "1", "--results_json", str(results)]
    benchmark.main(argv, extra_callbacks=[inspect])
    dataset = inspect.datasets[-1]
    assert [s.remote for s in dataset.streams] == [str(single[0]), str(other)]
    assert [s.choose for s in dataset.streams] == [4, 12]  # 16 samples per epoch, a quarter from the first
    for stream in dataset.streams:  # each source cached in its own folder, and read
        assert stream.local == cache_folder(str(cache), stream.remote)
        assert (Path(stream.local) / "index.json").is_file() and list(Path(stream.local).rglob("shard.*.mds*"))
    assert json.loads(results.read_text())["measured_batches"] == 3  # 4 batches, 1 warm-up

    # Mixed formats are refused; the image loader takes several sources too.
    with pytest.raises(ValueError, match="mix precomputed formats"):
        data.StreamingLatents(remote=f"{single[0]},{states[0]}", local=str(tmp_path / "mixed"), batch_size=4)
    from t2ibench.core.tokenizer import bundled_tokenizer

    source2 = tmp_path / "source2"
    shutil.copytree(source, source2)
    images = data.laion_dataloader(f"{source},{source2}", str(tmp_path / "images"), bundled_tokenizer(), IMAGE_SIZE,
                                   4, 0, epoch_size=8)
    assert [s.remote for s in images.dataset.streams] == [str(source), str(source2)]
    assert [next(iter(images))["image"].shape] == [(4, 3, IMAGE_SIZE, IMAGE_SIZE)]
