"""Flux.1 as a model family: configs against the published architecture, FLOPs against an independent
count, latent packing against FluxPipeline's, rectified flow, MLPerf's validation loss, training
through Composer, and an exported folder that FluxPipeline loads offline and samples from."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from composer import Trainer
from diffusers import FluxPipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
from validation import ValidationLoss, validation_noise  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tiny model's small matmuls gain nothing from a second one, and on a
    shared, oversubscribed CPU OpenMP's waiting threads made a tiny step 10x slower (2.5 s vs 0.25 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def schnell_meta() -> dict[str, torch.nn.Module]:
    return flux.meta_components("flux1-schnell")


@pytest.fixture(scope="module")
def tiny() -> flux.FluxComponents:
    torch.manual_seed(17)
    return flux.build_components("flux1-tiny")


def test_flux1_schnell_is_the_published_architecture(schnell_meta):
    transformer = schnell_meta["transformer"]
    assert len(transformer.transformer_blocks) == 19 and len(transformer.single_transformer_blocks) == 38
    assert transformer.inner_dim == 3072 == 24 * 128 and transformer.config.in_channels == 16 * 2 * 2
    assert sum(transformer.config.axes_dims_rope) == transformer.config.attention_head_dim
    assert not hasattr(transformer.time_text_embed, "guidance_embedder")  # schnell: no guidance embedding
    assert flux.count_parameters(transformer) == pytest.approx(11.9e9, rel=0.005)
    vae = schnell_meta["vae"].config
    assert (vae.latent_channels, vae.scaling_factor, vae.shift_factor) == (16, 0.3611, 0.1159)
    assert schnell_meta["text_encoder"].config.hidden_size == 768  # the pooled output Flux reads
    t5 = schnell_meta["text_encoder_2"]
    assert t5.config.d_model == 4096 and flux.count_parameters(t5) == pytest.approx(4.76e9, rel=0.01)
    assert flux.FLUX1_SCHNELL["max_sequence_length"] == 256


def test_flux1_tiny_keeps_the_structure_at_a_few_million_parameters():
    parts = flux.meta_components("flux1-tiny")
    transformer = parts["transformer"]
    assert 1e6 < flux.count_parameters(transformer) < 5e6
    assert transformer.config.in_channels == parts["vae"].config.latent_channels * 4 == 64
    assert sum(transformer.config.axes_dims_rope) == transformer.config.attention_head_dim
    assert transformer.config.joint_attention_dim == parts["text_encoder_2"].config.d_model
    assert transformer.config.pooled_projection_dim == parts["text_encoder"].config.hidden_size
    assert len(transformer.transformer_blocks) > 0 and len(transformer.single_transformer_blocks) > 0


def test_flux1_schnell_flops_per_256px_sample_against_an_independent_count(schnell_meta):
    flops = flux.count_flops_per_image(schnell_meta, image_size=256, max_sequence_length=256)
    analytic = flux.analytic_transformer_flops(flux.FLUX1_SCHNELL["transformer"], 256, 256)
    assert flops["transformer_fwd"] == pytest.approx(analytic["forward"], rel=0.001)
    # Backward: two matmuls per forward matmul (gradients of inputs and of weights).
    assert flops["transformer_fwd_bwd"] == pytest.approx(3 * flops["transformer_fwd"], rel=0.01)
    assert flops["transformer_fwd_bwd"] == pytest.approx(flux.NVIDIA_DECLARED_FLOP_PER_SAMPLE, rel=0.01)
    assert flops["total"] == flops["transformer_fwd_bwd"]  # precomputed: no encoder in the step


def test_pack_and_image_ids_match_flux_pipeline():
    latents = torch.randn(2, 16, 8, 6)
    packed = flux.pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 6))
    assert torch.equal(flux.unpack_latents(packed, 8, 6), latents)
    # FluxPipeline unpacks with pixel sizes (latent x vae_scale_factor 8)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 48, 8), latents)
    assert torch.equal(flux.image_ids(8, 6), FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32))


def test_rectified_flow_interpolates_and_its_velocity_leads_back_to_the_data():
    x0, noise = torch.randn(4, 16, 4, 4), torch.randn(4, 16, 4, 4)
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    x_t = flux.interpolate(x0, noise, t)
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[3], noise[3])
    v = flux.velocity_target(x0, noise)
    # One Euler step of the exact velocity from t to 0 lands on the data (what FluxPipeline integrates).
    assert torch.allclose(x_t - t.view(-1, 1, 1, 1) * v, x0, atol=1e-6)
    torch.manual_seed(0)
    uniform = flux.sample_timesteps(20000, "cpu", "uniform")
    logit = flux.sample_timesteps(20000, "cpu", "logit_normal")
    assert uniform.min() >= 0 and uniform.max() < 1 and uniform.std() == pytest.approx(12 ** -0.5, rel=0.03)
    assert logit.median() == pytest.approx(0.5, abs=0.02) and logit.std() < 0.8 * uniform.std()
    with pytest.raises(ValueError, match="--timestep_sampling"):
        flux.sample_timesteps(2, "cpu", "cosine")


def test_schnell_refuses_to_tokenize_without_t5_tokenizer(tmp_path):
    with pytest.raises(flux.MissingPart, match="--model_name .*tokenizer_2"):
        flux.t5_tokenizer("flux1-schnell", str(tmp_path))


def test_precomputed_bytes_per_256px_sample():
    sizes = flux.precomputed_bytes_per_sample("flux1-schnell", 256)
    assert sizes["vae_moments"] == 2 * 16 * 32 * 32 * 2 and sizes["t5_states"] == 256 * 4096 * 2
    assert sizes["total"] == 65_536 + 2_097_152 + 1_536 + 8


def precomputed_batch(parts: flux.FluxComponents, captions: list[str], images: torch.Tensor) -> dict:
    """What latents.py stores for Flux: VAE moments and both text outputs, from the tiny encoders."""
    ids = flux.tokenize_captions(parts, captions)
    with torch.no_grad():
        dist = parts.vae.encode(images).latent_dist
        t5_states, pooled = flux.encode_text(parts.text_encoder, parts.text_encoder_2, ids["clip_ids"], ids["t5_ids"])
    return {"latent_mean": dist.mean, "latent_logvar": dist.logvar, "t5_states": t5_states, "clip_pooled": pooled}


def test_online_and_precomputed_batches_give_the_same_step(tiny):
    captions, images = ["a red square", "a blue circle"], torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    model = flux.Flux(flux.build_transformer("flux1-tiny"), vae=tiny.vae, text_encoder=tiny.text_encoder,
                      text_encoder_2=tiny.text_encoder_2, latent_shift=tiny.latent_shift, latent_scale=tiny.latent_scale)
    online = {"image": images, **flux.tokenize_captions(tiny, captions)}
    stored = precomputed_batch(tiny, captions, flux.scale_images(images))
    torch.manual_seed(3)
    a = model(online)
    torch.manual_seed(3)
    b = model(stored)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5)


def test_caption_dropout_replaces_text_by_the_empty_caption(tiny):
    model = flux.Flux(flux.build_transformer("flux1-tiny"), latent_shift=0.0, latent_scale=1.0)
    batch = precomputed_batch(tiny, ["a"] * 4, torch.zeros(4, 3, 64, 64))
    empty = {k: torch.full_like(batch[k][:1], 7.0) for k in ("t5_states", "clip_pooled")}
    model.set_caption_dropout(1.0, empty)
    dropped = model._drop_captions(batch)
    assert (dropped["t5_states"] == 7).all() and (dropped["clip_pooled"] == 7).all()
    model.set_caption_dropout(0.0, empty)
    assert torch.equal(model._drop_captions(batch)["t5_states"], batch["t5_states"])


class Batches(torch.utils.data.Dataset):
    def __init__(self, batch: dict):
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["latent_mean"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.batch.items()}


def test_tiny_trains_through_composer_and_its_validation_loss_falls(tiny):
    torch.manual_seed(0)
    captions = ["a red square", "a blue circle"] * 2
    images = torch.rand(4, 3, 64, 64) * 2 - 1
    data = precomputed_batch(tiny, captions, images)
    data["sample_index"] = torch.arange(4)
    model = flux.Flux(flux.build_transformer("flux1-tiny"), latent_shift=tiny.latent_shift,
                      latent_scale=tiny.latent_scale)
    model.eval()

    def validation_loss() -> float:
        metric = ValidationLoss()
        metric.update(*model.eval_forward(data))
        return metric.compute().item()

    before = validation_loss()
    loader = torch.utils.data.DataLoader(Batches(data), batch_size=4, shuffle=False)
    Trainer(model=model, train_dataloader=loader, max_duration="30ba", progress_bar=False,
            optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3), device="cpu", seed=1).fit()
    after = validation_loss()
    assert after < 0.8 * before
    window = model.loss_bins.take()
    assert window is not None and window[1].sum().item() == 30 * 4  # every trained sample landed in a bin


def test_validation_loss_is_fixed_per_sample_whatever_the_batching(tiny):
    torch.manual_seed(0)
    data = precomputed_batch(tiny, ["x"] * 8, torch.rand(8, 3, 64, 64) * 2 - 1)
    data["sample_index"] = torch.arange(8)
    model = flux.Flux(flux.build_transformer("flux1-tiny"), latent_shift=0.0, latent_scale=1.0).eval()

    def run(splits: list[slice]) -> ValidationLoss:
        metric = ValidationLoss()
        for part in splits:
            torch.manual_seed(len(splits))  # the posterior draw is the only other randomness
            batch = {k: v[part] for k, v in data.items()}
            batch["latent_logvar"] = torch.full_like(batch["latent_logvar"], -60.0)  # deterministic posterior
            metric.update(*model.eval_forward(batch))
        return metric

    whole, halves = run([slice(0, 8)]), run([slice(4, 8), slice(0, 4)])
    assert whole.compute().item() == pytest.approx(halves.compute().item(), rel=1e-5)
    assert whole.counts.tolist() == [1.0] * 8  # one sample at each of the 8 timesteps
    assert torch.equal(validation_noise(torch.tensor([5]), (2, 2)), validation_noise(torch.tensor([5, 6]), (2, 2))[:1])


def test_exported_folder_loads_in_flux_pipeline_offline_and_samples(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(5)
    transformer = flux.build_transformer("flux1-tiny")
    flux.write_pipeline(tmp_path / "pipe", tiny, transformer)
    loaded = FluxPipeline.from_pretrained(str(tmp_path / "pipe"), local_files_only=True)
    length = tiny.max_sequence_length
    prompts = ["a red square", "a blue circle"]
    images = flux.sample_images(loaded, prompts=prompts, image_size=64, num_steps=2, seed=0,
                                max_sequence_length=length)
    assert images.shape == (2, 3, 64, 64) and torch.isfinite(images).all()
    # The same images from the training side's own tokenization and text encoding.
    ids = flux.tokenize_captions(tiny, prompts)
    t5_states, pooled = flux.encode_text(tiny.text_encoder, tiny.text_encoder_2, ids["clip_ids"], ids["t5_ids"])
    ours = flux.sample_images(flux.make_pipeline(tiny, transformer), t5_states=t5_states, clip_pooled=pooled,
                              image_size=64, num_steps=2, seed=0, max_sequence_length=length)
    assert torch.allclose(images, ours, atol=1e-5)
