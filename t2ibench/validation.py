"""MLPerf's quality measure for text-to-image training: the validation loss at fixed timesteps.

MLPerf Training's Flux.1 benchmark (v5.1) scores a run by its loss on held-out samples, each
evaluated at one of 8 fixed timesteps t = k/8, k = 0..7, with the mean over all samples as the
figure (its reference averages per timestep and weights by the counts, which is the same number);
the target is 0.586. Here sample i is evaluated at k = i mod 8 with noise drawn from a generator
seeded by i, so every evaluation of a run (and of any run on the same held-out set) scores the same
problems, whatever the number of ranks or the batch size: only the weights change the figure. The
latents are the VAE posterior's mean (not a draw), for the same reason.
(The reference draws the eval noise from the training RNG and assigns timesteps in blocks per
batch; the held-out set, timesteps and loss are the same.)

`ValidationLoss` is a torchmetrics Metric, so Composer's evaluator sums it over ranks.
"""
from __future__ import annotations

import torch
from torchmetrics import Metric

NUM_VALIDATION_TIMESTEPS = 8


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
