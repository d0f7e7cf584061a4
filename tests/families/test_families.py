"""Model families: SD2 behind the ModelFamily interface, checkpoints of earlier releases still loading,
and a second family plugging in as one module plus a registration, used by every part of a run."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

import benchmark
from t2ibench.families import FAMILIES, MODEL_CONFIGS, family_of
from t2ibench.families.sd2 import SD2, TINY
from t2ibench.train.model import DiffusionModel

# The training model's state-dict keys and shapes as the release before the package layout wrote them
# into checkpoints (model.StableDiffusion at d47ee91, built on the meta device): sorted "key (shape)"
# lines, hashed. A checkpoint loads only if these stay the same.
RECORDED_STATE_DICTS = {
    "sd2-base": (1306, "d698b35c3a3c57d7f8c10e99b7218effa6252cf4b7aa18f6269d7ec1c5eed235"),
    "tiny": (656, "4c87cb5bd1c5d1be65f456d647d6dfb6f5c9b99ab9d72bbd7f9aac1d837f60e5"),
}


@pytest.mark.parametrize("config", sorted(RECORDED_STATE_DICTS))
def test_checkpoint_keys_are_those_of_the_release_before(config):
    family = family_of(config)
    model = DiffusionModel(family, family.meta_parts(config))
    lines = sorted(f"{k} {tuple(v.shape)}" for k, v in model.state_dict().items())
    assert (len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()) == RECORDED_STATE_DICTS[config]
    # Named by the parts' diffusers names: what export.py and the EMA look for.
    assert {k.split(".")[0] for k in model.state_dict()} == {"unet", "vae", "text_encoder"}


def test_every_config_belongs_to_one_family_and_sd2_is_complete():
    assert MODEL_CONFIGS["sd2-base"] is MODEL_CONFIGS["tiny"]
    family = MODEL_CONFIGS["tiny"]
    parts = family.build("tiny")
    assert (parts.pretrained, parts.random) == ([], ["vae", "text_encoder"])  # tiny: never pretrained
    assert parts.latent_scale == family.build_vae("tiny").config.scaling_factor == 3.6
    inputs = family.tokenize(parts.tokenizers, ["a red square", ""])
    assert list(inputs) == list(family.text_input_keys) and inputs["captions"].shape == (2, 77)
    conditioning = family.encode_text(parts.text_encoders, inputs)
    assert {k: tuple(v.shape[1:]) for k, v in conditioning.items()} == family.conditioning_shapes("tiny")
    latents = torch.randn(2, family.latent_channels("tiny"), 4, 4)
    prediction = family.predict(parts.denoiser, latents, torch.tensor([1, 999]), conditioning)
    assert prediction.shape == latents.shape
    assert family.make_pipeline(parts, parts.noise_scheduler).__class__.__name__ == family.pipeline_class
    with pytest.raises(SystemExit, match="--model_config 'sd9' is unknown"):
        family_of("sd9")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_family_reports_the_same_flops_keys_and_builds_a_tiny_vae_like_a_trained_one(family):
    tiny = family.configs[-1]
    flops = family.flops_per_image(tiny, 64)
    assert {"denoiser_fwd", "denoiser_fwd_bwd", "vae_encoder", "text_encoder", "total"} <= set(flops)
    assert 2 * flops["denoiser_fwd"] < flops["denoiser_fwd_bwd"] < flops["total"]
    assert flops["total"] == flops["denoiser_fwd_bwd"] + flops["vae_encoder"] + flops["text_encoder"]
    # The log-variance bias reaches the posterior (SD's quant_conv, the last encoder convolution of
    # Flux's VAE): a random VAE's std would be ~1, burying the latent means.
    torch.manual_seed(0)
    posterior = family.build_vae(tiny).encode(torch.rand(2, 3, 64, 64) * 2 - 1).latent_dist
    assert posterior.std.max() < 1e-2 < posterior.mean.std()


class Renamed(SD2):
    """A second family in a few lines: SD2's tiny model under another config name and another name
    for the denoiser (Flux.1 calls its denoiser `transformer`); everything else is the base class's."""

    name = "renamed"
    architectures = {"renamed-tiny": {("transformer" if part == "unet" else part): config
                                      for part, config in TINY.items()}}
    pretrained_configs = ()
    denoiser_name = "transformer"


@pytest.mark.slow
def test_a_second_family_is_a_module_and_a_registration(tmp_path, monkeypatch):
    # The registration (families.MODEL_CONFIGS); everything else in the run goes through the interface.
    monkeypatch.setitem(MODEL_CONFIGS, "renamed-tiny", Renamed())
    results = tmp_path / "r.json"
    benchmark.main(["--model_config", "renamed-tiny", "--use_synth_data", "--batch_size", "2", "--image_size", "32",
                    "--max_duration", "2ba", "--num_workers", "0", "--warmup_batches", "1", "--use_ema",
                    "--caption_drop_prob", "0.5", "--save_folder", str(tmp_path / "run"), "--save_interval", "2ba",
                    "--results_json", str(results)])
    r = json.loads(results.read_text())
    assert r["model_config"] == "renamed-tiny" and r["flops_per_image"] > 0 and r["final_loss"] > 0
    assert r["flops_per_image_breakdown"]["denoiser_fwd_bwd"] > r["flops_per_image_breakdown"]["denoiser_fwd"] > 0
    state = torch.load(tmp_path / "run" / "latest-rank0.pt", map_location="cpu", weights_only=False)["state"]
    assert {k.split(".")[0] for k in state["model"]} == {"transformer", "vae", "text_encoder"}
    ema = dict(state["algorithms"])["EMA"]
    assert ema["shadow"] and all(k.startswith("transformer.") for k in ema["shadow"])
