"""Bad input to benchmark.py: each class of mistake stops at once, before anything is built,
with one line naming the flag or file; user errors print no traceback; nothing hangs. Also: a retried
--autoresume job that already finished exits 0, and an offline W&B run records the benchmark's metrics.

Most cases call `benchmark.main` in this process (validation runs before the model, the data or the
Trainer is built); a few run the command line to check exit codes and that no traceback is printed.
"""
from __future__ import annotations

import json
import shutil
import os
import sys
import zipfile
from pathlib import Path

import pytest

import benchmark
import data
from t2ibench.datasets import precomputed
from t2ibench.datasets.sources import Source, record_cache
from tests import preloaded
from tests.helpers import REAL_2BA, ROOT, TINY_2BA, error_of, free_port, offline_env, run_cli, write_images, write_latents


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images") / "mds", 6)


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> Path:
    return write_latents(tmp_path_factory.mktemp("latents") / "mds", 6, text_dim=8)


# -----------------------------------------------------------------------------------------------
# Flags: counts, rates, time strings, precision.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["--num_synthetic_samples", "3"], "--num_synthetic_samples"),  # fewer than one batch: used to hang
    (["--num_synthetic_samples", "3", "--max_duration", "1ep"], "--num_synthetic_samples"),  # 0 batches
    (["--num_synthetic_samples", "0"], "--num_synthetic_samples"),
    (["--max_duration", "10tok"], "--max_duration"),  # tokens are never counted: used to hang
    (["--max_duration", "0ba"], "--max_duration"),
    (["--max_duration", "0.5dur"], "--max_duration"),
    (["--max_duration", "2sp"], "--max_duration"),  # less than one global batch of 4
    (["--save_interval", "0ba"], "--save_interval"),  # used to save nothing
    (["--save_interval", "100tok"], "--save_interval"),
    (["--log_interval", "0ba"], "--log_interval"),
    (["--log_interval", "8sp"], "--log_interval"),
    (["--predownload", "-5"], "--predownload"),  # used to hang
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--weight_decay", "-1"], "--weight_decay"),
    (["--download_retry", "-1"], "--download_retry"),
    (["--download_timeout", "0"], "--download_timeout"),
    (["--max_bad_fraction", "1.5"], "--max_bad_fraction"),
    (["--cache_limit", "lots"], "--cache_limit"),
    (["--validate_hash", "md6"], "--validate_hash"),
    (["--peak_tflops", "nan"], "--peak_tflops"),
    (["--max_duration=-5ba"], "--max_duration"),
    (["--save_num_checkpoints_to_keep", "-2"], "--save_num_checkpoints_to_keep"),
    (["--precision", "amp_fp16"], "--precision"),  # CPU only here
    (["--remote", "/data/mds"], "--use_synth_data"),  # would be ignored silently
])
def test_bad_numbers_and_units_fail_at_once(args, flag):
    assert flag in error_of(benchmark.main, TINY_2BA + args)


def test_saving_over_an_earlier_runs_checkpoints_is_refused(tmp_path):
    (tmp_path / "ep0-ba2-rank0.pt").write_bytes(b"an earlier run's checkpoint")
    message = error_of(benchmark.main, TINY_2BA + ["--save_folder", str(tmp_path)])
    assert "--save_folder" in message and "--autoresume" in message
    assert (tmp_path / "ep0-ba2-rank0.pt").read_bytes() == b"an earlier run's checkpoint"


def test_keeping_zero_local_checkpoints_is_refused(tmp_path):
    message = error_of(benchmark.main, TINY_2BA + ["--save_folder", str(tmp_path), "--save_num_checkpoints_to_keep", "0"])
    assert "--save_num_checkpoints_to_keep" in message and "-1" in message


# -----------------------------------------------------------------------------------------------
# Flags that would do nothing beside the others given (checks.check_flags_that_act): refused in one
# line, as --synthetic_bucket_weights without --aspect_buckets always was.
# -----------------------------------------------------------------------------------------------

XL_BUCKETS = ["--model_config", "sdxl-tiny", "--image_size", "64", "--aspect_buckets"]


@pytest.mark.parametrize("data, args, expect", [
    ("synthetic", ["--bucket_crop", "center"], "--bucket_crop center would do nothing: images are squares without "
     "--aspect_buckets"),
    ("synthetic", [*XL_BUCKETS, "--bucket_crop", "center"], "--bucket_crop center would do nothing: --use_synth_data"),
    ("synthetic", ["--no_shuffle", "--epoch_size", "100", "--image_key", "png"],
     "--no_shuffle, --epoch_size 100, --image_key png would do nothing: --use_synth_data draws random samples"),
    ("images", ["--num_synthetic_samples", "8"], "--num_synthetic_samples 8 would do nothing: this run reads real data"),
    ("latents", ["--caption_key", "txt", "--max_bad_fraction", "0.5"],
     "--caption_key txt, --max_bad_fraction 0.5 would do nothing: --precomputed reads latents.py's shards"),
    ("synthetic", ["--sampler", "ddim", "--guidance_scale", "3"],
     "--sampler ddim, --guidance_scale 3.0 would do nothing: no sample grid is drawn without --sample_prompts"),
    ("synthetic", ["--save_interval", "1ba"], "--save_interval 1ba would do nothing: no checkpoint is saved"),
    ("synthetic", ["--profile_dir", "prof"], "--profile_dir prof would do nothing: no batch is profiled"),
    ("synthetic", ["--norm_precision", "fp32"], "--norm_precision fp32 would do nothing: this run is fp32"),
])
def test_a_flag_that_would_do_nothing_is_refused_in_one_line(images, latents, data, args, expect):
    base = {"synthetic": TINY_2BA, "images": [*REAL_2BA, "--local", str(images)],
            "latents": [*REAL_2BA, "--local", str(latents), "--precomputed"]}[data]
    assert expect in error_of(benchmark.main, [*base, *args])


@pytest.mark.parametrize("args", [
    [*XL_BUCKETS, "--bucket_crop", "center", "--use_synth_data"],  # real images: below, with the bucketed data
    ["--sampler", "ddim", "--guidance_scale", "3", "--sample_prompts", "shapes", "--samples_dir", "{tmp}/samples"],
    ["--save_interval", "1ba", "--save_folder", "{tmp}/ckpt"],
    ["--profile_dir", "{tmp}/prof", "--profile_batches", "1", "--max_duration", "3ba"],
    ["--norm_precision", "fp32", "--precision", "amp_bf16"],
])
def test_the_same_flags_beside_what_they_need_are_taken(tmp_path, args):
    argv = [*TINY_2BA, *(a.format(tmp=tmp_path) for a in args)]
    if "--bucket_crop" in argv:  # bucketed real images: the crop applies (tests/datasets/test_bucket_runs.py trains one)
        import sort_buckets  # bucketed real images are one folder per bucket (docs/data.md)

        sort_buckets.main([str(write_images(tmp_path / "mds", 6)), "--out", str(tmp_path / "sorted"), "--image_size",
                           "64", "--workers", "1", "--no_progress"])
        argv = [a for a in argv if a != "--use_synth_data"] + ["--local", str(tmp_path / "sorted")]
    settings = benchmark.validate(benchmark.parse_args(argv), 1)
    assert settings.model_config in ("tiny", "sdxl-tiny")


# -----------------------------------------------------------------------------------------------
# Files a user names and the sizes in them: read bounded, a byte-order mark skipped, sizes in ASCII
# digits within --image_size's bound (cli.read_text, cli.parse_number, buckets.parse_bucket).
# -----------------------------------------------------------------------------------------------

XL_SYNTH = ["--model_config", "sdxl-tiny", "--image_size", "64", "--use_synth_data", "--batch_size", "2",
            "--num_workers", "0", "--max_duration", "1ba"]
SAMPLING = ["--sample_prompts", "shapes", "--samples_dir", "/tmp/unused-samples"]
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows editors write first


@pytest.mark.parametrize("argv, expect", [
    # Read whole, /dev/zero filled the memory until the process was killed (exit 137, no word).
    # (now refused before it is opened: a device is not a regular file, t2ibench/core/locations.file_problem)
    (["--aspect_buckets", "/dev/zero"], "--aspect_buckets /dev/zero is a character device, not a regular file"),
    (["@/dev/zero"], "flag file @/dev/zero is a character device, not a regular file"),
    (["--aspect_buckets", "{tmp}/big.txt"], "--aspect_buckets {tmp}/big.txt holds more than 1,048,576 bytes"),
    (["--aspect_buckets", "{tmp}/latin1.txt"], "--aspect_buckets {tmp}/latin1.txt is not UTF-8 text (byte 9)"),
    (["--sample_prompts", "{tmp}/big.txt", "--samples_dir", "{tmp}/samples"],
     "--sample_prompts {tmp}/big.txt holds more than 1,048,576 bytes"),
    (["--sample_prompts", "{tmp}/latin1.txt", "--samples_dir", "{tmp}/samples"],
     "--sample_prompts {tmp}/latin1.txt is not UTF-8 text"),  # was a UnicodeDecodeError traceback
    (["@{tmp}/self.args"], "flag file @{tmp}/self.args is inside 16 others"),  # was a RecursionError traceback
])
def test_files_a_user_names_are_read_bounded_in_one_line(tmp_path, argv, expect):
    (tmp_path / "big.txt").write_bytes(b"64x64\n" * 200_000)  # 1.2 MB of valid lines
    (tmp_path / "latin1.txt").write_bytes("64x64\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "self.args").write_text(f"--seed 3 @{tmp_path}/self.args\n")
    message = error_of(benchmark.main, XL_SYNTH + [a.format(tmp=tmp_path) for a in argv])
    assert expect.format(tmp=tmp_path) in message, message


def test_a_byte_order_mark_is_skipped_in_every_file_read(tmp_path):
    from t2ibench.eval.sampling import load_prompts

    (tmp_path / "buckets.txt").write_bytes(BOM + b"64x64\n32x64\n")
    (tmp_path / "flags.args").write_bytes(BOM + b"--seed 5\n")
    (tmp_path / "prompts.txt").write_bytes(BOM + b"a red square\n")
    args = benchmark.parse_args(XL_SYNTH + [f"@{tmp_path}/flags.args", "--aspect_buckets", str(tmp_path / "buckets.txt"),
                                            "--sample_prompts", str(tmp_path / "prompts.txt"),
                                            "--samples_dir", str(tmp_path / "samples")])
    settings = benchmark.validate(args, 1)
    assert settings.seed == 5 and [b.name for b in settings.buckets] == ["64x64", "32x64"]  # line 1 read, not refused
    assert load_prompts(settings.sample_prompts) == ["a red square"]  # the prompt the samples are drawn for


@pytest.mark.parametrize("argv, expect", [
    # A Unicode digit passes str.isdigit() and was an int() traceback; other scripts' digits were numbers.
    (["--aspect_buckets", "{tmp}/superscript.txt"], "line 1: '²x64' is not HEIGHTxWIDTH in pixels, each side 1 to"),
    (["--aspect_buckets", "{tmp}/arabic.txt"], "line 2: '٦٤x٣٢' is not HEIGHTxWIDTH in pixels"),
    (["--aspect_buckets", "--synthetic_bucket_weights", "²x64=1"], "'²x64=1' is not HEIGHTxWIDTH=WEIGHT"),
    (["--aspect_buckets", "--synthetic_bucket_weights", "64x64=١"], "'64x64=١' is not HEIGHTxWIDTH=WEIGHT"),
    ([*SAMPLING, "--sample_size", "²x64"], "--sample_size ²x64: not HEIGHTxWIDTH in pixels"),
    ([*SAMPLING, "--sample_size", "٦٤x٦٤"], "--sample_size ٦٤x٦٤: not HEIGHTxWIDTH in pixels"),
    (["--batch_size", "٢"], "--batch_size ٢ must be an integer from 1 to"),
    (["--lr", "١e-4"], "--lr ١e-4 must be a finite number > 0"),
    (["--max_duration", "١ba"], "--max_duration ١ba must be written in ASCII (digits 0-9)"),
    (["--epoch_size", "٤"], "--epoch_size ٤ must be written in ASCII"),
    (["--cache_limit", "٥gb"], "--cache_limit ٥gb must be written in ASCII"),
    (["--device_train_microbatch_size", "١"], "--device_train_microbatch_size ١ must be written in ASCII"),
    # A side beyond --image_size's bound of 16,384 trained until the allocator failed.
    (["--aspect_buckets", "{tmp}/huge.txt"], "line 2: '8x99999992' is not HEIGHTxWIDTH in pixels, each side 1 to 16,384"),
    ([*SAMPLING, "--sample_size", "8x99999992"], "--sample_size 8x99999992: not HEIGHTxWIDTH in pixels, each side"),
    (["--aspect_buckets", "{tmp}/many.txt"], "line 257: more than 256 buckets"),
])
def test_sizes_and_numbers_are_ascii_and_bounded(tmp_path, argv, expect):
    (tmp_path / "superscript.txt").write_text("²x64\n64x64\n")
    (tmp_path / "arabic.txt").write_text("64x64\n٦٤x٣٢\n")
    (tmp_path / "huge.txt").write_text("64x64\n8x99999992\n")
    (tmp_path / "many.txt").write_text("".join(f"{8 * side}x64\n" for side in range(1, 258)))
    message = error_of(benchmark.main, XL_SYNTH + [a.format(tmp=tmp_path) for a in argv])
    assert expect in message, message


def test_bucket_weights_whose_sum_overflows_are_shares_of_their_largest():
    # Each weight finite, their sum inf: the shares were NaN and numpy refused them at the first batch.
    args = benchmark.parse_args(XL_SYNTH + ["--aspect_buckets", "--synthetic_bucket_weights", "64x64=1e308,40x96=1e308"])
    settings = benchmark.validate(args, 1)
    shares = dict(zip((b.name for b in settings.buckets), settings.bucket_weights))
    assert shares["64x64"] == shares["40x96"] == 0.5 and sum(settings.bucket_weights) == 1.0


@pytest.mark.slow
def test_counting_the_flops_of_many_buckets_says_how_far_it_is(tmp_path, capsys, monkeypatch):
    from t2ibench.callbacks import buckets as bucket_callbacks

    # Sides off SDXL's 32-px grid: no quadratic fits them, so each bucket is counted (SDXL base: 5 to 7 s
    # each; 2,048 of them counted for over 10 minutes without a line). The interval is 30 s; here every bucket.
    monkeypatch.setattr(bucket_callbacks, "COUNT_PROGRESS_SECONDS", 0.0)
    (tmp_path / "off_grid.txt").write_text("40x96\n56x72\n64x64\n72x56\n")
    benchmark.main(XL_SYNTH + ["--warmup_batches", "0", "--aspect_buckets", str(tmp_path / "off_grid.txt")])
    out = capsys.readouterr().out
    assert "counting the FLOPs per image of the 4 buckets" in out
    for done in (1, 2, 3):
        assert f"counted {done} of 4 buckets" in out and " s each: about " in out, out


@pytest.mark.parametrize("argv, expect", [
    (["benchmark.py", *XL_SYNTH, "--aspect_buckets", "/dev/zero"], "benchmark.py: error: --aspect_buckets /dev/zero is a character device"),
    (["-m", "t2ibench.datasets.buckets", "0", "8"], "python -m t2ibench.datasets.buckets: error: image_size 0 must be an integer from 1 to"),
    (["-m", "t2ibench.datasets.buckets", "60", "8"], "image_size 60 must be a multiple of patch_px 8"),
])
def test_bounded_reads_and_the_bucket_picture_are_one_line_on_the_command_line(argv, expect):
    result = preloaded.run([sys.executable, *argv], cwd=ROOT, env=offline_env(), capture_output=True, text=True,
                           timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and ": error: " in lines[0] and expect in lines[0], result.stderr


# -----------------------------------------------------------------------------------------------
# Locations: outputs, URI schemes, checkpoints.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, where", [
    ("--results_json", "proc"), ("--results_json", "folder"), ("--results_json", "under_file"),
    ("--ema_export_dir", "proc"), ("--ema_export_dir", "file"), ("--save_folder", "proc"), ("--save_folder", "file"),
])
def test_unwritable_outputs_fail_before_training(tmp_path, flag, where):
    (tmp_path / "file").write_text("mine")
    location = {"proc": "/proc/benchmark-out/x", "folder": str(tmp_path), "file": str(tmp_path / "file"),
                "under_file": str(tmp_path / "file" / "r.json")}[where]
    extra = ["--use_ema"] if flag == "--ema_export_dir" else []
    assert flag in error_of(benchmark.main, TINY_2BA + extra + [flag, location])
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("args, flag, expect", [
    (["--remote", "s4://bucket/mds"], "--remote", "s3://"),  # mistyped scheme: the supported ones listed
    (["--remote", "s3:/bucket/mds"], "--remote", "s3://bucket/mds"),  # one slash
    (["--save_folder", "s4://bucket/ckpt"], "--save_folder", "s3://"),
    (["--load_path", "ftp://host/x.pt"], "--load_path", "s3://"),
    (["--results_json", "s3://bucket/r.json"], "--results_json", "local path"),
    (["--remote", "file://otherhost/data"], "--remote", "file:///path"),
])
def test_uri_schemes(args, flag, expect):
    message = error_of(benchmark.main, TINY_2BA + args)
    assert flag in message and expect in message


def test_file_uri_is_a_local_path(images, tmp_path):
    args = benchmark.parse_args(REAL_2BA + ["--remote", f"file://{images}", "--local", str(tmp_path / "cache"),
                                        "--results_json", f"file://{tmp_path}/r.json"])
    settings = benchmark.validate(args, 1)
    assert settings.sources[0].remote == str(images) and settings.results_json == f"{tmp_path}/r.json"


@pytest.mark.parametrize("case", ["missing", "folder", "text", "zip"])
def test_load_path_must_be_a_checkpoint(tmp_path, case):
    path = tmp_path / "ckpt.pt"
    if case == "folder":
        path.mkdir()
    elif case == "text":
        path.write_text("not a checkpoint")
    elif case == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "a zip, but not a torch checkpoint")
    message = error_of(benchmark.main, TINY_2BA + ["--load_path", str(path)])
    assert "--load_path" in message and str(path) in message


# -----------------------------------------------------------------------------------------------
# Data: MDS folders, columns, size against the global batch, caches.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, expect", [
    ("empty_local", "--local"),
    ("local_is_file", "--local"),
    ("garbage_index", "index.json"),
    ("image_key", "--image_key"),
    ("caption_key", "--caption_key"),
    ("precomputed_on_images", "--precomputed"),
    ("latents_without_precomputed", "--precomputed"),
    ("hash_not_in_index", "--validate_hash"),
    ("smaller_than_batch", "--batch_size"),  # 6 samples, global batch 8: used to hang
    ("smaller_than_batch_1ep", "--batch_size"),  # used to 'finish' after 0 batches
])
def test_bad_data_fails_at_once(images, latents, tmp_path, case, expect):
    empty, junk = tmp_path / "empty", tmp_path / "junk"
    empty.mkdir()
    junk.mkdir()
    (junk / "index.json").write_text("{not json")
    (tmp_path / "a_file").write_text("x")
    args = {
        "empty_local": ["--local", str(empty)],
        "local_is_file": ["--local", str(tmp_path / "a_file")],
        "garbage_index": ["--local", str(junk)],
        "image_key": ["--remote", str(images), "--image_key", "png"],
        "caption_key": ["--remote", str(images), "--caption_key", "txt"],
        "precomputed_on_images": ["--remote", str(images), "--precomputed"],
        "latents_without_precomputed": ["--remote", str(latents)],
        "hash_not_in_index": ["--remote", str(images), "--validate_hash", "sha256"],
        "smaller_than_batch": ["--remote", str(images), "--batch_size", "8"],
        "smaller_than_batch_1ep": ["--remote", str(images), "--batch_size", "8", "--max_duration", "1ep"],
    }[case]
    if "--remote" in args:
        args += ["--local", str(tmp_path / "cache")]
    assert expect in error_of(benchmark.main, REAL_2BA + args)
    assert not (tmp_path / "cache").exists()  # nothing was written or downloaded


def test_a_cache_filled_from_another_remote_is_refused(images, latents, tmp_path):
    cache = tmp_path / "cache"
    first = benchmark.parse_args(REAL_2BA + ["--remote", str(images), "--local", str(cache)])
    benchmark.validate(first, 1)
    record_cache(Source(str(images), str(cache)))
    (cache / "index.json").write_bytes((images / "index.json").read_bytes())  # as Streaming leaves it
    benchmark.validate(benchmark.parse_args(REAL_2BA + ["--remote", f"{images}/", "--local", str(cache)]), 1)  # same
    message = error_of(benchmark.main, REAL_2BA + ["--remote", str(latents), "--precomputed", "--local", str(cache)])
    assert "--local" in message and str(images) in message
    message = error_of(benchmark.main, REAL_2BA + ["--local", str(cache)])  # the cache alone: Streaming would delete its shards
    assert f"--remote {images}" in message
    # A folder holding some other dataset with no record: refused, not trusted.
    other = write_images(tmp_path / "other", 5)
    message = error_of(benchmark.main, REAL_2BA + ["--remote", str(images), "--local", str(other)])
    assert "--local" in message and "remote.json" in message


def test_latent_shards_without_the_flag_suggest_it_in_data_too(latents, tmp_path):
    from t2ibench.core.tokenizer import bundled_tokenizer
    with pytest.raises(ValueError, match="--precomputed"):
        data.StreamingImageCaptions(remote=None, local=str(latents), tokenizer=bundled_tokenizer(), image_size=32,
                                    batch_size=1)


def test_too_many_bad_images_is_one_line(tmp_path):
    from streaming import MDSWriter
    from t2ibench.core.tokenizer import bundled_tokenizer
    with MDSWriter(out=str(tmp_path / "rotten"), columns={"jpg": "bytes", "caption": "str", "key": "str"}) as w:
        for i in range(6):
            w.write({"jpg": b"not an image %d" % i, "caption": "x", "key": str(i)})
    loader = data.laion_dataloader(remote=None, local=str(tmp_path / "rotten"), tokenizer=bundled_tokenizer(),
                                   image_size=32, batch_size_per_device=2, num_workers=1, bad_check_after=2)
    with pytest.raises(Exception) as error:  # raised in the worker, re-created by the DataLoader
        next(iter(loader))
    line = benchmark.user_error(error.value)
    assert line is not None and "\n" not in line and "max_bad_fraction" in line
    del loader


# -----------------------------------------------------------------------------------------------
# S3 on loopback (moto's server): no credentials, unreachable endpoint.
# -----------------------------------------------------------------------------------------------

def s3_env(monkeypatch, endpoint: str, credentials: bool) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")  # no ~/.aws fallback
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    if credentials:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    else:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)


@pytest.mark.parametrize("case, expect", [
    ("no_credentials", "AWS_ACCESS_KEY_ID"),
    ("unreachable", "S3_ENDPOINT_URL"),
    ("missing_dataset", "not found"),
    ("image_key", "--image_key"),  # checked against the remote's index.json before anything is built
])
@pytest.mark.slow
def test_s3_problems_are_one_line_naming_remote(s3_endpoint, images, tmp_path, monkeypatch, case, expect):
    import boto3
    s3_env(monkeypatch, s3_endpoint, credentials=True)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="laion")
    for f in images.iterdir():
        s3.upload_file(str(f), "laion", f"mds/{f.name}")
    s3_env(monkeypatch, f"http://127.0.0.1:{free_port()}" if case == "unreachable" else s3_endpoint,
           credentials=case != "no_credentials")
    remote = "s3://laion/missing" if case == "missing_dataset" else "s3://laion/mds"
    extra = ["--image_key", "png"] if case == "image_key" else []
    message = error_of(benchmark.main, REAL_2BA + ["--remote", remote, "--local", str(tmp_path / "cache"), "--download_timeout", "20",
                               *extra])
    assert expect in message and ("--remote" in message or "--image_key" in message)


def test_debug_shows_the_original_error(s3_endpoint, tmp_path, monkeypatch):
    from botocore.exceptions import NoCredentialsError
    s3_env(monkeypatch, s3_endpoint, credentials=False)
    with pytest.raises(NoCredentialsError):
        benchmark.main(REAL_2BA + ["--remote", "s3://laion/mds", "--local", str(tmp_path / "cache"), "--debug"])


def test_wandb_login_error_is_one_line():
    import wandb.errors
    line = benchmark.user_error(wandb.errors.UsageError("api_key not configured (no-tty)"))
    assert "--wandb_project" in line and "WANDB_MODE=offline" in line and "\n" not in line


def test_s3_without_credentials_on_the_command_line(s3_endpoint, tmp_path, monkeypatch):
    s3_env(monkeypatch, s3_endpoint, credentials=False)
    result = run_cli(REAL_2BA + ["--remote", "s3://laion/mds", "--local", str(tmp_path / "cache")],
                     env=offline_env(**{k: v for k, v in os.environ.items() if k.startswith(("AWS_", "S3_"))}),
                     timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("benchmark.py: error: --remote s3://laion/mds") and "AWS_ACCESS_KEY_ID" in lines[-1]


# -----------------------------------------------------------------------------------------------
# The command line: exit codes, no traceback, no hang; a finished --autoresume job; W&B offline.
# -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_rerun_of_a_finished_autoresume_job_exits_0_with_its_summary(tmp_path, capsys):
    run = TINY_2BA + ["--save_folder", str(tmp_path / "ckpt"), "--run_name", "done", "--autoresume",
                  "--save_interval", "1ba", "--use_ema", "--ema_export_dir", str(tmp_path / "ema")]
    measured = benchmark.main(run + ["--results_json", str(tmp_path / "first.json")])  # the job that trained
    assert measured["images_per_sec"] > 0 and measured["measured_batches"] == 1
    kept = (tmp_path / "first.json").read_text()
    shutil.rmtree(tmp_path / "ema")  # as if killed before the export

    # The retried job, same command line but its own results file: exit 0, the summary says why.
    retry = run_cli(run + ["--results_json", str(tmp_path / "retry.json")])
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert "already complete" in retry.stdout and "Traceback" not in retry.stderr
    written = json.loads((tmp_path / "retry.json").read_text())
    assert written["already_complete"] is True and written["images_per_sec"] is None
    assert written["trained_batches"] == 2 and written["measured_batches"] == 0
    assert (tmp_path / "ema" / "unet" / "diffusion_pytorch_model.safetensors").is_file()  # the retry exported it
    assert (tmp_path / "ema" / "model_index.json").is_file()  # the whole pipeline
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("ep*.pt")) == ["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt"]

    # Retried with the same results file: the measured figures are kept, not replaced by nulls.
    capsys.readouterr()
    again = benchmark.main(run + ["--results_json", str(tmp_path / "first.json")])
    assert again["already_complete"] is True and (tmp_path / "first.json").read_text() == kept
    assert "kept " in capsys.readouterr().out


def test_rerun_of_a_finished_epoch_run_reports_it_too(tmp_path):
    # With an epoch duration the last checkpoint is taken before the epoch counter moves on, so
    # Composer's fit() runs and trains 0 batches: the same summary, not a crash on empty figures.
    run = TINY_2BA + ["--max_duration", "1ep", "--num_synthetic_samples", "8", "--save_folder", str(tmp_path),
                  "--run_name", "epoch", "--autoresume", "--save_interval", "1ba"]
    assert benchmark.main(run)["measured_batches"] == 1
    again = benchmark.main(run)
    assert again["already_complete"] is True and again["trained_batches"] == 2 and again["final_loss"] is None


def wandb_records(run_file: Path) -> dict[str, str]:
    """History and summary values of an offline W&B run, read with wandb's own file reader."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(run_file))
    values = {}
    while (raw := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        items = record.history.item if kind == "history" else record.summary.update if kind == "summary" else []
        for item in items:
            values[f"{kind}:{item.key or '/'.join(item.nested_key)}"] = item.value_json
    return values


@pytest.mark.slow
def test_wandb_offline_run_records_the_benchmark_metrics(tmp_path):
    results = tmp_path / "results.json"
    env = offline_env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    result = run_cli(TINY_2BA + ["--wandb_project", "sd2-benchmark", "--wandb_name", "offline-test",
                             "--results_json", str(results)], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    values = wandb_records(run_file)
    measured = json.loads(results.read_text())
    for kind in ("history", "summary"):
        assert float(values[f"{kind}:benchmark/images_per_sec"]) == pytest.approx(measured["images_per_sec"])
    assert float(values["summary:benchmark/measured_batches"]) == measured["measured_batches"] == 1


def test_validation_returns_frozen_settings_and_leaves_the_parsed_flags_as_parsed(tmp_path):
    args = benchmark.parse_args(TINY_2BA + ["--device_train_microbatch_size", "2", "--results_json", f"file://{tmp_path}/r.json",
                                        "--precomputed", "--model_config", "flux1-tiny"])
    parsed = dict(vars(args))
    settings = benchmark.validate(args, 1)
    assert vars(args) == parsed  # nothing is written back into the parsed flags
    # The resolved values live in the settings, under the flags' names.
    assert (settings.device_train_microbatch_size, settings.fsdp, settings.sampler) == (2, "none", "euler")
    assert settings.precomputed_format == "text_states" and settings.model_name == settings.family.default_model_name
    assert settings.results_json == f"{tmp_path}/r.json" and settings.encoders_seed == settings.seed
    with pytest.raises(AttributeError):  # frozen (dataclasses.FrozenInstanceError)
        settings.batch_size = 8
