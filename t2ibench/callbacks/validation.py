"""Log MLPerf's validation loss at 8 fixed timesteps every `--eval_interval` (with FID and CLIP score when
their files are given), and stop the run at the first evaluation that meets every target given
(`--eval_target`, `--fid_target`, `--clip_target`: MLPerf's run stop), timed as MLPerf times it. What it
logs and keeps: docs/metrics.md, "Validation loss", "FID and CLIP score" and "Time to target".
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger, WandBLogger
from composer.utils import dist

from t2ibench.callbacks.samples import SampleImages
from t2ibench.callbacks.throughput import Pauses
from t2ibench.core.errors import fail
from t2ibench.eval import fid_stats
from t2ibench.eval.image_metrics import ImageQuality, load_clip, load_fid
from t2ibench.eval.validation import EVAL_LABEL, ValidationLoss, held_out_read

# The x axis of the validation curve in W&B: samples trained over all ranks (MLPerf counts samples).
SAMPLES_KEY = "eval/samples_trained"


class ValidationLog(Callback):
    """Log and keep the validation loss of every evaluation (and FID and CLIP score with `images`);
    record its seconds in `pauses`; with targets, stop training at the end of the first evaluation
    that meets all of them.

    Every rank computes the same loss from the sums and counts of all ranks (one all-reduce), so
    every rank decides alike and stops at the same batch.

    Args:
        pauses: the run's Pauses (Throughput leaves them out of the measured time).
        target: the validation loss a run aims for (MLPerf Flux.1: 0.586), or None.
        images: the FID and CLIP score of images drawn at each evaluation, or None.
        fid_target, clip_target: at or under that FID, at or over that CLIP score (MLPerf SD2: 90, 15).
    """

    def __init__(self, pauses: Pauses, target: float | None = None, images: ImageQuality | None = None,
                 fid_target: float | None = None, clip_target: float | None = None):
        self.pauses, self.target, self.images = pauses, target, images
        self.fid_target, self.clip_target = fid_target, clip_target
        self.history: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None
        self._start = 0.0
        self._fit_start = 0.0
        self._trained_before = 0.0  # training seconds of earlier runs of a resumed job
        self._elapsed_before = 0.0  # their seconds from the start of training, evaluations included

    @classmethod
    def for_run(cls, settings: Any, pauses: Pauses, images: ImageQuality | None) -> ValidationLog:
        """The run's log, with its targets (benchmark.py's Settings)."""
        return cls(pauses, settings.eval_target, images, settings.fid_target, settings.clip_target)

    @property
    def last_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None

    def fit_start(self, state: State, logger: Logger) -> None:
        # After the set-up (model, data, the run record's checks, the buckets' FLOP counts at the
        # throughput callback's FIT_START) and the --fid_real_stats file: off the clock, as MLPerf's run
        # start follows initialization (its SD2 reference reads COCO's FID statistics from a file it ships).
        if self.images is not None:
            self.images.read_stats()
        self._fit_start = time.perf_counter()
        if self.reached is not None:
            state.stop_training()  # a retried job whose run had reached its target: nothing more to train
        if dist.get_global_rank() == 0 and any(isinstance(d, WandBLogger) for d in logger.destinations):
            import wandb
            if wandb.run is not None:  # the curve against samples trained, not Composer's batch step
                wandb.define_metric(SAMPLES_KEY)
                wandb.define_metric("eval/*", step_metric=SAMPLES_KEY)

    def eval_start(self, state: State, logger: Logger) -> None:
        self._start = time.perf_counter()

    def eval_end(self, state: State, logger: Logger) -> None:
        metric = state.eval_metrics.get(EVAL_LABEL, {}).get("ValidationLoss")
        if not isinstance(metric, ValidationLoss):
            return
        # Composer's compute() syncs the metric only for the moment it computes: the states here are
        # this rank's, summed over the ranks once (MLPerf's loss is the mean over every rank's samples).
        sums = torch.stack([metric.sums.detach().double(), metric.counts.detach().double()])
        sums = state.device.tensor_to_device(sums)
        if dist.get_world_size() > 1:
            dist.all_reduce(sums, reduce_operation="SUM")
        sums = sums.cpu()
        counts = sums[1]
        if not counts.sum() > 0:  # the same on every rank: every rank stops here
            fail(f"the evaluation at batch {int(state.timestamp.batch)} scored no held-out sample on any rank "
                 "(--eval_remote/--eval_local, --eval_samples): give held-out data of at least one global batch")
        loss = float(sums[0].sum() / counts.sum())
        per_timestep = [float(s / c) if c else None for s, c in zip(sums[0].tolist(), counts.tolist())]
        batch, samples = int(state.timestamp.batch), int(state.timestamp.sample)
        if self.history and self.history[-1]["batch"] == batch:
            self.pauses.record(self._start, time.perf_counter() - self._start)
            return  # a retried job's evaluation of the weights its checkpoint already scored
        scores = self.images.measure(state) if self.images is not None else {}  # every rank, at once
        seconds = time.perf_counter() - self._start
        self.pauses.record(self._start, seconds)
        entry = {"batch": batch, "samples_trained": samples, "loss": loss, "per_timestep": per_timestep,
                 "held_out_samples": int(counts.sum()), **scores, "seconds": seconds,
                 "training_seconds": self.training_seconds(), "elapsed_seconds": self.elapsed_seconds()}
        self.history.append(entry)
        metrics = {"eval/loss": loss, "eval/seconds": seconds, SAMPLES_KEY: samples}
        metrics.update({f"eval/loss_t{k}": value for k, value in enumerate(per_timestep) if value is not None})
        metrics.update({f"eval/{key}": scores[key] for key in ("fid", "clip_score") if key in scores})
        if self.target is not None:
            metrics["eval/target"] = self.target  # a flat line beside the curve
        logger.log_metrics(metrics, step=batch)
        if self.has_target and self.reached is None and self.meets_targets(entry):
            self.reached = entry
            # MLPerf's run stop: this batch's checkpoint is still written (Composer's final one).
            state.stop_training()

    @property
    def has_target(self) -> bool:
        return any(target is not None for target in (self.target, self.fid_target, self.clip_target))

    def meets_targets(self, entry: dict[str, Any]) -> bool:
        """Whether an evaluation meets every target given (MLPerf SD2's FID and CLIP together)."""
        return ((self.target is None or entry["loss"] <= self.target)
                and (self.fid_target is None or entry["fid"] <= self.fid_target)
                and (self.clip_target is None or entry["clip_score"] >= self.clip_target))

    def training_seconds(self) -> float:
        """Seconds of this job's fit so far, evaluations and sample grids left out, plus earlier jobs'."""
        now = time.perf_counter()
        elapsed = now - self._fit_start if self._fit_start else 0.0
        return self._trained_before + elapsed - self.pauses.seconds_within(self._fit_start, now)

    def elapsed_seconds(self) -> float:
        """Seconds from the start of training to now, evaluations and everything else included (MLPerf's
        clock), plus earlier jobs' (the time between a kill and its resume is not counted)."""
        return self._elapsed_before + (time.perf_counter() - self._fit_start if self._fit_start else 0.0)

    def summary(self) -> dict[str, Any]:
        """What the results JSON keeps: the last loss, the history, the target and when it was reached."""
        reached, last = self.reached, self.history[-1] if self.history else {}
        return {"eval_loss": self.last_loss, "eval_history": self.history, "eval_target": self.target,
                "fid_target": self.fid_target, "clip_target": self.clip_target,
                "fid": last.get("fid"), "clip_score": last.get("clip_score"),
                **(self.images.summary() if self.images is not None else {}),
                "eval_target_reached": reached,
                "eval_seconds": sum(entry["seconds"] for entry in self.history),
                "converged": reached is not None if self.has_target else None,
                "samples_to_target": reached["samples_trained"] if reached else None,
                "time_to_target_s": reached["elapsed_seconds"] if reached else None,
                "training_seconds_to_target": reached["training_seconds"] if reached else None}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "reached": self.reached, "trained_seconds": self.training_seconds(),
                "elapsed_seconds": self.elapsed_seconds()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.reached = list(state["history"]), state["reached"]
        self._trained_before = float(state["trained_seconds"])
        # Checkpoints written before the clock was kept have only the training seconds.
        self._elapsed_before = float(state.get("elapsed_seconds", state["trained_seconds"]))


def describe(r: dict) -> str:
    """The summary's validation line(s) from the results (empty without an evaluation)."""
    if r.get("eval_loss") is None:
        return ""
    count = len(r["eval_history"])
    text = (f"eval loss    {r['eval_loss']:.4f} (validation loss at 8 fixed timesteps, {count} "
            f"evaluation{'' if count == 1 else 's'}, {r['eval_seconds']:.1f} s left out of images/s)\n")
    scores = [f"FID {r['fid']:.2f}" + ("" if r.get("fid_comparable") else " (a test's extractor: not comparable "
                                       "with published FID)")] if r.get("fid") is not None else []
    scores += [f"CLIP score {r['clip_score']:.2f}"] if r.get("clip_score") is not None else []
    if scores:
        text += f"images       {', '.join(scores)} ({r['image_eval_samples']:,} held-out captions drawn)\n"
    targets = [text_of for value, text_of in ((r.get("eval_target"), f"loss <= {r.get('eval_target')}"),
                                              (r.get("fid_target"), f"FID <= {r.get('fid_target')}"),
                                              (r.get("clip_target"), f"CLIP score >= {r.get('clip_target')}"))
               if value is not None]
    if not targets:
        return text
    reached = r["eval_target_reached"]
    if not reached:
        last = r["eval_history"][-1]
        return text + (f"target       {', '.join(targets)} not reached in {last['samples_trained']:,} samples "
                       f"(converged: false; {', '.join(best_toward_targets(r))})\n")
    # Results written before the clock was kept have no time to target.
    clock = (f"time to target {r['time_to_target_s']:.1f} s (from the start of training, evaluations included; "
             if r.get("time_to_target_s") is not None else "(")
    return text + (f"target       {', '.join(targets)} reached at batch {reached['batch']}, "
                   f"{reached['samples_trained']:,} samples (all ranks): {clock}"
                   f"{reached['training_seconds']:.1f} s of training alone); the run stopped there\n")


def best_toward_targets(r: dict) -> list[str]:
    """The best figure of each target the run had, over its evaluations ('best FID 93.10'): a run to FID and
    CLIP score missed those, not a loss it never aimed at; an evaluation without the score is left out."""
    best = []
    for target, key, name, pick, shown in (("eval_target", "loss", "loss", min, ".4f"),
                                           ("fid_target", "fid", "FID", min, ".2f"),
                                           ("clip_target", "clip_score", "CLIP score", max, ".2f")):
        values = [entry.get(key) for entry in r["eval_history"] if entry.get(key) is not None]
        if r.get(target) is not None:
            best.append(f"best {name} {pick(values):{shown}}" if values else f"no {name} measured")
    return best


def image_quality(settings: Any, held_out: Any, encoders: Any, pauses: Any, average: Any) -> ImageQuality | None:
    """The run's ImageQuality (None without --fid_weights and --clip_model), its files loaded now: a
    file that does not load stops the run here, before training. Built here, not in eval/image_metrics.py:
    its drawer is the sampling callback, and eval/ may not import callbacks/. `held_out`: the held-out dataset;
    `encoders`: the parts that encode captions and decode latents; `average`: the run's EMA or None."""
    if settings.fid_weights is None and settings.clip_model is None:
        return None
    fid, comparable = load_fid(settings.fid_weights, settings.image_size) if settings.fid_weights else (None, False)
    clip = load_clip(settings.clip_model, settings.image_size) if settings.clip_model else None
    num_samples = settings.image_eval_samples or held_out_read(held_out.num_samples, settings.eval_samples)
    stats_from = None
    if settings.fid_real_stats is not None:
        stats_from = fid_stats.describe(fid_stats.file_sha256(settings.fid_weights), settings.image_size, num_samples)
        if Path(settings.fid_real_stats).is_file():  # refused now, before training, when it does not fit the run
            fid_stats.read(settings.fid_real_stats, stats_from, int(fid.real_features_sum.shape[0]))
    drawer = SampleImages(settings.family, [""] * num_samples, "", None, encoders=encoders, height=settings.image_size,
                          width=settings.image_size, pauses=pauses, average=average, sampler=settings.sampler,
                          num_steps=settings.sample_steps, guidance_scale=settings.guidance_scale, seed=settings.seed)
    return ImageQuality(held_out, num_samples, drawer, fid, comparable, clip, settings.fid_real_stats, stats_from)
