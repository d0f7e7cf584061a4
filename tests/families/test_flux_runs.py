"""flux1-tiny through benchmark.py: one rank in-process (validation loss, samples, EMA, export that
FluxPipeline loads), and two ranks through Composer's launcher, SIGKILLed after a checkpoint and
resumed with --autoresume to the same weights, EMA, optimizer state and validation losses.

The two-rank runs train on synthetic data in MLPerf's precomputed format (VAE moments, T5 states,
CLIP pooled). They use DDP: FSDP is not in this project yet (see docs/flux.md).
"""
from __future__ import annotations

import json
import signal

import pytest
from composer.core import Callback, State
from composer.loggers import Logger
from diffusers import FluxPipeline

import benchmark
from t2ibench.callbacks.throughput import Throughput
from t2ibench.callbacks.validation import ValidationLog
from tests.helpers import Launch, assert_tensors_equal, ema_state, kill_and_resume, load, two_ranks

FLUX_TINY = ["--model_config", "flux1-tiny", "--precomputed", "--use_synth_data", "--image_size", "32",
             "--num_workers", "0", "--seed", "17", "--warmup_batches", "1", "--log_interval", "1ba"]
# 2 ranks x 2 samples; 12 samples: an epoch is 3 batches, so the run crosses epochs and resumes mid-epoch.
RESUME_RUN = FLUX_TINY + ["--batch_size", "4", "--num_synthetic_samples", "12", "--use_ema", "--max_duration", "6ba",
                          "--save_interval", "2ba", "--eval_interval", "3ba", "--eval_samples", "8",
                          "--run_name", "flux-resume", "--autoresume"]
KILL_AFTER = "ep1-ba4-rank0.pt"  # after the evaluation at batch 3
FINAL = "ep1-ba6-rank0.pt"


class PausesSeen(Callback):
    """Fault-free probe: at the end of fit, what the Throughput and ValidationLog callbacks hold."""

    def fit_end(self, state: State, logger: Logger) -> None:
        self.throughput = next(cb for cb in state.callbacks if isinstance(cb, Throughput))
        self.validation = next(cb for cb in state.callbacks if isinstance(cb, ValidationLog))


def test_one_rank_validation_loss_samples_ema_and_export(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    probe = PausesSeen()
    results = benchmark.main(FLUX_TINY + [
        "--batch_size", "4", "--max_duration", "4ba", "--eval_interval", "2ba", "--eval_samples", "8",
        "--eval_target", "1e-9", "--use_ema", "--ema_export_dir", str(tmp_path / "pipe"), "--sample_prompts", "shapes",
        "--sample_interval", "4ba", "--sample_steps", "2", "--samples_dir", str(tmp_path / "samples"),
        "--caption_drop_prob", "0.1", "--results_json", str(tmp_path / "r.json")], extra_callbacks=[probe])
    stored = json.loads((tmp_path / "r.json").read_text())
    assert stored["model_config"] == "flux1-tiny" and stored["precomputed_format"] == "text_states"
    history = stored["eval_history"]
    assert [entry["batch"] for entry in history] == [2, 4] and stored["eval_loss"] == history[-1]["loss"]
    assert all(entry["held_out_samples"] == 8 and len(entry["per_timestep"]) == 8 for entry in history)
    # A target no loss meets: the run goes on to --max_duration (one that is met stops it: test_validation.py).
    assert stored["eval_target_reached"] is None and stored["converged"] is False
    # Every evaluation and the sample grid are pauses, which the measured throughput leaves out.
    pauses = probe.throughput.pauses.intervals
    for entry in probe.validation.history:
        assert any(seconds == entry["seconds"] for _, seconds in pauses)
    assert len(pauses) == len(history) + 1  # + the grid at batch 4
    assert (tmp_path / "samples" / "4.png").is_file()
    assert results["flops_per_image"] > 0 and results["loss_by_timestep_bin"]
    pipe = FluxPipeline.from_pretrained(str(tmp_path / "pipe"), local_files_only=True)
    images = pipe(["a red square"], height=32, width=32, num_inference_steps=2, output_type="np",
                  max_sequence_length=pipe.tokenizer_2.model_max_length).images
    assert images.shape == (1, 32, 32, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted two-rank run and the same run SIGKILLed after its batch-4 checkpoint, resumed."""
    tmp = tmp_path_factory.mktemp("flux-resume")

    def launch(name: str, folder: str) -> Launch:
        args = RESUME_RUN + ["--save_folder", str(tmp / folder), "--results_json", str(tmp / f"{name}.json")]
        return Launch(two_ranks("benchmark.py", *args), tmp / f"{name}.log")

    return dict(tmp=tmp, **kill_and_resume(launch, tmp / "killed", KILL_AFTER))


@pytest.mark.multirank
def test_two_ranks_killed_and_resumed_reach_the_same_weights_and_validation_loss(runs):
    tmp, reference, killed, resumed = runs["tmp"], runs["reference"], runs["killed"], runs["resumed"]
    assert reference.proc.returncode == 0, reference.tail()
    assert killed.proc.returncode == -signal.SIGKILL
    assert resumed.proc.returncode == 0, resumed.tail()
    assert "batch 5/6 " in resumed.output() and "batch 1/6 " not in resumed.output(), resumed.tail()
    ref, res = load(tmp / "reference" / FINAL), load(tmp / "killed" / FINAL)
    assert {k.split(".")[0] for k in ref["state"]["model"]} == {"transformer"}  # no encoder: precomputed
    assert_tensors_equal(ref["state"]["model"], res["state"]["model"], "transformer weights")
    assert_tensors_equal(ema_state(ref)["shadow"], ema_state(res)["shadow"], "EMA shadow")
    for key in ref["state"]["optimizers"]["AdamW"]["state"]:
        assert_tensors_equal(ref["state"]["optimizers"]["AdamW"]["state"][key],
                             res["state"]["optimizers"]["AdamW"]["state"][key], f"AdamW state {key}")
    r_ref, r_res = (json.loads((tmp / f"{name}.json").read_text()) for name in ("reference", "resumed"))
    assert r_ref["world_size"] == 2 and r_ref["final_loss"] == r_res["final_loss"]
    # Both evaluations, on both ranks' halves of the 8 held-out samples, once each; the resumed run
    # kept the one before the kill (from the checkpoint) and computed the same loss at batch 6.
    assert [e["batch"] for e in r_ref["eval_history"]] == [e["batch"] for e in r_res["eval_history"]] == [3, 6]
    assert all(e["held_out_samples"] == 8 for e in r_ref["eval_history"])
    assert [e["loss"] for e in r_ref["eval_history"]] == [e["loss"] for e in r_res["eval_history"]]


def test_latents_py_writes_mlperfs_format_and_training_reads_it_like_synthetic_data(tmp_path):
    import convert
    import data
    import latents
    from learns import write_shapes
    from t2ibench.families import family_of
    write_shapes(tmp_path / "pictures", ["a red square", "a blue circle"], 4, 32, seed=0)
    convert.main([str(tmp_path / "pictures"), "--out", str(tmp_path / "mds"), "--workers", "1", "--no_progress"])
    common = ["--model_config", "flux1-tiny", "--local", str(tmp_path / "mds"), "--image_size", "32", "--batch_size", "4",
              "--num_workers", "0", "--no_progress"]
    states = latents.main(common + ["--out", str(tmp_path / "states")])
    tokens = latents.main(common + ["--out", str(tmp_path / "tokens"), "--store_token_ids"])
    flux = family_of("flux1-tiny")
    sizes = flux.precomputed_bytes_per_sample("flux1-tiny", 32)
    assert states["format"] == "text_states" and tokens["format"] == "tokens"
    # What is stored per sample: the arrays of the family's format, plus the caption and MDS offsets.
    assert 0 < states["bytes_per_sample_raw"] - sizes["total"] < 100
    # A stored sample and a synthetic one have the same keys, shapes and dtypes.
    stored = data.StreamingLatents(local=str(tmp_path / "states"), batch_size=4, family=flux, config="flux1-tiny",
                                   image_size=32, shuffle=False)
    synthetic = data.SyntheticLatents(32, 64, num_samples=4, family=flux, config="flux1-tiny", text_format="text_states",
                                      latent_channels=16)
    a, b = stored.get_item(0), synthetic[0]
    assert {k: (tuple(v.shape), v.dtype) for k, v in a.items()} == {k: (tuple(v.shape), v.dtype) for k, v in b.items()}
    for name in ("states", "tokens"):
        r = benchmark.main(FLUX_TINY[:2] + ["--precomputed", "--local", str(tmp_path / name), "--image_size", "32",
                                            "--batch_size", "4", "--max_duration", "2ba", "--num_workers", "0",
                                            "--eval_interval", "2ba", "--eval_local", str(tmp_path / name)])
        assert r["precomputed_format"] == ("text_states" if name == "states" else "tokens")
        assert r["eval_history"][0]["held_out_samples"] == 8
