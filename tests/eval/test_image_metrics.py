"""FID and CLIP score at each evaluation (`--fid_weights`, `--clip_model`): equal to torchmetrics' own
figures on the images the run drew (its sample grids at the same batches, same seeds) against the
held-out images and captions, on one rank and two; the targets stop the run or not; every missing or
wrong file and every flag without what it needs refused in one line; InceptionV3's FID weights loaded
from a file; a CLIP model found in the local hub cache by its id.

The feature extractor and the CLIP model are tiny ones the test builds with random weights: their FID
and CLIP score are NOT comparable with published ones (the run says so for the extractor).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchmetrics.functional.multimodal import clip_score
from torchmetrics.image.fid import FrechetInceptionDistance
from transformers import CLIPModel, CLIPProcessor

import benchmark
import data
from t2ibench.eval import image_metrics
from tests.helpers import (LAUNCH_TIMEOUT_S, ROOT, TINY_MODEL, composer_launcher, error_of, jpeg, offline_env, rank_env,
                           run_cli, write_images)

HELD_OUT = 8


class Extractor(torch.nn.Module):
    """uint8 images -> 8 features: one fixed random convolution, averaged over the image. Not an FID network."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=torch.Generator().manual_seed(0)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images.float() / 255.0).mean(dim=(2, 3))


def tiny_clip(folder: Path) -> Path:
    """A 1-layer CLIP on 32 px images with the CLIP BPE tokenizer. Both towers' last norms lean on a
    shared positive bias and both project alike, so image and caption embeddings point mostly the same
    way: scores are well above torchmetrics' floor of 0 and still depend on the inputs."""
    from transformers import CLIPConfig, CLIPImageProcessor

    from t2ibench.core.tokenizer import bundled_tokenizer

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(text_config=dict(tower, max_position_embeddings=77), projection_dim=16,
                        vision_config=dict(tower, image_size=32, patch_size=8))
    torch.manual_seed(0)
    model = CLIPModel(config)
    with torch.no_grad():
        for norm in (model.text_model.final_layer_norm, model.vision_model.post_layernorm):
            norm.weight.fill_(0.5)
            norm.bias.copy_(torch.linspace(0.5, 1.5, 32))
        model.visual_projection.weight.copy_(model.text_projection.weight)
    model.save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=bundled_tokenizer(pad_token="<|endoftext|>")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image-metrics")
    torch.jit.save(torch.jit.script(Extractor()), str(root / "extractor.pt"))
    (root / "captions.txt").write_text("\n".join(f"photo {i}" for i in range(HELD_OUT)) + "\n")
    return {"extractor": root / "extractor.pt", "clip": tiny_clip(root / "clip"), "root": root,
            "train": write_images(root / "train", 16), "held_out": write_images(root / "held-out", HELD_OUT),
            "captions": root / "captions.txt"}


def args(files: dict[str, Path], *extra: str) -> list[str]:
    return [*TINY_MODEL, "--num_workers", "0", "--local", str(files["train"]), "--eval_local", str(files["held_out"]),
            "--eval_interval", "2ba", "--max_duration", "4ba", "--sample_steps", "2", "--use_ema",
            "--fid_weights", str(files["extractor"]), "--clip_model", str(files["clip"]), *extra]


@pytest.fixture(scope="module")
def run(files) -> tuple[dict, Path, str]:
    """One run scored at batches 2 and 4, drawing the held-out captions as sample grids at the same
    batches (the same images: caption i with seed + i, from the EMA weights), three at a time."""
    out = files["root"] / "run"
    printed = io.StringIO()
    # Rounds of 3 drawn images (256 in a run): the 8 captions drawn and scored in three rounds, as 30,000 are.
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as patch:
        patch.setattr(image_metrics, "DRAWN_PER_ROUND", 3)
        results = benchmark.main(args(files, "--sample_prompts", str(files["captions"]), "--sample_interval", "2ba",
                                      "--samples_dir", str(out / "grids"), "--results_json", str(out / "r.json")))
    return results, out, printed.getvalue()


def grid_images(path: Path, count: int, size: int = 32) -> torch.Tensor:
    """The (count, 3, size, size) uint8 images of a sample grid, in prompt order."""
    grid = np.asarray(Image.open(path).convert("RGB"))
    columns = grid.shape[1] // size
    tiles = [grid[(i // columns) * size:(i // columns + 1) * size, (i % columns) * size:(i % columns + 1) * size]
             for i in range(count)]
    return torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2).contiguous()


@pytest.mark.slow
def test_fid_and_clip_score_at_each_evaluation_are_torchmetrics_on_the_drawn_images(run, files):
    results, out, progress = run
    history = results["eval_history"]
    assert [entry["batch"] for entry in history] == [2, 4]
    assert results["fid_comparable"] is False and results["image_eval_samples"] == HELD_OUT
    # The held-out images as the run reads them: write_images stored jpeg(i), decoded at --image_size.
    real = torch.stack([data.decode_image_with_geometry(jpeg(i), 32)[0] for i in range(HELD_OUT)])
    model = CLIPModel.from_pretrained(files["clip"]).eval()
    processor = CLIPProcessor.from_pretrained(files["clip"])
    captions = [f"photo {i}" for i in range(HELD_OUT)]
    for entry in history:
        fake = grid_images(out / "grids" / f"{entry['batch']}.png", HELD_OUT)
        fid = FrechetInceptionDistance(feature=Extractor())
        fid.update(real, real=True)
        fid.update(fake, real=False)
        assert entry["fid"] == pytest.approx(float(fid.compute()), rel=1e-4)
        expected_clip = float(clip_score(list(fake), captions, model_name_or_path=lambda: (model, processor)))
        assert entry["clip_score"] == pytest.approx(expected_clip, rel=1e-4)
        assert 1.0 < entry["clip_score"] <= 100.0 and entry["fid"] > 0
        assert entry["image_samples"] == HELD_OUT and 0 < entry["image_seconds"] <= entry["seconds"]
    # Training moved the weights between the evaluations: the images, hence the scores, differ.
    assert history[0]["fid"] != history[1]["fid"]
    assert results["fid"] == history[-1]["fid"] and results["clip_score"] == history[-1]["clip_score"]
    assert results["converged"] is None  # no target given
    assert f"FID {history[-1]['fid']:.2f} | CLIP {history[-1]['clip_score']:.2f}" in progress  # the progress line
    assert progress.count("drawing and scoring 8 held-out captions for FID and CLIP score") == 2  # each evaluation
    with Image.open(out / "r-eval.png") as picture:  # the scores' panel below the loss's: 8 inches high, not 5
        assert picture.height == 8 * 120


@pytest.mark.parametrize("target, converged", [("1e9", True), ("1e-9", False)])
@pytest.mark.slow
def test_fid_target_stops_the_run_at_the_first_evaluation_under_it_or_reports_it_unreached(files, target, converged,
                                                                                            capsys):
    results = benchmark.main(args(files, "--fid_target", target))
    assert results["converged"] is converged and results["fid_target"] == float(target)
    if converged:  # FID >= 0: the first evaluation meets 1e9, and the run stops there
        assert [entry["batch"] for entry in results["eval_history"]] == [2]
        assert results["samples_to_target"] == 8 and results["time_to_target_s"] > 0
        assert f"FID <= {float(target)} reached at batch 2" in capsys.readouterr().out
    else:
        assert [entry["batch"] for entry in results["eval_history"]] == [2, 4] and results["samples_to_target"] is None
        out = capsys.readouterr().out
        best = min(entry["fid"] for entry in results["eval_history"])
        # A run to FID alone missed FID: the summary gives the best FID, not a loss it never aimed at as if missed.
        assert f"FID <= {float(target)} not reached in 16 samples (converged: false; best FID {best:.2f})" in out
        assert "best loss" not in out


@pytest.mark.slow
def test_inception_fid_weights_load_from_a_file_and_score(tmp_path):
    # torch-fidelity's InceptionV3 with random weights, saved as a user's weights file would be: the
    # path torchmetrics runs with the real file, at 299 px, on a few images.
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class Unloaded(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return super().load_state_dict(state_dict, strict=False)

    torch.save({}, tmp_path / "empty.pth")
    torch.manual_seed(0)
    weights = Unloaded("inception-v3-compat", ["2048"], str(tmp_path / "empty.pth")).state_dict()
    torch.save(weights, tmp_path / "inception.pth")
    fid, comparable = image_metrics.load_fid(str(tmp_path / "inception.pth"), 32)
    assert comparable is True
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    fid.update(images[:3], real=True)
    fid.update(images[3:], real=False)
    assert float(fid.compute()) > 0
    del weights["fc.weight"]  # a truncated file: one line, not a traceback
    torch.save(weights, tmp_path / "truncated.pth")
    with pytest.raises(SystemExit, match="not the layers of torch-fidelity's InceptionV3"):
        image_metrics.load_fid(str(tmp_path / "truncated.pth"), 32)


@pytest.mark.slow
def test_missing_and_wrong_files_and_flags_without_what_they_need_fail_in_one_line(files, tmp_path):
    (tmp_path / "notes.txt").write_text("not weights")
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "other.pth")
    # The run without the score flags, nor --sample_steps (which draws nothing then: refused first).
    without = args(files)[:args(files).index("--sample_steps")]
    cases = [
        (args(files, "--fid_weights", str(tmp_path / "absent.pth")), "--fid_weights", "no such file"),
        (args(files, "--fid_weights", str(tmp_path / "notes.txt")), "--fid_weights", "is not a PyTorch weights file"),
        (args(files, "--fid_weights", str(tmp_path / "other.pth")), "--fid_weights", "holds no InceptionV3 FID weights"),
        (args(files, "--clip_model", str(tmp_path / "absent")), "--clip_model", "no such folder"),
        (args(files, "--clip_model", str(tmp_path)), "--clip_model", "has no config.json"),
        ([*TINY_MODEL, "--use_synth_data", "--fid_weights", str(files["extractor"])], "--fid_weights",
         "needs --eval_interval"),
        ([*TINY_MODEL, "--use_synth_data", "--eval_interval", "2ba", "--clip_model", str(files["clip"])],
         "--clip_model", "needs held-out image-caption shards"),
        (args(files, "--clip_target", "0.15"), "--clip_target 0.15", "is --clip_target 15"),
        (args(files, "--image_eval_samples", "9"), "--image_eval_samples 9", "reads 8 held-out samples"),
        (args(files, "--image_eval_samples", "1"), "--image_eval_samples 1", "FID needs at least 2 images"),
        ([*without, "--clip_model", str(files["clip"]), "--fid_target", "90"], "--fid_target 90", "needs --fid_weights"),
        ([*without, "--image_eval_samples", "4"], "--image_eval_samples", "needs --fid_weights or --clip_model"),
        (args(files, "--fid_real_stats", str(tmp_path)), "--fid_real_stats", "is not a regular file"),
        (args(files, "--fid_real_stats", str(tmp_path / "notes.txt")), "--fid_real_stats",
         "is not a statistics file this project wrote"),
        ([*without, "--clip_model", str(files["clip"]), "--fid_real_stats", str(tmp_path / "new.npz")],
         "--fid_real_stats", "needs --fid_weights"),
    ]
    for argv, flag, why in cases:
        message = error_of(benchmark.main, argv)
        assert flag in message and why in message, message
        if "no such" in why:
            assert "nothing is downloaded here" in message


@pytest.mark.multirank
def test_two_ranks_score_every_ranks_images_as_one_set(files):
    # 7 captions over 2 ranks (4 and 3): each rank draws and extracts its own share, torchmetrics sums
    # the states over the ranks, and the figures are those of all 7 images (rank 0's grid holds them all).
    out = files["root"] / "two-ranks"
    out.mkdir()
    (out / "captions.txt").write_text("\n".join(f"photo {i}" for i in range(7)) + "\n")
    done = run_cli(args(files, "--image_eval_samples", "7", "--max_duration", "2ba", "--sample_prompts",
                        str(out / "captions.txt"), "--sample_interval", "2ba", "--samples_dir", str(out / "grids"),
                        "--results_json", str(out / "r.json")),
                   launcher=composer_launcher(2), env=rank_env(), timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "r.json").read_text())
    (entry,) = results["eval_history"]
    assert results["world_size"] == 2 and entry["image_samples"] == 7
    real = torch.stack([data.decode_image_with_geometry(jpeg(i), 32)[0] for i in range(7)])
    fake = grid_images(out / "grids" / "2.png", 7)
    fid = FrechetInceptionDistance(feature=Extractor())
    fid.update(real, real=True)
    fid.update(fake, real=False)
    assert entry["fid"] == pytest.approx(float(fid.compute()), rel=1e-4)
    model, processor = CLIPModel.from_pretrained(files["clip"]).eval(), CLIPProcessor.from_pretrained(files["clip"])
    expected = clip_score(list(fake), [f"photo {i}" for i in range(7)], model_name_or_path=lambda: (model, processor))
    assert entry["clip_score"] == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.slow
def test_clip_model_is_read_from_the_local_hub_cache_by_its_hub_id(files, tmp_path):
    # A hub id already downloaded (the cache's layout: models--ORG--NAME/snapshots/REV, refs/main) is taken
    # without a network; an id the cache lacks is one line.
    repo = tmp_path / "hub" / "models--test-org--tiny-clip"
    shutil.copytree(files["clip"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    probe = ("import sys; from t2ibench.eval.image_metrics import load_clip; "
             "print(type(load_clip(sys.argv[1], 32)).__name__)")
    env = offline_env(HF_HUB_CACHE=str(tmp_path / "hub"))
    found = subprocess.run([sys.executable, "-c", probe, "test-org/tiny-clip"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == "PerImageCLIPScore", found.stderr[-2000:]
    absent = subprocess.run([sys.executable, "-c", probe, "test-org/absent"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert absent.returncode != 0 and "nor a hub id in the local Hugging Face cache" in absent.stderr
    assert "Traceback" not in absent.stderr


class OneRow(Extractor):
    def forward(self, images: torch.Tensor) -> torch.Tensor:  # one row whatever the batch: a wrong FID, silently
        return self.conv(images.float() / 255.0).mean(dim=(0, 2, 3)).unsqueeze(0)


class Flat(Extractor):
    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (N,)
        return self.conv(images.float() / 255.0).mean(dim=(1, 2, 3))


class ImageShaped(Extractor):
    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (N, 3, 299)
        return torch.zeros(images.shape[0], 3, 299)


class NotANumber(Extractor):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images.float() / 255.0).mean(dim=(2, 3)) * float("nan")


class Needs299(Extractor):
    def forward(self, images: torch.Tensor) -> torch.Tensor:  # an InceptionV3-like network without a resize
        if images.shape[-1] != 299:
            raise RuntimeError("expected 299 x 299 input")
        return self.conv(images.float() / 255.0).mean(dim=(2, 3))


class NaNBeyondTwo(Extractor):
    def forward(self, images: torch.Tensor) -> torch.Tensor:  # passes the probe, then NaN on the run's batches
        features = self.conv(images.float() / 255.0).mean(dim=(2, 3))
        return features if images.shape[0] == 2 else features * float("nan")


def scripted(module: torch.nn.Module, path: Path) -> str:
    torch.jit.save(torch.jit.script(module), str(path))
    return str(path)


def test_user_models_are_probed_on_two_inputs_before_training_and_refused_in_one_line(files, tmp_path):
    cases = [(OneRow(), "returns shape (1, 8) for 2 images, not (2, D)"),
             (Flat(), "returns shape (2,) for 2 images"),
             (ImageShaped(), "returns shape (2, 3, 299) for 2 images"),
             (NotANumber(), "returns NaN or infinite features"),
             (Needs299(), "fails on (2, 3, 32, 32) uint8 images (--image_size 32) (RuntimeError: expected 299 x 299 input)")]
    for module, why in cases:
        path = scripted(module, tmp_path / f"{type(module).__name__}.pt")
        with pytest.raises(SystemExit, match=re.escape(f"--fid_weights {path}: the TorchScript ")) as refused:
            image_metrics.load_fid(path, 32)
        assert why in str(refused.value), str(refused.value)
    # Through the command: one line, before any batch is trained (no checkpoint, no results).
    message = error_of(benchmark.main, args(files, "--fid_weights", str(tmp_path / "OneRow.pt"), "--results_json",
                                             str(tmp_path / "never.json")))
    assert "returns shape (1, 8) for 2 images" in message and not (tmp_path / "never.json").exists()
    # A CLIP folder whose weights are damaged (cut short): named, one line.
    damaged = tmp_path / "damaged-clip"
    shutil.copytree(files["clip"], damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    message = error_of(benchmark.main, args(files, "--clip_model", str(damaged)))
    assert f"--clip_model {damaged}: its files do not load as a CLIP model" in message


def test_a_non_finite_feature_stops_every_rank_in_one_line_before_the_matrix_square_root(files, tmp_path):
    # Finite on the probe's two images, NaN on the batch of 8 held-out images at the first evaluation:
    # stopped on every rank before torchmetrics' compute() (oneMKL's square root ends the process on NaN).
    path = scripted(NaNBeyondTwo(), tmp_path / "nan.pt")
    message = error_of(benchmark.main, args(files, "--fid_weights", path, "--clip_model", str(files["clip"])))
    assert "--fid_weights: the extractor returned NaN or infinite features for the held-out images" in message


def random_clip(folder: Path) -> Path:
    """tiny_clip's shape with its random weights as drawn: cosines of either sign."""
    tiny_clip(folder)
    from transformers import CLIPConfig
    torch.manual_seed(1)
    CLIPModel(CLIPConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


@pytest.mark.filterwarnings("ignore:Encountered caption longer")  # torchmetrics' own slice, the reference
def test_clip_score_clips_each_image_and_keeps_a_long_captions_end_token(tmp_path):
    folder = random_clip(tmp_path / "clip")
    clip = image_metrics.load_clip(str(folder), 32)
    model, processor = clip.model, clip.processor
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    captions = [f"photo {i}" for i in range(6)]
    clip.update(images, captions)
    ours = float(clip.compute())
    # torchmetrics' score of each image alone is its definition, max(100 cos, 0); the run's is their mean.
    alone = [float(clip_score(image, caption, model_name_or_path=lambda: (model, processor)))
             for image, caption in zip(images, captions)]
    assert ours == pytest.approx(sum(alone) / len(alone), rel=1e-5)
    batched = float(clip_score(list(images), captions, model_name_or_path=lambda: (model, processor)))
    assert ours != pytest.approx(batched, rel=1e-3)  # some images score under 0: clipping the mean differs
    # A caption of 100 one-token words: CLIP reads its first 75 and the end token, as the tokenizer cuts it.
    words = ("a red square on a blue circle " * 15).split()[:100]
    clip.reset()
    clip.update(images[:1], [" ".join(words)])
    long = float(clip.compute())
    clip.reset()
    clip.update(images[:1], [" ".join(words[:75])])
    assert long == pytest.approx(float(clip.compute()), rel=1e-5)
    sliced = float(clip_score(images[0], " ".join(words), model_name_or_path=lambda: (model, processor)))
    assert long != pytest.approx(sliced, rel=1e-3)  # torchmetrics' slice drops the end token CLIP pools at


@pytest.mark.multirank
def test_three_ranks_with_fewer_captions_and_an_odd_held_out_count_score_as_one_rank(files, capsys):
    # 7 held-out samples at 2 a rank on 3 ranks (no batch divides 7: ranks 1 and 2 end on the sampler's
    # repeat) and 2 captions (rank 2 draws none): every sample once, every rank done, the figures of one
    # rank. The one-rank run computes the held-out images' FID statistics and writes them; the three ranks
    # read them before their clock starts. The learning rate moves no weight (float32), so both evaluate the same weights. Its own
    # launches: no shared run has 3 ranks.
    out = files["root"] / "three-ranks"
    out.mkdir()
    stats = out / "real.npz"
    flags = args(files, "--batch_size", "6", "--lr", "1e-30", "--eval_interval", "1ba", "--max_duration", "1ba",
                 "--eval_samples", "7", "--image_eval_samples", "2", "--fid_real_stats", str(stats))
    one = benchmark.main([*flags, "--results_json", str(out / "one.json")])
    assert f"FID's reference statistics written to {stats}" in capsys.readouterr().out and stats.is_file()
    three = run_cli([*flags, "--results_json", str(out / "three.json")], launcher=composer_launcher(3), env=rank_env(),
                    timeout=LAUNCH_TIMEOUT_S)
    assert three.returncode == 0, three.stdout[-3000:] + three.stderr[-3000:]
    assert "held-out images for FID's reference statistics" not in three.stdout  # read from the file
    (alone,) = one["eval_history"]
    (spread,) = json.loads((out / "three.json").read_text())["eval_history"]
    assert spread["held_out_samples"] == alone["held_out_samples"] == 7
    assert spread["image_samples"] == alone["image_samples"] == 2
    for key in ("loss", "fid", "clip_score"):
        assert spread[key] == pytest.approx(alone[key], rel=1e-4), key
    # The file fits only what it was computed from: another caption count is refused, before training.
    message = error_of(benchmark.main, [*flags, "--image_eval_samples", "3"])
    assert f"--fid_real_stats {stats} was computed with num_images 2, this run has 3" in message
