"""The set-up the GPU defaults pick (`--activation_checkpointing auto`): the largest microbatch that
fits without activation checkpointing, or the largest that fits with it, whichever is predicted to
train more images per second. What fits is the memory model's count (`t2ibench.memory.plan`); the
time a microbatch takes is its kernel launches (`t2ibench.kernels`) plus its arithmetic, with one more
forward of the denoiser when it is recomputed. The rule and its derivation from the H100 measurements:
docs/speed.md, "The default set-up on a GPU".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from t2ibench import kernels, memory
from t2ibench.families import family_of
from t2ibench.precomputed import TEXT_STATES, batch_text_format

# The GPU time one kernel launch adds to a step, counted in the FLOPs the step would have computed
# in that time. Fitted to the H100 runs of 2026-11-26 (docs/speed.md): SDXL at 1024, microbatch 2
# without checkpointing against 32 with it, gives 7.4e9; SD2 at 512, 32 without against 128 with,
# 6.9e9; this is their mean. About 17-21 us at the 350-430 TFLOP/s those steps reach when launches
# are amortised: a fixed cost per microbatch that only a larger microbatch spreads.
LAUNCH_COST_FLOPS = 7.2e9


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One set-up the rule weighs: its microbatch (0: none fits) and its predicted cost per image."""

    activation_checkpointing: bool
    microbatch: int
    predicted_bytes: int | None = None  # the step's memory at this microbatch, context and reserve included
    kernels_per_image: float | None = None  # launches per image, the step's per-step ones spread over its batch
    flops_per_image: float | None = None  # arithmetic per image, the recomputed forward included

    @property
    def cost_flops_per_image(self) -> float | None:
        """Predicted time per image, in FLOPs: the launches at LAUNCH_COST_FLOPS each, plus the arithmetic."""
        if self.kernels_per_image is None or self.flops_per_image is None:
            return None
        return self.kernels_per_image * LAUNCH_COST_FLOPS + self.flops_per_image


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
                "setup_candidates": [{**dataclasses.asdict(c), "cost_flops_per_image": c.cost_flops_per_image}
                                     for c in self.candidates]}


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
                 fp8: str = "off") -> Setup:
    """The set-up a run with these (resolved) settings uses on GPUs of `gpu_memory_bytes`.

    `activation_checkpointing` "on" or "off": as given, at `microbatch` or else the largest that fits.
    "auto" with a `microbatch`: on only when that microbatch does not fit without it. "auto" without
    one: the largest fitting microbatch without checkpointing and the largest with it (powers of two
    dividing `per_device_batch`; None: any), the one with the lower predicted cost per image. Off,
    without counting the checkpointed step, when the plain step's launches cost less than the forward
    checkpointing recomputes (it saves launches only), or when it fits no larger microbatch; on when
    nothing fits without it. A microbatch of 1 when nothing fits at all (the run's own OOM then says so)."""
    text_format = batch_text_format(family_of(model_config), precomputed, precomputed_format)
    options = dict(precision=precision, norm_precision=norm_precision, precomputed=precomputed,
                   precomputed_format=text_format, use_ema=use_ema, fsdp=fsdp, num_gpus=num_gpus,
                   weight_casts=weight_casts, fp8=fp8)

    def planned(checkpointing: bool) -> dict[str, Any]:
        return memory.plan(model_config, image_size, gpu_memory_bytes, per_device_batch=per_device_batch,
                           activation_checkpointing=checkpointing, **options)

    def done(checkpointing: bool, reason: str, candidates: tuple[Candidate, ...] = ()) -> Setup:
        chosen = microbatch or max(1, planned(checkpointing)["microbatch"])
        return Setup(chosen, checkpointing, weight_casts, reason, candidates)

    if activation_checkpointing != "auto":
        return done(activation_checkpointing == "on", f"--activation_checkpointing {activation_checkpointing}")
    gib = f"{memory.gib(gpu_memory_bytes):.1f} GiB"
    plain = planned(False)
    if microbatch is not None:
        need = memory.predicted_bytes(plain, microbatch)
        if plain["microbatch"] and need <= gpu_memory_bytes:
            return done(False, f"auto: microbatch {microbatch} fits without it ({memory.gib(need):.1f} of {gib})")
        return done(True, f"auto: microbatch {microbatch} does not fit without it ({memory.gib(need):.1f} of {gib})")
    without = plain["microbatch"]
    if not without:
        return done(True, f"auto: no microbatch fits without it (1 image needs "
                          f"{memory.gib(memory.predicted_bytes(plain, 1)):.1f} of {gib})")
    # Without a batch, the step's once-per-step launches are spread over the largest microbatch counted.
    batch = per_device_batch or memory.MAX_MICROBATCH
    plain_step = _weighed(model_config, image_size, batch, plain, False, options)
    recomputed = _flops(model_config, image_size, precomputed, text_format)["denoiser_fwd"]
    if plain_step.kernels_per_image * LAUNCH_COST_FLOPS <= recomputed:
        # Checkpointing saves launches only; with all of them saved it would still recompute more.
        return done(False, f"auto: microbatch {without} without it; its {plain_step.kernels_per_image:,.0f} launches "
                           f"per image cost less than the forward it would recompute "
                           f"({plain_step.kernels_per_image * LAUNCH_COST_FLOPS / 1e12:.2f} against "
                           f"{recomputed / 1e12:.2f} TFLOP per image)", (plain_step,))
    checkpointed = planned(True)
    if checkpointed["microbatch"] <= without:
        return done(False, f"auto: it fits no larger microbatch than {without}", (plain_step,))
    candidates = (plain_step, _weighed(model_config, image_size, batch, checkpointed, True, options))
    slow, fast = sorted(candidates, key=lambda c: c.cost_flops_per_image, reverse=True)
    ratio = slow.cost_flops_per_image / fast.cost_flops_per_image
    reason = (f"auto: microbatch {fast.microbatch} {'with' if fast.activation_checkpointing else 'without'} it, "
              f"{fast.kernels_per_image:,.0f} launches per image, is predicted {ratio:.2f}x the images/s of "
              f"{slow.microbatch} {'with' if slow.activation_checkpointing else 'without'}, "
              f"{slow.kernels_per_image:,.0f} launches per image")
    return done(fast.activation_checkpointing, reason, candidates)


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
                     flops["total"] + (flops["denoiser_fwd"] if checkpointing else 0.0))
