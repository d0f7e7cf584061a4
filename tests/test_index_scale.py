"""bench/index_scale.py at small N: the indexes it writes are real MDS indexes, and the epoch start it
measures is Streaming's own, in real DataLoader workers."""
from __future__ import annotations

import argparse

import pytest

import index_scale


def test_written_index_opens_as_an_mds_dataset(tmp_path):
    from streaming import StreamingDataset

    index_scale.write_index(tmp_path / "a", "latents", 7, 13)
    dataset = StreamingDataset(local=str(tmp_path / "a"), batch_size=4)
    assert dataset.num_samples == 7 * 13 and len(dataset.shards) == 7
    assert dataset.shards[0].column_names == index_scale.KINDS["latents"]["names"]


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
