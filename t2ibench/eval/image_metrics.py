"""FID and CLIP score at each evaluation, computed by torchmetrics on images drawn from the EMA weights
for held-out captions, from files the user has (`--fid_weights`, `--clip_model`): nothing can be
downloaded at run time. What they measure and how they compare with MLPerf's: docs/metrics.md, "FID and
CLIP score".
"""
from __future__ import annotations

import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from composer.core import State
from composer.utils import dist
from torchmetrics.multimodal.clip_score import CLIPScore

from t2ibench.eval import fid_stats
from t2ibench.core.errors import fail
from t2ibench.core.locations import file_problem

# MLPerf's Stable Diffusion v2 target (Training v3.1-v5.0): both at one evaluation, on 30,000 COCO captions.
MLPERF_SD2_FID, MLPERF_SD2_CLIP_SCORE = 90.0, 15.0  # CLIP: 0.15 as a cosine, 15.0 as torchmetrics reports it
IMAGE_METRIC_FLAGS = ("fid_weights", "clip_model", "image_eval_samples", "fid_target", "clip_target",
                      "fid_real_stats")
# A key only InceptionV3's FID weights have (torch-fidelity's and pytorch-fid's files name their layers alike).
INCEPTION_KEY = "Mixed_7c.branch_pool.conv.weight"
SCORED_PER_CALL = 32  # images per feature-extractor call: bounds its activations whatever the sample count
# Images drawn per call at an evaluation: 200 MB of uint8 at 512 px, whatever the caption count; the EMA's
# weights are swapped in per call (milliseconds on a GPU against seconds of drawing).
DRAWN_PER_ROUND = 256
PROBE_BATCH = 2  # every model the user hands in runs on this many inputs before training starts
PROBE_CAPTIONS = ("a photograph of a red square", "a painting of a blue circle")
MISSING = "nothing is downloaded here"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _script_error(error: BaseException) -> str:
    """The line of a TorchScript error that says what failed: its last (the first is "The following
    operation failed in the TorchScript interpreter.", then the traceback of the scripted code)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].removeprefix("builtins.")[:300] if lines else type(error).__name__


def is_torchscript(path: Path) -> bool:
    """A TorchScript archive (torch.jit.save) holds code/; a state dict saved by torch.save does not."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/code/" in name for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def probe_images(image_size: int) -> torch.Tensor:
    """The probe every user model gets before training: two different (2, 3, S, S) uint8 images."""
    return torch.randint(0, 256, (PROBE_BATCH, 3, image_size, image_size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def feature_problem(features: Any, rows: int) -> str | None:
    """Why a model's output for `rows` inputs is not (rows, D) finite floating-point features, or None."""
    if not isinstance(features, torch.Tensor):
        return f"returns {type(features).__name__}, not a tensor"
    if not features.is_floating_point():
        return f"returns {features.dtype} features, not floating-point ones"
    if features.dim() != 2 or features.shape[0] != rows or features.shape[1] < 1:
        return f"returns shape {tuple(features.shape)} for {rows} images, not ({rows}, D): one row of features per image"
    if not bool(torch.isfinite(features).all()):
        return "returns NaN or infinite features"
    return None


def load_fid(path: str, image_size: int):
    """torchmetrics' FrechetInceptionDistance on the extractor in `path`, probed on a batch of two
    images, and whether its FID compares with published ones: True for InceptionV3's FID weights
    (torch-fidelity's network, as torchmetrics runs it: resized to 299 px inside), False for a
    TorchScript feature extractor of the user's (or a test's), given the images at `image_size`."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    where = Path(path)
    expected = ("give InceptionV3's FID weights (weights-inception-2015-12-05-6726825d.pth, the file torchmetrics' "
                "FID downloads) or a TorchScript feature extractor")
    given = f"(2, 3, {image_size}, {image_size}) uint8 images (--image_size {image_size})"
    problem = file_problem(f"--fid_weights {path}", where)
    if problem:
        fail(f"{problem}; {expected}: {MISSING}")
    if is_torchscript(where):
        try:
            extractor = torch.jit.load(str(where), map_location="cpu").eval()
            with torch.no_grad():
                features = extractor(probe_images(image_size))
        except Exception as error:  # noqa: BLE001  TorchScript raises RuntimeError and its own types
            fail(f"--fid_weights {path}: the TorchScript module fails on {given} ({_script_error(error)}); it must map "
                 "(N, 3, S, S) uint8 images at --image_size to (N, D) features")
        problem = feature_problem(features, PROBE_BATCH)
        if problem:
            fail(f"--fid_weights {path}: the TorchScript extractor, given {given}, {problem}")
        # reset_real_features=False: the held-out images are the same at every evaluation, so their
        # features are computed once (before the first) and kept through reset(). input_img_size: the
        # size torchmetrics' own dummy call at construction gives it (its default is 299 px).
        fid = FrechetInceptionDistance(feature=extractor, reset_real_features=False,
                                       input_img_size=(3, image_size, image_size))
        comparable = False
    else:
        try:
            state = torch.load(where, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001  pickle and zip errors of every kind
            fail(f"--fid_weights {path} is not a PyTorch weights file ({_first_line(error)}); {expected}")
        if not isinstance(state, dict) or INCEPTION_KEY not in state:
            fail(f"--fid_weights {path} holds no InceptionV3 FID weights (no {INCEPTION_KEY}); {expected}")
        try:
            fid = FrechetInceptionDistance(feature=2048, reset_real_features=False,
                                           feature_extractor_weights_path=str(where))
        except ModuleNotFoundError:
            fail("--fid_weights needs torch-fidelity, whose InceptionV3 torchmetrics runs: pip install "
                 "torch-fidelity==0.3.0 (pinned in requirements.txt)")
        except RuntimeError as error:  # load_state_dict: missing or misshapen layers
            fail(f"--fid_weights {path}: not the layers of torch-fidelity's InceptionV3 ({_first_line(error)}); "
                 f"{expected}")
        with torch.no_grad():
            features = fid.inception(probe_images(image_size))
        problem = feature_problem(features, PROBE_BATCH)
        if problem:  # weights of NaN, say
            fail(f"--fid_weights {path}: InceptionV3 with these weights, given {given}, {problem}")
        comparable = True
    # torchmetrics 1.7.4 sets the features' dtype in update() only, and compute() reads it: a rank with no
    # caption of its own (fewer captions than ranks) would raise there and leave the others waiting.
    fid.orig_dtype = features.dtype
    return fid, comparable


def clip_features(model: Any, processor: Any, images: torch.Tensor,
                  captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP's image and caption embeddings, (N, D) each. Hand-written beside torchmetrics 1.7.4's
    `_get_features`, which cuts a caption over the text model's 77 positions by slicing its token ids,
    dropping the end token CLIP's text model pools at: here the tokenizer truncates, keeping it."""
    device = images.device
    pixels = processor(images=[image.cpu() for image in images], return_tensors="pt")["pixel_values"].to(device)
    limit = model.config.text_config.max_position_embeddings
    text = processor(text=captions, return_tensors="pt", padding=True, truncation=True, max_length=limit)
    return (model.get_image_features(pixels),
            model.get_text_features(text["input_ids"].to(device), text["attention_mask"].to(device)))


class PerImageCLIPScore(CLIPScore):
    """torchmetrics' CLIPScore (its states, their sum over the ranks, compute) with each image scored as
    its documentation defines the score, max(100 x cos(E_I, E_C), 0): torchmetrics 1.7.4's update adds
    the unclipped cosines and clips only the mean. `update(images, captions)`: (N, 3, H, W) uint8."""

    def update(self, images: torch.Tensor, captions: list[str]) -> None:  # type: ignore[override]
        image_features, text_features = clip_features(self.model, self.processor, images, captions)
        cosine = torch.nn.functional.cosine_similarity(image_features.float(), text_features.float(), dim=-1)
        self.score += (100 * cosine).clamp(min=0).sum().to(self.score)
        self.n_samples += len(captions)


def load_clip(folder: str, image_size: int):
    """torchmetrics' CLIPScore (its states, sync and compute) on the transformers CLIP model and processor
    saved in `folder`, or of a hub id already in the local Hugging Face cache: never downloaded (ViT-H-14 is
    4 GB; a run would stall on it, or hang without a network). Probed on two images and two captions."""
    from transformers import CLIPModel, CLIPProcessor

    expected = ("give a local transformers CLIP model folder (config.json, weights, tokenizer and preprocessor "
                "files; MLPerf's SD2 used laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
    where = Path(folder)
    if where.is_dir() and not (where / "config.json").is_file():
        fail(f"--clip_model {folder} has no config.json: not a transformers model folder; {expected}")

    def model_and_processor():
        return (CLIPModel.from_pretrained(folder, local_files_only=True).eval(),
                CLIPProcessor.from_pretrained(folder, local_files_only=True))

    try:
        clip = PerImageCLIPScore(model_name_or_path=model_and_processor)
    except Exception as error:  # noqa: BLE001  transformers' OSError, safetensors' SafetensorError, JSON errors...
        if not where.is_dir():
            fail(f"--clip_model {folder}: no such folder, nor a hub id in the local Hugging Face cache; {expected}: "
                 f"{MISSING}")
        fail(f"--clip_model {folder}: its files do not load as a CLIP model ({type(error).__name__}: "
             f"{_first_line(error)}); {expected}")
    try:
        with torch.no_grad():
            features = clip_features(clip.model, clip.processor, probe_images(image_size), list(PROBE_CAPTIONS))
    except Exception as error:  # noqa: BLE001  a model that loads but does not run: the user's files
        fail(f"--clip_model {folder}: the model fails on two {image_size} px images and two captions "
             f"({type(error).__name__}: {_first_line(error)}); {expected}")
    for name, output in zip(("image", "caption"), features):
        problem = feature_problem(output, PROBE_BATCH)
        if problem:
            fail(f"--clip_model {folder}: its {name} embedding, for two {name}s, {problem}")
    return clip


class ImageQuality:
    """FID against the held-out images and CLIP score against their captions, of images drawn for the
    first `num_samples` held-out captions, at every evaluation (`ValidationLog` calls `measure`).

    Caption i goes to rank i % world size and is drawn with seed + i (`SampleImages.draw`: the EMA's
    weights once it has started, a sharded denoiser too), so the images do not depend on the number of
    ranks; torchmetrics sums each metric's states over the ranks in compute(), and a rank with no
    caption of its own adds nothing and waits on nobody. The real images are the held-out samples at
    --image_size as the validation loss reads them (an undecodable one is replaced by the next, as
    there); the first evaluation streams them through the extractor, and only their features are kept
    (or they are read from `real_stats` before the clock starts, and written there when it is absent).
    The drawn images are drawn and scored a round at a time (`_drawn`). The extractors wait on the CPU
    between evaluations and run on the training device during one.

    Args:
        dataset: the held-out image-caption dataset (data.StreamingImageCaptions).
        num_samples: captions drawn and scored per evaluation (over all ranks).
        drawer: a SampleImages without an interval, whose prompts this fills with the captions.
        fid: torchmetrics' FID, or None; fid_comparable: whether it runs InceptionV3's FID weights.
        clip: PerImageCLIPScore, or None.
        real_stats: the --fid_real_stats file, or None; stats_from: what it must be computed from
            (`fid_stats.describe`).
    """

    def __init__(self, dataset: Any, num_samples: int, drawer: Any, fid: Any, fid_comparable: bool, clip: Any,
                 real_stats: str | None = None, stats_from: dict[str, Any] | None = None):
        self.dataset, self.num_samples, self.drawer = dataset, num_samples, drawer
        self.fid, self.fid_comparable, self.clip = fid, fid_comparable, clip
        self.real_stats, self.stats_from = real_stats, stats_from
        self._mine: list[int] | None = None
        self._real_ready = False  # the real images' FID states hold every held-out image's features

    def read_stats(self) -> None:
        """The real images' FID statistics from --fid_real_stats when it exists (checked against the run
        at set-up already): read before the run's clock starts, as MLPerf's SD2 reference reads COCO's from
        the file it ships. The totals go to rank 0 (compute() sums the ranks' states)."""
        if self.fid is None or not self.real_stats or not Path(self.real_stats).is_file() or self._real_ready:
            return
        states = fid_stats.read(self.real_stats, self.stats_from, int(self.fid.real_features_sum.shape[0]))
        for key, value in states.items():
            setattr(self.fid, key, value if dist.get_global_rank() == 0 else torch.zeros_like(value))
        self._real_ready = True

    def _read_held_out(self, state: State) -> None:
        """This rank's captions and, unless read from the file, the real images' FID features, streamed
        through the extractor in chunks of SCORED_PER_CALL (only the features are kept), and written to
        --fid_real_stats when it names a new file. At the first evaluation, every rank at once: touching
        the held-out data is on the clock (MLPerf: the clock starts before the dataset is touched)."""
        rank, world = dist.get_global_rank(), dist.get_world_size()
        self._mine = list(range(rank, self.num_samples, world))
        images_needed = self.fid is not None and not self._real_ready
        if rank == 0 and images_needed:
            print(f"reading {self.num_samples:,} held-out images for FID's reference statistics (once)", flush=True)
        device = state.device.tensor_to_device(torch.empty(0)).device
        if images_needed:
            self.fid.to(device)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for begin in range(0, len(self._mine), SCORED_PER_CALL):
                chunk, images = self._mine[begin:begin + SCORED_PER_CALL], []
                for i in chunk:
                    source = i
                    if images_needed:  # an undecodable sample is replaced by the next, as for the loss
                        item = self.dataset.get_item(i)
                        images.append(item["image"])
                        source = int(item["sample_index"])
                    self.drawer.prompts[i] = self.dataset.read_sample(source)[self.dataset.caption_key]
                if images:
                    self.fid.update(torch.stack(images).to(device), real=True)
        if not images_needed:
            return
        self._real_ready = True
        self._stop_unless_finite(("real_features_sum", "real_features_cov_sum"), state, "held-out images")
        if self.real_stats:
            totals = {key: getattr(self.fid, key).clone() for key in fid_stats.REAL_STATES}
            if world > 1:
                for value in totals.values():
                    dist.all_reduce(value, reduce_operation="SUM")
            if rank == 0:
                fid_stats.write(self.real_stats, totals, self.stats_from)
                print(f"FID's reference statistics written to {self.real_stats} (later runs read them)", flush=True)

    def _drawn(self, state: State) -> Iterator[tuple[list[int], list[np.ndarray]]]:
        """This rank's captions and their drawn images, DRAWN_PER_ROUND at a time, so that an evaluation
        holds one round of images, not the rank's share (23.6 GB at MLPerf's 30,000 at 512 px on one
        device). A denoiser sharded by FSDP draws the share in one call: `SampleImages.draw` pads every
        call to the largest share so that the ranks' weight gathers pair up, and a rank with no caption
        must still call it."""
        from torch.distributed.fsdp import FSDPModule

        # --fsdp shards only the denoiser, so any FSDP module in the model is the denoiser's (read from the
        # whole model: eval/ may not import train/'s unwrap_model).
        if any(isinstance(module, FSDPModule) for module in state.model.modules()):
            yield self._mine, self.drawer.draw(state, self._mine)
            return
        for begin in range(0, len(self._mine), DRAWN_PER_ROUND):
            part = self._mine[begin:begin + DRAWN_PER_ROUND]
            yield part, self.drawer.draw(state, part)

    def _stop_unless_finite(self, keys: tuple[str, ...], state: State, what: str) -> None:
        """Stop every rank at once, in one line, when any rank's FID features of `what` hold NaN or
        infinity: they would reach the matrix square root, which crashes in oneMKL on such input."""
        finite = all(bool(torch.isfinite(getattr(self.fid, key)).all()) for key in keys)
        flag = state.device.tensor_to_device(torch.tensor([0 if finite else 1], dtype=torch.uint8))
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, reduce_operation="MAX")
        if int(flag.item()):
            fail(f"--fid_weights: the extractor returned NaN or infinite features for the {what} at batch "
                 f"{int(state.timestamp.batch)}; FID is not computed from them (check the extractor, or the images)")

    def measure(self, state: State) -> dict[str, Any]:
        """Draw this rank's captions and score every rank's images: {"fid", "clip_score", ...} (the
        same numbers on every rank)."""
        start = time.perf_counter()
        if self._mine is None:
            self._read_held_out(state)
        if dist.get_global_rank() == 0:  # minutes at MLPerf's 30,000 captions: say what the pause is
            print(f"drawing and scoring {self.num_samples:,} held-out captions for "
                  f"{' and '.join(name for name, on in (('FID', self.fid), ('CLIP score', self.clip)) if on)} "
                  f"({dist.get_world_size()} rank(s), each its share)", flush=True)
        device = state.device.tensor_to_device(torch.empty(0)).device
        scores: dict[str, Any] = {"image_samples": self.num_samples}
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for metric in (self.fid, self.clip):
                if metric is not None:
                    metric.to(device)
            for part, drawn in self._drawn(state):
                captions = [self.drawer.prompts[i] for i in part]
                for begin in range(0, len(drawn), SCORED_PER_CALL):
                    fake = torch.from_numpy(np.stack(drawn[begin:begin + SCORED_PER_CALL])).permute(0, 3, 1, 2)
                    fake = fake.contiguous().to(device)
                    if self.fid is not None:
                        self.fid.update(fake, real=False)
                    if self.clip is not None:
                        self.clip.update(fake, captions[begin:begin + SCORED_PER_CALL])
            if self.fid is not None:
                self._stop_unless_finite(("fake_features_sum", "fake_features_cov_sum"), state, "drawn images")
                scores["fid"] = float(self.fid.compute())
                self.fid.reset()  # the generated images' states; the real ones are kept
                self.fid.to("cpu")
            if self.clip is not None:
                scores["clip_score"] = float(self.clip.compute())
                self.clip.reset()
                self.clip.to("cpu")
                if not np.isfinite(scores["clip_score"]):  # the same on every rank: every rank stops
                    fail(f"--clip_model: the CLIP score at batch {int(state.timestamp.batch)} is not finite (NaN "
                         "or infinite embeddings); check the model")
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
    if settings.fid_real_stats is not None and settings.fid_weights is None:
        fail(f"--fid_real_stats {settings.fid_real_stats} needs --fid_weights (the network its statistics are of)")
    if settings.fid_real_stats is not None:
        fid_stats.check_location(settings.fid_real_stats)
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
