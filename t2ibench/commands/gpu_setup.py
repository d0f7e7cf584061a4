"""The set-up the GPU defaults pick (`--activation_checkpointing auto`): the largest microbatch that
fits without activation checkpointing, or the largest that fits with it, whichever is predicted to
train more images per second. What fits is the memory model's count (`t2ibench.memory.plan`); the
time a microbatch takes is its kernel launches (`t2ibench.memory.kernels`) plus its arithmetic, with one more
forward of the denoiser when it is recomputed; on several GPUs the step adds its collectives
(`t2ibench.train.parallel.traffic_bytes_per_gpu`: under FSDP every microbatch gathers the weights again,
so fewer, larger microbatches send less). The rule and its derivation from the H100 measurements:
docs/speed.md, "The default set-up on a GPU".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from t2ibench.core import devices
from t2ibench.memory import kernels
from t2ibench import memory
from t2ibench.families import family_of
from t2ibench.train.parallel import traffic_bytes_per_gpu
from t2ibench.datasets.precomputed import TEXT_STATES, batch_text_format

# The GPU time one kernel launch adds to a step, counted in the FLOPs the step would have computed
# in that time. Fitted to the H100 runs of 2026-11-26 (docs/speed.md): SDXL at 1024, microbatch 2
# without checkpointing against 32 with it, gives 7.4e9; SD2 at 512, 32 without against 128 with,
# 6.9e9; this is their mean. About 17-21 us at the 350-430 TFLOP/s those steps reach when launches
# are amortised: a fixed cost per microbatch that only a larger microbatch spreads.
LAUNCH_COST_FLOPS = 7.2e9
# Checkpointing is taken only when predicted at least this much faster: the two fits above differ
# by 6% and each measured rate by up to 5%, so a smaller predicted gain is one the data cannot tell
# from none, and the plain step (less compute, the usual set-up) stays.
MIN_CHECKPOINTING_GAIN = 1.10
# The rate the fitted H100 steps compute at once their launches are spread: SDXL 425 and SD2 353
# TFLOP/s (docs/speed.md, the cost of a launch), their mean. A second the step spends in collectives
# costs it this many FLOPs, so that the collectives' time, at the link rate of the same GPU
# (t2ibench.core.devices: an H100's NVLink 4), adds to a cost counted in FLOPs.
FITTED_FLOPS_PER_SEC = 3.9e14
# A launch's GPU time on the fitted H100, about 18 us. On another GPU (`device_rates`) a launch takes the
# same time (the host issues it) and the step computes at the fitted rate times the ratio of the two
# GPUs' dense bf16 peaks, so a launch costs more FLOPs on a faster GPU; bench/gpu/predict.py holds the
# launches' time fixed across GPUs by the same rule.
LAUNCH_SECONDS = LAUNCH_COST_FLOPS / FITTED_FLOPS_PER_SEC


def device_rates(device: devices.Device | None) -> tuple[float, float]:
    """(the FLOPs a launch costs, the FLOP/s the step computes at) on `device` (None: the fitted H100's)."""
    ref = devices.reference()
    if device is None or not device.bf16_flops_per_sec:
        return LAUNCH_COST_FLOPS, FITTED_FLOPS_PER_SEC
    rate = FITTED_FLOPS_PER_SEC * device.bf16_flops_per_sec / ref.bf16_flops_per_sec
    return LAUNCH_SECONDS * rate, rate


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One set-up the rule weighs: its microbatch (0: none fits) and its predicted cost per image."""

    activation_checkpointing: bool
    microbatch: int
    predicted_bytes: int | None = None  # the step's memory at this microbatch, context and reserve included
    kernels_per_image: float | None = None  # launches per image, the step's per-step ones spread over its batch
    flops_per_image: float | None = None  # arithmetic per image, the recomputed forward included
    traffic_bytes_per_step: float = 0.0  # what each GPU sends per step (DDP's all-reduce, FSDP's per microbatch)
    traffic_seconds_per_step: float = 0.0  # that at the GPU's link rate, not overlapped
    images_per_step: int = 1  # the per-GPU batch the step's collectives are spread over
    launch_cost_flops: float = LAUNCH_COST_FLOPS  # on the GPU weighed (device_rates)
    fitted_flops_per_sec: float = FITTED_FLOPS_PER_SEC

    @property
    def compute_flops_per_image(self) -> float | None:
        """The GPU's own time per image, in FLOPs: the launches at `launch_cost_flops` each, plus the arithmetic."""
        if self.kernels_per_image is None or self.flops_per_image is None:
            return None
        return self.kernels_per_image * self.launch_cost_flops + self.flops_per_image

    @property
    def traffic_flops_per_image(self) -> float:
        """The collectives' time per image, in the FLOPs the GPU computes in it (`fitted_flops_per_sec`)."""
        return self.traffic_seconds_per_step / self.images_per_step * self.fitted_flops_per_sec

    @property
    def cost_flops_per_image(self) -> float | None:
        """Predicted time per image, in FLOPs: the GPU's compute plus the collectives' time (none on one GPU)."""
        compute = self.compute_flops_per_image
        return None if compute is None else compute + self.traffic_flops_per_image


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run on this GPU uses: the microbatch, checkpointing, weight casts, and why."""

    microbatch: int
    activation_checkpointing: bool
    weight_casts: str
    reason: str  # which rule chose checkpointing: the flag, or `auto` and the figures it compared
    candidates: tuple[Candidate, ...] = ()  # what `auto` weighed (empty when the flag chose)

    def summary(self) -> dict[str, Any]:
        """The JSON-able choice (bench/memory.py's and bench/step_ops.py's `--json`)."""
        return {"microbatch": self.microbatch, "activation_checkpointing": self.activation_checkpointing,
                "weight_casts": self.weight_casts, "activation_checkpointing_reason": self.reason,
                "setup_candidates": [{**dataclasses.asdict(c), "compute_flops_per_image": c.compute_flops_per_image,
                                      "traffic_flops_per_image": c.traffic_flops_per_image,
                                      "cost_flops_per_image": c.cost_flops_per_image} for c in self.candidates]}


def from_flag(mode: str) -> tuple[bool, str]:
    """Checkpointing without a count, and why: "on" or "off" as the flag says; "auto" off, as on a
    CPU, where the plain step stays (the rule weighs the launches of GPU kernels)."""
    if mode == "auto":
        return False, "auto: off without CUDA"
    return mode == "on", f"--activation_checkpointing {mode}"


@functools.lru_cache(maxsize=None)
def _flops(model_config: str, image_size: int, precomputed: bool, text_format: str | None) -> dict[str, float]:
    return family_of(model_config).flops_per_image(model_config, image_size, vae=not precomputed,
                                                   text_encoders=text_format != TEXT_STATES)


@functools.lru_cache(maxsize=None)
def step_kernels(model_config: str, image_size: int, microbatch: int, per_device_batch: int, *,
                 precision: str, norm_precision: str, precomputed: bool, precomputed_format: str | None,
                 activation_checkpointing: bool, weight_casts: str, use_ema: bool) -> kernels.StepKernels:
    """`kernels.count_step_kernels`, counted once per process and set-up (seconds to half a minute)."""
    return kernels.count_step_kernels(model_config, image_size, microbatch, per_device_batch, precision=precision,
                                      norm_precision=norm_precision, precomputed=precomputed,
                                      precomputed_format=precomputed_format,
                                      activation_checkpointing=activation_checkpointing, weight_casts=weight_casts,
                                      use_ema=use_ema)


def choose_setup(model_config: str, image_size: int, gpu_memory_bytes: float, per_device_batch: int | None, *,
                 activation_checkpointing: str = "auto", microbatch: int | None = None, precision: str = "amp_bf16",
                 norm_precision: str = "autocast", precomputed: bool = False, precomputed_format: str | None = None,
                 use_ema: bool = True, fsdp: str = "none", num_gpus: int = 1, weight_casts: str = "microbatch",
                 fp8: str = "off", link_gb_per_sec: float | None = None,
                 device: devices.Device | None = None) -> Setup:
    """The set-up a run with these (resolved) settings uses on GPUs of `gpu_memory_bytes`.

    `activation_checkpointing` "on" or "off": as given, at `microbatch` or else the largest that fits.
    "auto" with a `microbatch`: on only when that microbatch does not fit without it. "auto" without
    one: the largest fitting microbatch without checkpointing and the largest with it (powers of two
    dividing `per_device_batch`; None: any): checkpointing when its predicted cost per image is
    MIN_CHECKPOINTING_GAIN times lower, else none. A cost is the launches and arithmetic, plus on
    several GPUs the collectives the step sends (`traffic_bytes_per_gpu`) at `link_gb_per_sec`
    gigabytes per second per GPU (default `device`'s link, else an H100's NVLink; a multi-node run's link
    is slower), launches and collectives costed at `device`'s rates (`device_rates`; None: the H100's). Off
    without counting the checkpointed step when even its arithmetic and one microbatch's collectives
    alone would not be that much lower, or when it fits no larger microbatch; on when nothing fits
    without it. A microbatch of 1 when nothing fits at all (the run's own OOM then says so)."""
    text_format = batch_text_format(family_of(model_config), precomputed, precomputed_format)
    options = dict(precision=precision, norm_precision=norm_precision, precomputed=precomputed,
                   precomputed_format=text_format, use_ema=use_ema, fsdp=fsdp, num_gpus=num_gpus,
                   weight_casts=weight_casts, fp8=fp8)
    link_gb_per_sec = link_gb_per_sec or (device or devices.reference()).link_gb_per_sec
    launch_cost, rate = device_rates(device)
    weighing = {**options, "link_gb_per_sec": link_gb_per_sec, "launch_cost_flops": launch_cost,
                "fitted_flops_per_sec": rate}  # what a candidate's cost takes

    def planned(checkpointing: bool) -> dict[str, Any]:
        return memory.plan(model_config, image_size, gpu_memory_bytes, per_device_batch=per_device_batch,
                           activation_checkpointing=checkpointing, **options)

    def done(checkpointing: bool, reason: str, candidates: tuple[Candidate, ...] = ()) -> Setup:
        chosen = microbatch or max(1, planned(checkpointing)["microbatch"])
        return Setup(chosen, checkpointing, weight_casts, reason, candidates)

    if activation_checkpointing != "auto":
        return done(activation_checkpointing == "on", f"--activation_checkpointing {activation_checkpointing}")
    gib = f"{memory.gib(gpu_memory_bytes):.1f} GiB"
    # What a microbatch must fit in: the device less the plan's headroom (memory.HEADROOM_FRACTION).
    usable = f"the {memory.gib(memory.usable_bytes(gpu_memory_bytes)):.1f} usable of {gib}"
    plain = planned(False)
    if microbatch is not None:
        need = memory.predicted_bytes(plain, microbatch)
        if plain["microbatch"] and need <= memory.usable_bytes(gpu_memory_bytes):
            return done(False, f"auto: microbatch {microbatch} fits without it ({memory.gib(need):.1f} of {usable})")
        return done(True, f"auto: microbatch {microbatch} does not fit without it ({memory.gib(need):.1f} of {usable})")
    without = plain["microbatch"]
    if not without:
        return done(True, f"auto: no microbatch fits without it (1 image needs "
                          f"{memory.gib(memory.predicted_bytes(plain, 1)):.1f} of {usable})")
    # Without a batch, the step's once-per-step launches are spread over the largest microbatch counted.
    batch = per_device_batch or memory.MAX_MICROBATCH
    plain_step = _weighed(model_config, image_size, batch, plain, False, weighing)
    flops = _flops(model_config, image_size, precomputed, text_format)
    # Checkpointing saves launches and collectives only: with no launch left and the fewest collectives
    # a step can send (one microbatch), its arithmetic (the forward recomputed) must still be
    # MIN_CHECKPOINTING_GAIN times cheaper than the plain step.
    fewest = Candidate(True, batch, kernels_per_image=0.0, flops_per_image=flops["total"] + flops["denoiser_fwd"],
                       **_traffic(model_config, batch, batch, weighing))
    floor = fewest.cost_flops_per_image
    if plain_step.cost_flops_per_image < MIN_CHECKPOINTING_GAIN * floor:
        sent = f" and {_gb(plain_step.traffic_bytes_per_step)} of collectives per step" \
            if plain_step.traffic_bytes_per_step else ""
        alone = " and one microbatch's collectives" if fewest.traffic_bytes_per_step else ""
        return done(False, f"auto: microbatch {without} without it: {plain_step.cost_flops_per_image / 1e12:.2f} "
                           f"TFLOP per image with its {plain_step.kernels_per_image:,.0f} launches{sent}, under "
                           f"{MIN_CHECKPOINTING_GAIN:.2f}x the {floor / 1e12:.2f} of checkpointing's arithmetic"
                           f"{alone} alone", (plain_step,))
    checkpointed = planned(True)
    if checkpointed["microbatch"] <= without:
        return done(False, f"auto: it fits no larger microbatch than {without}", (plain_step,))
    candidates = (plain_step, _weighed(model_config, image_size, batch, checkpointed, True, weighing))
    plain_step, checkpointed_step = candidates
    gain = plain_step.cost_flops_per_image / checkpointed_step.cost_flops_per_image
    launches = (f"{checkpointed_step.kernels_per_image:,.0f} against {plain_step.kernels_per_image:,.0f} launches "
                "per image")
    # Where the collectives turn the choice, the reason says so, with the choice without them.
    compute_gain = plain_step.compute_flops_per_image / checkpointed_step.compute_flops_per_image
    if (gain >= MIN_CHECKPOINTING_GAIN) != (compute_gain >= MIN_CHECKPOINTING_GAIN):
        launches += (f"; the collectives decided it: {_gb(checkpointed_step.traffic_bytes_per_step)} against "
                     f"{_gb(plain_step.traffic_bytes_per_step)} per GPU per step at {link_gb_per_sec:g} GB/s, "
                     f"{compute_gain:.2f}x without them")
    if gain >= MIN_CHECKPOINTING_GAIN:
        return done(True, f"auto: microbatch {checkpointed_step.microbatch} with it is predicted {gain:.2f}x the "
                          f"images/s of {without} without ({launches})", candidates)
    if gain > 1:
        return done(False, f"auto: microbatch {checkpointed_step.microbatch} with it is predicted only {gain:.2f}x the "
                           f"images/s of {without} without ({launches}), under the "
                           f"{MIN_CHECKPOINTING_GAIN:.2f}x it must gain", candidates)
    return done(False, f"auto: microbatch {without} without it is predicted {1 / gain:.2f}x the images/s of "
                       f"{checkpointed_step.microbatch} with ({launches})", candidates)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


def _weighed(model_config: str, image_size: int, per_device_batch: int, plan: dict[str, Any], checkpointing: bool,
             options: dict[str, Any]) -> Candidate:
    """A candidate's predicted cost: its kernels per image (counted at its microbatch) and its FLOPs."""
    microbatch = plan["microbatch"]
    # Under FSDP the denoiser computes with the bf16 weights it gathers: no weight casts per microbatch,
    # as with the copies of `--weight_casts step` (the count leaves FSDP's own collectives out).
    casts = "step" if options["weight_casts"] == "step" or options["fsdp"] != "none" else "microbatch"
    counted = step_kernels(model_config, image_size, microbatch, per_device_batch, precision=options["precision"],
                           norm_precision=options["norm_precision"], precomputed=options["precomputed"],
                           precomputed_format=options["precomputed_format"], activation_checkpointing=checkpointing,
                           weight_casts=casts, use_ema=options["use_ema"])
    flops = _flops(model_config, image_size, options["precomputed"], options["precomputed_format"])
    # Recomputation runs the denoiser's forward once more per image; the encoders run once either way.
    return Candidate(checkpointing, microbatch, memory.predicted_bytes(plan, microbatch),
                     sum(counted.per_image().values()),
                     flops["total"] + (flops["denoiser_fwd"] if checkpointing else 0.0),
                     **_traffic(model_config, microbatch, per_device_batch, options))


def _traffic(model_config: str, microbatch: int, per_device_batch: int, options: dict[str, Any]) -> dict[str, Any]:
    """A step's collectives at `microbatch`, as Candidate's fields: the bytes each GPU sends (once per
    step, and per microbatch under FSDP), their seconds at the link rate, the images they are spread
    over. Nothing on one GPU (no parameter counted)."""
    rates = dict(launch_cost_flops=options["launch_cost_flops"], fitted_flops_per_sec=options["fitted_flops_per_sec"])
    if options["num_gpus"] == 1:
        return dict(images_per_step=per_device_batch, **rates)
    units = memory.fsdp_unit_params(model_config)
    once, per_microbatch = traffic_bytes_per_gpu(options["fsdp"], options["num_gpus"], units["denoiser"],
                                                 units["root"], options["precision"])
    sent = once + -(-per_device_batch // microbatch) * per_microbatch
    return dict(traffic_bytes_per_step=sent, traffic_seconds_per_step=sent / (options["link_gb_per_sec"] * 1e9),
                images_per_step=per_device_batch, **rates)
