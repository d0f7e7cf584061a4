"""bench/blocks.py on the CPU against a real benchmark.py run of the same settings: its report and its JSON
are consistent (the composed step is the sum of its timed parts, the prediction follows from the step
and the traffic the sharding implies), it compares with the run it is given, and it refuses a run of
other settings before timing anything. The 25% band itself is a figure the script prints
(docs/flux.md), not an assertion here: wall-clock times on a shared CPU are not a test."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmark
import blocks
from t2ibench.families import family_of
from t2ibench.memory import build_meta_model

SETTINGS = ["--model_config", "flux1-tiny", "--precomputed", "--image_size", "32"]
TIMING = ["--warmup", "1", "--repeats", "3", "--harness_batches", "4", "--num_workers", "0"]


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "flux-tiny.json"
    benchmark.main(SETTINGS + ["--use_synth_data", "--batch_size", "8", "--device_train_microbatch_size", "4",
                               "--max_duration", "6ba", "--warmup_batches", "2", "--num_workers", "0",
                               "--results_json", str(path)])
    return path


def test_prediction_is_the_sum_of_its_timed_parts_and_compares_with_the_run(measured_run, capsys):
    result = blocks.main(SETTINGS + TIMING + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1", "2",
                                             "--compare_results_json", str(measured_run), "--json"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == result  # --json: the last line
    assert "predicted (not measured) samples/s per GPU" in out and "ratio" in out
    family = family_of("flux1-tiny")
    denoiser = build_meta_model("flux1-tiny", precomputed=True).denoiser
    params = sum(p.numel() for p in denoiser.parameters())
    assert result["denoiser_params"] == params
    # One GPU replicates the weights; two shard them (--fsdp auto: full_shard for Flux.1): both timed.
    assert set(result["measured"]) == {"replicated", "sharded"}
    for times in result["measured"].values():
        counts = {b["name"]: b["count"] for b in times["blocks"]}
        assert counts == {"transformer_blocks.*": 2, "single_transformer_blocks.*": 4}
        assert sum(counts.values()) == len(family.fsdp_blocks(denoiser))
        assert all(b["seconds"] > 0 for b in times["blocks"]) and times["rest_seconds"] > 0
        assert times["composed_microbatch_seconds"] == pytest.approx(
            times["rest_seconds"] + sum(b["count"] * b["seconds"] for b in times["blocks"]))
    harness_per_image = result["harness_seconds_per_step"] / result["harness_per_device_batch"]
    rows = {row["gpus"]: row for row in result["predicted"]}
    assert set(rows) == {1, 2} and {rows[1]["fsdp"], rows[2]["fsdp"]} == {"none", "full_shard"}
    for gpus, row in rows.items():
        times = result["measured"]["replicated" if gpus == 1 else "sharded"]
        per_param = times["adamw_seconds_per_param"] + times["ema_seconds_per_param"]
        assert times["ema_seconds_per_param"] == 0  # no --use_ema
        assert row["per_gpu_batch"] == 8 // gpus and row["accumulation"] == 8 // gpus // 4
        assert row["optimizer_seconds"] == pytest.approx(per_param * params / gpus)
        assert row["harness_seconds"] == pytest.approx(harness_per_image * row["per_gpu_batch"])
        assert row["compute_seconds"] == pytest.approx(
            row["accumulation"] * times["composed_microbatch_seconds"] + row["optimizer_seconds"] + row["harness_seconds"])
        assert row["comm_seconds"] == pytest.approx(row["traffic_bytes_per_gpu"] / (450e9))
        assert row["step_seconds"] == pytest.approx(row["compute_seconds"] + row["comm_seconds"])
        assert row["samples_per_sec_per_gpu"] == pytest.approx(row["per_gpu_batch"] / row["step_seconds"])
        assert row["samples_per_sec_per_gpu_overlapped"] == pytest.approx(
            row["per_gpu_batch"] / max(row["compute_seconds"], row["comm_seconds"]))
    # The traffic the sharding implies: none on one GPU; full_shard on two, per microbatch, gathers the
    # fp32 weights twice (no autocast: an fp32 CPU run) and reduce-scatters fp32 gradients, half of each sent.
    assert rows[1]["traffic_bytes_per_gpu"] == 0
    assert rows[2]["traffic_bytes_per_gpu"] == pytest.approx(rows[2]["accumulation"] * 0.5 * (2 * 4 + 4) * params)
    run = json.loads(measured_run.read_text())
    comparison = result["comparison"]
    assert comparison["gpus"] == 1 and comparison["measured_images_per_sec_per_device"] == run["images_per_sec_per_device"]
    assert comparison["ratio"] == pytest.approx(rows[1]["samples_per_sec_per_gpu"] / run["images_per_sec_per_device"])
    assert comparison["within_25_percent"] == (abs(comparison["ratio"] - 1) <= 0.25)
    assert result["reference"]["B200"] == 51.0  # MLPerf v5.1's published rows, for a Flux.1 model


@pytest.mark.parametrize("change, flag", [({"device_train_microbatch_size": 2}, "microbatch"),
                                          ({"fp8": "tensorwise"}, "fp8"), ({"world_size": 4}, "device(s)")])
def test_a_run_of_other_settings_is_refused_before_timing(measured_run, tmp_path, change, flag):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(measured_run.read_text()), **change}))
    with pytest.raises(SystemExit) as exit_info:
        blocks.main(SETTINGS + TIMING + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1",
                                         "--compare_results_json", str(other)])
    message = str(exit_info.value.code)
    assert message.startswith("blocks.py: error: --compare_results_json") and flag in message and "\n" not in message


def test_a_batch_the_gpu_counts_do_not_divide_is_refused():
    with pytest.raises(SystemExit) as exit_info:
        blocks.main(SETTINGS + ["--global_batch", "12", "--microbatch", "4", "--gpus", "8"])
    assert "--global_batch 12 over --gpus 8" in str(exit_info.value.code)


@pytest.mark.parametrize("model_config", ["tiny", "sdxl-tiny"])
def test_a_unets_blocks_are_timed_one_per_level_and_the_rest_runs_around_stand_ins(model_config):
    # Each down block, the mid block and each up block (the UNet's FSDP units) once; the up blocks read
    # their own `resnets` in the UNet's forward, which the stand-ins of the rest's step must answer.
    result = blocks.main(["--model_config", model_config, "--image_size", "32", "--precomputed", "--global_batch", "4",
                          "--microbatch", "2", "--gpus", "1", "--warmup", "0", "--repeats", "1",
                          "--harness_batches", "2", "--num_workers", "0"])
    denoiser = build_meta_model(model_config, precomputed=True).denoiser
    times = result["measured"]["replicated"]
    assert sum(b["count"] for b in times["blocks"]) == len(family_of(model_config).fsdp_blocks(denoiser))
    assert {b["name"] for b in times["blocks"]} >= {"mid_block", "down_blocks.0", "up_blocks.0"}
    assert times["rest_seconds"] > 0 and result["predicted"][0]["samples_per_sec_per_gpu"] > 0
