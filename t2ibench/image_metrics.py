"""FID and CLIP score at each evaluation, computed by torchmetrics on images drawn from the EMA weights
for held-out captions, from files the user has (`--fid_weights`, `--clip_model`): nothing can be
downloaded at run time. What they measure and how they compare with MLPerf's: docs/metrics.md, "FID and
CLIP score".
"""
from __future__ import annotations

import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from composer.core import State
from composer.utils import dist

from t2ibench.errors import fail
from t2ibench.locations import file_problem
from t2ibench.validation import held_out_read

# MLPerf's Stable Diffusion v2 target (Training v3.1-v5.0): both at one evaluation, on 30,000 COCO captions.
MLPERF_SD2_FID, MLPERF_SD2_CLIP_SCORE = 90.0, 15.0  # CLIP: 0.15 as a cosine, 15.0 as torchmetrics reports it
IMAGE_METRIC_FLAGS = ("fid_weights", "clip_model", "image_eval_samples", "fid_target", "clip_target")
# A key only InceptionV3's FID weights have (torch-fidelity's and pytorch-fid's files name their layers alike).
INCEPTION_KEY = "Mixed_7c.branch_pool.conv.weight"
SCORED_PER_CALL = 32  # images per feature-extractor call: bounds its activations whatever the sample count
MISSING = "nothing is downloaded here"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def is_torchscript(path: Path) -> bool:
    """A TorchScript archive (torch.jit.save) holds code/; a state dict saved by torch.save does not."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/code/" in name for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def load_fid(path: str):
    """torchmetrics' FrechetInceptionDistance on the extractor in `path`, and whether its FID compares
    with published ones: True for InceptionV3's FID weights (torch-fidelity's network, as torchmetrics
    runs it), False for a TorchScript feature extractor of the user's (or a test's)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    where = Path(path)
    expected = ("give InceptionV3's FID weights (weights-inception-2015-12-05-6726825d.pth, the file torchmetrics' "
                "FID downloads) or a TorchScript feature extractor")
    problem = file_problem(f"--fid_weights {path}", where)
    if problem:
        fail(f"{problem}; {expected}: {MISSING}")
    if is_torchscript(where):
        try:
            extractor = torch.jit.load(str(where), map_location="cpu").eval()
            # reset_real_features=False: the held-out images are the same at every evaluation, so their
            # features are computed once (at the first) and kept through reset().
            return FrechetInceptionDistance(feature=extractor, reset_real_features=False), False
        except Exception as error:  # noqa: BLE001  TorchScript raises RuntimeError and its own types
            fail(f"--fid_weights {path}: the TorchScript module does not map (N, 3, 299, 299) uint8 images to "
                 f"(N, D) features ({_first_line(error)})")
    try:
        state = torch.load(where, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  pickle and zip errors of every kind
        fail(f"--fid_weights {path} is not a PyTorch weights file ({_first_line(error)}); {expected}")
    if not isinstance(state, dict) or INCEPTION_KEY not in state:
        fail(f"--fid_weights {path} holds no InceptionV3 FID weights (no {INCEPTION_KEY}); {expected}")
    try:
        return FrechetInceptionDistance(feature=2048, reset_real_features=False,
                                        feature_extractor_weights_path=str(where)), True
    except ModuleNotFoundError:
        fail("--fid_weights needs torch-fidelity, whose InceptionV3 torchmetrics runs: pip install "
             "torch-fidelity==0.3.0 (pinned in requirements.txt)")
    except RuntimeError as error:  # load_state_dict: missing or misshapen layers
        fail(f"--fid_weights {path}: not the layers of torch-fidelity's InceptionV3 ({_first_line(error)}); {expected}")


def load_clip(folder: str):
    """torchmetrics' CLIPScore (100 x the cosine of image and caption embeddings) on the transformers
    CLIP model and processor saved in `folder`, or of a hub id already in the local Hugging Face cache:
    never downloaded (ViT-H-14 is 4 GB; a run would stall on it, or hang without a network)."""
    from torchmetrics.multimodal.clip_score import CLIPScore
    from transformers import CLIPModel, CLIPProcessor

    expected = ("give a local transformers CLIP model folder (config.json, weights, tokenizer and preprocessor "
                "files; MLPerf's SD2 used laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")

    def model_and_processor():
        return (CLIPModel.from_pretrained(folder, local_files_only=True).eval(),
                CLIPProcessor.from_pretrained(folder, local_files_only=True))

    try:
        return CLIPScore(model_name_or_path=model_and_processor)
    except (OSError, ValueError, KeyError, TypeError) as error:
        if not Path(folder).is_dir():
            fail(f"--clip_model {folder}: no such folder, nor a hub id in the local Hugging Face cache; {expected}: "
                 f"{MISSING}")
        fail(f"--clip_model {folder}: not a complete CLIP model folder ({_first_line(error)}); {expected}")


class ImageQuality:
    """FID against the held-out images and CLIP score against their captions, of images drawn for the
    first `num_samples` held-out captions, at every evaluation (`ValidationLog` calls `measure`).

    Caption i goes to rank i % world size and is drawn with seed + i (`SampleImages.draw`: the EMA's
    weights once it has started, a sharded denoiser too), so the images do not depend on the number of
    ranks; torchmetrics sums each metric's states over the ranks in compute(). The real images are
    the held-out samples at --image_size as the validation loss reads them (an undecodable one is
    replaced by the next, as there); their features are computed at the first evaluation and kept.
    The extractors wait on the CPU between evaluations and run on the training device during one.

    Args:
        dataset: the held-out image-caption dataset (data.StreamingImageCaptions).
        num_samples: captions drawn and scored per evaluation (over all ranks).
        drawer: a SampleImages without an interval, whose prompts this fills with the captions.
        fid: torchmetrics' FID, or None; fid_comparable: whether it runs InceptionV3's FID weights.
        clip: torchmetrics' CLIPScore, or None.
    """

    def __init__(self, dataset: Any, num_samples: int, drawer: Any, fid: Any, fid_comparable: bool, clip: Any):
        self.dataset, self.num_samples, self.drawer = dataset, num_samples, drawer
        self.fid, self.fid_comparable, self.clip = fid, fid_comparable, clip
        self._mine: list[int] | None = None
        self._real: torch.Tensor | None = None

    def _read_held_out(self) -> None:
        """This rank's share of the held-out images (uint8, 3 x S x S, as the validation loss reads
        them: get_item) and their captions."""
        self._mine = list(range(dist.get_global_rank(), self.num_samples, dist.get_world_size()))
        images = []
        for i in self._mine:
            item = self.dataset.get_item(i)  # an undecodable sample is replaced by the next, as for the loss
            images.append(item["image"])
            self.drawer.prompts[i] = self.dataset.read_sample(int(item["sample_index"]))[self.dataset.caption_key]
        size = self.dataset.image_size
        self._real = torch.stack(images) if images else torch.empty(0, 3, size, size, dtype=torch.uint8)

    def measure(self, state: State) -> dict[str, Any]:
        """Draw this rank's captions and score every rank's images: {"fid", "clip_score", ...} (the
        same numbers on every rank)."""
        start = time.perf_counter()
        if dist.get_global_rank() == 0:  # minutes at MLPerf's 30,000 captions: say what the pause is
            print(f"drawing and scoring {self.num_samples:,} held-out captions for "
                  f"{' and '.join(name for name, on in (('FID', self.fid), ('CLIP score', self.clip)) if on)} "
                  f"({dist.get_world_size()} rank(s), each its share)", flush=True)
        first = self._real is None
        if first:
            self._read_held_out()
        drawn = self.drawer.draw(state, self._mine)
        fake = (torch.from_numpy(np.stack(drawn)).permute(0, 3, 1, 2).contiguous() if drawn
                else torch.empty_like(self._real))
        device = state.device.tensor_to_device(torch.empty(0)).device
        captions = [self.drawer.prompts[i] for i in self._mine]
        scores: dict[str, Any] = {"image_samples": self.num_samples}
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            if self.fid is not None:
                self.fid.to(device)
                for begin in range(0, len(fake), SCORED_PER_CALL):
                    if first:
                        self.fid.update(self._real[begin:begin + SCORED_PER_CALL].to(device), real=True)
                    self.fid.update(fake[begin:begin + SCORED_PER_CALL].to(device), real=False)
                scores["fid"] = float(self.fid.compute())
                self.fid.reset()  # the generated images' states; the real ones are kept
                self.fid.to("cpu")
            if self.clip is not None:
                self.clip.to(device)
                for begin in range(0, len(fake), SCORED_PER_CALL):
                    self.clip.update(fake[begin:begin + SCORED_PER_CALL].to(device),
                                     captions[begin:begin + SCORED_PER_CALL])
                scores["clip_score"] = float(self.clip.compute())
                self.clip.reset()
                self.clip.to("cpu")
        scores["image_seconds"] = time.perf_counter() - start
        return scores

    def summary(self) -> dict[str, Any]:
        """What the results JSON keeps beside the history's scores."""
        return {"image_eval_samples": self.num_samples, "fid_comparable": self.fid_comparable if self.fid else None}


def check_image_flags(settings: Any, held_out: int | None) -> None:
    """The FID and CLIP flags, before anything loads: one line naming the flag. `held_out`: the
    held-out samples an evaluation reads (None: no held-out image shards)."""
    given = [name for name in IMAGE_METRIC_FLAGS if getattr(settings, name) is not None]
    if not given:
        return
    flag = f"--{given[0]}"
    if not settings.eval_interval:
        fail(f"{flag} needs --eval_interval: FID and CLIP score are computed at each evaluation, on held-out "
             "image-caption shards (--eval_remote/--eval_local)")
    if settings.fid_weights is None and settings.clip_model is None:
        fail(f"{flag} needs --fid_weights or --clip_model (the files the scores are computed with)")
    if held_out is None or settings.precomputed:
        fail(f"{flag} needs held-out image-caption shards (--eval_remote/--eval_local without --use_synth_data or "
             "--precomputed): their images are FID's reference and their captions are what is drawn")
    if settings.fid_target is not None and settings.fid_weights is None:
        fail(f"--fid_target {settings.fid_target} needs --fid_weights (the network FID is computed with)")
    if settings.clip_target is not None and settings.clip_model is None:
        fail(f"--clip_target {settings.clip_target} needs --clip_model (the CLIP model the score is computed with)")
    if settings.clip_target is not None and not 1.0 <= settings.clip_target <= 100.0:
        fail(f"--clip_target {settings.clip_target}: the CLIP score is torchmetrics' 100 x cosine, 0 to 100 "
             f"(MLPerf's SD2 target, cosine 0.15, is --clip_target {MLPERF_SD2_CLIP_SCORE:g})")
    samples = settings.image_eval_samples or held_out
    if settings.image_eval_samples is not None and settings.image_eval_samples > held_out:
        fail(f"--image_eval_samples {settings.image_eval_samples}: the evaluation reads {held_out} held-out samples "
             "(--eval_remote/--eval_local, --eval_samples); give at most that many")
    if settings.fid_weights is not None and samples < 2:
        fail(f"--image_eval_samples {samples}: FID needs at least 2 images (a covariance); give more")


def for_run(settings: Any, held_out: Any, encoders: Any, pauses: Any, average: Any) -> ImageQuality | None:
    """The run's ImageQuality (None without --fid_weights and --clip_model), its files loaded now: a
    file that does not load stops the run here, before training. `held_out`: the held-out dataset;
    `encoders`: the parts that encode captions and decode latents; `average`: the run's EMA or None."""
    if settings.fid_weights is None and settings.clip_model is None:
        return None
    from t2ibench.callbacks.samples import SampleImages  # it imports the model; image_metrics is imported by checks

    fid, comparable = load_fid(settings.fid_weights) if settings.fid_weights else (None, False)
    clip = load_clip(settings.clip_model) if settings.clip_model else None
    num_samples = settings.image_eval_samples or held_out_read(held_out.num_samples, settings.eval_samples)
    drawer = SampleImages(settings.family, [""] * num_samples, "", None, encoders=encoders, height=settings.image_size,
                          width=settings.image_size, pauses=pauses, average=average, sampler=settings.sampler,
                          num_steps=settings.sample_steps, guidance_scale=settings.guidance_scale, seed=settings.seed)
    return ImageQuality(held_out, num_samples, drawer, fid, comparable, clip)
