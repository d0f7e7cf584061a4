"""Cast the denoiser's weights to bf16 once per optimizer step instead of in every microbatch
(`--weight_casts`): fewer kernel launches in launch-bound steps, the same numbers as autocast with
one microbatch per step, the step's gradients summed in fp32 with any number. How and when it
applies: docs/speed.md, "Launch-bound steps".
"""
from __future__ import annotations

from typing import Callable

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
    """The denoiser computes with bf16 copies of its weights, refreshed once per optimizer step; the
    step's gradients are summed in fp32 whatever the number of microbatches.

    How the sum stays fp32 at the fewest kernels: the first microbatch's gradients land in the
    copies' bf16 `.grad` (AccumulateGrad takes the backward's output as it is) and are upcast into
    the fp32 weights' `.grad` with one multi-tensor copy after that backward (`after_backward`); from
    then on a post-accumulate-grad hook on each copy adds the new bf16 gradient into the fp32 one
    (one kernel, fp32 += bf16) and drops it. Per step that is the launches a bf16 sum took (one add
    per tensor from the second microbatch on, one upcast), with the sum exact to fp32 (summed in the
    copies' bf16 `.grad`, as before, it kept 8 significant bits: percents off from a few hundred
    microbatches on, docs/speed.md). It is autocast's own sum of the same bf16 gradients, bit for
    bit, with one microbatch per step or many (where every weight feeds a bf16 op). The hook, not a
    `_foreach_add_` after each backward: the hook frees each bf16 gradient as soon as backward makes
    it, so no bf16 gradients accumulate beside the fp32 ones during a backward (4 bytes per
    parameter then, not 6), and a mixed-dtype foreach add launches one kernel per tensor all the same."""

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
        # fp32 weights are back in place and hold the step's gradients. AFTER_BACKWARD follows every
        # microbatch's backward.
        return event in (Event.BEFORE_TRAIN_BATCH, Event.AFTER_BACKWARD, Event.AFTER_TRAIN_BATCH)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.BEFORE_TRAIN_BATCH:
            self.begin_step()
        elif event == Event.AFTER_BACKWARD:
            self.after_backward()
        else:
            self.end_step()

    @property
    def num_tensors(self) -> int:
        return len(self._slots)

    @property
    def masters(self) -> list[torch.nn.Parameter]:
        """The fp32 weights: the optimizer's parameters, which receive the step's gradients."""
        return [param for _, _, param in self._slots]

    def begin_step(self) -> None:
        """Refresh the copies from the fp32 weights and compute with them until `end_step`."""
        masters = self.masters
        if self._swapped:  # a retried batch (Composer's OOM search): the copies are still in place
            self._put(masters)
        if not self._copies or self._copies[0].device != masters[0].device:
            # Allocated once (the parameters may have moved to the GPU since __init__) and refreshed in
            # place: stable addresses for CUDA graphs and no allocation per step.
            self._copies = [torch.nn.Parameter(torch.empty_like(p, dtype=self.dtype)) for p in masters]
            for master, copy in zip(masters, self._copies):
                copy.register_post_accumulate_grad_hook(_add_into(master))
        with torch.no_grad():
            torch._foreach_copy_(self._copies, masters)
        for copy in self._copies:
            copy.grad = None
        self._put(self._copies)
        self._swapped = True

    def after_backward(self) -> None:
        """Upcast the gradients still in bf16 (the step's first backward's) into the fp32 weights'
        `.grad`, where the later microbatches' hooks add theirs."""
        pending = [(master, copy) for master, copy in zip(self.masters, self._copies) if copy.grad is not None]
        if not pending:
            return
        grads = [torch.empty_like(master) for master, _ in pending]
        torch._foreach_copy_(grads, [copy.grad for _, copy in pending])
        for (master, copy), grad in zip(pending, grads):
            # A master with a gradient already (none under Composer, which zeroes them after
            # BEFORE_TRAIN_BATCH) keeps it and adds this one, as autocast's AccumulateGrad would.
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            copy.grad = None

    def end_step(self) -> None:
        """Put the fp32 weights back, holding the step's gradients in fp32."""
        if not self._swapped:
            return
        self.after_backward()  # for a caller without Composer's AFTER_BACKWARD (a test's own loop)
        self._put(self.masters)
        self._swapped = False

    def _put(self, params: list[torch.nn.Parameter]) -> None:
        # Plain attribute replacement in `_parameters`: what torch.func.functional_call does, kept for
        # the whole step so that activation checkpointing's recomputation (in backward, after the
        # forward has returned) also finds the bf16 copies.
        for (owner, name, _), param in zip(self._slots, params):
            owner._parameters[name] = param


def _add_into(master: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of `master`'s bf16 copy: once `master` holds an fp32 gradient
    (from the step's second microbatch on), add the copy's new gradient into it and free it."""

    def hook(copy: torch.Tensor) -> None:
        if master.grad is None:  # the step's first backward: upcast all at once by after_backward
            return
        master.grad.add_(copy.grad)
        copy.grad = None

    return hook
