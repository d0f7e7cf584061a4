"""The training recipe, samples, export and learning: the tiny model through benchmark.py on CPU.

* warm-up + gradient clipping + caption dropout + min-SNR + offset noise + EMA start: a run cut
  after its checkpoint at batch 2 (a callback passed in raises) and resumed with --autoresume
  ends with the weights, EMA and loss bins of the run that was not cut, bit for bit;
* --grad_clip_norm's clipping (t2ibench.train.grad_norm) is Composer's GradientClipping, to the bit;
* caption dropout replaces rows by the empty caption in every data path, the same rows under a seed;
* min-SNR-gamma weights match the formula for epsilon and v-prediction;
* sample grids written while training; --ema_export_dir and export.py write pipelines that
  diffusers loads and samples offline; the tiny VAE carries its scaling factor;
* bench/learns.py, shortened: the tiny model learns two captions.
"""
from __future__ import annotations

import dataclasses
import types

from pathlib import Path

import pytest
import torch
from composer.algorithms.gradient_clipping import apply_gradient_clipping
from composer.core import Event
from PIL import Image

import benchmark
from t2ibench.families import MODEL_CONFIGS
from t2ibench.families.sd2 import TINY_SCALING_FACTOR
from t2ibench.train.grad_norm import GradientNorm
from t2ibench.train.model import DiffusionModel
from t2ibench.core.tokenizer import tokenize
from tests.helpers import ROOT, TINY_SYNTH

SD2 = MODEL_CONFIGS["tiny"]

TINY = [*TINY_SYNTH, "--num_synthetic_samples", "12", "--warmup_batches", "1", "--log_interval", "1ba"]
RECIPE = ["--lr", "1e-3", "--lr_warmup_batches", "3", "--lr_schedule", "cosine", "--grad_clip_norm", "0.5",
          "--caption_drop_prob", "0.5", "--snr_gamma", "5", "--offset_noise", "0.1", "--use_ema", "--ema_start", "1ba"]


class CutAfter:
    """A callback that raises when batch `batch` + 1 starts, i.e. after batch `batch`'s checkpoint was saved."""

    def __new__(cls, batch: int):
        from composer.core import Callback

        class _Cut(Callback):
            def batch_start(self, state, logger):
                if int(state.timestamp.batch) == batch:
                    raise KeyboardInterrupt(f"cut after batch {batch}")
        return _Cut()


def _weights(checkpoint: Path) -> dict:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]
    ema = next(s for name, s in state["algorithms"] if name == "EMA")
    return {**{k: v for k, v in state["model"].items() if k.startswith("unet.")},
            **{"ema." + k: v for k, v in ema["shadow"].items()}}


@pytest.mark.slow
def test_recipe_run_resumes_bit_for_bit(tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    common = TINY + RECIPE + ["--max_duration", "4ba", "--save_interval", "2ba", "--run_name", "r", "--autoresume"]
    r_straight = benchmark.main(common + ["--save_folder", str(straight)])
    with pytest.raises(KeyboardInterrupt):
        benchmark.main(common + ["--save_folder", str(cut)], extra_callbacks=[CutAfter(2)])
    assert (cut / "ep0-ba2-rank0.pt").exists() and not (cut / "ep1-ba4-rank0.pt").exists()
    r_resumed = benchmark.main(common + ["--save_folder", str(cut)])
    assert r_resumed["measured_batches"] + r_resumed["warmup_batches"] == 2  # resumed at batch 2, not restarted
    a, b = _weights(straight / "ep1-ba4-rank0.pt"), _weights(cut / "ep1-ba4-rank0.pt")
    assert a.keys() == b.keys() and any(k.startswith("ema.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert r_straight["final_loss"] == r_resumed["final_loss"]
    assert r_straight["loss_by_timestep_bin"] == r_resumed["loss_by_timestep_bin"]  # the sums came back too
    # Loss by noise level: 10 bins of 100 timesteps; the straight run counts all 16 samples.
    bins = r_straight["loss_by_timestep_bin"]
    assert [b["timesteps"] for b in bins] == [[100 * i, 100 * i + 99] for i in range(10)]
    assert sum(b["samples"] for b in bins) == 16
    assert all(b["mean_loss"] > 0 for b in bins if b["samples"])


@pytest.mark.parametrize("threshold", [0.05, 100.0])  # clipped, and left as it is
def test_gradient_clipping_is_composers_to_the_bit(threshold):
    # GradientNorm clips with the norm it keeps for grad_norm; Composer's GradientClipping (what
    # --grad_clip_norm ran before) computes its own and drops it. The same gradients either way.
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    x = torch.randn(8, 16)
    for net in nets:
        net(x).square().mean().backward()
    before = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in nets[0].parameters()]))
    apply_gradient_clipping(nets[0], clipping_type="norm", clipping_threshold=threshold, fsdp_enabled=False)
    norm = GradientNorm(clip_norm=threshold)
    state = types.SimpleNamespace(optimizers=[torch.optim.AdamW(nets[1].parameters())])
    assert norm.match(Event.AFTER_TRAIN_BATCH, state) and not norm.match(Event.AFTER_BACKWARD, state)
    norm.apply(Event.AFTER_TRAIN_BATCH, state, None)
    for ours, composers in zip(nets[1].parameters(), nets[0].parameters()):
        assert torch.equal(ours.grad, composers.grad)
    assert norm.last_norm() == pytest.approx(float(before), rel=1e-6)
    assert (threshold < norm.last_norm()) == (threshold == 0.05)


def test_recipe_flags_reach_the_step():
    """The flags change the first batch's loss (the plain run's is the 2023 step's)."""
    base = TINY + ["--max_duration", "1ba", "--lr", "1e-3", "--loss_bins", "0"]
    plain = benchmark.main(base)["final_loss"]
    recipe = benchmark.main(base + ["--caption_drop_prob", "0.9", "--offset_noise", "0.5", "--snr_gamma", "1"])
    assert recipe["final_loss"] != plain


@pytest.mark.parametrize("args, flag", [
    (["--lr_warmup_batches", "-1"], "--lr_warmup_batches"),
    (["--grad_clip_norm", "0"], "--grad_clip_norm"),
    (["--caption_drop_prob", "1.5"], "--caption_drop_prob"),
    (["--ema_start", "10sp", "--use_ema"], "--ema_start"),
    (["--ema_start", "10ba"], "--ema_start"),
    (["--sample_prompts", "/nonexistent/prompts.txt", "--samples_dir", "/tmp"], "--sample_prompts"),
    (["--sample_prompts", "default"], "--sample_prompts"),
    (["--sample_prompts", "default", "--samples_dir", "/tmp", "--sample_interval", "3sp"], "--sample_interval"),
    (["--snr_gamma", "-1"], "--snr_gamma"),
    (["--samples_dir", "/tmp/x"], "--samples_dir"),
])
def test_bad_recipe_flags_fail_at_once(args, flag):
    with pytest.raises(SystemExit) as info:
        benchmark.main(TINY + ["--max_duration", "1ba"] + args)
    message = str(info.value.code)
    assert flag in message and "\n" not in message


def test_caption_dropout_in_every_data_path():
    torch.manual_seed(0)
    parts = SD2.build("tiny")
    model = DiffusionModel(SD2, parts)
    empty_ids = tokenize(parts.tokenizer, [""])
    empty_states = parts.text_encoder(empty_ids)[0].detach()
    model.set_caption_dropout(0.5, {"captions": empty_ids}, {"text_states": empty_states})
    captions = tokenize(parts.tokenizer, [f"caption {i}" for i in range(64)])
    states = torch.randn(64, 77, 64)
    for key, rows, empty in (("captions", captions, empty_ids), ("text_states", states, empty_states)):
        torch.manual_seed(1)
        dropped = model._drop_captions({key: rows, "latent_mean": torch.zeros(64)})[key]
        torch.manual_seed(1)
        again = model._drop_captions({key: rows})[key]
        assert torch.equal(dropped, again)  # the same rows under the same seed
        is_empty = (dropped == empty).flatten(1).all(1)
        kept = (dropped == rows).flatten(1).all(1)
        assert (is_empty | kept).all() and 16 < int(is_empty.sum()) < 48
    model.set_caption_dropout(0.5, {"captions": empty_ids}, None)
    with pytest.raises(ValueError, match="text_states"):
        model._drop_captions({"text_states": states})


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_gamma_weights(prediction_type):
    torch.manual_seed(0)
    parts = SD2.build("tiny", vae=False, text_encoders=False, tokenizers=False)
    scheduler = parts.noise_scheduler.__class__.from_config(parts.noise_scheduler.config, prediction_type=prediction_type)
    model = DiffusionModel(SD2, dataclasses.replace(parts, noise_scheduler=scheduler, latent_scale=1.0), snr_gamma=5.0)
    prediction, target = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    timesteps = torch.tensor([0, 500, 999])
    alpha = scheduler.alphas_cumprod[timesteps]
    snr = alpha / (1 - alpha)
    weight = torch.minimum(snr, torch.tensor(5.0)) / (snr if prediction_type == "epsilon" else snr + 1)
    expected = (((prediction - target) ** 2).mean(dim=(1, 2, 3)) * weight).mean()
    assert torch.allclose(model.loss((prediction, target, timesteps), {}), expected)
    assert weight[0] < weight[2] or prediction_type == "v_prediction"  # low noise is down-weighted


def test_tiny_vae_is_a_miniature_of_a_trained_one():
    torch.manual_seed(0)
    vae = SD2.build("tiny", denoiser=False).vae
    assert vae.config.scaling_factor == TINY_SCALING_FACTOR
    posterior = vae.encode(torch.rand(4, 3, 32, 32) * 2 - 1).latent_dist
    assert posterior.std.max() < 0.01  # nearly deterministic, like a trained VAE
    rms = posterior.mean.pow(2).mean().sqrt() * vae.config.scaling_factor
    assert 0.5 < rms < 2.0  # scaled latents of roughly unit size


@pytest.mark.slow
def test_samples_ema_export_and_export_py_give_pipelines_diffusers_samples(tmp_path):
    from diffusers import StableDiffusionPipeline

    import export

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\n\na blue circle\na green triangle\n")
    save, samples = tmp_path / "run", tmp_path / "samples"
    result = benchmark.main(TINY + ["--max_duration", "4ba", "--use_ema", "--save_folder", str(save),
                                    "--save_interval", "4ba", "--ema_export_dir", str(tmp_path / "ema_pipe"),
                                    "--sample_prompts", str(prompts), "--sample_interval", "2ba",
                                    "--samples_dir", str(samples), "--sample_steps", "2", "--guidance_scale", "3"])
    assert sorted(p.name for p in samples.iterdir()) == ["2.png", "4.png"]
    grid = Image.open(samples / "4.png")
    assert grid.size == (64, 64)  # 3 prompts of 32 px in a 2 x 2 grid
    assert result["images_per_sec"] > 0

    export.main([str(save / "ep1-ba4-rank0.pt"), "--out", str(tmp_path / "ema_export"), "--ema"])
    export.main([str(save / "ep1-ba4-rank0.pt"), "--out", str(tmp_path / "trained_export")])
    with pytest.raises(SystemExit, match="--out"):
        export.main([str(save / "ep1-ba4-rank0.pt"), "--out", str(tmp_path / "trained_export")])

    unets = {}
    for name in ("ema_pipe", "ema_export", "trained_export"):
        folder = tmp_path / name
        assert {p.name for p in folder.iterdir()} >= {"unet", "vae", "text_encoder", "tokenizer", "scheduler",
                                                     "model_index.json"}
        pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
        assert pipe.vae.config.scaling_factor == TINY_SCALING_FACTOR
        image = pipe("a red square", height=32, width=32, num_inference_steps=2, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images[0]
        assert image.shape == (32, 32, 3) and (0 <= image).all() and (image <= 1).all()
        unets[name] = pipe.unet.state_dict()
    for k, v in unets["ema_pipe"].items():
        assert torch.equal(v, unets["ema_export"][k]), k
    assert any(not torch.equal(v, unets["trained_export"][k]) for k, v in unets["ema_pipe"].items())


@pytest.mark.slow
def test_learns_script_end_to_end_short(tmp_path, capsys):
    """bench/learns.py's whole path, briefly: pictures -> convert.py -> benchmark.py -> scores.

    The >= 90% score needs minutes of training (bench/learns.py's defaults: 600 batches); here 40
    batches must only bring the loss well below a random UNet's (~1) and every stage must report.
    """
    import learns

    with pytest.raises(SystemExit, match="--captions.*colour"):
        learns.main(["--captions", "a red square", "something vague", "--workdir", str(tmp_path / "bad")])
    r = learns.main(["--captions", "a red square", "a blue circle", "--images_per_caption", "8", "--image_size", "32",
                     "--batches", "40", "--batch_size", "8", "--samples_per_caption", "4", "--sample_steps", "4",
                     "--workdir", str(tmp_path / "work")])
    assert r["classes"] == ["a red square", "a blue circle"] and r["images"] == 16 and r["chance"] == 0.5
    assert 0 <= r["score_before"] <= 1 and 0 <= r["score_after"] <= 1
    assert r["final_loss"] < 0.8, r["final_loss"]
    assert sum(b["samples"] for b in r["loss_by_timestep_bin"]) == 40 * 8
    assert "chance 50.0%" in capsys.readouterr().out


@pytest.mark.slow
def test_precomputed_text_states_run_with_dropout_samples_and_export(tmp_path):
    """Precomputed batches (stored text states, no encoders in the model): the empty caption's states,
    the sampler's encoders and the exported pipeline's come from encoders built aside under --seed."""
    benchmark.main(TINY + ["--precomputed", "--max_duration", "2ba", "--caption_drop_prob", "0.5",
                           "--sample_prompts", "shapes", "--samples_dir", str(tmp_path / "samples"),
                           "--sample_steps", "2", "--sample_size", "16x32", "--use_ema",
                           "--ema_export_dir", str(tmp_path / "pipe")])
    assert (tmp_path / "samples" / "2.png").is_file()
    # SD2 trains on squares and samples at any --sample_size: 8 prompts of 16 x 32 px, 3 x 3
    assert Image.open(tmp_path / "samples" / "2.png").size == (96, 48)
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"} <= {
        p.name for p in (tmp_path / "pipe").iterdir()}


RECIPE_VALUES = ("lr", "weight_decay", "caption_drop_prob", "grad_clip_norm", "lr_schedule", "autoresume", "use_ema",
                 "ema_export_dir", "snr_gamma", "offset_noise")


@pytest.mark.parametrize("stage", [1, 2])
def test_recipe_files_are_the_documented_recipe_and_the_tiny_ones_keep_its_values(stage, tmp_path):
    real = benchmark.parse_args([f"@{ROOT}/recipes/sd2-stage{stage}.args"])
    tiny = benchmark.parse_args([f"@{ROOT}/recipes/tiny-stage{stage}.args"])
    assert (real.lr, real.weight_decay, real.caption_drop_prob, real.grad_clip_norm) == (1e-4, 0.01, 0.1, 1.0)
    assert real.batch_size == 2048 and real.autoresume and real.model_config == "sd2-base"
    if stage == 1:
        assert (real.image_size, real.max_duration, real.lr_warmup_batches) == (256, "550000ba", 10000)
    else:
        assert (real.image_size, real.max_duration, real.lr_warmup_batches) == (512, "1400000ba", 0)
        assert (real.use_ema, real.ema_start, real.ema_half_life) == (True, "1350000ba", "6931ba")
    for name in RECIPE_VALUES:
        assert getattr(tiny, name) == getattr(real, name), name
    assert tiny.model_config == "tiny" and (tiny.lr_warmup_batches > 0) == (real.lr_warmup_batches > 0)
    # The full-size recipe passes every check on 8 GPUs given its data and where the run goes.
    where = ["--samples_dir", str(tmp_path / "samples")] if stage == 1 else ["--ema_export_dir", str(tmp_path / "pipe")]
    args = benchmark.parse_args([f"@{ROOT}/recipes/sd2-stage{stage}.args", "--use_synth_data", "--run_name", "r",
                                 "--save_folder", str(tmp_path / "run"), *where])
    benchmark.validate(args, world_size=8)
    # Flags after the file override it; a file that cannot be read is one line.
    assert benchmark.parse_args([f"@{ROOT}/recipes/sd2-stage1.args", "--lr", "2e-4"]).lr == 2e-4
    with pytest.raises(SystemExit):
        benchmark.parse_args([f"@{tmp_path}/missing.args"])
