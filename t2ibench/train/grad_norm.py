"""The gradient's global L2 norm once per optimizer step, before clipping (`grad_norm` in every run's
summary and results JSON; a non-finite one stops the run, t2ibench.callbacks.nonfinite_loss), and
`--grad_clip_norm`'s clipping with that same norm. What the key means: docs/metrics.md."""
from __future__ import annotations

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger


def trained_parameters(state: State) -> list[torch.Tensor]:
    """The parameters the optimizers step: the fp32 weights under t2ibench.train.weight_casts too, sharded
    (DTensors) under FSDP."""
    return [p for optimizer in state.optimizers for group in optimizer.param_groups for p in group["params"]]


def gradient_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of `params`' gradients as one vector, on their device: torch's multi-tensor
    norm (a few launches, no host sync). Under FSDP a DTensor holding this rank's part
    (`global_value` makes it the whole gradient's)."""
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def global_value(norm: torch.Tensor) -> float:
    """A norm from `gradient_norm` as a number, reduced over the ranks when it is sharded (a
    collective under FSDP: every rank calls it, and every rank gets the same value)."""
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor's: its shards reduced
    return float(full_tensor() if full_tensor is not None else norm)


class GradientNorm(Algorithm):
    """At AFTER_TRAIN_BATCH (the step's gradients complete, before the optimizer) keep the norm; with
    `clip_norm`, scale the gradients to at most that norm with it.

    One algorithm for both, not Composer's GradientClipping beside a norm of our own: Composer
    0.32.1's computes the norm with `torch.nn.utils.clip_grad_norm_` and drops it, so a run that
    clips would read every gradient twice. torch's `clip_grad_norm_` is `get_total_norm` followed by
    `clip_grads_with_norm_`, the two calls made here: the clipping is Composer's, to the bit, on the
    same gradients (the optimizer's parameters are the denoiser's, the only ones with gradients).
    The norm stays a device tensor (`last_norm` reads it): `StopOnNonFiniteLoss` reads each step's
    before the optimizer steps, where Composer's closure syncs anyway (t2ibench.callbacks.nonfinite_loss)."""

    def __init__(self, clip_norm: float | None = None):
        self.clip_norm = clip_norm
        self._norm: torch.Tensor | None = None

    def match(self, event: Event, state: State) -> bool:
        return event == Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        params = trained_parameters(state)
        norm = gradient_norm(params)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_norm, norm)
        self._norm = norm.detach()

    def last_norm(self) -> float | None:
        """The last step's norm before clipping (None before the first step); every rank calls it
        (see `global_value`)."""
        return None if self._norm is None else global_value(self._norm)
