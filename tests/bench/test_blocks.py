"""bench/blocks.py on the CPU against a real benchmark.py run of the same settings: its report and its JSON
are consistent (the composed step is the sum of its timed parts, the prediction follows from the step
and the traffic the sharding implies), it times what the run runs (diffusers' checkpointing as the run
turns it on, one part at a time, fresh block inputs, one device's weight casts per step), its parts'
counted memory stays far below what a one-GPU run holds, and it refuses a results file it cannot
compare with, or bad numbers, before timing anything. The 25% band itself is a figure the script prints
(docs/flux.md), not an assertion here: wall-clock times on a shared CPU are not a test."""
from __future__ import annotations

import collections
import json
import weakref
from pathlib import Path

import pytest
import torch

import benchmark
import blocks
from t2ibench.core import devices
from t2ibench import memory
from t2ibench.train.compiling import graphs_compiled
from t2ibench.families import family_of
from t2ibench.memory import build_meta_model
from tests.helpers import Launch, error_of, supervise, two_ranks

SETTINGS = ["--model_config", "flux1-tiny", "--precomputed", "--image_size", "32"]
TIMING = ["--warmup", "1", "--repeats", "3", "--harness_batches", "4", "--num_workers", "0"]
SHORT = ["--warmup", "1", "--repeats", "1", "--harness_batches", "2", "--num_workers", "0"]


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "flux-tiny.json"
    benchmark.main(SETTINGS + ["--use_synth_data", "--batch_size", "8", "--device_train_microbatch_size", "4",
                               "--max_duration", "6ba", "--warmup_batches", "2", "--num_workers", "0",
                               "--results_json", str(path)])
    return path


class ModuleCalls:
    """From outside the script: every forward of a module that holds real (not meta) weights, by module,
    and whether a block's floating inputs arrived with a gradient already summed into them."""

    def __init__(self, classes: tuple[str, ...]):
        self.classes, self.calls, self.inputs_with_grad = classes, collections.Counter(), 0
        self.kinds: dict[int, str] = {}
        # A module freed after its part was timed may leave its id() to the next part's: keyed apart.
        self.keys: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()

    def __enter__(self) -> "ModuleCalls":
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self.hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def hook(self, module: torch.nn.Module, args: tuple) -> None:
        weight = next(module.parameters(), None)
        if type(module).__name__ not in self.classes or weight is None or weight.device.type == "meta":
            return
        key = self.keys.setdefault(module, len(self.kinds))
        self.calls[key] += 1
        self.kinds[key] = type(module).__name__
        self.inputs_with_grad += sum(1 for a in args if isinstance(a, torch.Tensor) and a.is_leaf and a.grad is not None)

    def counts(self, kind: str) -> set[int]:
        """How many times each module of this class ran forward (one value when all ran alike)."""
        return {n for key, n in self.calls.items() if self.kinds[key] == kind}


@pytest.mark.slow
def test_prediction_is_the_sum_of_its_timed_parts_and_compares_with_the_run(measured_run, tmp_path, capsys):
    result = blocks.main(SETTINGS + TIMING + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1", "2",
                                             "--compare_results_json", str(measured_run), "--json"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == result  # --json: the last line
    assert "predicted (not measured) samples/s per GPU" in out and "ratio" in out
    family = family_of("flux1-tiny")
    denoiser = build_meta_model("flux1-tiny", precomputed=True).denoiser
    params = sum(p.numel() for p in denoiser.parameters())
    assert result["denoiser_params"] == params
    # One GPU replicates the weights (fp32 on a CPU: no weight copies); two shard them (--fsdp auto:
    # full_shard for Flux.1): both timed.
    assert set(result["measured"]) == {"replicated", "sharded"}
    for times in result["measured"].values():
        counts = {b["name"]: b["count"] for b in times["blocks"]}
        assert counts == {"transformer_blocks.*": 2, "single_transformer_blocks.*": 4}
        assert sum(counts.values()) == len(family.fsdp_blocks(denoiser))
        assert all(b["seconds"] > 0 and b["peak_memory_bytes"] is None for b in times["blocks"])  # CPU: no peak
        assert times["rest_seconds"] > 0
        assert times["composed_microbatch_seconds"] == pytest.approx(
            times["rest_seconds"] + sum(b["count"] * b["seconds"] for b in times["blocks"]))
    updates = result["per_parameter"]
    assert updates["adamw_seconds_per_param"] > 0
    assert updates["ema_seconds_per_param"] == 0 and updates["weight_casts_seconds_per_param"] == 0  # neither runs
    harness_per_image = result["harness_seconds_per_step"] / result["harness_per_device_batch"]
    rows = {row["gpus"]: row for row in result["predicted"]}
    assert set(rows) == {1, 2} and {rows[1]["fsdp"], rows[2]["fsdp"]} == {"none", "full_shard"}
    for gpus, row in rows.items():
        times = result["measured"][row["weights"]]
        assert row["weights"] == ("replicated" if gpus == 1 else "sharded") and row["weight_casts"] == "microbatch"
        assert row["per_gpu_batch"] == 8 // gpus and row["accumulation"] == 8 // gpus // 4
        assert row["optimizer_seconds"] == pytest.approx(updates["adamw_seconds_per_param"] * params / gpus)
        assert row["weight_casts_seconds"] == 0
        assert row["harness_seconds"] == pytest.approx(harness_per_image * row["per_gpu_batch"])
        assert row["compute_seconds"] == pytest.approx(
            row["accumulation"] * times["composed_microbatch_seconds"] + row["optimizer_seconds"] + row["harness_seconds"])
        assert row["comm_seconds"] == pytest.approx(row["traffic_bytes_per_gpu"] / (450e9))
        assert row["step_seconds"] == pytest.approx(row["compute_seconds"] + row["comm_seconds"])
        assert row["samples_per_sec_per_gpu"] == pytest.approx(row["per_gpu_batch"] / row["step_seconds"])
        assert row["samples_per_sec_per_gpu_overlapped"] == pytest.approx(
            row["per_gpu_batch"] / max(row["compute_seconds"], row["comm_seconds"]))
    # The traffic the sharding implies: none on one GPU; full_shard on two, per microbatch, gathers the
    # fp32 weights twice but the root unit's once (no autocast: an fp32 CPU run) and reduce-scatters fp32
    # gradients, half of each sent.
    root = memory.fsdp_unit_params("flux1-tiny")["root"]
    assert result["root_unit_params"] == root > 0
    per_microbatch = 0.5 * (4 * (2 * params - root) + 4 * params)
    assert rows[1]["traffic_bytes_per_gpu"] == 0
    assert rows[2]["traffic_bytes_per_microbatch"] == pytest.approx(per_microbatch)
    assert rows[2]["traffic_bytes_per_step_once"] == 0  # Composer reduce-scatters in every microbatch
    assert rows[2]["traffic_bytes_per_gpu"] == pytest.approx(rows[2]["accumulation"] * per_microbatch)
    run = json.loads(measured_run.read_text())
    comparison = result["comparison"]
    assert comparison["gpus"] == 1 and comparison["measured_images_per_sec_per_device"] == run["images_per_sec_per_device"]
    assert comparison["ratio"] == pytest.approx(rows[1]["samples_per_sec_per_gpu"] / run["images_per_sec_per_device"])
    assert comparison["within_25_percent"] == (abs(comparison["ratio"] - 1) <= 0.25)
    assert result["reference"]["B200"] == 51.0  # MLPerf v5.1's published rows, for a Flux.1 model
    # The same prediction again from the line it wrote, timing nothing (nothing is built).
    saved = tmp_path / "blocks.log"
    saved.write_text("timing...\n" + out)
    with ModuleCalls(("FluxTransformerBlock", "FluxSingleTransformerBlock")) as calls:
        again = blocks.main(SETTINGS + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1", "2",
                                        "--measured_json", str(saved)])
    assert not calls.calls and again["measured_json"] == str(saved)
    assert again["measured"] == result["measured"] and again["per_parameter"] == result["per_parameter"]
    for row, before in zip(again["predicted"], result["predicted"]):
        assert row == pytest.approx(before)


@pytest.mark.slow
def test_compiled_blocks_are_timed_apart_from_their_compile_and_compared_with_a_compiled_run(measured_run, dynamo_eager,
                                                                                            tmp_path, capsys):
    # --compile compiles each part as the run's --compile compiles the model (t2ibench.train.compiling; dynamo's
    # eager backend here: graphs and their compile seconds need no AOT autograd): a compiled run is its
    # comparison, an eager one is refused.
    compiled_run = tmp_path / "compiled.json"
    benchmark.main(SETTINGS + ["--use_synth_data", "--batch_size", "8", "--device_train_microbatch_size", "4",
                               "--max_duration", "4ba", "--warmup_batches", "2", "--num_workers", "0", "--compile",
                               "--results_json", str(compiled_run)])
    graphs = graphs_compiled()
    result = blocks.main(SETTINGS + SHORT + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1", "--compile",
                                             "--compare_results_json", str(compiled_run), "--json"])
    out = capsys.readouterr().out
    times = result["measured"]["replicated"]
    # One graph per part timed (the double-stream block, a single-stream one), compiled before its timed
    # runs; nothing outside the blocks compiles on precomputed text states (no encoder runs).
    assert graphs_compiled() - graphs == len(times["blocks"]) == 2
    assert all(b["compile_seconds"] > 0 for b in times["blocks"]) and times["rest_compile_seconds"] == 0
    assert result["compile"] and result["compile_seconds"] == pytest.approx(sum(b["compile_seconds"]
                                                                                for b in times["blocks"]))
    assert "compiled in" in out and "compiling: " in out and "none of it in the times above" in out
    assert result["comparison"]["gpus"] == 1 and json.loads(out.strip().splitlines()[-1]) == result
    message = error_of(blocks.main, SETTINGS + SHORT + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1",
                                                        "--compile", "--compare_results_json", str(measured_run)],
                       prog="blocks.py")
    assert "its compile is false, this prediction's is true; predict with the run's setting (--compile)" in message


# Every setting of the results JSON that changes the step, changed one at a time, and the counts and
# devices the prediction cannot stand for.
OTHER_SET_UPS = [
    ({"device_train_microbatch_size": 2}, "device_train_microbatch_size is 2"),
    ({"global_batch_size": 16}, "global_batch_size is 16"),
    ({"image_size": 64}, "image_size is 64"), ({"model_config": "tiny"}, "model_config"),
    ({"precision": "amp_bf16"}, "precision"), ({"norm_precision": "fp32"}, "norm_precision"),
    ({"precomputed_format": "tokens"}, "precomputed_format"), ({"use_ema": True}, "use_ema"),
    ({"use_ema": 1}, "use_ema is 1"),  # 1 == True in Python: compared with its type
    ({"activation_checkpointing": True}, "activation_checkpointing"),
    ({"weight_casts": "step"}, "weight_casts"), ({"fp8": "tensorwise"}, "fp8"),
    ({"fsdp": "full_shard"}, "fsdp is \"full_shard\""), ({"compile": True}, "--compile"),
    ({"channels_last": True}, "--channels_last"), ({"xformers": True}, "--xformers"),
    ({"fused_adamw": True}, "fused_adamw"), ({"data": "/data/mds"}, "--use_synth_data"),
    ({"weight_casts": None}, "it has no weight_casts"),
    ({"world_size": 4}, "add 4 to --gpus"), ({"world_size": "1"}, "world_size is \"1\", not a device count"),
    ({"world_size": True}, "world_size is true"), ({"world_size": 1.0}, "world_size is 1.0"),
    ({"device": "NVIDIA H100 80GB HBM3"}, "the run's device is \"NVIDIA H100 80GB HBM3\""),
    ({"images_per_sec_per_device": 0}, "images_per_sec_per_device is 0, not a finite positive number"),
    ({"images_per_sec_per_device": -5}, "images_per_sec_per_device is -5"),
    ({"images_per_sec_per_device": float("nan")}, "images_per_sec_per_device is NaN"),
    ({"images_per_sec_per_device": float("inf")}, "images_per_sec_per_device is Infinity"),
    ({"images_per_sec_per_device": True}, "images_per_sec_per_device is true"),
    ({"images_per_sec_per_device": None}, "images_per_sec_per_device is null"),
    ({"images_per_sec_per_device": 1e308}, "images_per_sec_per_device: 1e+308 images/s per GPU is outside what a run"),
    ({"images_per_sec_per_device": 5e-324}, "images/s per GPU is outside what a run measures"),
    # A run of aspect-ratio buckets (benchmark.py's keys): blocks.py times square images only.
    ({"aspect_buckets": "default", "bucket_list": ["32x32", "24x40", "40x24"], "synthetic_bucket_weights": "uniform"},
     "the run trained aspect-ratio buckets (--aspect_buckets default, 3 buckets from 32x32 to 40x24, synthetic "
     "batches drawn by --synthetic_bucket_weights uniform), and blocks.py times square 32x32 images only; compare "
     "with a run without --aspect_buckets"),
    ({"already_complete": True}, "found its run complete, so it measured nothing"),
]


@pytest.mark.parametrize("change, expect", OTHER_SET_UPS, ids=[f"{next(iter(c))}={next(iter(c.values()))!r}"
                                                               for c, _ in OTHER_SET_UPS])
def test_a_run_it_cannot_stand_for_is_refused_in_one_line_before_timing(measured_run, tmp_path, change, expect):
    run = {**json.loads(measured_run.read_text()), **change}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({k: v for k, v in run.items() if v is not None or k not in change}))
    with ModuleCalls(("FluxTransformerBlock", "FluxSingleTransformerBlock")) as calls:
        message = error_of(blocks.main, SETTINGS + TIMING + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1",
                                                             "--compare_results_json", str(other)], prog="blocks.py")
    assert message.startswith("blocks.py: error: --compare_results_json") and expect in message
    assert not calls.calls  # nothing was built or timed


@pytest.mark.parametrize("content, expect", [
    (b"{", "not JSON"), (b"[1, 2]", "a list, not an object"), (b"\xff\xfe", "is not UTF-8 text"), (None, "no such file"),
    (b'{"images_per_sec": 1.0, "model_config": "flux1-tiny"}',
     "not a benchmark.py results JSON (it has no world_size, global_batch_size, device)"),
    (json.dumps({"model_config": "flux1-tiny", "device": "cpu", "microbatch": 4, "measured": {}, "predicted": []}).encode(),
     "a line blocks.py wrote with --json, not a benchmark.py results JSON; predict from it with --measured_json"),
])
def test_a_file_that_is_no_results_json_is_refused_in_one_line(tmp_path, content, expect):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_bytes(content)
    message = error_of(blocks.main, SETTINGS + ["--global_batch", "8", "--microbatch", "4", "--gpus", "1",
                                                "--compare_results_json", str(path)], prog="blocks.py")
    assert expect in message and str(path) in message


@pytest.mark.parametrize("argv, expect", [
    (["--global_batch", "12", "--microbatch", "4", "--gpus", "8"], "--global_batch 12 is not a multiple of --gpus 8"),
    (["--global_batch", "8", "--gpus", "16"], "--global_batch 8 is not a multiple of --gpus 16"),
    (["--global_batch", "16", "--microbatch", "4", "--gpus", "8"], "which --microbatch 4 does not divide"),
    (["--image_size", "1048576"], "--image_size 1048576 must be an integer from 1 to 16384"),
    (["--repeats", "1000000000"], "--repeats 1000000000 must be an integer from 1 to 1000"),
    (["--gpus", "1", "8", "--weight_casts", "step", "--precision", "amp_bf16"], "--weight_casts step runs on a single"),
    (["--num_workers", "100000"], "worker processes per CPU core"),
    (["--count_memory", "--compare_results_json", "run.json"], "--count_memory times nothing"),
])
def test_numbers_it_cannot_run_are_refused_naming_the_flags_given(argv, expect):
    message = error_of(blocks.main, SETTINGS + argv, prog="blocks.py")
    assert expect in message and "--microbatch 0" not in message


# The H100's measured blocks of Flux.1-schnell (checkpointed, microbatch 32), as blocks.py wrote them.
H100_LINES = Path(__file__).resolve().parents[2] / "results" / "h100-2026-11-26" / "blocks2.jsonl"
H100_FLUX = ["--model_config", "flux1-schnell", "--precomputed", "--activation_checkpointing",
             "--measured_json", str(H100_LINES)]


def test_a_saved_h100_line_predicts_the_chosen_flux_set_up_without_a_gpu():
    # docs/flux.md's set-up: shard_grad_op, checkpointing, one microbatch of 64 per GPU per step; the
    # line measured microbatch 32, so its times count twice, and the weights go once each way per step.
    line = next(json.loads(text) for text in H100_LINES.read_text().splitlines()
                if text.startswith("{") and json.loads(text)["model_config"] == "flux1-schnell")
    result = blocks.main(H100_FLUX + ["--fsdp", "shard_grad_op", "--microbatch", "64", "--gpus", "8"])
    (row,) = result["predicted"]
    params = line["denoiser_params"]
    assert result["device"] == line["device"] and result["precision"] == "amp_bf16"  # the line's, not this CPU's
    assert result["measured_microbatch"] == 32 and result["microbatch"] == 64
    measured = line["measured"]["sharded"]
    assert result["measured"]["sharded"]["composed_microbatch_seconds"] == pytest.approx(
        2 * measured["composed_microbatch_seconds"])
    assert row["fsdp"] == "shard_grad_op" and row["accumulation"] == 1
    # One bf16 all-gather of the weights and one fp32 reduce-scatter of the gradients, 7/8 of each sent.
    assert row["traffic_bytes_per_gpu"] == pytest.approx(7 / 8 * (2 + 4) * params)
    optimizer = measured["adamw_seconds_per_param"] * params / 8
    harness = line["harness_seconds_per_step"]  # measured at the same 64 images per step
    assert row["compute_seconds"] == pytest.approx(2 * measured["composed_microbatch_seconds"] + optimizer + harness)
    assert row["samples_per_sec_per_gpu"] == pytest.approx(64 / (row["compute_seconds"] + row["traffic_bytes_per_gpu"]
                                                                  / 450e9))
    # The default before (full_shard, two microbatches of 32) sends about 8/3 as much.
    (before,) = blocks.main(H100_FLUX + ["--gpus", "8"])["predicted"]
    root = memory.fsdp_unit_params("flux1-schnell")["root"]
    assert before["traffic_bytes_per_gpu"] == pytest.approx(2 * 7 / 8 * (2 * (2 * params - root) + 4 * params))
    assert row["samples_per_sec_per_gpu"] > before["samples_per_sec_per_gpu"]


@pytest.mark.parametrize("device", ["h200", "b200"])
@pytest.mark.slow
def test_a_saved_h100_line_predicts_another_gpu_each_part_scaled_by_its_roofline(device):
    # Each part's time less its launches scales by the roofline of its counted work: never slower on a GPU
    # with more of both bandwidth and FLOP/s, never faster than the larger of the two ratios; the updates by
    # HBM bandwidth; the collectives at the GPU's own link.
    target, h100 = devices.get(device), devices.reference()
    argv = H100_FLUX + ["--fsdp", "shard_grad_op", "--microbatch", "64", "--gpus", "8"]
    on_h100 = blocks.main(argv)
    there = blocks.main(argv + ["--device", device])
    assert on_h100["predicted_device"] is None and there["predicted_device"] == target.label
    assert there["link_gbps"] == target.link_gb_per_sec and there["device"] == on_h100["device"]  # measured there
    fastest = max(target.bf16_flops_per_sec / h100.bf16_flops_per_sec, target.hbm_bytes_per_sec / h100.hbm_bytes_per_sec)
    before, after = on_h100["measured"]["sharded"], there["measured"]["sharded"]
    for measured, scaled in zip(before["blocks"] + [{"seconds": before["rest_seconds"]}],
                                after["blocks"] + [{"seconds": after["rest_seconds"]}]):
        assert 1 <= measured["seconds"] / scaled["seconds"] <= fastest + 1e-9
    assert there["per_parameter"]["adamw_seconds_per_param"] == pytest.approx(
        on_h100["per_parameter"]["adamw_seconds_per_param"] * h100.hbm_bytes_per_sec / target.hbm_bytes_per_sec)
    (row,), (base,) = there["predicted"], on_h100["predicted"]
    assert row["comm_seconds"] == pytest.approx(row["traffic_bytes_per_gpu"] / (target.link_gb_per_sec * 1e9))
    assert row["samples_per_sec_per_gpu"] > base["samples_per_sec_per_gpu"]


def test_device_predicts_another_gpu_only_from_a_saved_measurement():
    message = error_of(blocks.main, ["--model_config", "flux1-tiny", "--device", "h200", "--gpus", "1"], prog="blocks.py")
    assert "--device h200: timing runs on the CPU" in message and "--measured_json" in message


@pytest.mark.parametrize("argv, expect", [
    (["--microbatch", "48", "--gpus", "8", "--global_batch", "384"],
     "microbatch 32, which --microbatch 48 is no multiple"),
    (["--fp8", "tensorwise", "--compile"], "fp8 \"off\" (this prediction's \"tensorwise\")"),
    (["--compile"], "compile false (this prediction's true)"),  # a line older than --compile timed eager parts
    (["--use_ema"], "use_ema false"),
    (["--gpus", "1"], "no times for weights cast_per_step"),
    (["--count_memory"], "--measured_json predicts from a saved measurement"),
])
def test_a_saved_line_that_cannot_stand_for_the_set_up_is_refused_in_one_line(argv, expect):
    message = error_of(blocks.main, H100_FLUX + argv, prog="blocks.py")
    assert "--measured_json" in message and expect in message


@pytest.mark.parametrize("content, expect", [(b"not json\n{\"a\": 1}\n", "holds no line blocks.py wrote"),
                                             (b"\xff\xfe", "is not UTF-8 text"), (None, "no such file")])
def test_a_file_without_a_saved_line_is_refused_in_one_line(tmp_path, content, expect):
    path = tmp_path / "blocks.log"
    if content is not None:
        path.write_bytes(content)
    message = error_of(blocks.main, SETTINGS + ["--measured_json", str(path)], prog="blocks.py")
    assert expect in message and str(path) in message


# flux1-tiny on two CPU ranks, 4 images each per step (fp32: Composer is told fp32 on a CPU, so FSDP2
# gathers fp32 weights); the third argument is the microbatch.
TRAFFIC_RUNS = {"full_shard": ("full_shard", [], "2"),  # two microbatches per step
                "flux_set_up": ("shard_grad_op", ["--activation_checkpointing", "on"], "4")}  # docs/flux.md's


@pytest.mark.multirank
def test_the_traffic_it_counts_is_what_two_ranks_send(tmp_path):
    # What Composer's FSDP2 sends, counted from outside (tests/traffic_run.py wraps the all-gather and the
    # reduce-scatter), against blocks.py's traffic model: full_shard gathers every microbatch, each block
    # twice and the root unit once, and reduce-scatters every microbatch; the chosen Flux.1 set-up
    # (shard_grad_op, checkpointing, the per-rank batch in one microbatch) gathers and reduce-scatters
    # each unit once per step, its recompute included.
    launches = {name: Launch(two_ranks("tests/traffic_run.py", "--report", str(tmp_path / name),
                                       *SETTINGS, "--use_synth_data", "--batch_size", "8", "--max_duration", "2ba",
                                       "--warmup_batches", "1", "--num_workers", "0", "--fsdp", mode, *extra,
                                       "--device_train_microbatch_size", micro), tmp_path / f"{name}.log")
                for name, (mode, extra, micro) in TRAFFIC_RUNS.items()}
    supervise(list(launches.values()))
    denoiser = build_meta_model("flux1-tiny", precomputed=True).denoiser
    params = sum(p.numel() for p in denoiser.parameters())
    root = memory.fsdp_unit_params("flux1-tiny")["root"]
    units = len(family_of("flux1-tiny").fsdp_blocks(denoiser)) + 1
    for name, (mode, _, micro) in TRAFFIC_RUNS.items():
        assert launches[name].proc.returncode == 0, launches[name].tail()
        microbatches = 4 // int(micro)
        once, per_microbatch = blocks.traffic_bytes_per_gpu(mode, 2, params, root, "fp32")
        for rank in range(2):
            report = json.loads((tmp_path / name / f"rank{rank}.json").read_text())
            assert len(report["batches"]) == 2 and report["world_size"] == 2
            for batch in report["batches"]:
                assert batch["all_gather"] + batch["reduce_scatter"] == pytest.approx(once + microbatches * per_microbatch)
                assert batch["reduce_scatter"] == pytest.approx(microbatches * 0.5 * 4 * params)
                assert batch["reduce_scatter_calls"] == microbatches * units
                gathers = 2 * units - 1 if mode == "full_shard" else units
                assert batch["all_gather_calls"] == microbatches * gathers


@pytest.mark.parametrize("model_config", ["tiny"])  # sdxl-tiny: in the test of checkpointing below
def test_a_unets_blocks_are_timed_one_per_level_and_the_rest_runs_around_stand_ins(model_config):
    # Each down block, the mid block and each up block (the UNet's FSDP units) once; the up blocks read
    # their own `resnets` in the UNet's forward, which the stand-ins of the rest's step must answer.
    result = blocks.main(["--model_config", model_config, "--image_size", "32", "--precomputed", "--global_batch", "4",
                          "--microbatch", "2", "--gpus", "1", *SHORT])
    denoiser = build_meta_model(model_config, precomputed=True).denoiser
    times = result["measured"]["replicated"]
    assert sum(b["count"] for b in times["blocks"]) == len(family_of(model_config).fsdp_blocks(denoiser))
    assert {b["name"] for b in times["blocks"]} >= {"mid_block", "down_blocks.0", "up_blocks.0"}
    assert times["rest_seconds"] > 0 and result["predicted"][0]["samples_per_sec_per_gpu"] > 0


@pytest.mark.parametrize("model_config, classes", [
    # SDXL's UNet checkpoints resnets and transformer layers inside a level (not its mid block's first
    # resnet), never a level whole; Flux.1's transformer checkpoints each block whole.
    ("sdxl-tiny", ("CrossAttnUpBlock2D", "UNetMidBlock2DCrossAttn", "ResnetBlock2D", "BasicTransformerBlock")),
    ("flux1-tiny", ("FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxAttention")),
])
@pytest.mark.slow
def test_each_layer_runs_as_often_as_in_the_run_and_inputs_carry_no_summed_gradient(model_config, classes):
    checkpointing = True  # without it every layer runs once per step in both (the other tests' runs)
    flags = ["--model_config", model_config, "--image_size", "32", "--precomputed", "--precision", "amp_bf16",
             "--num_workers", "0", "--activation_checkpointing"]
    with ModuleCalls(classes) as run:  # two steps of one microbatch
        benchmark.main(flags + ["--use_synth_data", "--batch_size", "2", "--device_train_microbatch_size", "2",
                                "--max_duration", "2ba", "--warmup_batches", "1"])
    with ModuleCalls(classes) as timed:  # two runs of each part
        result = blocks.main(flags + ["--global_batch", "2", "--microbatch", "2", "--gpus", "1", "--warmup", "1",
                             "--repeats", "1", "--harness_batches", "2"])
    for kind in classes:
        # Forwards per step of each module of the kind (its recomputations in backward included).
        in_run = {n / 2 for n in run.counts(kind)}
        assert in_run and {n / 2 for n in timed.counts(kind)} == in_run, kind
        assert in_run == ({1, 2} if checkpointing and kind == "ResnetBlock2D" else
                          {2} if checkpointing and kind not in ("CrossAttnUpBlock2D", "UNetMidBlock2DCrossAttn")
                          else {1}), kind
    # A block's input gradient is handed on in the run; a repeat that summed it would arrive with one.
    assert timed.inputs_with_grad == 0
    assert result["predicted"][0]["samples_per_sec_per_gpu"] > 0
    denoiser = build_meta_model(model_config, precomputed=True).denoiser
    assert sum(b["count"] for b in result["measured"]["replicated"]["blocks"]) == len(
        family_of(model_config).fsdp_blocks(denoiser))


def test_one_device_casts_weights_once_per_step_as_the_run_does():
    # --weight_casts step on one device (the run's default on one CUDA GPU under amp_bf16; on a CPU asked
    # for): the blocks compute with t2ibench.train.weight_casts' bf16 copies, and the step adds their refresh
    # and the gradients' upcast, per parameter, once.
    result = blocks.main(["--model_config", "flux1-tiny", "--image_size", "32", "--precomputed", "--global_batch", "4",
                          "--microbatch", "2", "--gpus", "1", "--precision", "amp_bf16", "--weight_casts", "step",
                          *SHORT])
    assert set(result["measured"]) == {"cast_per_step"}
    (row,) = result["predicted"]
    per_param = result["per_parameter"]["weight_casts_seconds_per_param"]
    assert row["weight_casts"] == "step" and per_param > 0
    assert row["weight_casts_seconds"] == pytest.approx(per_param * result["denoiser_params"])
    assert row["compute_seconds"] == pytest.approx(
        row["accumulation"] * result["measured"]["cast_per_step"]["composed_microbatch_seconds"]
        + row["optimizer_seconds"] + row["weight_casts_seconds"] + row["harness_seconds"])
    auto = blocks.validate(blocks.build_parser().parse_args(["--model_config", "flux1-tiny", "--gpus", "1",
                                                             "--precision", "amp_bf16"]))
    assert auto.setups[1].weight_casts == "microbatch"  # auto on a CPU: as benchmark.py resolves it


@pytest.mark.slow
def test_each_part_fits_far_inside_what_the_run_holds_sdxl_checkpointed_at_microbatch_32():
    # The case that ran out of memory on an H100 where benchmark.py peaked at 70 GiB: every part of
    # SDXL's step, counted on the meta device for CUDA, needs well under the bytes a one-GPU run holds
    # before its first activation, so blocks.py fits wherever benchmark.py does.
    result = blocks.main(["--model_config", "sdxl-base", "--precomputed", "--precomputed_format", "text_states",
                          "--use_ema", "--activation_checkpointing", "--global_batch", "64", "--microbatch", "32",
                          "--gpus", "1", "--count_memory"])
    counted = result["counted_memory"]
    parts = counted["parts_bytes"]["cast_per_step"]  # one CUDA GPU under amp_bf16: weights cast per step
    assert set(parts) == {"down_blocks.0", "down_blocks.1", "down_blocks.2", "mid_block", "up_blocks.0",
                          "up_blocks.1", "up_blocks.2", "the rest"}
    assert counted["largest_part_bytes"] == max(parts.values())
    assert counted["one_gpu_run_fixed_bytes"] == sum(memory.fixed_bytes(
        "sdxl-base", precomputed=True, precomputed_format="text_states", use_ema=True, fsdp="none", num_gpus=1,
        weight_casts="step").values())
    assert counted["largest_part_bytes"] < 0.5 * counted["one_gpu_run_fixed_bytes"]
