"""SDXL as a model family (sdxl.py): configs built offline, conditioning as diffusers' pipeline computes
it, zeroed caption dropout, size/crop ids from the data, FLOPs against a hand count, export to a
StableDiffusionXLPipeline folder that loads offline and samples."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import data  # noqa: E402
import unet_flops  # noqa: E402
from t2ibench.families import sdxl  # noqa: E402
from t2ibench.model import scale_images  # noqa: E402
from t2ibench.tokenizer import tokenize  # noqa: E402

CAPTIONS = ["a red square!", "", "a blue circle on a green field, oil painting"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's tensors are too small to share among threads: one is several times faster
    than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> sdxl.Components:
    torch.manual_seed(0)
    return sdxl.build_components("sdxl-tiny")


# -----------------------------------------------------------------------------------------------
# Configs.
# -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_on_meta() -> sdxl.Components:
    return sdxl.meta_components("sdxl-base")


def test_sdxl_base_builds_offline_with_the_published_architecture(base_on_meta):
    parts = base_on_meta
    counts = {name: sum(p.numel() for p in getattr(parts, name).parameters())
              for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    # The published SDXL base 1.0: UNet 2.567B, VAE 83.7M (SD's), CLIP ViT-L text 123.1M, bigG text 694.7M.
    assert counts == {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480,
                      "text_encoder_2": 694_659_840}
    unet = parts.unet
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
    counts = sdxl.parameter_counts("sdxl-tiny")
    assert 1e6 < counts["unet"] < 5e6
    assert sum(counts.values()) < 10e6  # mostly the encoders' token embeddings


# -----------------------------------------------------------------------------------------------
# FLOPs: flop_counter on meta tensors against a count by hand from the config.
# -----------------------------------------------------------------------------------------------

def test_sdxl_base_flops_per_1024_image_equal_a_count_by_hand(base_on_meta):
    parts = base_on_meta
    counted = sdxl.count_flops_per_image(parts.unet, None, None, None, image_size=1024)
    by_hand_fwd, by_hand_fwd_bwd = unet_flops.unet_flops(sdxl.SDXL_BASE["unet"], 1024 // 8)
    assert counted["unet_fwd"] == by_hand_fwd
    assert counted["unet_fwd_bwd"] == by_hand_fwd_bwd
    assert 2.9 < by_hand_fwd_bwd / by_hand_fwd < 3.0  # backward: about twice the forward
    assert counted["total"] == counted["unet_fwd_bwd"]  # precomputed: no encoder runs


def test_encoder_flops_are_counted_when_they_run():
    parts = sdxl.meta_components("sdxl-tiny")
    online = sdxl.count_flops_per_image(parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2, 64)
    assert online["vae_encoder"] > 0 and online["text_encoder"] > 0
    assert online["total"] == pytest.approx(online["unet_fwd_bwd"] + online["vae_encoder"] + online["text_encoder"])
    fwd, fwd_bwd = unet_flops.unet_flops(sdxl.SDXL_TINY["unet"], 8)
    assert (online["unet_fwd"], online["unet_fwd_bwd"]) == (fwd, fwd_bwd)


# -----------------------------------------------------------------------------------------------
# Tokenizers and conditioning.
# -----------------------------------------------------------------------------------------------

def test_two_tokenizers_differ_only_in_padding(tmp_path):
    tokenizer, tokenizer_2 = sdxl.bundled_tokenizers()
    assert (tokenizer.pad_token, tokenizer_2.pad_token) == ("<|endoftext|>", "!")
    first, second = tokenize(tokenizer, CAPTIONS), tokenize(tokenizer_2, CAPTIONS)
    assert not torch.equal(first, second)
    assert torch.equal(sdxl.repad(second, tokenizer.pad_token_id), first)
    # "!" inside a caption is token 0, bigG's pad: repad keys on the end token, not on the id.
    assert (second[0, :6] == 0).any()
    tokenizer.save_pretrained(tmp_path)
    from transformers import CLIPTokenizer
    assert torch.equal(tokenize(CLIPTokenizer.from_pretrained(tmp_path), CAPTIONS), first)


def test_conditioning_equals_the_diffusers_pipeline(tiny):
    from diffusers import StableDiffusionXLPipeline

    pipeline = StableDiffusionXLPipeline(vae=tiny.vae, text_encoder=tiny.text_encoder, text_encoder_2=tiny.text_encoder_2,
                                         tokenizer=tiny.tokenizer, tokenizer_2=tiny.tokenizer_2, unet=tiny.unet,
                                         scheduler=tiny.noise_scheduler, add_watermarker=False)
    expected_states, _, expected_pooled, _ = pipeline.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
    states, pooled = sdxl.encode_text(tiny.text_encoder, tiny.text_encoder_2, tokenize(tiny.tokenizer_2, CAPTIONS),
                                      tiny.tokenizer.pad_token_id)
    assert states.shape == (3, 77, 96) and pooled.shape == (3, 64)
    torch.testing.assert_close(states, expected_states)
    torch.testing.assert_close(pooled, expected_pooled)
    # Without re-padding, ViT-L's states at the padded positions would differ from the pipeline's.
    wrong, _ = sdxl.encode_text(tiny.text_encoder, tiny.text_encoder_2, tokenize(tiny.tokenizer_2, CAPTIONS),
                                tiny.tokenizer_2.pad_token_id)
    assert not torch.allclose(wrong, expected_states)


def test_caption_dropout_zeroes_both_encoders_and_keeps_the_size_ids():
    batch = 4000
    cond = sdxl.Conditioning(torch.randn(batch, 77, 96) + 3, torch.randn(batch, 64) + 3,
                             sdxl.uncropped_time_ids(batch, 64))
    torch.manual_seed(0)
    dropped = sdxl.drop_conditioning(cond, 0.25)
    states_zero = (dropped.text_states == 0).flatten(1).all(1)
    pooled_zero = (dropped.pooled == 0).all(1)
    assert torch.equal(states_zero, pooled_zero)  # the same rows lose both
    assert 0.22 < states_zero.float().mean() < 0.28
    kept = ~states_zero
    assert torch.equal(dropped.text_states[kept], cond.text_states[kept])
    assert torch.equal(dropped.time_ids, cond.time_ids)
    assert torch.equal(sdxl.drop_conditioning(cond, 0.0).text_states, cond.text_states)


def test_time_ids_reach_the_unet_and_its_added_embedding_learns(tiny):
    torch.manual_seed(1)
    unet = tiny.unet
    latents = torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([10, 900])
    states, pooled = sdxl.encode_text(tiny.text_encoder, tiny.text_encoder_2, tokenize(tiny.tokenizer_2, CAPTIONS[:2]))
    square = sdxl.time_ids(torch.tensor([[64, 64], [64, 64]]), torch.zeros(2, 2), 64)
    assert square.tolist() == [[64, 64, 0, 0, 64, 64]] * 2
    cropped = sdxl.time_ids(torch.tensor([[480, 640], [480, 640]]), torch.tensor([[0, 11], [0, 11]]), 64)
    a = sdxl.predict(unet, latents, timesteps, sdxl.Conditioning(states, pooled, square))
    b = sdxl.predict(unet, latents, timesteps, sdxl.Conditioning(states, pooled, cropped))
    assert a.shape == latents.shape and not torch.allclose(a, b)
    a.pow(2).mean().backward()
    assert unet.add_embedding.linear_1.weight.grad.abs().sum() > 0
    unet.zero_grad(set_to_none=True)


def test_a_few_steps_lower_the_loss_on_one_batch(tiny):
    """A training step assembled from the family's pieces learns (epsilon target, DDPM noise)."""
    import copy

    torch.manual_seed(2)
    unet = copy.deepcopy(tiny.unet)
    images = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        latents = tiny.vae.encode(scale_images(images)).latent_dist.mean * tiny.latent_scale
    states, pooled = sdxl.encode_text(tiny.text_encoder, tiny.text_encoder_2, tokenize(tiny.tokenizer_2, CAPTIONS + ["x"]))
    cond = sdxl.Conditioning(states, pooled, sdxl.uncropped_time_ids(4, 64))
    noise = torch.randn(latents.shape)
    timesteps = torch.tensor([100, 300, 500, 700])
    noisy = tiny.noise_scheduler.add_noise(latents, noise, timesteps)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=2e-3)
    losses = []
    for _ in range(10):
        loss = torch.nn.functional.mse_loss(sdxl.predict(unet, noisy, timesteps, cond), noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_vae_dtype_keeps_an_fp16_overflowing_vae_in_fp32(tiny, base_on_meta):
    base = base_on_meta.vae
    assert sdxl.vae_dtype(base, torch.float16) == torch.float32  # SDXL's own VAE: force_upcast
    assert sdxl.vae_dtype(base, torch.bfloat16) == torch.bfloat16
    assert sdxl.vae_dtype(tiny.vae, torch.float16) == torch.float16
    assert sdxl.vae_dtype(tiny.vae, None) == torch.float32


def test_parts_are_random_offline_and_the_same_whatever_else_is_built(tmp_path):
    # sdxl-base without a pipeline folder: the bundled tokenizers (not random parts) and SDXL's scale.
    base = sdxl.build_components("sdxl-base", str(tmp_path / "absent"), with_unet=False, with_vae=False,
                                 with_text_encoders=False)
    assert base.random == [] and base.pretrained == [] and base.tokenizer_2.pad_token == "!"
    assert base.latent_scale == 0.13025
    torch.manual_seed(5)
    alone = sdxl.build_components("sdxl-tiny", with_unet=False, with_vae=False, with_tokenizers=False)
    assert alone.random == ["text_encoder", "text_encoder_2"]
    torch.manual_seed(5)
    everything = sdxl.build_components("sdxl-tiny")
    assert everything.random == ["vae", "text_encoder", "text_encoder_2"]
    for a, b in zip(alone.text_encoder_2.parameters(), everything.text_encoder_2.parameters()):
        assert torch.equal(a, b)
    assert everything.latent_scale == sdxl.SDXL_TINY["vae"]["scaling_factor"]


# -----------------------------------------------------------------------------------------------
# The exported pipeline.
# -----------------------------------------------------------------------------------------------

def test_exported_folder_loads_offline_in_the_sdxl_pipeline_and_samples(tiny, tmp_path, monkeypatch):
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline

    sdxl.write_pipeline(tmp_path / "pipe", tiny.unet, tiny.vae, tiny.text_encoder, tiny.text_encoder_2, tiny.tokenizer,
                        tiny.tokenizer_2, DDIMScheduler.from_config(tiny.noise_scheduler.config))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipeline = StableDiffusionXLPipeline.from_pretrained(tmp_path / "pipe")
    assert (pipeline.tokenizer.pad_token, pipeline.tokenizer_2.pad_token) == ("<|endoftext|>", "!")
    assert pipeline.config.force_zeros_for_empty_prompt
    out = pipeline("a red square", num_inference_steps=2, guidance_scale=5.0, output_type="np",
                   generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, 64, 64, 3) and np.isfinite(out.images).all()  # 64 px: sdxl-tiny's default size
    for name in ("unet", "text_encoder_2"):
        for (key, a), b in zip(getattr(tiny, name).state_dict().items(), getattr(pipeline, name).state_dict().values()):
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
    tokenizer = sdxl.bundled_tokenizers()[1]
    dataset = data.StreamingImageCaptions(remote=None, local=str(tmp_path / "mds"), tokenizer=tokenizer, image_size=64,
                                          batch_size=2, shuffle=False, micro_conditioning=True)
    samples = [dataset[i] for i in range(2)]
    assert samples[0]["original_size"].tolist() == [200, 300] and samples[0]["crop_top_left"].tolist() == [0, 16]
    assert samples[1]["original_size"].tolist() == [300, 200] and samples[1]["crop_top_left"].tolist() == [16, 0]
    synthetic = data.SyntheticImageCaptions(32, 4, micro_conditioning=True)[0]
    assert synthetic["original_size"].tolist() == [32, 32] and synthetic["crop_top_left"].tolist() == [0, 0]
    assert "original_size" not in data.SyntheticImageCaptions(32, 4)[0]


def test_precomputed_shards_store_the_geometry_and_refuse_without_it(tmp_path):
    from streaming import MDSWriter

    def write(out: Path, micro_conditioning: bool) -> None:
        columns = data.mds_columns(4, 8, None, micro_conditioning=micro_conditioning)
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
    assert data.bytes_per_sample(64, micro_conditioning=True) == data.bytes_per_sample(64) + 16
    dataset = data.StreamingLatents(remote=None, local=str(tmp_path / "xl"), batch_size=2, image_size=64,
                                    shuffle=False, micro_conditioning=True)
    assert dataset[1]["original_size"].tolist() == [481, 640] and dataset[1]["crop_top_left"].tolist() == [0, 11]
    with pytest.raises(ValueError, match="original size and crop"):
        data.StreamingLatents(remote=None, local=str(tmp_path / "sd2"), batch_size=2, image_size=64,
                              micro_conditioning=True)
    synthetic = data.SyntheticLatents(64, 96, num_samples=2, micro_conditioning=True)[0]
    assert synthetic["original_size"].tolist() == [64, 64]
