"""Cast the denoiser's weights to bf16 once per optimizer step instead of in every microbatch
(`--weight_casts`): fewer kernel launches in launch-bound steps, the same numbers as autocast with
one microbatch per step. How and when it applies: docs/speed.md, "Launch-bound steps".
"""
from __future__ import annotations

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger

WEIGHT_CASTS = ("microbatch", "step")  # what a run applies
WEIGHT_CAST_CHOICES = ("auto", *WEIGHT_CASTS)  # --weight_casts; auto: step on one CUDA device under amp_bf16


def resolve_weight_casts(mode: str, *, on_gpu: bool, precision: str, world_size: int) -> str:
    """`auto` made concrete: step on one CUDA device under bf16 autocast, else microbatch."""
    if mode != "auto":
        return mode
    return "step" if on_gpu and precision == "amp_bf16" and world_size == 1 else "microbatch"


def weight_casts_problem(mode: str, *, precision: str, world_size: int) -> str | None:
    """Why `--weight_casts step` cannot run with these settings (None when it can)."""
    if mode != "step":
        return None
    if precision != "amp_bf16":
        return (f"--weight_casts step needs --precision amp_bf16 (this run is {precision}); "
                "pass --weight_casts microbatch")
    if world_size > 1:
        return (f"--weight_casts step runs on a single device (this run has {world_size} ranks: DDP and FSDP "
                "cast their own weights); pass --weight_casts microbatch")
    return None


class CastWeightsOncePerStep(Algorithm):
    """The denoiser computes with bf16 copies of its weights, refreshed once per optimizer step."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.module, self.dtype = module, dtype
        # (owner module, attribute name, fp32 parameter): where each trainable weight lives.
        self._slots = [(owner, name, param) for owner in module.modules()
                       for name, param in owner._parameters.items()
                       if param is not None and param.requires_grad and param.dtype == torch.float32]
        self._copies: list[torch.nn.Parameter] = []
        self._swapped = False

    def match(self, event: Event, state: State) -> bool:
        # Composer runs gradient clipping and the optimizer step after AFTER_TRAIN_BATCH: by then the
        # fp32 weights are back in place and hold the step's gradients.
        return event in (Event.BEFORE_TRAIN_BATCH, Event.AFTER_TRAIN_BATCH)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.BEFORE_TRAIN_BATCH:
            self.begin_step()
        else:
            self.end_step()

    @property
    def num_tensors(self) -> int:
        return len(self._slots)

    def begin_step(self) -> None:
        """Refresh the copies from the fp32 weights and compute with them until `end_step`."""
        masters = [param for _, _, param in self._slots]
        if self._swapped:  # a retried batch (Composer's OOM search): the copies are still in place
            self._put(masters)
        if not self._copies or self._copies[0].device != masters[0].device:
            # Allocated once (the parameters may have moved to the GPU since __init__) and refreshed in
            # place: stable addresses for CUDA graphs and no allocation per step.
            self._copies = [torch.nn.Parameter(torch.empty_like(p, dtype=self.dtype)) for p in masters]
        with torch.no_grad():
            torch._foreach_copy_(self._copies, masters)
        for copy in self._copies:
            copy.grad = None
        self._put(self._copies)
        self._swapped = True

    def end_step(self) -> None:
        """Put the fp32 weights back with the step's gradients (upcast), free the bf16 gradients."""
        if not self._swapped:
            return
        masters = [param for _, _, param in self._slots]
        self._put(masters)
        self._swapped = False
        pairs = [(master, copy.grad) for master, copy in zip(masters, self._copies) if copy.grad is not None]
        if pairs:
            grads = [torch.empty_like(master) for master, _ in pairs]
            torch._foreach_copy_(grads, [low for _, low in pairs])
            for (master, _), grad in zip(pairs, grads):
                master.grad = grad if master.grad is None else master.grad.add_(grad)
        for copy in self._copies:
            copy.grad = None

    def _put(self, params: list[torch.nn.Parameter]) -> None:
        # Plain attribute replacement in `_parameters`: what torch.func.functional_call does, kept for
        # the whole step so that activation checkpointing's recomputation (in backward, after the
        # forward has returned) also finds the bf16 copies.
        for (owner, name, _), param in zip(self._slots, params):
            owner._parameters[name] = param
