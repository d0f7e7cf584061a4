"""bench/index_scale.py at small N: the indexes it writes are real MDS indexes, and the epoch start it
measures is Streaming's own, in real DataLoader workers."""
from __future__ import annotations

import argparse

import pytest

import index_scale

pytestmark = pytest.mark.usefixtures("preloaded_commands")  # the commands they start: forks (conftest)


def test_written_index_opens_as_an_mds_dataset(tmp_path):
    from streaming import StreamingDataset

    index_scale.write_index(tmp_path / "a", "latents", 7, 13)
    dataset = StreamingDataset(local=str(tmp_path / "a"), batch_size=4)
    assert dataset.num_samples == 7 * 13 and len(dataset.shards) == 7
    assert dataset.shards[0].column_names == index_scale.KINDS["latents"]["names"]


def test_a_bucketed_epoch_start_is_streamings_per_stream_over_one_stream_per_folder(tmp_path):
    index_scale.write_dataset(tmp_path / "b", "latents", 40, 25, buckets=7)  # 40 shards over 7 folders
    assert len([p for p in (tmp_path / "b").iterdir() if p.is_dir()]) == 7
    args = argparse.Namespace(local=str(tmp_path / "b"), batch_size=4, shuffle_algo="py1e", epoch_size=None,
                              num_canonical_nodes=None, workers=2, aspect_buckets=7)
    result = index_scale.child(args)
    assert result["epoch_samples"] == 40 * 25 and sum(w["leader"] for w in result["workers"]) == 1
    # Full batches of one stream only: each folder's part-filled last batch is not dealt out.
    assert 40 * 25 - 7 * 4 <= sum(w["samples"] for w in result["workers"]) <= 40 * 25


def test_bucket_epoch_counts_what_an_epoch_trains(capsys):
    from tests.helpers import bench_script

    result = bench_script("bucket_epoch").main(["--samples", "20000", "--ranks_per_node", "2", "--workers", "2"])
    assert result["trained"] + result["left_out"] == result["total"] == 20_000
    assert 0 <= result["left_out"] < 25 * 8  # at most a part-filled global batch of each of the 25 buckets
    assert "photos trained" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_data_times_the_bucketed_loader_beside_the_square_one(capsys):
    from tests.helpers import bench_script

    rows = bench_script("bench_data").main(["--num_samples", "48", "--image_size", "64", "--batch_size", "4",
                                            "--num_workers", "0", "--aspect_buckets"])
    assert [row["loader"] for row in rows] == ["square", "bucketed"] and all(row["images_per_sec"] > 0 for row in rows)


def test_epoch_start_in_workers_is_measured_and_projected(tmp_path):
    rows = {"index": [], "epoch": []}
    for num_shards, per_shard in ((40, 25), (80, 25)):
        local = tmp_path / f"{num_shards}"
        index_scale.write_index(local, "latents", num_shards, per_shard)
        args = argparse.Namespace(local=str(local), batch_size=4, shuffle_algo="py1e", epoch_size=None,
                                  num_canonical_nodes=None, workers=2)
        result = index_scale.child(args)  # in this process: the workers are forked from it, as in training
        workers = result["workers"]
        assert len(workers) == 2 and sum(w["leader"] for w in workers) == 1  # one builds, the other attaches
        assert len({w["pid"] for w in workers}) == 2
        assert result["epoch_samples"] == num_shards * per_shard
        assert sum(w["samples"] for w in workers) >= num_shards * per_shard  # every sample (plus padding)
        row = index_scale.summarize(num_shards, per_shard, result)
        assert row["open_s"] > 0 and row["worker_uss_mib"] > 0 and row["worker_pss_mib"] > 0
        assert row["partition_shm_mib"] == pytest.approx(num_shards * per_shard * 8 / 2**20)
        rows["index"].append(row)
        rows["epoch"].append(row)
    # The projection, from rows that follow known linear laws (at this small N the measured slopes are
    # noise: a few MiB and milliseconds, moved by whatever else the machine runs).
    laws = []
    for shards, samples in ((1_000, 100_000), (3_000, 900_000), (10_000, 3_000_000)):
        laws.append({**row, "shards": shards, "samples": samples, "epoch_samples": samples,
                     "open_s": 1e-4 * shards, "open_rss_mib": 4e-3 * shards, "open_peak_extra_mib": 4e-3 * shards,
                     "worker_uss_mib": 5 + 1e-4 * shards, "epoch_s": 3e-7 * samples,
                     "leader_peak_extra_mib": 5.3e-5 * samples, "worker_uss_growth_mib": 1e-6 * samples})
    rows = {"index": laws, "epoch": laws}
    options = argparse.Namespace(workers=8, gpus_per_node=8, shuffle_algo="py1e", budget_gib=4.0, budget_s=60.0,
                                 projected_epoch_size=200_000_000, open_s_per_shard=None, epoch_s_per_sample=None)
    report = index_scale.project(rows, options)
    assert report["fits"]["builder_peak_mib_per_sample"] == pytest.approx(5.3e-5, rel=1e-6)
    assert len(report["projection"]) == 2 * len(index_scale.PROJECTED) * len(index_scale.SHARD_LIMITS)
    latents_512 = [r for r in report["projection"] if r["dataset"] == "latents-512px" and r["shard_limit"] == "64mb"]
    assert latents_512[0]["samples_per_shard"] == index_scale.SHARD_LIMIT // index_scale.PROJECTED["latents-512px"]
    assert latents_512[0]["shards"] * latents_512[0]["samples_per_shard"] >= index_scale.TARGET_SAMPLES
    assert [r["epoch_size"] for r in latents_512] == [index_scale.TARGET_SAMPLES, 200_000_000]
    # Memory grows with the epoch; the largest epoch within budget fits it, a full epoch of 2B does not.
    assert latents_512[0]["rank_gib"] > latents_512[1]["rank_gib"] and not latents_512[0]["within_budget"]
    assert all(r["max_epoch_size"] < index_scale.TARGET_SAMPLES for r in report["projection"])


def test_an_epoch_too_large_for_memory_is_warned_about(tmp_path, caplog, monkeypatch):
    import data
    from streaming import StreamingDataset

    assert data.LARGE_EPOCH_SAMPLES * data.EPOCH_BYTES_PER_SAMPLE <= 4 * 2**30 < \
        (data.LARGE_EPOCH_SAMPLES + 1000) * data.EPOCH_BYTES_PER_SAMPLE
    # A real dataset of 100,000 samples (described only), with the threshold lowered below it: opening
    # one of 100 million samples would cost this test 20 s and 800 MB (Streaming's span table).
    monkeypatch.setattr(data, "LARGE_EPOCH_SAMPLES", 50_000)
    index_scale.write_index(tmp_path / "big", "latents", 100, 1000)
    big = StreamingDataset(local=str(tmp_path / "big"), batch_size=4)
    with caplog.at_level("WARNING", logger="data"):
        data.warn_about_large_epoch(big)
    assert "an epoch of 100,000 samples" in caplog.text and "--epoch_size" in caplog.text
    caplog.clear()
    bounded = StreamingDataset(local=str(tmp_path / "big"), batch_size=4, epoch_size="40k")
    with caplog.at_level("WARNING", logger="data"):
        data.warn_about_large_epoch(bounded)
    assert caplog.text == ""


def test_compact_spanner_answers_as_streaming_does():
    import numpy as np
    from streaming.base.spanner import Spanner

    import data

    sizes = np.random.default_rng(0).integers(0, 40, size=200).astype(np.int64)
    sizes[[0, 5, -1]] = [0, 0, 7]  # empty shards, first and in the middle
    ours, theirs = data.CompactSpanner(sizes.copy()), Spanner(sizes.copy())
    assert ours.num_samples == theirs.num_samples == sizes.sum()
    assert [ours[i] for i in range(ours.num_samples)] == [theirs[i] for i in range(theirs.num_samples)]
    for bad in (-1, ours.num_samples):
        with pytest.raises(IndexError):
            ours[bad]
    import streaming.base.dataset

    assert streaming.base.dataset.Spanner is data.CompactSpanner  # what every dataset of the project builds


# -----------------------------------------------------------------------------------------------
# Nothing read before the first step but indexes: a bucketed run from S3 on loopback, against a square one.
# -----------------------------------------------------------------------------------------------

def read_before_the_first_step(s3_endpoint, folder, key: str, cache, argv: list[str], monkeypatch) -> dict[str, int]:
    """Upload `folder` to s3://data/`key` (moto on loopback), train 1 batch from it, and return the files
    (and their sizes) the run had brought into its cache when its first epoch started: everything it read
    from the remote before step 1 (Streaming downloads into the cache only)."""
    import boto3
    from composer.core import Callback

    import benchmark

    for name, value in (("S3_ENDPOINT_URL", s3_endpoint), ("AWS_DEFAULT_REGION", "us-east-1"),
                        ("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"), ("AWS_CONFIG_FILE", "/nonexistent"),
                        ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(name, value)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    if "data" not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket="data")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        s3.upload_file(str(path), "data", f"{key}/{path.relative_to(folder)}")
    seen: dict[str, int] = {}

    class AtEpochStart(Callback):
        def epoch_start(self, state, logger) -> None:
            if not seen:
                seen.update({str(p.relative_to(cache)): p.stat().st_size for p in cache.rglob("*") if p.is_file()})

    benchmark.main([*argv, "--remote", f"s3://data/{key}", "--local", str(cache), "--num_workers", "0",
                    "--max_duration", "1ba", "--batch_size", "2", "--warmup_batches", "0"],
                   extra_callbacks=[AtEpochStart()])
    return seen


@pytest.mark.slow
def test_a_bucketed_run_reads_only_index_files_before_its_first_step_as_a_square_one(s3_endpoint, tmp_path,
                                                                                      monkeypatch):
    import convert
    from t2ibench.datasets.bucket_folders import RECORD_FILE
    from t2ibench.datasets.buckets import default_buckets
    from t2ibench.datasets.sources import CACHE_RECORD
    from tests.helpers import mixed_aspect_folder

    photos = mixed_aspect_folder(tmp_path / "photos", 32)
    convert.convert([str(photos)], str(tmp_path / "square"), size_limit="8kb", workers=1, progress=False)
    convert.convert([str(photos)], str(tmp_path / "buckets"), size_limit="8kb", workers=1, progress=False,
                    buckets=default_buckets(64, 8), image_size=64)
    xl = ["--model_config", "sdxl-tiny", "--seed", "17"]
    square = read_before_the_first_step(s3_endpoint, tmp_path / "square", "square", tmp_path / "cache-square", xl,
                                        monkeypatch)
    bucketed = read_before_the_first_step(s3_endpoint, tmp_path / "buckets", "buckets", tmp_path / "cache-buckets",
                                          [*xl, "--aspect_buckets"], monkeypatch)
    remote_shards = [p for p in (tmp_path / "buckets").rglob("shard.*")]
    assert len(remote_shards) >= 8  # a shard or more per bucket folder: all of them stayed on the remote
    for files in (square, bucketed):
        read = {name for name in files if name != CACHE_RECORD}  # the cache's own record, written here
        assert read and all(name.endswith(("index.json", RECORD_FILE)) for name in read), read
    # The bucketed run read its record and each folder's index, byte for byte what the remote holds.
    expected = {str(p.relative_to(tmp_path / "buckets")): p.stat().st_size for p in (tmp_path / "buckets").rglob("*")
                if p.name in ("index.json", RECORD_FILE)}
    assert {name: size for name, size in bucketed.items() if name != CACHE_RECORD} == expected
