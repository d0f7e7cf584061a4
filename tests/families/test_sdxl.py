"""SDXL as a model family (t2ibench/families/sdxl.py): configs built offline, conditioning as diffusers'
pipeline computes it, zeroed caption dropout, size/crop ids from the data, FLOPs against a hand
count, a pipeline folder that StableDiffusionXLPipeline loads offline and samples from."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data
import unet_flops
from t2ibench.datasets import precomputed
from t2ibench.families import MODEL_CONFIGS, Parts
from t2ibench.families import sdxl
from t2ibench.train.model import DiffusionModel
from t2ibench.core.tokenizer import tokenize

FAMILY = MODEL_CONFIGS["sdxl-base"]

CAPTIONS = ["a red square!", "", "a blue circle on a green field, oil painting"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(scope="module")
def tiny() -> Parts:
    torch.manual_seed(0)
    return FAMILY.build("sdxl-tiny")


# -----------------------------------------------------------------------------------------------
# Configs.
# -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_on_meta() -> Parts:
    return FAMILY.meta_parts("sdxl-base")


def test_sdxl_base_builds_offline_with_the_published_architecture(base_on_meta):
    parts = base_on_meta
    modules = {"unet": parts.denoiser, "vae": parts.vae, **parts.text_encoders}
    counts = {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()}
    # The published SDXL base 1.0: UNet 2.567B, VAE 83.7M (SD's), CLIP ViT-L text 123.1M, bigG text 694.7M.
    assert counts == {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480,
                      "text_encoder_2": 694_659_840}
    unet = parts.denoiser
    assert unet.add_embedding.linear_1.in_features == 6 * 256 + 1280 == 2816
    # Transformer depths 1 / 2 / 10 at the two attention levels and in the middle; 64-wide heads.
    depths = [len(block.attentions[0].transformer_blocks) for block in unet.down_blocks if hasattr(block, "attentions")]
    assert depths == [2, 10] and len(unet.mid_block.attentions[0].transformer_blocks) == 10
    assert not hasattr(unet.down_blocks[0], "attentions")
    for block in unet.down_blocks[1:]:
        attn = block.attentions[0].transformer_blocks[0].attn2
        assert attn.inner_dim // attn.heads == 64 and attn.cross_attention_dim == 2048
    assert parts.vae.config.scaling_factor == 0.13025 and parts.vae.config.sample_size == 1024


@pytest.mark.parametrize("name", sorted(sdxl.CONFIGS))
def test_unet_widths_agree_with_the_text_encoders(name):
    sdxl.check_config(name)
    cfg = sdxl.CONFIGS[name]["unet"]
    assert [t for t in cfg["down_block_types"]] == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    assert cfg["addition_embed_type"] == "text_time" and cfg["use_linear_projection"]


def test_sdxl_tiny_is_a_miniature_of_a_few_million_parameters():
    parts = FAMILY.meta_parts("sdxl-tiny")
    unet = sum(p.numel() for p in parts.denoiser.parameters())
    frozen = sum(p.numel() for m in (parts.vae, *parts.text_encoders.values()) for p in m.parameters())
    assert 1e6 < unet < 5e6
    assert frozen < 6e6  # mostly the encoders' token embeddings
    assert FAMILY.default_image_size("sdxl-tiny") == 64 and FAMILY.default_image_size("sdxl-base") == 1024


# -----------------------------------------------------------------------------------------------
# FLOPs: flop_counter on meta tensors against a count by hand from the config.
# -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sdxl_base_flops_per_1024_image_equal_a_count_by_hand():
    from t2ibench.costs.scale import PRICED_MODELS

    counted = FAMILY.flops_per_image("sdxl-base", 1024, text_encoders=False)
    assert counted["vae_encoder"] == pytest.approx(PRICED_MODELS["sdxl-base"][2], rel=1e-3)  # cost.py's constant
    counted["total"] -= counted["vae_encoder"]
    by_hand_fwd, by_hand_fwd_bwd = unet_flops.unet_flops(sdxl.SDXL_BASE["unet"], 1024 // 8)
    assert counted["denoiser_fwd"] == by_hand_fwd
    assert counted["denoiser_fwd_bwd"] == by_hand_fwd_bwd
    assert 2.9 < by_hand_fwd_bwd / by_hand_fwd < 3.0  # backward: about twice the forward
    assert counted["total"] == counted["denoiser_fwd_bwd"]  # precomputed: no encoder runs


@pytest.mark.parametrize("height, width", [(32, 128), (128, 32), (48, 80), (40, 56)])
def test_flops_of_a_bucket_equal_a_count_by_hand(height, width):
    # Aspect-ratio buckets: (height, width), odd latent sides (6 x 10 down to 3 x 5, then 2 x 3) included.
    counted = FAMILY.flops_per_image("sdxl-tiny", (height, width), vae=False, text_encoders=False)
    by_hand = unet_flops.unet_flops(sdxl.SDXL_TINY["unet"], (height // 8, width // 8))
    assert (counted["denoiser_fwd"], counted["denoiser_fwd_bwd"]) == by_hand
    assert counted["total"] == counted["denoiser_fwd_bwd"]


def test_cost_table_is_labelled_for_sdxl_base_at_1024(tmp_path, capsys):
    import json

    import cost

    result = tmp_path / "sdxl.json"
    result.write_text(json.dumps({"images_per_sec": 100.0, "world_size": 8, "image_size": 1024,
                                  "model_config": "sdxl-base", "precomputed": True, "device": "NVIDIA H100"}))
    rows = cost.main([str(result), "--num_gpus", "8", "--precompute"])
    out = capsys.readouterr().out
    assert out.startswith("SDXL base 1.0 at 1024x1024 from precomputed latents:") and "SD2 base at" not in out
    assert "not Stable Diffusion 2 base" in out
    # The one-time pass at SDXL's VAE encoder cost: 312 TFLOP/s x 40% / 4,879 GFLOP = 25.6 images/s per A100.
    assert "at 25.6 images/s per GPU" in out
    assert rows[0].days == pytest.approx(2_867_200_000 / 100 / 86_400 + 2e9 / 25.58 / 3600 / 24 / 8, rel=1e-3)


def test_encoder_flops_are_counted_when_they_run():
    online = FAMILY.flops_per_image("sdxl-tiny", 64)
    assert online["vae_encoder"] > 0 and online["text_encoder"] > 0
    assert online["total"] == pytest.approx(online["denoiser_fwd_bwd"] + online["vae_encoder"] + online["text_encoder"])
    fwd, fwd_bwd = unet_flops.unet_flops(sdxl.SDXL_TINY["unet"], 8)
    assert (online["denoiser_fwd"], online["denoiser_fwd_bwd"]) == (fwd, fwd_bwd)


# -----------------------------------------------------------------------------------------------
# Tokenizers and conditioning.
# -----------------------------------------------------------------------------------------------

def test_two_tokenizers_differ_only_in_padding(tmp_path):
    tokenizers = sdxl.bundled_tokenizers()
    tokenizer, tokenizer_2 = tokenizers["tokenizer"], tokenizers["tokenizer_2"]
    assert (tokenizer.pad_token, tokenizer_2.pad_token) == ("<|endoftext|>", "!")
    first, second = tokenize(tokenizer, CAPTIONS), tokenize(tokenizer_2, CAPTIONS)
    assert not torch.equal(first, second)
    assert torch.equal(sdxl.repad(second, tokenizer.pad_token_id), first)
    # "!" inside a caption is token 0, bigG's pad: repad keys on the end token, not on the id.
    assert (second[0, :6] == 0).any()
    tokenizer.save_pretrained(tmp_path)
    from transformers import CLIPTokenizer
    assert torch.equal(tokenize(CLIPTokenizer.from_pretrained(tmp_path), CAPTIONS), first)
    assert torch.equal(FAMILY.tokenize(tokenizers, CAPTIONS)["captions"], second)  # one set of ids: bigG's


def test_conditioning_equals_the_diffusers_pipeline(tiny):
    pipeline = FAMILY.make_pipeline(tiny, tiny.noise_scheduler)
    expected_states, _, expected_pooled, _ = pipeline.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
    with torch.no_grad():
        conditioning = FAMILY.encode_text(tiny.text_encoders, FAMILY.tokenize(tiny.tokenizers, CAPTIONS))
    assert {k: tuple(v.shape[1:]) for k, v in conditioning.items()} == FAMILY.conditioning_shapes("sdxl-tiny")
    assert conditioning["text_states"].shape == (3, 77, 96) and conditioning["pooled_text_states"].shape == (3, 64)
    torch.testing.assert_close(conditioning["text_states"], expected_states)
    torch.testing.assert_close(conditioning["pooled_text_states"], expected_pooled)
    # Without re-padding, ViT-L's states at the padded positions would differ from the pipeline's.
    with torch.no_grad():
        wrong = tiny.text_encoders["text_encoder"](FAMILY.tokenize(tiny.tokenizers, CAPTIONS)["captions"],
                                                   output_hidden_states=True).hidden_states[-2]
    assert not torch.allclose(wrong, expected_states[..., :32])


class Recorder(torch.nn.Module):
    """Stands in for the UNet in a DiffusionModel: keeps the conditioning it is called with."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[dict] = []

    def forward(self, noisy, timesteps, states, added_cond_kwargs):
        self.seen.append({"states": states, **added_cond_kwargs})
        return type("Out", (), {"sample": noisy * self.weight})()


def test_caption_dropout_zeroes_both_encoders_and_keeps_the_size_ids(tiny):
    parts = Parts(Recorder(), None, tiny.text_encoders, {}, tiny.noise_scheduler, tiny.latent_scale)
    model = DiffusionModel(FAMILY, parts)
    model.set_caption_dropout(0.25)
    batch_size = 400
    ids = FAMILY.tokenize(tiny.tokenizers, ["a red square"] * batch_size)["captions"]
    batch = {"latent_mean": torch.randn(batch_size, 4, 8, 8), "latent_logvar": torch.full((batch_size, 4, 8, 8), -20.0),
             "captions": ids, "original_size": torch.tensor([[480, 640]] * batch_size),
             "crop_top_left": torch.tensor([[0, 11]] * batch_size)}
    torch.manual_seed(0)
    model(batch)
    seen = parts.denoiser.seen[-1]
    states_zero = (seen["states"] == 0).flatten(1).all(1)
    pooled_zero = (seen["text_embeds"] == 0).all(1)
    assert torch.equal(states_zero, pooled_zero)  # the same rows lose both encoders' conditioning
    assert 0.17 < states_zero.float().mean() < 0.33
    kept = seen["states"][~states_zero]
    assert torch.allclose(kept, kept[:1].expand_as(kept))  # the others keep their caption's states
    assert seen["time_ids"][0].tolist() == [480, 640, 0, 11, 64, 64]  # size ids of every row kept
    assert (seen["time_ids"] == seen["time_ids"][:1]).all()
    # Stored conditioning (latents.py --store_text_states) is dropped the same way.
    with torch.no_grad():
        stored = FAMILY.encode_text(tiny.text_encoders, {"captions": ids})
    model({**{k: v for k, v in batch.items() if k != "captions"}, **stored})
    seen = parts.denoiser.seen[-1]
    assert torch.equal((seen["states"] == 0).flatten(1).all(1), (seen["text_embeds"] == 0).all(1))
    assert 0.17 < (seen["states"] == 0).flatten(1).all(1).float().mean() < 0.33
    # Without the size and crop the model refuses the batch rather than guess them.
    with pytest.raises(ValueError, match="original size and crop"):
        model({k: v for k, v in batch.items() if k != "crop_top_left"})
    assert FAMILY.as_unconditional(stored)["pooled_text_states"].abs().sum() == 0


def test_time_ids_reach_the_unet_and_its_added_embedding_learns(tiny):
    torch.manual_seed(1)
    unet = tiny.denoiser
    latents = torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([10, 900])
    with torch.no_grad():
        conditioning = FAMILY.encode_text(tiny.text_encoders, FAMILY.tokenize(tiny.tokenizers, CAPTIONS[:2]))
    square = {**conditioning, "original_size": torch.tensor([[64, 64]] * 2), "crop_top_left": torch.zeros(2, 2)}
    cropped = {**conditioning, "original_size": torch.tensor([[480, 640]] * 2), "crop_top_left": torch.tensor([[0, 11]] * 2)}
    assert sdxl.time_ids(square["original_size"], square["crop_top_left"], (64, 64)).tolist() == [[64, 64, 0, 0, 64, 64]] * 2
    a = FAMILY.predict(unet, latents, timesteps, square)
    b = FAMILY.predict(unet, latents, timesteps, cropped)
    assert a.shape == latents.shape and not torch.allclose(a, b)
    # Sampling passes no size: the uncropped target size, as the pipeline's default.
    torch.testing.assert_close(FAMILY.predict(unet, latents, timesteps, conditioning), a.detach())
    a.pow(2).mean().backward()
    assert unet.add_embedding.linear_1.weight.grad.abs().sum() > 0
    unet.zero_grad(set_to_none=True)


def test_a_few_steps_lower_the_loss_on_one_batch(tiny):
    """The training model (DiffusionModel with the SDXL family) learns one batch of images."""
    import copy

    torch.manual_seed(2)
    parts = Parts(copy.deepcopy(tiny.denoiser), tiny.vae, tiny.text_encoders, {}, tiny.noise_scheduler, tiny.latent_scale)
    model = DiffusionModel(FAMILY, parts)
    batch = {"image": torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8),
             **FAMILY.tokenize(tiny.tokenizers, CAPTIONS + ["x"]),
             "original_size": torch.tensor([[64, 64]] * 4), "crop_top_left": torch.zeros(4, 2, dtype=torch.long)}
    optimizer = torch.optim.AdamW(model.denoiser.parameters(), lr=2e-3)
    losses = []
    for _ in range(10):
        torch.manual_seed(3)  # the same noise and timesteps every step: only the weights change
        loss = model.loss(model(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_an_sdxl_vae_that_overflows_in_fp16_runs_in_fp32_outside_autocast(tiny, base_on_meta):
    from t2ibench.train.model import vae_overflows_in

    assert vae_overflows_in(base_on_meta.vae, torch.float16)  # SDXL's own VAE: force_upcast
    assert not vae_overflows_in(base_on_meta.vae, torch.bfloat16) and not vae_overflows_in(tiny.vae, torch.float16)
    model = DiffusionModel(FAMILY, Parts(tiny.denoiser, tiny.vae, {}, {}, tiny.noise_scheduler, tiny.latent_scale))
    images = torch.randint(0, 256, (1, 3, 64, 64), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast stands in for CUDA's fp16 here
        assert model.encode_images(images).dtype == torch.bfloat16
        model.vae_in_fp32 = True
        assert model.encode_images(images).dtype == torch.float32


def test_parts_are_random_offline_and_the_same_whatever_else_is_built(tmp_path):
    # sdxl-base without a pipeline folder: the bundled tokenizers (not random parts) and SDXL's scale.
    base = FAMILY.build("sdxl-base", str(tmp_path / "absent"), denoiser=False, vae=False, text_encoders=False)
    assert base.random == [] and base.pretrained == [] and base.tokenizers["tokenizer_2"].pad_token == "!"
    assert base.latent_scale == 0.13025
    torch.manual_seed(5)
    alone = FAMILY.build("sdxl-tiny", denoiser=False, vae=False, tokenizers=False)
    assert alone.random == ["text_encoder", "text_encoder_2"]
    torch.manual_seed(5)
    everything = FAMILY.build("sdxl-tiny")
    assert everything.random == ["vae", "text_encoder", "text_encoder_2"]
    for a, b in zip(alone.text_encoders["text_encoder_2"].parameters(),
                    everything.text_encoders["text_encoder_2"].parameters()):
        assert torch.equal(a, b)
    assert everything.latent_scale == sdxl.SDXL_TINY["vae"]["scaling_factor"]


# -----------------------------------------------------------------------------------------------
# The exported pipeline.
# -----------------------------------------------------------------------------------------------

def test_pretrained_parts_come_from_a_local_pipeline_folder(tiny, tmp_path, monkeypatch):
    from t2ibench.eval.sampling import write_pipeline

    write_pipeline(tmp_path / "pipe", FAMILY, tiny)
    # sdxl-base reads --model_name; the tiny shapes stand in for it here (the loading is the same).
    monkeypatch.setattr(type(FAMILY), "pretrained_configs", ("sdxl-base", "sdxl-tiny"))
    loaded = FAMILY.build("sdxl-tiny", str(tmp_path / "pipe"), denoiser=False)
    assert sorted(loaded.pretrained) == ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"]
    assert loaded.random == [] and loaded.tokenizers["tokenizer"].pad_token == "<|endoftext|>"
    for name in ("text_encoder", "text_encoder_2"):
        for a, b in zip(tiny.text_encoders[name].parameters(), loaded.text_encoders[name].parameters()):
            assert torch.equal(a, b)
    precomputed = FAMILY.build("sdxl-tiny", str(tmp_path / "pipe"), denoiser=False, vae=False, text_encoders=False)
    assert precomputed.latent_scale == tiny.latent_scale  # read from vae/config.json alone


def test_pipeline_folder_loads_offline_in_the_sdxl_pipeline_and_samples(tiny, tmp_path, monkeypatch):
    from diffusers import StableDiffusionXLPipeline

    from t2ibench.eval.sampling import write_pipeline

    write_pipeline(tmp_path / "pipe", FAMILY, tiny)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipeline = StableDiffusionXLPipeline.from_pretrained(tmp_path / "pipe")
    assert (pipeline.tokenizer.pad_token, pipeline.tokenizer_2.pad_token) == ("<|endoftext|>", "!")
    assert pipeline.config.force_zeros_for_empty_prompt
    out = pipeline("a red square", num_inference_steps=2, guidance_scale=5.0, output_type="np",
                   generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, 64, 64, 3) and np.isfinite(out.images).all()  # 64 px: sdxl-tiny's default size
    for name, module in (("unet", tiny.denoiser), ("text_encoder_2", tiny.text_encoders["text_encoder_2"])):
        for (key, a), b in zip(module.state_dict().items(), getattr(pipeline, name).state_dict().values()):
            assert torch.equal(a, b), key


# -----------------------------------------------------------------------------------------------
# Micro-conditioning from the data.
# -----------------------------------------------------------------------------------------------

def jpeg(width: int, height: int, orientation: int | None = None) -> bytes:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    return buffer.getvalue()


@pytest.mark.parametrize("width, height, orientation, expected", [
    (300, 200, None, (200, 300, 0, 16)),     # landscape: resized to 96 x 64, crop starts 16 px in
    (200, 300, None, (300, 200, 16, 0)),     # portrait
    (300, 200, 6, (300, 200, 16, 0)),        # stored landscape, shown portrait (EXIF rotation)
    (64, 64, None, (64, 64, 0, 0)),          # already square
    (1280, 960, None, (960, 1280, 0, 11)),   # big enough for JPEG draft decoding: sizes of the full image
])
def test_decode_reports_original_size_and_crop(width, height, orientation, expected):
    pixels, geometry = data.decode_image_with_geometry(jpeg(width, height, orientation), 64)
    assert pixels.shape == (3, 64, 64)
    assert (geometry.original_height, geometry.original_width, geometry.crop_top, geometry.crop_left) == expected
    assert torch.equal(pixels, data.decode_image(jpeg(width, height, orientation), 64))


def test_streamed_and_synthetic_batches_carry_the_geometry(tmp_path):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "mds"), columns={"jpg": "bytes", "caption": "str"}) as writer:
        writer.write({"jpg": jpeg(300, 200), "caption": "a wide one"})
        writer.write({"jpg": jpeg(200, 300), "caption": "a tall one"})
    dataset = data.StreamingImageCaptions(remote=None, local=str(tmp_path / "mds"), tokenizer=sdxl.bundled_tokenizers(),
                                          image_size=64, batch_size=2, shuffle=False, family=FAMILY)
    samples = [dataset[i] for i in range(2)]
    assert samples[0]["original_size"].tolist() == [200, 300] and samples[0]["crop_top_left"].tolist() == [0, 16]
    assert samples[1]["original_size"].tolist() == [300, 200] and samples[1]["crop_top_left"].tolist() == [16, 0]
    assert samples[0]["captions"].shape == (77,)
    synthetic = data.SyntheticImageCaptions(32, 4, family=FAMILY)[0]
    assert synthetic["original_size"].tolist() == [32, 32] and synthetic["crop_top_left"].tolist() == [0, 0]
    assert "original_size" not in data.SyntheticImageCaptions(32, 4)[0]  # SD2's batches are as before


def test_precomputed_shards_store_the_geometry_and_refuse_without_it(tmp_path):
    from streaming import MDSWriter

    def write(out: Path, micro_conditioning: bool) -> None:
        columns = precomputed.mds_columns(4, 8, None, micro_conditioning=micro_conditioning)
        with MDSWriter(out=str(out), columns=columns) as writer:
            for i in range(2):
                sample = {"index": i, "latent_mean": np.zeros((4, 8, 8), np.float16),
                          "latent_logvar": np.zeros((4, 8, 8), np.float16),
                          "token_ids": np.zeros(77, np.uint16), "caption": "c"}
                if micro_conditioning:
                    sample.update(original_size=np.array([480 + i, 640], np.int32),
                                  crop_top_left=np.array([0, 11], np.int32))
                writer.write(sample)

    write(tmp_path / "xl", True)
    write(tmp_path / "sd2", False)
    assert precomputed.bytes_per_sample(64, micro_conditioning=True) == precomputed.bytes_per_sample(64) + 16
    dataset = data.StreamingLatents(remote=None, local=str(tmp_path / "xl"), batch_size=2, image_size=64,
                                    shuffle=False, family=FAMILY)
    assert dataset[1]["original_size"].tolist() == [481, 640] and dataset[1]["crop_top_left"].tolist() == [0, 11]
    with pytest.raises(ValueError, match="without original_size, crop_top_left, which this model is conditioned on"):
        data.StreamingLatents(remote=None, local=str(tmp_path / "sd2"), batch_size=2, image_size=64,
                              family=FAMILY)
    shapes = FAMILY.conditioning_shapes("sdxl-tiny")
    synthetic = data.SyntheticLatents(64, 96, num_samples=2, family=FAMILY, text_format="text_states",
                                      config="sdxl-tiny")[0]
    assert synthetic["original_size"].tolist() == [64, 64]
    assert {k: tuple(synthetic[k].shape) for k in shapes} == shapes
