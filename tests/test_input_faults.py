"""The classes of bad input a fuzz found (nothing lost, nothing hung, nothing trained on the wrong
data), one or a few tests per class, each through the real command: two writers into one output,
a corrupt compressed shard read by loader workers, a stale cache of a re-converted remote,
precomputed data that does not fit the run, a full disk, a truncated latest checkpoint, malformed
files and flags, and messages that must point at the cause.

Real parts throughout: shards written by MDSWriter, Composer runs through the commands' `main`
(in this process) or their command line (a subprocess, always with a timeout, where a hang or the
exit status matters), a full disk made by mounting a 64 KiB tmpfs (the tests run as root; they
are skipped, saying why, where mounting is not allowed).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import benchmark
import convert
import cost
import export
import latents
from t2ibench.datasets import convert_inputs
from tests import preloaded
from tests.helpers import ROOT, TINY_MODEL, error_of, jpeg, killed_in_child, write_images

# A run that must end in one line within this many seconds, or it hangs (it hung until killed).
COMMAND_TIMEOUT_SECONDS = 180
TINY = [*TINY_MODEL, "--max_duration", "2ba", "--warmup_batches", "1"]


def write_photos(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"p{i:03d}.jpg").write_bytes(jpeg(i))
        (folder / f"p{i:03d}.txt").write_text(f"photo {i}")
    return folder


def corrupt(path: Path) -> None:
    """Random bytes of the same size: the index's size check passes, decoding does not."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


def run_command(*argv: str, timeout: float = COMMAND_TIMEOUT_SECONDS,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A command line of this repository, killed (and the test failed) if it outlives `timeout`."""
    return preloaded.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


def one_line_error(result: subprocess.CompletedProcess, prog: str) -> str:
    """The command failed with exactly one error line and no traceback; that line."""
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def readable_samples(folder: Path) -> int:
    """Samples StreamingDataset reads back from a local MDS dataset, every one of them."""
    from streaming import StreamingDataset
    dataset = StreamingDataset(local=str(folder), batch_size=1, shuffle=False)
    return sum(1 for i in range(dataset.num_samples) if dataset[i] is not None)


# -----------------------------------------------------------------------------------------------
# 1. Two writers, one output: the second is refused; the first completes, every shard there.
# -----------------------------------------------------------------------------------------------

def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the first command ended before {what}: {process.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.002)


@pytest.mark.multirank
def test_a_second_convert_into_the_same_out_is_refused_and_the_first_completes(tmp_path):
    photos = write_photos(tmp_path / "photos", 300)
    out = tmp_path / "out"
    first = preloaded.PreloadedPopen([sys.executable, "convert.py", str(photos), "--out", str(out), "--workers", "1",
                              "--no_progress", "--size_limit", "2kb"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    staging = out / convert_inputs.STAGING
    try:
        wait_for(lambda: staging.is_dir() and any(staging.glob("shard.*")), first, "shard in its staging folder")
        first.send_signal(signal.SIGSTOP)  # the first conversion is half-way, for as long as the second takes
        try:
            message = error_of(convert.main, [str(photos), "--out", str(out), "--workers", "1", "--no_progress"],
                               "convert.py")
        finally:
            first.send_signal(signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=COMMAND_TIMEOUT_SECONDS)
    finally:
        first.kill()
    assert f"--out {out} is being written by another command" in message
    assert first.returncode == 0, stderr[-2000:]
    assert "wrote 300 samples" in stdout
    index = json.loads((out / "index.json").read_text())
    assert all((out / shard["zip_data"]["basename"]).is_file() for shard in index["shards"])
    assert readable_samples(out) == 300


def test_every_command_refuses_an_output_another_one_is_writing(tmp_path):
    """export.py, latents.py and benchmark.py hold their outputs as convert.py does (files.hold_output)."""
    from t2ibench.core.files import acquire

    checkpoint = tmp_path / "run.pt"
    checkpoint.write_bytes(b"not a checkpoint: never read, the output is refused first")
    images = write_images(tmp_path / "images", 4, compression="zstd")
    out = tmp_path / "out"
    commands = [
        (export.main, "export.py", "--out", [str(checkpoint), "--out", str(out)]),
        (latents.main, "latents.py", "--out", ["--local", str(images), "--out", str(out), "--model_config", "tiny",
                                               "--image_size", "32", "--num_workers", "0", "--no_progress"]),
        (benchmark.main, "benchmark.py", "--save_folder", [*SYNTH, "--save_folder", str(out)]),
        (benchmark.main, "benchmark.py", "--ema_export_dir", [*SYNTH, "--use_ema", "--ema_export_dir", str(out)]),
    ]
    for main, prog, flag, argv in commands:
        hold = acquire(flag, out)  # what the same command, still writing, holds
        try:
            message = error_of(main, argv, prog)
        finally:
            hold.release()
        assert f"{flag} {out} is being written by another command" in message
        assert not out.exists()  # the refused command left nothing (the hold removed the folder it made)


SYNTH = [*TINY, "--use_synth_data", "--num_workers", "0"]


# -----------------------------------------------------------------------------------------------
# 2. A corrupt compressed shard read by loader workers: one line naming the shard, quickly.
# -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corrupt_shards(tmp_path_factory) -> Path:
    """Image shards (zstd, several) whose second shard is random bytes of its own size."""
    out = write_images(tmp_path_factory.mktemp("corrupt") / "mds", 16, compression="zstd", size_limit=4096)
    corrupt(out / "shard.00001.mds.zstd")
    return out


@pytest.mark.multirank  # the point is several loader processes sharing Streaming's shard state
def test_corrupt_zstd_shard_with_two_loader_workers_ends_naming_it(corrupt_shards, tmp_path):
    # Streamed through a cache, as from a remote: it hung after the first batch until killed.
    result = run_command("benchmark.py", *TINY, "--max_duration", "4ba", "--num_workers", "2", "--remote",
                         str(corrupt_shards), "--local", str(tmp_path / "cache"), "--allow_random_encoders")
    line = one_line_error(result, "benchmark.py")
    assert f"shard {corrupt_shards}/shard.00001.mds.zstd cannot be read" in line
    assert "batch_size" not in line


def test_a_shard_failure_in_either_of_streamings_threads_is_not_logged_as_a_traceback():
    # Streaming's download and ready threads may both fail, on one shard each: the callback of the first to
    # finish saw the other's error as the last one remembered, took its own for another and re-raised it, and
    # concurrent.futures logged a traceback (seen once under a heavier load, three pytest workers on two cores).
    from concurrent.futures import Future
    from threading import Event

    import data

    dataset = object.__new__(data.StreamingImageCaptions)  # the callback's state alone: no shards needed
    first, second = OSError("shard.00001.mds.zstd: the ready thread's read"), OSError("the download thread's read")
    dataset._failed_shard, dataset._shard_errors = ("shard.00001.mds.zstd", second), [first, second]
    dataset._event = Event()
    for error in (first, second):
        future = Future()
        future.set_exception(error)
        dataset.on_exception(future)  # no raise: the yield loop raises the shard's error, naming it
        assert dataset._event.is_set()
    other = Future()
    other.set_exception(ValueError("not a shard's"))
    with pytest.raises(ValueError):
        dataset.on_exception(other)  # anything else, as Streaming does


def test_corrupt_zstd_shard_without_workers_is_not_blamed_on_the_batch_size(corrupt_shards, capsys):
    message = error_of(benchmark.cli, [*TINY, "--max_duration", "4ba", "--num_workers", "0", "--local",
                                       str(corrupt_shards), "--allow_random_encoders"], "benchmark.py")
    assert f"shard {corrupt_shards}/shard.00001.mds.zstd cannot be read" in message
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.multirank  # the point is several loader processes sharing Streaming's shard state
def test_corrupt_zstd_shard_in_latents_with_two_workers_ends_naming_it(corrupt_shards, tmp_path):
    result = run_command("latents.py", "--local", str(corrupt_shards), "--out", str(tmp_path / "latents"),
                         "--model_config", "tiny", "--image_size", "32", "--batch_size", "2", "--chunk_size", "4",
                         "--num_workers", "2", "--no_progress")
    line = one_line_error(result, "latents.py")
    assert f"shard {corrupt_shards}/shard.00001.mds.zstd cannot be read" in line


# -----------------------------------------------------------------------------------------------
# 6. --autoresume with the latest checkpoint cut short: resumed from the newest complete one.
# -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_autoresume_from_a_truncated_latest_checkpoint_resumes_from_the_one_before(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*SYNTH, "--save_folder", str(run), "--save_interval", "1ba", "--autoresume", "--run_name", "cut"]
    benchmark.main(argv)
    latest = run / "ep0-ba2-rank0.pt"
    assert (run / "latest-rank0.pt").resolve() == latest.resolve()
    whole = latest.read_bytes()
    latest.write_bytes(whole[:len(whole) // 2])
    capsys.readouterr()
    results = benchmark.main([*argv, "--max_duration", "3ba"])
    err = capsys.readouterr().err
    assert ("the latest checkpoint ep0-ba2-rank0.pt is incomplete (cut short; kept as ep0-ba2-rank0.pt.truncated); "
            "resuming from the newest complete one, ep0-ba1-rank0.pt") in err
    assert (run / "ep0-ba2-rank0.pt.truncated").stat().st_size == len(whole) // 2  # the user's bytes, kept
    assert results["measured_batches"] + results["warmup_batches"] == 2  # batches 2 and 3, from batch 1
    assert (run / "latest-rank0.pt").resolve().name == "ep0-ba3-rank0.pt"


def test_autoresume_with_latest_pointing_at_a_checkpoint_that_is_gone_stops_in_one_line(tmp_path):
    """A latest-rank0.pt whose checkpoint was moved or deleted is not "no checkpoint yet": Composer would
    train from batch 0 and replace the link. Refused before anything is built, the link left as it was."""
    run = tmp_path / "run"
    argv = [*SYNTH, "--save_folder", str(run), "--save_interval", "1ba", "--autoresume", "--run_name", "gone"]
    benchmark.main(argv)
    link = run / "latest-rank0.pt"
    assert os.readlink(link) == "ep0-ba2-rank0.pt"
    # Moved away, with an older checkpoint still beside the link.
    (run / "ep0-ba2-rank0.pt").rename(tmp_path / "elsewhere.pt")
    message = error_of(benchmark.main, [*argv, "--max_duration", "3ba"], "benchmark.py")
    assert f"--autoresume: {link} points at ep0-ba2-rank0.pt, which is gone (moved or deleted)" in message
    # Every checkpoint deleted, through the command line's entry: SystemExit with the line as its code
    # (Python prints it and exits with status 1, as for every user error).
    (run / "ep0-ba1-rank0.pt").unlink()
    with pytest.raises(SystemExit) as stopped:
        benchmark.cli([*argv, "--max_duration", "3ba"])
    assert stopped.value.code == message
    assert os.readlink(link) == "ep0-ba2-rank0.pt" and sorted(p.name for p in run.iterdir()) == ["latest-rank0.pt"]


# -----------------------------------------------------------------------------------------------
# 3. A dataset re-converted in place at its --remote: the old cached copy is refused, not trained on.
# -----------------------------------------------------------------------------------------------

@pytest.fixture
def s3(monkeypatch, s3_endpoint):
    """The environment Streaming and boto3 read for the S3 server on loopback, and a client with a bucket "data"."""
    import boto3

    for name, value in (("S3_ENDPOINT_URL", s3_endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="data")
    return client


@pytest.mark.slow
def test_a_remote_converted_again_is_not_trained_from_its_old_cache(tmp_path, s3):
    first, second = write_photos(tmp_path / "first", 8), write_photos(tmp_path / "second", 12)
    (second / "p000.jpg").write_bytes(jpeg(99))  # other pixels, as well as other samples
    remote = "s3://data/laion/mds"  # a local --remote takes the same check (sources.check_cache_current)
    convert.main([str(first), "--out", remote, "--workers", "1", "--no_progress"])
    argv = [*TINY, "--num_workers", "0", "--remote", remote, "--local", str(tmp_path / "cache"),
            "--allow_random_encoders"]
    benchmark.main(argv)  # fills the cache
    convert.main([str(second), "--out", remote, "--workers", "1", "--no_progress", "--overwrite"])
    message = error_of(benchmark.main, argv, "benchmark.py")
    assert f"--local {tmp_path / 'cache'} holds an older copy of --remote {remote}" in message
    latents_argv = ["--remote", remote, "--local", str(tmp_path / "cache"), "--out", str(tmp_path / "latents"),
                    "--model_config", "tiny", "--image_size", "32", "--num_workers", "0", "--no_progress"]
    assert "holds an older copy" in error_of(latents.main, latents_argv, "latents.py")
    assert not (tmp_path / "latents").exists()


# -----------------------------------------------------------------------------------------------
# 4. Precomputed data that does not fit the run: every shard of every source checked, in one line.
# -----------------------------------------------------------------------------------------------

PRECOMPUTED = ["--model_config", "tiny", "--batch_size", "4", "--max_duration", "2ba", "--num_workers", "0",
               "--precomputed"]


def write_latents(out: Path, count: int = 8, image_size: int = 32, channels: int = 4, shapeless: bool = False,
                  token_max: int = 100, nan: bool = False) -> Path:
    """Precomputed shards in latents.py's format (precomputed.mds_columns), written by MDSWriter, made wrong as asked."""
    from streaming import MDSWriter
    from t2ibench.datasets import precomputed
    from t2ibench.families import MODEL_CONFIGS

    family = MODEL_CONFIGS["tiny"]
    columns = precomputed.mds_columns(channels, image_size // 8, None, "fp16", True, family=family, config="tiny")
    if shapeless:
        columns["latent_mean"] = columns["latent_logvar"] = "ndarray:float16"
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(out), columns=columns, compression="zstd") as writer:
        for i in range(count):
            mean = rng.standard_normal((channels, image_size // 8, image_size // 8)).astype(np.float16)
            if nan:
                mean[:] = np.nan
            sample = {"index": i, "latent_mean": mean, "latent_logvar": np.full_like(mean, -10), "caption": f"c {i}"}
            for key, shape in precomputed.stored_shapes(family, "tiny", False).items():
                sample[precomputed.token_column(key, family)] = rng.integers(0, token_max, shape).astype(np.uint16)
            writer.write(sample)
    return out


@pytest.mark.parametrize("case, size, expected", [
    ("shapeless", 64, "shard shard.00000.mds.zstd stores latent_mean as 'ndarray:float16', without a fixed shape"),
    ("32px at --image_size 64", 64, "holds latents of 32x32 images, not --image_size 64"),
    ("3 channels", 32, "holds 3-channel latents; the VAE of --model_config tiny makes 4"),
    ("merged parts of two sizes", 32, "shard b/shard.00000.mds.zstd holds latents of 64x64 images, not --image_size 32"),
])
def test_precomputed_shards_that_do_not_fit_are_refused_before_training(tmp_path, case, size, expected):
    from streaming.base.util import merge_index

    folder = tmp_path / "latents"
    if case == "merged parts of two sizes":
        write_latents(folder / "a", image_size=32), write_latents(folder / "b", image_size=64)
        merge_index([str(folder / "a" / "index.json"), str(folder / "b" / "index.json")], str(folder))
    else:
        write_latents(folder, shapeless=case == "shapeless", channels=3 if case == "3 channels" else 4)
    message = error_of(benchmark.main, [*PRECOMPUTED, "--image_size", str(size), "--local", str(folder)],
                       "benchmark.py")
    assert expected in message


@pytest.mark.parametrize("case, expected", [
    ("token ids beyond the vocabulary", "token_ids holds token id 6"),
    ("NaN latents", "latent_mean is not finite (NaN or infinity): the latents were computed wrongly"),
])
def test_precomputed_values_that_cannot_train_name_the_shard_not_the_learning_rate(tmp_path, case, expected):
    folder = write_latents(tmp_path / "latents", token_max=65535 if "token" in case else 100, nan="NaN" in case)
    argv = [*PRECOMPUTED, "--image_size", "32", "--local", str(folder)]
    if "token" in case:  # without loader workers, in this process
        line = error_of(benchmark.cli, argv, "benchmark.py")
    else:  # found in a loader worker: the same line
        line = one_line_error(run_command("benchmark.py", *argv, "--num_workers", "2"), "benchmark.py")
    assert f"shard {folder}/shard.00000.mds.zstd, sample " in line and expected in line
    assert "--lr" not in line and "BadDataError" not in line


# -----------------------------------------------------------------------------------------------
# 7. Malformed files and flags that reached Python's errors.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage, expected", [
    (lambda index: index["shards"][0].update(samples="lots"), "shard 0 has 'samples': 'lots', not a count"),
    (lambda index: index.update(shards=["shard.00000.mds"]), "shard 0 is str ('shard.00000.mds'), not an object"),
    (lambda index: index["shards"][0]["raw_data"].pop("basename"), "its raw_data has no file name"),
    (lambda index: index["shards"][1].update(samples=0), "shard shard.00001.mds holds no samples (index.json lists 0)"),
])
def test_index_fields_of_the_wrong_type_are_one_line(tmp_path, damage, expected):
    folder = write_images(tmp_path / "mds", 16, compression=None, size_limit=4096)
    index = json.loads((folder / "index.json").read_text())
    damage(index)
    (folder / "index.json").write_text(json.dumps(index))
    message = error_of(benchmark.main, [*TINY, "--num_workers", "0", "--local", str(folder)], "benchmark.py")
    assert expected in message and str(folder) in message


@pytest.mark.parametrize("content, expected", [
    (b'--batch_size "8\n', "flag file @{path}, line 1: No closing quotation"),
    (b"--batch_size 8  # caf\xe9\n", "flag file @{path} is not UTF-8 text"),
])
def test_flag_files_with_an_open_quote_or_not_utf8_are_one_line(tmp_path, content, expected):
    path = tmp_path / "flags.args"
    path.write_bytes(content)
    for main, prog in ((benchmark.main, "benchmark.py"), (convert.main, "convert.py"), (cost.main, "cost.py")):
        assert expected.format(path=path) in error_of(main, [f"@{path}"], prog)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of a tiny run (the encoders in it: trained online)."""
    run = tmp_path_factory.mktemp("run")
    benchmark.main([*SYNTH, "--save_folder", str(run), "--save_interval", "2ba"])
    return run / "latest-rank0.pt"


@pytest.mark.parametrize("damage, expected", [
    ("shape", "its vae weights do not fit the vae of this model"),
    ("nan", "unet.conv_in.weight holds NaN or infinite values"),
])
def test_export_of_damaged_or_nan_weights_is_refused_and_writes_nothing(checkpoint, tmp_path, damage, expected):
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    model = state["state"]["model"]
    if damage == "shape":
        key = next(k for k in model if k.startswith("vae.") and k.endswith("conv_in.weight"))
        model[key] = model[key][:, :1]
    else:
        model["unet.conv_in.weight"] = torch.full_like(model["unet.conv_in.weight"], float("nan"))
    damaged = tmp_path / "damaged.pt"
    torch.save(state, damaged)
    out = tmp_path / "pipeline"
    assert expected in error_of(export.main, [str(damaged), "--out", str(out)], "export.py")
    assert not out.exists()


@pytest.mark.parametrize("field, value, expected", [
    ("world_size", 10**400, "'world_size' must be a positive integer (GPUs, at most 1,000,000), got a number of 401 digits"),
    ("model_config", ["sd2-base"], "'model_config' must be a model configuration name"),
])
def test_cost_results_with_absurd_fields_are_one_line(tmp_path, field, value, expected):
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"images_per_sec": 100.0, "world_size": 8, field: value}))
    assert expected in error_of(cost.main, [str(results)], "cost.py")


def test_gpu_report_out_naming_a_file_is_refused(tmp_path):
    import gpu_report

    existing = tmp_path / "results.txt"
    existing.write_text("mine")
    message = error_of(gpu_report.main, ["--dry_run", "--gpus", "8", "--gpu_memory_gib", "79.1", "--out",
                                         str(existing)], "gpu_report.py")
    assert "is a file, not a folder" in message and existing.read_text() == "mine"


# -----------------------------------------------------------------------------------------------
# 8. Messages that point at the cause (the shard, the file), not elsewhere.
# -----------------------------------------------------------------------------------------------

def test_a_damaged_parquet_page_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "photos.parquet"
    pq.write_table(pa.table({"jpg": [jpeg(i) for i in range(600)], "txt": [f"c {i}" for i in range(600)]}), path,
                   row_group_size=300)
    content = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    content[start + 100:start + 3000] = b"\xab" * 2900  # the second row group's first page; the footer is intact
    path.write_bytes(bytes(content))
    message = error_of(convert.main, [str(path), "--out", str(tmp_path / "out"), "--workers", "1", "--no_progress"],
                       "convert.py")
    assert f"{path} cannot be read after row" in message and "the file is damaged" in message
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------------------------
# 9. A writer killed mid-write (a preempted job): what it left is taken over by the rerun; what the
#    user put in the folder still stops it. Leftovers made by the real code, killed at a set point.
# -----------------------------------------------------------------------------------------------

def staged_pipeline(folder: Path) -> None:
    """What export.py and --ema_export_dir write, through the same staged folder: parts, model_index.json last."""
    from t2ibench.core.files import staged_folder

    folder.mkdir(parents=True, exist_ok=True)
    with staged_folder(folder, last="model_index.json") as staging:
        for part in ("unet", "vae"):
            os.makedirs(staging / part)
            (staging / part / "config.json").write_text("{}")
        (staging / "model_index.json").write_text("{}")


def copy_with(folder: Path, to: Path, name: str, content: str = "mine") -> Path:
    """A copy of `folder` with the user's file `name` added."""
    shutil.copytree(folder, to, symlinks=True)
    (to / name).write_text(content)
    return to


def test_what_a_killed_export_left_is_taken_over_and_a_users_file_is_not(checkpoint, tmp_path):
    from t2ibench.core.files import STAGING_FOLDER, acquire

    out = tmp_path / "pipe"
    # Killed while moving the finished parts into place (the 1st replace writes the staging marker).
    killed_in_child(lambda: staged_pipeline(out), on="replace", match=f"{STAGING_FOLDER}/", nth=3)
    left = sorted(os.listdir(out))
    assert len(left) == 2 and STAGING_FOLDER in left  # one part moved, the rest still staged
    # Anything the user put there: refused, and nothing of it touched.
    other = copy_with(out, tmp_path / "other", "notes.txt")
    message = error_of(export.main, [str(checkpoint), "--out", str(other)], "export.py")
    assert f"--out {other} exists and is not an empty folder" in message
    assert (other / "notes.txt").read_text() == "mine" and (other / STAGING_FOLDER).is_dir()
    # A staging folder without this project's marker is the user's.
    theirs = tmp_path / "theirs"
    (theirs / STAGING_FOLDER).mkdir(parents=True)
    (theirs / STAGING_FOLDER / "draft.txt").write_text("mine")
    assert "exists and is not an empty folder" in error_of(export.main, [str(checkpoint), "--out", str(theirs)])
    assert (theirs / STAGING_FOLDER / "draft.txt").read_text() == "mine"
    # A staging folder of an export still running (it holds --out) is never taken over.
    hold = acquire("--out", out)
    try:
        assert f"--out {out} is being written by another command" in error_of(export.main, [str(checkpoint), "--out",
                                                                                                str(out)])
    finally:
        hold.release()
    assert sorted(os.listdir(out)) == left
    # The rerun takes over: a whole pipeline, nothing of the killed one left.
    export.main([str(checkpoint), "--out", str(out)])
    assert STAGING_FOLDER not in os.listdir(out) and json.loads((out / "model_index.json").read_text())["unet"]
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()


def test_an_ema_export_killed_while_written_does_not_block_the_rerun(tmp_path):
    from t2ibench.core.files import STAGING_FOLDER

    ema = tmp_path / "ema"
    killed_in_child(lambda: staged_pipeline(ema), on="makedirs", match=f"{STAGING_FOLDER}/vae")
    assert os.listdir(ema) == [STAGING_FOLDER]
    other = copy_with(ema, tmp_path / "other", "README.md")
    message = error_of(benchmark.main, [*SYNTH, "--use_ema", "--ema_export_dir", str(other)], "benchmark.py")
    assert f"--ema_export_dir {other} is not empty" in message and (other / "README.md").read_text() == "mine"
    benchmark.main([*SYNTH, "--use_ema", "--ema_export_dir", str(ema)])
    assert sorted(os.listdir(ema)) == ["model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae"]


def test_latents_killed_writing_its_record_does_not_block_the_rerun(tmp_path):
    from t2ibench.core.files import write_text
    from t2ibench.datasets.precomputed import RECORD_FILE

    images = write_images(tmp_path / "images", 4, compression="zstd")
    out = tmp_path / "latents"
    out.mkdir()
    # The record is latents.py's first file (latent_store.write_json: files.write_text), killed before its rename.
    killed_in_child(lambda: write_text(out / RECORD_FILE, "{}"), on="replace", match=f"/.{RECORD_FILE}.")
    assert len(os.listdir(out)) == 1 and os.listdir(out)[0].endswith(".partial")
    argv = ["--out", str(out), "--model_config", "tiny", "--image_size", "32", "--num_workers", "0", "--no_progress"]
    other = copy_with(out, tmp_path / "other", "notes.txt")
    message = error_of(latents.main, ["--local", str(images), *argv[:1], str(other), *argv[2:]], "latents.py")
    assert "not empty and holds no precomputed latents" in message and (other / "notes.txt").is_file()
    report = latents.main(["--local", str(images), *argv])
    assert report["samples"] == 4 and sorted(os.listdir(out)) == ["chunk000000", "index.json", RECORD_FILE]


def test_convert_killed_while_publishing_is_rerun_without_overwrite(tmp_path):
    photos = write_photos(tmp_path / "photos", 12)
    out = tmp_path / "out"
    argv = [str(photos), "--out", str(out), "--workers", "1", "--no_progress", "--size_limit", "4kb"]
    # Killed after moving the first shard out of its staging folder, before index.json.
    killed_in_child(lambda: convert.main(argv), on="replace", match=f"/{convert_inputs.STAGING}/", nth=2)
    assert not (out / "index.json").exists() and len(list(out.glob("shard.*"))) == 1
    other = copy_with(out, tmp_path / "other", "notes.txt")
    message = error_of(convert.main, [str(photos), "--out", str(other), "--workers", "1", "--no_progress"])
    assert f"--out {other} is not empty" in message and (other / "notes.txt").is_file()
    report = convert.main(argv)
    assert report.written == 12 and readable_samples(out) == 12
    assert sorted(os.listdir(out)) == ["index.json", *sorted(p.name for p in out.glob("shard.*"))]


@pytest.mark.multirank  # several commands: each killed with SIGKILL, then run again
def test_commands_killed_with_sigkill_while_exporting_finish_when_run_again(checkpoint, tmp_path):
    """The real commands, killed by a real SIGKILL mid-export (tests/kill_run.py), then rerun: export.py
    --out, and a benchmark.py --autoresume job whose --ema_export_dir was being written (a preempted job)."""
    from t2ibench.core.files import STAGING_FOLDER

    out = tmp_path / "pipe"
    killed = run_command("tests/kill_run.py", "--on", "makedirs", "--match", f"{STAGING_FOLDER}/", "--nth", "2",
                         "export.py", str(checkpoint), "--out", str(out), env={"PYTHONPATH": str(ROOT)})
    assert killed.returncode == -signal.SIGKILL and os.listdir(out) == [STAGING_FOLDER], killed.stderr[-2000:]
    export.main([str(checkpoint), "--out", str(out)])
    assert STAGING_FOLDER not in os.listdir(out) and (out / "model_index.json").is_file()

    ema, run = tmp_path / "ema", tmp_path / "run"
    job = [*SYNTH, "--use_ema", "--ema_export_dir", str(ema), "--save_folder", str(run), "--save_interval", "1ba",
           "--autoresume", "--run_name", "preempted"]
    killed = run_command("tests/kill_run.py", "--on", "makedirs", "--match", f"{STAGING_FOLDER}/", "--nth", "2",
                         "benchmark.py", *job, env={"PYTHONPATH": str(ROOT)})
    assert killed.returncode == -signal.SIGKILL and os.listdir(ema) == [STAGING_FOLDER], killed.stderr[-2000:]
    results = benchmark.main(job)  # the retried job: trained already, exports now
    assert results["already_complete"]
    assert STAGING_FOLDER not in os.listdir(ema) and (ema / "model_index.json").is_file()
