"""Flux.1 as a model family: configs against the published architecture, FLOPs against an independent
count, latent packing against FluxPipeline's, rectified flow, MLPerf's validation loss, training
through Composer, and an exported folder that FluxPipeline loads offline and samples from."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from composer import Trainer
from diffusers import FluxPipeline

from t2ibench.families import family_of
from t2ibench.families import flux
from t2ibench.costs.mlperf import newest_rcp_round, reference_samples_to_target
from t2ibench.train.model import DiffusionModel, count_parameters
from t2ibench.families.objectives import RectifiedFlowObjective
from t2ibench.eval.sampling import make_sampler, sample_latents
from t2ibench.costs.scale import NVIDIA_FLUX_DECLARED_FLOP_PER_SAMPLE
from t2ibench.eval.validation import ValidationLoss, validation_noise

FLUX = family_of("flux1-tiny")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(scope="module")
def tiny() -> flux.Parts:
    torch.manual_seed(17)
    return FLUX.build("flux1-tiny")


def test_flux1_schnell_is_the_published_architecture():
    parts = FLUX.meta_parts("flux1-schnell")
    transformer = parts.denoiser
    assert len(transformer.transformer_blocks) == 19 and len(transformer.single_transformer_blocks) == 38
    assert transformer.inner_dim == 3072 == 24 * 128 and transformer.config.in_channels == 16 * 2 * 2
    assert sum(transformer.config.axes_dims_rope) == transformer.config.attention_head_dim
    assert not hasattr(transformer.time_text_embed, "guidance_embedder")  # schnell: no guidance embedding
    assert count_parameters(transformer) == pytest.approx(11.9e9, rel=0.005)
    assert (parts.vae.config.latent_channels, parts.latent_scale, parts.latent_shift) == (16, 0.3611, 0.1159)
    assert parts.text_encoders["text_encoder"].config.hidden_size == 768  # the pooled output Flux reads
    t5 = parts.text_encoders["text_encoder_2"]
    assert t5.config.d_model == 4096 and count_parameters(t5) == pytest.approx(4.76e9, rel=0.01)
    assert FLUX.conditioning_shapes("flux1-schnell") == {"t5_states": (256, 4096), "clip_pooled": (768,)}


def test_flux1_tiny_keeps_the_structure_at_a_few_million_parameters(tiny):
    transformer = tiny.denoiser
    assert 1e6 < count_parameters(transformer) < 5e6
    assert transformer.config.in_channels == tiny.vae.config.latent_channels * 4 == 64
    assert sum(transformer.config.axes_dims_rope) == transformer.config.attention_head_dim
    assert transformer.config.joint_attention_dim == tiny.text_encoders["text_encoder_2"].config.d_model
    assert transformer.config.pooled_projection_dim == tiny.text_encoders["text_encoder"].config.hidden_size
    assert len(transformer.transformer_blocks) > 0 and len(transformer.single_transformer_blocks) > 0
    assert (tiny.pretrained, tiny.random) == ([], ["vae", "text_encoder", "text_encoder_2"])
    inputs = FLUX.tokenize(tiny.tokenizers, ["a red square", ""])
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {"clip_ids": (2, 77), "t5_ids": (2, 32)}
    conditioning = FLUX.encode_text(tiny.text_encoders, inputs)
    assert {k: tuple(v.shape[1:]) for k, v in conditioning.items()} == FLUX.conditioning_shapes("flux1-tiny")


@pytest.mark.slow
def test_flux1_schnell_flops_per_256px_sample_against_an_independent_count():
    flops = FLUX.flops_per_image("flux1-schnell", 256, vae=False, text_encoders=False)
    analytic = flux.analytic_transformer_flops("flux1-schnell", 256)
    assert flops["denoiser_fwd"] == pytest.approx(analytic["forward"], rel=0.001)
    # Backward: two matmuls per forward matmul (gradients of inputs and of weights).
    assert flops["denoiser_fwd_bwd"] == pytest.approx(3 * flops["denoiser_fwd"], rel=0.01)
    assert flops["denoiser_fwd_bwd"] == pytest.approx(NVIDIA_FLUX_DECLARED_FLOP_PER_SAMPLE, rel=0.01)
    assert flops["total"] == flops["denoiser_fwd_bwd"]  # precomputed: no encoder in the step


@pytest.mark.parametrize("height, width", [(32, 128), (128, 32), (48, 80)])
def test_flops_of_a_bucket_against_an_independent_count(height, width):
    flops = FLUX.flops_per_image("flux1-tiny", (height, width), vae=False, text_encoders=False)
    analytic = flux.analytic_transformer_flops("flux1-tiny", (height, width))
    assert flops["denoiser_fwd"] == pytest.approx(analytic["forward"], rel=0.001)
    # As many tokens as the square of the same pixels, so the same FLOPs; fewer tokens, fewer FLOPs.
    square = FLUX.flops_per_image("flux1-tiny", 64, vae=False, text_encoders=False)
    if height * width == 64 * 64:
        assert flops == square
    else:
        assert flops["denoiser_fwd"] < square["denoiser_fwd"]


def test_pack_and_image_ids_match_flux_pipeline():
    latents = torch.randn(2, 16, 8, 6)
    packed = flux.pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 6))
    assert torch.equal(flux.unpack_latents(packed, 8, 6), latents)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 48, 8), latents)  # pixel sizes, vae factor 8
    assert torch.equal(flux.image_ids(8, 6), FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32))


def test_rectified_flow_interpolates_and_its_velocity_leads_back_to_the_data(tiny):
    objective = RectifiedFlowObjective(tiny.noise_scheduler)
    x0, noise = torch.randn(4, 16, 4, 4), torch.randn(4, 16, 4, 4)
    timesteps = torch.tensor([0.0, 250.0, 500.0, 1000.0])
    x_t, v = objective.noisy_and_target(x0, noise, timesteps)
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[3], noise[3]) and torch.equal(v, noise - x0)
    # One Euler step of the exact velocity from t to 0 lands on the data (what FluxPipeline integrates).
    assert torch.allclose(x_t - (timesteps / 1000).view(-1, 1, 1, 1) * v, x0, atol=1e-6)
    torch.manual_seed(0)
    uniform = objective.sample_timesteps(20000, "cpu") / 1000
    logit = RectifiedFlowObjective(tiny.noise_scheduler, "logit_normal").sample_timesteps(20000, "cpu") / 1000
    assert uniform.min() >= 0 and uniform.max() < 1 and uniform.std() == pytest.approx(12 ** -0.5, rel=0.03)
    assert logit.median() == pytest.approx(0.5, abs=0.02) and logit.std() < 0.8 * uniform.std()
    assert objective.bin_index(torch.tensor([0.0, 99.9, 100.0, 999.9]), 10).tolist() == [0, 0, 1, 9]
    assert objective.fixed_timesteps(torch.arange(8), 8).tolist() == [0, 125, 250, 375, 500, 625, 750, 875]


def test_schnell_refuses_to_tokenize_without_t5_tokenizer(tmp_path):
    with pytest.raises(SystemExit, match="--model_name .*T5-XXL's SentencePiece tokenizer"):
        FLUX.build("flux1-schnell", str(tmp_path), denoiser=False, vae=False, text_encoders=False)


def test_precomputed_bytes_per_256px_sample():
    sizes = FLUX.precomputed_bytes_per_sample("flux1-schnell", 256)
    assert sizes["vae_moments"] == 2 * 16 * 32 * 32 * 2 and sizes["t5_states"] == 256 * 4096 * 2
    assert sizes["total"] == 65_536 + 2_097_152 + 1_536 + 8


def precomputed(parts, captions: list[str], images: torch.Tensor) -> dict:
    """What latents.py stores for Flux (--store_text_states): VAE moments and both text outputs."""
    with torch.no_grad():
        dist = parts.vae.encode(images).latent_dist
        conditioning = FLUX.encode_text(parts.text_encoders, FLUX.tokenize(parts.tokenizers, captions))
    return {"latent_mean": dist.mean, "latent_logvar": dist.logvar, **conditioning}


def test_online_and_precomputed_batches_give_the_same_step(tiny):
    captions, images = ["a red square", "a blue circle"], torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    model = DiffusionModel(FLUX, dataclasses.replace(tiny, denoiser=flux.FluxTransformer2DModel(
        **flux.CONFIGS["flux1-tiny"]["transformer"])))
    online = {"image": images, **FLUX.tokenize(tiny.tokenizers, captions)}
    stored = precomputed(tiny, captions, images.float() / 127.5 - 1)
    torch.manual_seed(3)
    a = model(online)
    torch.manual_seed(3)
    b = model(stored)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5)


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch: dict):
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["latent_mean"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.batch.items()}


def trainable(tiny) -> DiffusionModel:
    return DiffusionModel(FLUX, dataclasses.replace(tiny, vae=None, text_encoders={}, denoiser=flux.FluxTransformer2DModel(
        **flux.CONFIGS["flux1-tiny"]["transformer"])))


def test_tiny_trains_through_composer_and_its_validation_loss_falls(tiny):
    torch.manual_seed(0)
    data = precomputed(tiny, ["a red square", "a blue circle"] * 2, torch.rand(4, 3, 64, 64) * 2 - 1)
    data["sample_index"] = torch.arange(4)
    model = trainable(tiny)

    def validation_loss() -> float:
        metric = ValidationLoss()
        model.update_metric(data, model.eval_forward(data), metric)
        return metric.compute().item()

    before = validation_loss()
    loader = torch.utils.data.DataLoader(Rows(data), batch_size=4, shuffle=False)
    Trainer(model=model, train_dataloader=loader, max_duration="30ba", progress_bar=False,
            optimizers=torch.optim.AdamW(model.denoiser.parameters(), lr=2e-3), device="cpu", seed=1).fit()
    assert validation_loss() < 0.8 * before
    window = model.loss_bins.take()
    assert window is not None and window[1].sum().item() == 30 * 4  # every trained sample landed in a bin


def test_validation_loss_is_fixed_per_sample_whatever_the_batching(tiny):
    torch.manual_seed(0)
    data = precomputed(tiny, ["x"] * 8, torch.rand(8, 3, 64, 64) * 2 - 1)
    data["sample_index"] = torch.arange(8)
    model = trainable(tiny).eval()

    def run(splits: list[slice]) -> ValidationLoss:
        metric = ValidationLoss()
        for part in splits:
            torch.manual_seed(len(splits))  # no other randomness may enter
            model.update_metric(data, model.eval_forward({k: v[part] for k, v in data.items()}), metric)
        return metric

    whole, halves = run([slice(0, 8)]), run([slice(4, 8), slice(0, 4)])
    assert whole.compute().item() == pytest.approx(halves.compute().item(), rel=1e-6)
    assert whole.counts.tolist() == [1.0] * 8  # one sample at each of the 8 timesteps
    assert torch.equal(validation_noise(torch.tensor([5]), (2, 2)), validation_noise(torch.tensor([5, 6]), (2, 2))[:1])


def test_exported_folder_loads_in_flux_pipeline_offline_and_samples(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(5)
    parts = dataclasses.replace(tiny, denoiser=flux.FluxTransformer2DModel(**flux.CONFIGS["flux1-tiny"]["transformer"]))
    FLUX.make_pipeline(parts, make_sampler("euler", parts.noise_scheduler.config, FLUX)).save_pretrained(tmp_path / "pipe")
    loaded = FluxPipeline.from_pretrained(str(tmp_path / "pipe"), local_files_only=True)
    prompts = ["a red square", "a blue circle"]
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    images = loaded(prompts, height=64, width=64, num_inference_steps=3, generator=generators, output_type="pt",
                    max_sequence_length=loaded.tokenizer_2.model_max_length).images
    assert images.shape == (2, 3, 64, 64) and torch.isfinite(images).all()
    # The training side's own sampler loop, tokenization and text encoding give the same latents.
    conditioning = FLUX.encode_text(tiny.text_encoders, FLUX.tokenize(tiny.tokenizers, prompts))
    sampler = make_sampler("euler", parts.noise_scheduler.config, FLUX)
    ours = sample_latents(FLUX, parts.denoiser, conditioning, None, sampler, 3, 1.0, [0, 1], (16, 8, 8))
    pipeline_latents = loaded(prompts, height=64, width=64, num_inference_steps=3, output_type="latent",
                              generator=[torch.Generator().manual_seed(i) for i in range(2)],
                              max_sequence_length=32).images
    assert torch.allclose(flux.pack_latents(ours), pipeline_latents, atol=1e-4)


def test_cost_table_is_labelled_for_flux_with_mlperf_reference_rows(capsys):
    import cost
    rows = cost.main(["--model_config", "flux1-schnell", "--gpus", "8", "--images_per_sec", "240", "--num_gpus", "8", "16"])
    out = capsys.readouterr().out
    # priced to MLPerf's target: its reference's samples at batch 512 (the pairs record no batch)
    reference = reference_samples_to_target(newest_rcp_round())[512]  # the installed package's RCP file
    assert out.startswith(f"Flux.1-schnell (MLPerf Training v5.1's model) at 256x256: {reference:,} samples to MLPerf's "
                          "target (validation loss <= 0.586)")
    measured = [r for r in rows if r.source in ("measured", "predicted")]
    references = [r for r in rows if "published elsewhere" in r.source]
    assert [r.num_gpus for r in measured] == [8, 16]
    assert {r.source for r in references} == {f"MLPerf v5.1 {g} (published elsewhere)" for g in
                                                ("B200", "GB200", "GB300", "GB300 (best)")}
    b200 = next(r for r in references if "B200 (" in r.source and "GB" not in r.source)
    assert b200.num_gpus == 8 and b200.images_per_sec == 8 * 51.0
    assert b200.days == pytest.approx(reference / (8 * 51.0) / 86_400)
