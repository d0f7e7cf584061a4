"""Bad or unusual input to convert.py and latents.py: one-line refusals before any writing, nothing
the user owns deleted, resumable outputs tied to their source, and conversion losses reported.

Every input is a real file: JPEG/PNG written by Pillow, tars written by tarfile, MDS shards written
by convert.py. The scripts run in this process (their `main`, catching SystemExit) except for one
command line each, which checks the exit status and that no traceback is printed.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

import convert
import latents
from t2ibench.datasets import convert_inputs
from t2ibench.datasets.precomputed import RECORD_FILE
from tests import preloaded
from tests.helpers import ROOT, error_of, offline_env

TINY = ["--model_config", "tiny", "--image_size", "64", "--batch_size", "2", "--chunk_size", "2",
        "--num_workers", "0", "--no_progress"]


def jpeg(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, ((seed * 53) % 256, (seed * 97) % 256, 128)).save(buffer, format="JPEG")
    return buffer.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


def sample_members(keys: range) -> list[tuple[str, bytes]]:
    """webdataset members in the usual order: KEY.jpg, KEY.txt for each key."""
    return [m for k in keys for m in ((f"{k:06d}.jpg", jpeg(k)), (f"{k:06d}.txt", f"caption {k}".encode()))]


def write_photos(folder: Path, count: int, start: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        (folder / f"p{i:02d}.jpg").write_bytes(jpeg(i))
        (folder / f"p{i:02d}.txt").write_text(f"photo {i}")
    return folder


def convert_main(*argv: str) -> convert_inputs.Report:
    return convert.main([*argv, "--workers", "1", "--no_progress"])


def written_keys(out: Path) -> list[str]:
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(out), batch_size=1, shuffle=False)
    return [dataset[i]["key"] for i in range(dataset.num_samples)]


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """No AWS credentials anywhere boto3 looks (and no instance-metadata lookup)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# -----------------------------------------------------------------------------------------------
# convert.py
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, expected", [
    (["--quality", "500"], "--quality 500"),
    (["--quality", "0"], "--quality 0"),
    (["--workers", "0"], "--workers 0"),
    (["--size_limit", "0"], "--size_limit 0"),
    (["--size_limit", "5gb"], "--size_limit 5gb"),
    (["--min_size", "-1"], "--min_size -1"),
    (["--max_size", "10", "--min_size", "20"], "--max_size 10"),
    (["--compression", "lzma"], "unknown compression"),
    (["--hashes", "sha999"], "unknown compression or hash ['sha999']"),
])
def test_convert_refuses_out_of_range_flags_before_writing(tmp_path, extra, expected):
    photos = write_photos(tmp_path / "photos", 2)
    out = tmp_path / "mds"
    assert expected in error_of(convert.main, [str(photos), "--out", str(out), *extra])
    assert not out.exists()


@pytest.mark.parametrize("case, expected", [
    ("missing input", "does not exist"),
    ("empty input", "nothing to convert"),
    ("uri input", "inputs are local files or folders"),
    ("input twice", "would be converted twice"),
    ("not parquet", "is not a readable parquet file"),
    ("out is a file", "is a file"),
    ("out under /proc", "cannot be written"),
    ("file uri of another host", "write file:///path or the path"),
    ("mistyped scheme", "unknown URI scheme 's4://'; supported: "),
    ("s3 without credentials", "no AWS credentials"),
])
def test_convert_user_errors_are_one_line(tmp_path, no_aws, case, expected):
    photos = write_photos(tmp_path / "photos", 2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file at all")
    (tmp_path / "file").write_text("x")
    inputs, out = {
        "missing input": ([str(tmp_path / "missing")], str(tmp_path / "mds")),
        "empty input": ([str(tmp_path / "empty")], str(tmp_path / "mds")),
        "uri input": (["s3://bucket/photos"], str(tmp_path / "mds")),
        "input twice": ([str(photos), str(photos / "p00.jpg")], str(tmp_path / "mds")),
        "not parquet": ([str(tmp_path / "bad.parquet")], str(tmp_path / "mds")),
        "out is a file": ([str(photos)], str(tmp_path / "file")),
        "out under /proc": ([str(photos)], "/proc/convert-test/mds"),
        "file uri of another host": ([str(photos)], f"file://otherhost{tmp_path}/mds"),
        "mistyped scheme": ([str(photos)], "s4://bucket/mds"),
        "s3 without credentials": ([str(photos)], "s3://bucket/mds"),
    }[case]
    message = error_of(convert.main, [*inputs, "--out", out, "--workers", "1"])
    assert expected in message
    if case == "mistyped scheme":
        assert "s3://" in message and "gs://" in message
    assert not (tmp_path / "mds").exists()


def test_a_file_uri_is_its_path(tmp_path):
    # One rule for every command (t2ibench.core.locations): file:///path is the path /path.
    photos = write_photos(tmp_path / "photos", 2)
    report = convert_main(f"file://{photos}", "--out", f"file://{tmp_path}/mds")
    assert report.written == 2 and (tmp_path / "mds" / "index.json").is_file()


@pytest.mark.parametrize("layout", ["input inside out", "out inside input", "out is input"])
def test_convert_never_writes_over_or_deletes_its_input(tmp_path, layout):
    # A folder holding an MDS dataset *and* the photos: --overwrite must not delete the photos.
    work = tmp_path / "work"
    photos = write_photos(work / "photos", 3)
    convert_main(str(photos), "--out", str(tmp_path / "first"))
    for name in os.listdir(tmp_path / "first"):
        shutil.copy(tmp_path / "first" / name, work / name)
    before = tree(work)
    inputs, out = {"input inside out": (photos, work), "out inside input": (work, photos / "mds"),
                   "out is input": (photos, photos)}[layout]
    message = error_of(convert.main, [str(inputs), "--out", str(out), "--overwrite", "--workers", "1"])
    assert "separate folder" in message
    assert tree(work) == before


def test_convert_overwrite_deletes_only_the_dataset_it_wrote(tmp_path):
    out = tmp_path / "mds"
    convert_main(str(write_photos(tmp_path / "old", 4)), "--out", str(out))
    (out / "notes.txt").write_text("mine")
    new = write_photos(tmp_path / "new", 2, start=10)
    assert "notes.txt" in error_of(convert.main, [str(new), "--out", str(out), "--overwrite"])
    assert (out / "notes.txt").read_text() == "mine" and len(written_keys(out)) == 4  # untouched
    (out / "notes.txt").unlink()
    assert "--overwrite" in error_of(convert.main, [str(new), "--out", str(out)])
    # Reading the old dataset decompressed its shard next to it (Streaming does): that file is
    # listed in index.json, so it is the dataset's and goes too.
    assert "shard.00000.mds" in os.listdir(out)
    report = convert_main(str(new), "--out", str(out), "--overwrite")
    assert sorted(os.listdir(out)) == ["index.json", "shard.00000.mds.zstd"]
    assert report.written == 2 and sorted(written_keys(out)) == ["p10.jpg", "p11.jpg"]


def test_interleaved_tar_members_are_paired_by_key(tmp_path):
    # All images first, then all captions, in another order: no two members of a sample adjacent.
    shards = tmp_path / "wds"
    shards.mkdir()
    members = [(f"{k:06d}.jpg", jpeg(k)) for k in range(5)] + [(f"{k:06d}.txt", f"caption {k}".encode())
                                                                for k in (3, 1, 4, 0, 2)]
    write_tar(shards / "00000.tar", members)
    report = convert_main(str(shards), "--out", str(tmp_path / "mds"))
    assert report.written == 5 and not report.skipped
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(tmp_path / "mds"), batch_size=1, shuffle=False)
    pairs = {dataset[i]["key"]: (dataset[i]["caption"], dataset[i]["jpg"]) for i in range(5)}
    assert pairs == {f"{k:06d}": (f"caption {k}", jpeg(k)) for k in range(5)}


def truncate(path: Path, where: str) -> None:
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    if where == "at a header":  # the file ends exactly where the 7th member's header would start
        cut = members[6].offset
    elif where == "in a header":
        cut = members[6].offset + 100
    else:  # in the data of the last member
        cut = members[-1].offset_data + members[-1].size // 2
    path.write_bytes(data[:cut])


@pytest.mark.parametrize("where", ["at a header", "in a header", "in the data"])
def test_truncated_tar_is_refused_or_converted_with_the_loss_reported(tmp_path, capsys, where):
    shards = tmp_path / "wds"
    shards.mkdir()
    write_tar(shards / "00000.tar", sample_members(range(0, 5)))
    write_tar(shards / "00001.tar", sample_members(range(5, 10)))
    truncate(shards / "00001.tar", where)
    out = tmp_path / "mds"
    message = error_of(convert.main, [str(shards), "--out", str(out), "--workers", "1"])
    assert "00001.tar" in message and "--allow_truncated" in message and not out.exists()

    report = convert_main(str(shards), "--out", str(out), "--allow_truncated")
    assert "00001.tar" in capsys.readouterr().err
    assert any("00001.tar" in w and "lost" in w for w in report.warnings)
    assert written_keys(out)[:5] == [f"{k:06d}" for k in range(5)]
    if where == "in the data":  # 4 whole samples; the 5th image is cut short
        assert report.written == 9 and report.skipped == {convert_inputs.TRUNCATED: 1}
    else:  # 3 samples before the cut; the 7th member (a jpg) and what follows are lost
        assert report.written == 8 and not report.skipped


def test_truncated_gzip_tar_is_refused(tmp_path):
    write_tar(tmp_path / "00000.tar.gz", sample_members(range(4)), mode="w:gz")
    data = (tmp_path / "00000.tar.gz").read_bytes()
    (tmp_path / "00000.tar.gz").write_bytes(data[: len(data) // 2])
    assert "00000.tar.gz" in error_of(convert.main, [str(tmp_path / "00000.tar.gz"), "--out", str(tmp_path / "mds")])


def test_folder_with_tars_and_loose_images_converts_both(tmp_path):
    mixed = write_photos(tmp_path / "mixed", 3)
    write_tar(mixed / "00000.tar", sample_members(range(2)))
    report = convert_main(str(mixed), "--out", str(tmp_path / "all"))
    assert report.written == 5 and not report.not_read
    assert sorted(written_keys(tmp_path / "all")) == ["000000", "000001", "p00.jpg", "p01.jpg", "p02.jpg"]
    # One kind on request: what is left out is in the report, not "skipped 0" alone.
    report = convert_main(str(mixed), "--out", str(tmp_path / "tars"), "--format", "webdataset")
    assert report.written == 2 and "not read: 3 image(s) (--format webdataset)" in report.summary()
    (mixed / "orphan.txt").write_text("a caption without its image")
    report = convert_main(str(mixed), "--out", str(tmp_path / "images"), "--format", "folder")
    assert "1 .tar shard(s) (--format folder)" in report.summary()
    assert "1 .txt file(s) without a same-named image" in report.summary()


class Interrupt(KeyboardInterrupt):
    """What Ctrl-C raises, from the third sample on."""


def interrupt_after_two(monkeypatch) -> None:
    calls = []
    real = convert.prepare

    def prepare(candidate, **kwargs):
        calls.append(candidate.key)
        if len(calls) > 2:
            raise Interrupt
        return real(candidate, **kwargs)

    monkeypatch.setattr(convert, "prepare", prepare)


def test_failed_conversion_leaves_no_index_and_the_rerun_works(tmp_path, monkeypatch):
    photos = write_photos(tmp_path / "photos", 4)
    out = tmp_path / "mds"
    interrupt_after_two(monkeypatch)
    with pytest.raises(Interrupt):
        convert_main(str(photos), "--out", str(out), "--size_limit", "1kb")
    assert not out.exists()  # created by the run, removed with its partial shards
    # An --overwrite that fails keeps the old dataset whole.
    monkeypatch.undo()
    convert_main(str(photos), "--out", str(out))
    before = tree(out)
    interrupt_after_two(monkeypatch)
    with pytest.raises(Interrupt):
        convert_main(str(write_photos(tmp_path / "new", 4, start=10)), "--out", str(out), "--overwrite")
    assert tree(out) == before
    monkeypatch.undo()
    # A run killed outright leaves its staging folder (shards, no index.json): the rerun clears it.
    shutil.rmtree(out)
    (out / convert_inputs.STAGING).mkdir(parents=True)
    (out / convert_inputs.STAGING / "shard.00000.mds").write_bytes(b"partial")
    report = convert_main(str(photos), "--out", str(out))
    assert report.written == 4 and sorted(os.listdir(out)) == ["index.json", "shard.00000.mds.zstd"]
    # Killed while publishing (old index.json already deleted): shards alone, which --overwrite replaces.
    (out / "index.json").unlink()
    assert "--overwrite" in error_of(convert.main, [str(photos), "--out", str(out)])
    assert convert_main(str(photos), "--out", str(out), "--overwrite").written == 4


REAL_PREPARE = convert.prepare


def prepare_or_fail_on_p02(candidate, **kwargs):
    """convert.prepare, except that sample p02.jpg meets a full disk (in a worker process)."""
    if candidate.key == "p02.jpg":
        raise OSError(28, "No space left on device")
    return REAL_PREPARE(candidate, **kwargs)


def test_failure_in_a_worker_process_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    photos = write_photos(tmp_path / "photos", 4)
    monkeypatch.setattr(convert, "prepare", prepare_or_fail_on_p02)  # workers are forked after this
    message = error_of(convert.main, [str(photos), "--out", str(tmp_path / "mds"), "--workers", "2", "--no_progress"])
    assert "No space left on device" in message and not (tmp_path / "mds").exists()


def test_captions_that_are_not_utf8_are_decoded_and_counted(tmp_path):
    photos = write_photos(tmp_path / "photos", 3)
    (photos / "p01.txt").write_bytes("café crème".encode("cp1252"))
    (photos / "p02.txt").write_bytes("\ufeffnaïve".encode("utf-8"))  # UTF-8 with a byte-order mark: fine
    report = convert_main(str(photos), "--out", str(tmp_path / "mds"))
    assert report.written == 3 and report.non_utf8_captions == 1
    assert "1 caption file(s) were not UTF-8 and were read as Windows-1252" in report.summary()
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(tmp_path / "mds"), batch_size=1, shuffle=False)
    assert [dataset[i]["caption"] for i in range(3)] == ["photo 0", "café crème", "naïve"]


# -----------------------------------------------------------------------------------------------
# latents.py
# -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """4 photos converted by convert.py: 2 chunks of 2."""
    root = tmp_path_factory.mktemp("latents-source")
    convert_main(str(write_photos(root / "photos", 4)), "--out", str(root / "mds"))
    return root / "mds"


@pytest.mark.parametrize("extra, expected", [
    (["--max_bad_fraction", "-1"], "--max_bad_fraction -1"),
    (["--max_bad_fraction", "nan"], "--max_bad_fraction nan"),
    (["--seed", "-1"], "--seed -1"),
    (["--chunk_size", "0"], "--chunk_size 0"),
    (["--batch_size", "-2"], "--batch_size -2"),
    (["--image_size", "60"], "--image_size 60"),
    (["--num_workers", "-1"], "--num_workers"),
    (["--size_limit", "0"], "--size_limit 0"),
    (["--cache_limit", "lots"], "--cache_limit lots"),
    (["--compression", "lzma"], "unknown compression"),
    (["--dist_timeout", "0"], "--dist_timeout 0"),
    (["--model_config", "sd9"], "--model_config 'sd9'"),
    # Numbers and sizes are ASCII digits (other scripts' digits were read as numbers), sizes within
    # --image_size's bound, and the bucket list is read bounded (/dev/zero was read until killed).
    (["--size_limit", "٣mb"], "--size_limit ٣mb must be written in ASCII (digits 0-9)"),
    (["--image_size", "٦٤"], "--image_size ٦٤ must be an integer from 1 to 16384"),
    (["--model_config", "sdxl-tiny", "--aspect_buckets", "/dev/zero"],
     "--aspect_buckets /dev/zero is a character device, not a regular file"),
    (["--model_config", "sdxl-tiny", "--aspect_buckets", "{tmp}/buckets.txt"],
     "line 2: '²x64' is not HEIGHTxWIDTH in pixels, each side 1 to 16,384"),  # line 1, after a BOM, is read
    (["--model_config", "sdxl-tiny", "--aspect_buckets", "{tmp}/huge.txt"], "line 1: '8x99999992' is not HEIGHTxWIDTH"),
])
def test_latents_refuses_out_of_range_flags_before_writing(source, tmp_path, extra, expected):
    out = tmp_path / "latents"
    (tmp_path / "buckets.txt").write_bytes("\ufeff64x64\n²x64\n".encode())
    (tmp_path / "huge.txt").write_text("8x99999992\n64x64\n")
    argv = ["--local", str(source), "--out", str(out), *TINY, *[a.format(tmp=tmp_path) for a in extra]]
    assert expected in error_of(latents.main, argv)
    assert not out.exists()


@pytest.mark.parametrize("case, expected", [
    ("no input", "no input"),
    ("local missing", "is not a folder"),
    ("local not MDS", "holds no MDS dataset (no index.json)"),
    ("out is local", "is the input (--local"),
    ("out inside local", "lies inside the input (--local"),
    ("local inside out", "lies inside --out"),
    ("out under /proc", "cannot be written"),
    ("file uri of another host", "a file:// URI names a path on this machine"),
    ("mistyped scheme", "unknown URI scheme 's4://'"),
    ("s3 out without credentials", "no AWS credentials"),
])
def test_latents_user_errors_are_one_line(source, tmp_path, no_aws, case, expected):
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "latents")
    argv = {
        "no input": ["--out", out],
        "local missing": ["--local", str(tmp_path / "missing"), "--out", out],
        "local not MDS": ["--local", str(tmp_path / "empty"), "--out", out],
        "out is local": ["--local", str(source), "--out", str(source)],
        "out inside local": ["--local", str(source), "--out", str(source / "latents")],
        "local inside out": ["--local", str(source), "--out", str(source.parent), "--overwrite"],
        "out under /proc": ["--local", str(source), "--out", "/proc/latents-test"],
        "file uri of another host": ["--remote", f"file://otherhost{source}", "--out", out],
        "mistyped scheme": ["--remote", "s4://bucket/mds", "--out", out],
        "s3 out without credentials": ["--local", str(source), "--out", "s3://bucket/latents"],
    }[case]
    before = tree(source.parent)
    assert expected in error_of(latents.main, [*argv, *TINY])
    assert tree(source.parent) == before and not Path(out).exists()


def test_latents_resume_refuses_a_replaced_source_and_overwrite_keeps_foreign_files(source, tmp_path):
    src, out = tmp_path / "src", tmp_path / "latents"
    shutil.copytree(source, src)
    report = latents.main(["--local", str(src), "--out", str(out), *TINY, "--max_chunks", "1"])
    assert report["chunks_left"] == 1
    settings = json.loads((out / RECORD_FILE).read_text())
    assert len(settings["source_index_sha256"]) == 64

    # The source replaced at the same path by another dataset of the same size.
    shutil.rmtree(src)
    convert_main(str(write_photos(tmp_path / "other", 4, start=20)), "--out", str(src))
    message = error_of(latents.main, ["--local", str(src), "--out", str(out), *TINY])
    assert "another version of the source" in message and "--overwrite" in message
    assert sorted(p.name for p in out.iterdir()) == ["chunk000000", "precompute.json"]  # nothing written

    (out / "my-notes.txt").write_text("mine")
    message = error_of(latents.main, ["--local", str(src), "--out", str(out), *TINY, "--overwrite"])
    assert "my-notes.txt" in message and (out / "chunk000000" / "index.json").is_file()
    (out / "my-notes.txt").unlink()
    report = latents.main(["--local", str(src), "--out", str(out), *TINY, "--overwrite"])
    assert report["samples"] == 4
    settings_now = json.loads((out / RECORD_FILE).read_text())
    assert settings_now["source_index_sha256"] != settings["source_index_sha256"]


def test_latents_wrong_column_is_one_line(source, tmp_path):
    message = error_of(latents.main, ["--local", str(source), "--out", str(tmp_path / "latents"), *TINY,
                                      "--image_key", "png"])
    assert "image_key='png' is not a column" in message and not (tmp_path / "latents").exists()


# -----------------------------------------------------------------------------------------------
# The command lines: exit status, one line on stderr, no traceback.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script, argv, expected", [
    ("convert.py", ["{tmp}", "--out", "{tmp}/mds", "--quality", "500"], "--quality 500"),
    ("latents.py", ["--local", "{tmp}", "--out", "{tmp}/x", "--max_bad_fraction", "-1"], "--max_bad_fraction -1"),
])
def test_command_line_errors_exit_nonzero_without_traceback(tmp_path, script, argv, expected):
    write_photos(tmp_path, 1)
    result = preloaded.run([sys.executable, str(ROOT / script), *[a.format(tmp=tmp_path) for a in argv]],
                           cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and expected in lines[0], result.stderr
