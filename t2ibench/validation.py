"""MLPerf's validation loss at 8 fixed timesteps, as a torchmetrics Metric Composer's evaluator sums
over ranks, and the evaluator that computes it; how the timesteps and noise are fixed:
docs/metrics.md, "Validation loss".
"""
from __future__ import annotations

import torch
from composer import Evaluator
from torch.utils.data import DataLoader
from torchmetrics import Metric

NUM_VALIDATION_TIMESTEPS = 8
EVAL_LABEL = "eval"  # the Evaluator's label: Composer logs metrics/eval/ValidationLoss too


def held_out_read(available: int, eval_samples: int | None) -> int:
    """The held-out samples an evaluation reads: all `available`, or the first --eval_samples of them."""
    return min(available, eval_samples or available)


def validation_timestep_index(sample_index: torch.Tensor) -> torch.Tensor:
    """k in 0..7 for each held-out sample: its index mod 8 (balanced when the set is a multiple of 8)."""
    return sample_index.long() % NUM_VALIDATION_TIMESTEPS


def validation_noise(sample_index: torch.Tensor, shape: tuple[int, ...] | torch.Size, seed: int = 0) -> torch.Tensor:
    """Standard normal noise of `shape` per sample (B, *shape), fixed by (seed, sample index), on the CPU.

    One small generator per sample: the draw of sample i never depends on which rank or batch it is in.
    """
    rows = []
    for i in sample_index.tolist():
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(i))
        rows.append(torch.randn(tuple(shape), generator=g))
    return torch.stack(rows)


class ValidationLoss(Metric):
    """Mean validation loss over samples, and per fixed timestep (sums and counts, summed over ranks).

    `update(errors, k)`: per-sample losses and their timestep indices. `compute()`: the mean over
    all samples (MLPerf's figure). `per_timestep()`: the mean at each k (None where no sample).
    """

    full_state_update = False

    def __init__(self, num_timesteps: int = NUM_VALIDATION_TIMESTEPS, **kwargs):
        super().__init__(**kwargs)
        self.num_timesteps = num_timesteps
        self.add_state("sums", default=torch.zeros(num_timesteps, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", default=torch.zeros(num_timesteps, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, errors: torch.Tensor, timestep_index: torch.Tensor) -> None:
        index = timestep_index.long().to(self.sums.device)
        self.sums.index_add_(0, index, errors.detach().double().to(self.sums.device))
        self.counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))

    def compute(self) -> torch.Tensor:
        return self.sums.sum() / self.counts.sum().clamp(min=1)

    def per_timestep(self) -> list[float | None]:
        return [(s / c) if c else None for s, c in zip(self.sums.tolist(), self.counts.tolist())]


def validation_evaluator(loader: DataLoader, microbatch: int | float | str | None, eval_samples: int | None,
              global_batch_size: int, capped: bool) -> Evaluator:
    """Composer's evaluator of the validation loss on the held-out `loader`, at the training microbatch
    (when it is a number). `capped`: --eval_samples caps held-out shards at whole global batches
    (synthetic held-out sets are already that many samples)."""
    batches = -(-eval_samples // global_batch_size) if capped and eval_samples else -1
    return Evaluator(label=EVAL_LABEL, dataloader=loader, metric_names=["ValidationLoss"],
                     device_eval_microbatch_size=microbatch if isinstance(microbatch, int) else None,
                     subset_num_batches=batches)
