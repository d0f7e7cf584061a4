"""LAION-style data: convert.py to MDS shards, streaming them (local folder, S3 on loopback), bad
data at training time, rank partitioning, and a tiny benchmark.py run on real shards.

Every file is written by the test itself with Pillow and tarfile. Each test streams into its own
cache folder: Streaming keys its shared memory by the cache folder, and two live datasets may not
share one. Shared memory is released when each process exits (Streaming registers that at exit);
we do not call streaming's clean_stale_shared_memory(), which would also unlink the shared memory
of other Streaming jobs running on this machine.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import convert
import data
from t2ibench.datasets import convert_inputs
from t2ibench.train.model import scale_images
from t2ibench.core.tokenizer import MAX_LENGTH, bundled_tokenizer, tokenize
from tests import preloaded
from tests.helpers import ROOT, free_port, offline_env

SIZE = 64  # training resolution in these tests
NUM_PHOTOS = 24  # samples in the `shards` dataset: 2 ranks x 3 batches x 4, or 6 batches of 4
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]


# -----------------------------------------------------------------------------------------------
# Helpers and fixtures: small images, written as real files.
# -----------------------------------------------------------------------------------------------

def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def smooth_rgb(seed: int, width: int = 96, height: int = 72) -> Image.Image:
    """A small smooth color image (compresses like a photo, unlike random pixels)."""
    grid = np.random.default_rng(seed).integers(0, 256, (3, 4, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((width, height), Image.Resampling.BICUBIC)


def half_transparent_png() -> bytes:
    """80x80 RGBA: left half fully transparent (its hidden color black), right half opaque blue."""
    pixels = np.zeros((80, 80, 4), np.uint8)
    pixels[:, 40:] = (0, 0, 255, 255)
    return encoded(Image.fromarray(pixels), "PNG")


def caption_for(i: int) -> str:
    return f"photo number {WORDS[i // 12]} {WORDS[i % 12]}"  # unique words, no digits


def captions_key(ids: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(t) for t in ids)


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


# The mixed folder: what each file is, and the caption that must come back for it.
FOLDER_CAPTIONS = {
    "rgb.jpg": "a red barn in a field",
    "cmyk.jpg": "a cyan card",
    "sub/rgba.png": "a blue square on white",
    "sub/deeper/gray.png": "a gray cat",
    "sub/palette.png": "a palette icon",
}


@pytest.fixture(scope="module")
def raw_folder(tmp_path_factory) -> Path:
    """Images + same-named .txt captions, nested, in all the modes that need converting, plus one
    corrupt image, one without caption, one with a blank caption and an unrelated file."""
    root = tmp_path_factory.mktemp("raw")
    (root / "sub" / "deeper").mkdir(parents=True)
    files = {
        "rgb.jpg": encoded(smooth_rgb(1), "JPEG", quality=90),
        "cmyk.jpg": encoded(Image.new("CMYK", (72, 96), (255, 0, 0, 0)), "JPEG"),
        "sub/rgba.png": half_transparent_png(),
        "sub/deeper/gray.png": encoded(Image.new("L", (90, 70), 128), "PNG"),
        "sub/palette.png": encoded(Image.open(io.BytesIO(half_transparent_png())).quantize(4), "PNG"),  # P + tRNS
        "corrupt.jpg": b"\xff\xd8\xff\xe0 this is not really a JPEG" + bytes(200),
        "nocaption.jpg": encoded(smooth_rgb(2), "JPEG"),
        "blank.jpg": encoded(smooth_rgb(3), "JPEG"),
    }
    for name, content in files.items():
        (root / name).write_bytes(content)
    for name, caption in {**FOLDER_CAPTIONS, "corrupt.jpg": "broken", "blank.jpg": "  \n"}.items():
        (root / name).with_suffix(".txt").write_text(caption)
    (root / "notes.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """NUM_PHOTOS JPEG and PNG photos with unique captions, converted into several small shards."""
    raw = tmp_path_factory.mktemp("photos")
    for i in range(NUM_PHOTOS):
        name, fmt = (f"p{i:02d}.png", "PNG") if i % 4 == 3 else (f"p{i:02d}.jpg", "JPEG")
        (raw / name).write_bytes(encoded(smooth_rgb(100 + i), fmt))
        (raw / name).with_suffix(".txt").write_text(caption_for(i))
    out = tmp_path_factory.mktemp("shards") / "mds"
    report = convert.convert([str(raw)], str(out), size_limit="20kb", workers=1, progress=False)
    assert report.written == NUM_PHOTOS and report.shards >= 2
    return out


def all_caption_keys(tok) -> dict[tuple[int, ...], int]:
    ids = tokenize(tok, [caption_for(i) for i in range(NUM_PHOTOS)])
    return {captions_key(row): i for i, row in enumerate(ids)}


def check_sample(sample: dict[str, torch.Tensor]) -> None:
    assert set(sample) == {"image", "captions", "sample_index"}  # the index fixes its validation-loss noise
    image, captions = sample["image"], sample["captions"]
    assert image.shape == (3, SIZE, SIZE) and image.dtype == torch.uint8  # bytes cross from the workers
    assert captions.shape == (MAX_LENGTH,) and captions.dtype == torch.int64


# -----------------------------------------------------------------------------------------------
# Decoding.
# -----------------------------------------------------------------------------------------------

def decode_scaled(encoded_bytes: bytes, size: int) -> torch.Tensor:
    """decode_image's uint8 pixels, scaled to [-1, 1] as the model does on the device."""
    pixels = data.decode_image(encoded_bytes, size)
    assert pixels.dtype == torch.uint8
    return scale_images(pixels)


def test_decode_image_converts_every_mode_to_rgb_in_range():
    rgba = decode_scaled(half_transparent_png(), 32)
    assert torch.allclose(rgba[:, :, :10], torch.ones(3, 32, 10))  # transparent -> white, not black
    assert torch.allclose(rgba[:, :, -10:], torch.tensor([-1.0, -1.0, 1.0]).view(3, 1, 1).expand(3, 32, 10))
    gray = decode_scaled(encoded(Image.new("L", (40, 50), 51), "PNG"), 16)
    assert torch.allclose(gray, torch.full_like(gray, 51 / 127.5 - 1))
    deep = decode_scaled(encoded(Image.fromarray(np.full((20, 20), 65535, np.uint16)), "PNG"), 8)
    assert torch.allclose(deep, torch.ones_like(deep))  # 16-bit white stays white (no clipping to garbage)
    cyan = decode_scaled(encoded(Image.new("CMYK", (30, 30), (255, 0, 0, 0)), "JPEG", quality=100), 8)
    assert cyan[0].mean() < -0.9 and cyan[1].mean() > 0.9 and cyan[2].mean() > 0.9
    # EXIF orientation 3 (rotated 180 degrees): the stored left half is shown on the right.
    halves = np.zeros((40, 80, 3), np.uint8)
    halves[:, 40:] = 255
    exif = Image.Exif()
    exif[0x0112] = 3
    turned = decode_scaled(encoded(Image.fromarray(halves), "JPEG", exif=exif.tobytes()), 40)
    assert turned[:, :, :8].mean() > 0.9 and turned[:, :, -8:].mean() < -0.9
    # Shorter side resized to S, then center-cropped: a wide image keeps its middle.
    wide = np.zeros((50, 150, 3), np.uint8)
    wide[:, 50:100] = 255
    middle = decode_scaled(encoded(Image.fromarray(wide), "PNG"), 10)
    assert middle.shape == (3, 10, 10) and middle[:, :, 1:-1].min() > 0.99 and middle.min() > 0.5  # edges: filter taps
    with pytest.raises(Exception):
        data.decode_image(b"not an image", 8)


# -----------------------------------------------------------------------------------------------
# Conversion.
# -----------------------------------------------------------------------------------------------

def test_convert_folder_then_read_back_every_sample(raw_folder, tmp_path, tok):
    out = tmp_path / "mds"
    report = convert.convert([str(raw_folder)], str(out), workers=1, progress=False)
    assert report.written == len(FOLDER_CAPTIONS) and report.reencoded == 3  # the three PNGs
    assert dict(report.skipped) == {convert_inputs.UNDECODABLE: 1, convert_inputs.MISSING_CAPTION: 1, convert_inputs.EMPTY_CAPTION: 1}
    assert "skipped 3" in report.summary() and "1 undecodable image" in report.summary()
    index = json.loads((out / "index.json").read_text())
    assert index["shards"][0]["compression"] == "zstd" and index["shards"][0]["hashes"] == ["sha1", "xxh64"]

    from streaming import StreamingDataset
    raw = StreamingDataset(local=str(out), batch_size=1)
    dataset = data.StreamingImageCaptions(remote=None, local=str(out), tokenizer=tok, image_size=SIZE,
                                          batch_size=1, shuffle=False)
    assert dataset.num_samples == len(FOLDER_CAPTIONS)
    seen = set()
    for i in range(dataset.num_samples):
        stored, sample = raw[i], dataset[i]
        key = stored["key"]
        seen.add(key)
        assert stored["caption"] == FOLDER_CAPTIONS[key]
        assert stored["jpg"][:2] == b"\xff\xd8"  # everything is stored as JPEG...
        if key.endswith(".jpg"):  # ...and JPEGs byte for byte, not recompressed
            assert stored["jpg"] == (raw_folder / key).read_bytes()
        check_sample(sample)
        assert torch.equal(sample["captions"], tokenize(tok, [FOLDER_CAPTIONS[key]])[0])
        if key in ("sub/rgba.png", "sub/palette.png"):  # transparency was composited on white before JPEG encoding
            image = scale_images(sample["image"])
            assert image[:, :, :20].mean() > 0.95 and image[2, :, -20:].mean() > 0.9
    assert seen == set(FOLDER_CAPTIONS)
    # Iterating (the training path) yields the same samples as indexing.
    assert len(list(dataset)) == len(FOLDER_CAPTIONS)
    with pytest.raises(ValueError, match="image_key='png' is not a column"):
        data.StreamingImageCaptions(remote=None, local=str(out), tokenizer=tok, image_size=SIZE, batch_size=1,
                                    image_key="png")


def write_webdataset_tar(path: Path, samples: dict[str, dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, files in samples.items():
            for ext, content in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))


def test_sources_of_a_mixed_folder_are_read_tars_first_and_img2datasets_parquet_left_out(tmp_path):
    # A folder holding tar shards, their img2dataset metadata parquet and a loose captioned image:
    # --format auto reads the tar and the image, counts the parquet as not read, and finds every sample.
    jpeg = encoded(smooth_rgb(0), "JPEG")
    write_webdataset_tar(tmp_path / "00000.tar", {"a": {"jpg": jpeg, "txt": b"one"}, "b": {"jpg": jpeg, "txt": b"two"}})
    (tmp_path / "00000.parquet").write_bytes(b"metadata only")
    (tmp_path / "photo.jpg").write_bytes(jpeg)
    (tmp_path / "photo.txt").write_bytes("caf\xe9".encode("cp1252"))  # not UTF-8: read as Windows-1252, counted
    report = convert_inputs.Report(out="")
    sources, total = convert_inputs.find_sources([str(tmp_path)], "auto", report=report)
    assert [source.kind for source in sources] == ["webdataset", "folder"] and total == 3
    assert sum(report.not_read.values()) == 1
    candidates = list(convert_inputs.iter_candidates(sources, report, None, None))
    assert sorted(c.caption for c in candidates) == ["caf\xe9", "one", "two"] and report.non_utf8_captions == 1


def test_convert_webdataset_tars_then_read_back(tmp_path, tok):
    shards_dir = tmp_path / "wds"
    shards_dir.mkdir()
    jpg, png = encoded(smooth_rgb(7), "JPEG"), encoded(smooth_rgb(8), "PNG")
    write_webdataset_tar(shards_dir / "00000.tar", {
        "000000000": {"jpg": jpg, "txt": b"first caption", "json": b'{"caption": "ignored", "url": "x"}'},
        "000000001": {"png": png, "txt": b"second caption"},
        "000000002": {"jpg": jpg, "json": json.dumps({"caption": "caption from json"}).encode()},
        "000000003": {"jpg": jpg},
    })
    write_webdataset_tar(shards_dir / "00001.tar", {
        "000010000": {"jpg": b"\xff\xd8 corrupt", "txt": b"broken"},
        "000010001": {"txt": b"caption without image"},
        "000010002": {"webp": encoded(Image.new("RGBA", (70, 60), (0, 255, 0, 255)), "WEBP"), "txt": b"green"},
    })
    # img2dataset also leaves metadata parquet files and stats next to the tars: they must be ignored.
    (shards_dir / "00000.parquet").write_bytes(b"PAR1 metadata only")
    (shards_dir / "00000_stats.json").write_text("{}")

    out = tmp_path / "mds"
    report = convert.convert([str(shards_dir)], str(out), workers=1, progress=False)
    assert report.written == 4 and report.reencoded == 2
    assert dict(report.skipped) == {convert_inputs.MISSING_CAPTION: 1, convert_inputs.UNDECODABLE: 1, convert_inputs.MISSING_IMAGE: 1}

    expected = {"000000000": "first caption", "000000001": "second caption", "000000002": "caption from json",
                "000010002": "green"}
    from streaming import StreamingDataset
    raw = StreamingDataset(local=str(out), batch_size=1)
    dataset = data.StreamingImageCaptions(remote=None, local=str(out), tokenizer=tok, image_size=SIZE, batch_size=1,
                                          shuffle=False)
    keys = [raw[i]["key"] for i in range(raw.num_samples)]
    assert keys == list(expected)  # input order is kept
    for i, key in enumerate(keys):
        sample = dataset[i]
        check_sample(sample)
        assert torch.equal(sample["captions"], tokenize(tok, [expected[key]])[0])
    assert raw[0]["jpg"] == jpg


def test_convert_parquet_with_image_bytes(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    jpg = encoded(smooth_rgb(9), "JPEG")
    table = pa.table({"key": ["a", "b", "c", "d"], "txt": ["one", None, "three", "four"],
                      "jpg": [jpg, jpg, None, b"junk"], "url": ["u"] * 4})
    pq.write_table(table, tmp_path / "00000.parquet")
    out = tmp_path / "mds"
    report = convert.convert([str(tmp_path / "00000.parquet")], str(out), workers=1, progress=False)
    assert report.written == 1
    assert dict(report.skipped) == {convert_inputs.MISSING_CAPTION: 1, convert_inputs.MISSING_IMAGE: 1, convert_inputs.UNDECODABLE: 1}
    # Hugging Face datasets store an `image` struct {bytes, path} and often a `caption` column.
    hf = tmp_path / "hf"
    hf.mkdir()
    pq.write_table(pa.table({"image": [{"bytes": jpg, "path": "x.jpg"}] * 2, "caption": ["hf one", "hf two"]}),
                   hf / "train-00000.parquet")
    report = convert.convert([str(hf)], str(tmp_path / "mds-hf"), workers=1, progress=False)
    assert report.written == 2 and not report.skipped
    pq.write_table(pa.table({"key": ["a"], "txt": ["metadata only"]}), tmp_path / "meta.parquet")
    with pytest.raises(convert_inputs.ConvertError, match="no image column"):
        convert.convert([str(tmp_path / "meta.parquet")], str(tmp_path / "mds2"), progress=False)


def test_convert_command_line_errors_and_overwrite(raw_folder, tmp_path, capsys):
    def error_of(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            convert.main(list(argv))
        message = str(exit_info.value.code)
        assert message.startswith("convert.py: error: ") and "\n" not in message
        return message

    out = tmp_path / "mds"
    assert "does not exist" in error_of(str(tmp_path / "missing"), "--out", str(out))
    (tmp_path / "empty").mkdir()
    assert "nothing to convert" in error_of(str(tmp_path / "empty"), "--out", str(out))
    assert "unknown compression" in error_of(str(raw_folder), "--out", str(out), "--compression", "lzma")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("precious")
    assert "not empty" in error_of(str(raw_folder), "--out", str(tmp_path / "busy"))
    assert "refusing" in error_of(str(raw_folder), "--out", str(tmp_path / "busy"), "--overwrite")
    assert (tmp_path / "busy" / "thesis.tex").exists()

    # The real command line, with worker processes; then again on top of it.
    report = convert.main([str(raw_folder), "--out", str(out), "--workers", "2", "--no_progress"])
    assert report.written == len(FOLDER_CAPTIONS)
    assert f"wrote {len(FOLDER_CAPTIONS)} samples" in capsys.readouterr().out
    assert "--overwrite" in error_of(str(raw_folder), "--out", str(out))
    report = convert.main([str(raw_folder), "--out", str(out), "--overwrite", "--no_progress", "--min_size", "80"])
    assert report.written == 2 and report.skipped[convert_inputs.TOO_SMALL] == 3  # only the two 80x80 images pass

    with pytest.raises(SystemExit) as exit_info:
        convert.main(["--help"])
    assert exit_info.value.code == 0 and "python convert.py" in capsys.readouterr().out


# -----------------------------------------------------------------------------------------------
# Streaming.
# -----------------------------------------------------------------------------------------------

def test_stream_from_a_remote_folder_into_a_separate_cache(shards, tmp_path, tok):
    cache = tmp_path / "cache"
    loader = data.laion_dataloader(remote=str(shards), local=str(cache), tokenizer=tok, image_size=SIZE,
                                   batch_size_per_device=4, num_workers=1, seed=3)
    keys = all_caption_keys(tok)
    seen = []
    for batch in loader:
        assert batch["image"].shape == (4, 3, SIZE, SIZE) and batch["captions"].shape == (4, MAX_LENGTH)
        assert batch["image"].dtype == torch.uint8
        seen += [keys[captions_key(row)] for row in batch["captions"]]
    assert sorted(seen) == list(range(NUM_PHOTOS))  # one epoch: every sample once
    assert seen != list(range(NUM_PHOTOS))  # shuffled
    assert (cache / "index.json").is_file() and list(cache.glob("shard.*"))
    assert loader.state_dict()["sample_in_epoch"] == NUM_PHOTOS  # resumable position
    del loader
    # That cache holds decompressed shards only: Streaming without a remote would delete them.
    with pytest.raises(ValueError, match="pass that remote again"):
        data.laion_dataloader(remote=None, local=str(cache), tokenizer=tok, image_size=SIZE,
                              batch_size_per_device=4, num_workers=0)
    assert list(cache.glob("shard.*.mds"))


def test_stream_local_shards_without_remote(shards, tmp_path, tok):
    local = tmp_path / "mds"
    shutil.copytree(shards, local)  # Streaming decompresses shards next to the originals
    loader = data.laion_dataloader(remote=None, local=str(local), tokenizer=tok, image_size=SIZE,
                                   batch_size_per_device=4, num_workers=0, shuffle=False)
    keys = all_caption_keys(tok)
    seen = [keys[captions_key(row)] for batch in loader for row in batch["captions"]]
    assert seen == list(range(NUM_PHOTOS))  # not shuffled: the converted order


def test_stream_from_s3_on_loopback(raw_folder, tmp_path, tok, monkeypatch, s3_endpoint):
    import boto3

    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="laion")

    remote = "s3://laion/sd2/mds"
    report = convert.convert([str(raw_folder)], remote, workers=1, progress=False)  # uploads
    assert report.written == len(FOLDER_CAPTIONS)
    objects = {o["Key"] for o in s3.list_objects_v2(Bucket="laion")["Contents"]}
    assert "sd2/mds/index.json" in objects and "sd2/mds/shard.00000.mds.zstd" in objects
    with pytest.raises(convert_inputs.ConvertError, match="already holds an MDS dataset"):
        convert.convert([str(raw_folder)], remote, workers=1, progress=False)

    cache = tmp_path / "cache"
    loader = data.laion_dataloader(remote=remote, local=str(cache), tokenizer=tok, image_size=SIZE,
                                   batch_size_per_device=1, num_workers=0, shuffle=False)
    expected = {captions_key(row) for row in tokenize(tok, list(FOLDER_CAPTIONS.values()))}
    got = [captions_key(batch["captions"][0]) for batch in loader]
    assert sorted(got) == sorted(expected)
    assert (cache / "shard.00000.mds").is_file()
    del loader


# -----------------------------------------------------------------------------------------------
# Bad data at training time.
# -----------------------------------------------------------------------------------------------

def write_mds(out: Path, images: list[bytes], captions: list[str]) -> None:
    from streaming import MDSWriter
    with MDSWriter(out=str(out), columns=convert.COLUMNS, compression="zstd") as writer:
        for i, (image, caption) in enumerate(zip(images, captions)):
            writer.write({"jpg": image, "caption": caption, "key": str(i)})


def test_corrupt_image_in_a_shard_is_replaced_by_the_next_sample_and_counted(tmp_path, tok, caplog):
    images = [encoded(smooth_rgb(200 + i), "JPEG") for i in range(10)]
    images[3] = b"these bytes are not an image"
    write_mds(tmp_path / "mds", images, [caption_for(i) for i in range(10)])

    def dataset():
        return data.StreamingImageCaptions(remote=None, local=str(tmp_path / "mds"), tokenizer=tok, image_size=SIZE,
                                           batch_size=2, shuffle=False)

    first = dataset()
    with caplog.at_level("WARNING", logger="data"):
        samples = list(first)  # the training path: __iter__ in this process (no workers)
    assert len(samples) == 10
    for sample in samples:
        check_sample(sample)
    assert torch.equal(samples[3]["captions"], samples[4]["captions"])  # sample 3 -> sample 4
    assert torch.equal(samples[3]["image"], samples[4]["image"])
    assert sum(first.bad_samples.values()) == 1 and first.decoded == 11
    (shard,) = first.bad_samples
    assert shard.endswith("mds/shard.00000.mds.zstd")
    assert "sample 3 in" in caplog.text and "shard.00000.mds.zstd" in caplog.text and "replaced by sample 4" in caplog.text
    # Deterministic: another dataset object (another run, another rank) replaces it the same way.
    assert torch.equal(dataset()[3]["image"], samples[4]["image"])


def test_too_many_bad_samples_stop_the_run_naming_the_shard(tmp_path, tok):
    from streaming.base.util import merge_index

    # Two partitions merged into one dataset: a good shard and a shard of garbage.
    root = tmp_path / "mds"
    write_mds(root / "good", [encoded(smooth_rgb(300 + i), "JPEG") for i in range(8)], ["fine"] * 8)
    write_mds(root / "rotten", [b"garbage %d" % i for i in range(8)], ["bad"] * 8)
    merge_index(str(root), keep_local=True)
    loader = data.laion_dataloader(remote=None, local=str(root), tokenizer=tok, image_size=SIZE,
                                   batch_size_per_device=2, num_workers=1, shuffle=True,
                                   max_bad_fraction=0.2, bad_check_after=6)
    with pytest.raises(Exception, match=r"rotten/shard\.00000\.mds\.zstd") as error:
        for _ in loader:
            pass
    assert "max_bad_fraction=0.2" in str(error.value) and "BadDataError" in str(error.value)
    del loader


# -----------------------------------------------------------------------------------------------
# Ranks, and training.
# -----------------------------------------------------------------------------------------------

def rank_worker(shards_dir: str, cache: str, out: str) -> None:
    """Run as one rank (RANK/WORLD_SIZE... set by the test): write the caption ids this rank saw."""
    tok = bundled_tokenizer()
    loader = data.laion_dataloader(remote=shards_dir, local=cache, tokenizer=tok, image_size=SIZE,
                                   batch_size_per_device=2, num_workers=0, seed=11)
    seen = [captions_key(row) for batch in loader for row in batch["captions"]]
    Path(out).write_text(json.dumps(seen))


@pytest.mark.multirank
def test_two_ranks_get_disjoint_samples_covering_the_epoch(shards, tmp_path, tok):
    port = free_port()
    cache = tmp_path / "cache"  # one node: both ranks share the cache, as on a real machine
    procs = []
    for rank in range(2):
        env = offline_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", NODE_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(preloaded.PreloadedPopen(
            [sys.executable, __file__, "--rank-worker", str(shards), str(cache), str(tmp_path / f"rank{rank}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=120)[0])
        finally:
            proc.kill()  # no-op when it has exited; never leave a rank behind
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    keys = all_caption_keys(tok)
    ranks = [[keys[tuple(ids)] for ids in json.loads((tmp_path / f"rank{r}.json").read_text())] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == NUM_PHOTOS // 2
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(NUM_PHOTOS))


def test_benchmark_trains_on_converted_shards(shards, tmp_path):
    results = tmp_path / "results.json"
    command = [sys.executable, str(ROOT / "benchmark.py"), "--model_config", "tiny", "--remote", str(shards),
               "--local", str(tmp_path / "cache"), "--batch_size", "4", "--image_size", str(SIZE),
               "--max_duration", "2ba", "--num_workers", "0", "--results_json", str(results)]
    run = preloaded.run(command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(results.read_text())
    assert summary["images_per_sec"] > 0 and summary["data"] == str(shards)
    assert np.isfinite(summary["final_loss"])


# -----------------------------------------------------------------------------------------------
# Samples larger than --size_limit: every dataset convert.py and latents.py write trains.
# -----------------------------------------------------------------------------------------------

def noisy_jpeg(seed: int, side: int = 96) -> bytes:
    """A JPEG of random pixels, which compresses badly: 96x96 is about 11 kB, over an 8kb --size_limit."""
    return encoded(Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)),
                   "JPEG", quality=95)


def oversized_folder(root: Path, oversized: set[int], count: int = 12) -> Path:
    """`count` captioned photos in name order; those in `oversized` larger than 8kb, the others about 1.3 kB."""
    root.mkdir(parents=True)
    for i in range(count):
        (root / f"p{i:02d}.jpg").write_bytes(noisy_jpeg(i) if i in oversized else encoded(smooth_rgb(i), "JPEG"))
        (root / f"p{i:02d}.txt").write_text(caption_for(i))
    return root


def shard_samples(folder: Path) -> list[int]:
    return [shard["samples"] for shard in json.loads((folder / "index.json").read_text())["shards"]]


TRAIN_2BA = ["--model_config", "tiny", "--batch_size", "4", "--image_size", "32", "--max_duration", "2ba",
             "--num_workers", "0", "--warmup_batches", "1"]


def test_samples_larger_than_size_limit_get_shards_of_their_own_and_the_dataset_trains(tmp_path):
    """The first two photos, one inside and the last over --size_limit (the first one made Streaming's
    writer close an empty shard before it)."""
    import benchmark

    oversized = {0, 1, 6, 11}
    raw = oversized_folder(tmp_path / "raw", oversized)
    out = tmp_path / "mds"
    report = convert.main([str(raw), "--out", str(out), "--size_limit", "8kb", "--no_progress"])
    counts = shard_samples(out)
    # No shard of 0 samples (Streaming's MDSWriter closed one before a first sample over the limit).
    assert 0 not in counts and sum(counts) == report.written == 12 and len(counts) == report.shards
    # Each sample over the limit is alone in its shard, in input order.
    dataset = data.StreamingDataset(local=str(out), batch_size=1, shuffle=False)
    captions = [dataset[i]["caption"] for i in range(dataset.num_samples)]
    assert captions == [caption_for(i) for i in range(12)]
    bounds = np.cumsum([0, *counts])
    alone = {int(bounds[k]) for k, n in enumerate(counts) if n == 1}
    assert oversized <= alone
    results = benchmark.main([*TRAIN_2BA, "--local", str(out)])
    assert results["measured_batches"] == 1 and np.isfinite(results["final_loss"])


@pytest.mark.slow
def test_latents_of_oversized_samples_train_with_precomputed(tmp_path):
    """latents.py with a --size_limit below one sample's size (every sample over it), from a convert.py
    dataset with an oversized first photo, then benchmark.py --precomputed on what it wrote."""
    import benchmark
    import latents

    out = tmp_path / "mds"
    convert.main([str(oversized_folder(tmp_path / "raw", {0})), "--out", str(out), "--size_limit", "8kb",
                  "--no_progress"])
    stored = tmp_path / "latents"
    latents.main(["--local", str(out), "--out", str(stored), "--model_config", "tiny", "--image_size", "32",
                  "--batch_size", "4", "--num_workers", "0", "--size_limit", "100b", "--no_progress"])
    counts = shard_samples(stored)
    assert counts == [1] * 12  # one sample per shard, none empty
    results = benchmark.main([*TRAIN_2BA, "--precomputed", "--local", str(stored)])
    assert results["measured_batches"] == 1 and np.isfinite(results["final_loss"])


def test_a_dataset_with_an_empty_shard_as_streaming_writes_it_trains_and_feeds_latents(tmp_path):
    """Datasets convert.py wrote before its writer left out the empty shard: Streaming's own MDSWriter,
    given a first sample over size_limit, closes a shard of 0 samples. Nothing is lost, so every
    reader takes it, without numpy's divide-by-zero warnings from Streaming's epoch plan."""
    import benchmark
    import latents
    from streaming import MDSWriter as StreamingMDSWriter

    out = tmp_path / "mds"
    with StreamingMDSWriter(out=str(out), columns=convert.COLUMNS, compression="zstd", size_limit="8kb") as writer:
        for i in range(12):
            image = noisy_jpeg(i) if i == 0 else encoded(smooth_rgb(i), "JPEG")
            writer.write({"jpg": image, "caption": caption_for(i), "key": str(i)})
    counts = shard_samples(out)
    assert counts[0] == 0 and sum(counts) == 12  # what Streaming 0.13 writes
    with warnings.catch_warnings(record=True) as caught:  # what reaches the user (the filters as they are)
        results = benchmark.main([*TRAIN_2BA, "--local", str(out)])
    assert results["measured_batches"] == 1 and np.isfinite(results["final_loss"])
    assert not [w for w in caught if "divide by zero" in str(w.message)]
    stored = tmp_path / "latents"
    latents.main(["--local", str(out), "--out", str(stored), "--model_config", "tiny", "--image_size", "32",
                  "--batch_size", "4", "--num_workers", "0", "--no_progress"])
    assert sum(shard_samples(stored)) == 12


if __name__ == "__main__" and sys.argv[1:2] == ["--rank-worker"]:
    rank_worker(*sys.argv[2:5])

