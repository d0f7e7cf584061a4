"""MLPerf's validation loss at 8 fixed timesteps, as a torchmetrics Metric Composer's evaluator sums
over ranks, and the evaluator that computes it; how the timesteps and noise are fixed:
docs/metrics.md, "Validation loss".
"""
from __future__ import annotations

from typing import Any

import torch
from composer import Evaluator
from composer.utils import dist
from streaming import StreamingDataset
from torch.utils.data import DataLoader, Dataset
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


class HeldOutSamples(Dataset):
    """The first `count` samples of a held-out dataset, by index: a map-style view a DistributedSampler
    splits over the ranks. A StreamingDataset read by its own iterator pads every rank to the same count
    with repeated samples, and the loaders drop each rank's last partial batch (Streaming 0.13.0); by
    index, every sample is read once and Composer drops the sampler's padding (below)."""

    def __init__(self, dataset: Any, count: int):
        self.dataset, self.count = dataset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.dataset[index]


def held_out_available(dataset: Any) -> int:
    """The samples a held-out dataset holds: a StreamingDataset's len() is one rank's share."""
    return int(dataset.num_samples) if isinstance(dataset, StreamingDataset) else len(dataset)


def held_out_loader(loader: DataLoader, eval_samples: int | None) -> DataLoader:
    """Every held-out sample the evaluation reads (`held_out_read`), exactly once over all ranks, on any
    number of ranks and at any batch size, read as `loader` reads (batch size, workers).

    Composer's DistributedSampler split: rank r reads samples r, r + W, ...; the last ranks end with one
    repeated sample when W does not divide the count, and Composer 0.32.1's evaluation loop drops it
    from the metric (`drop_last=False` with a dataset of known length: `Trainer._eval_loop`) while the
    rank still runs its forward, so every rank runs as many batches (FSDP's gathers stay paired) and a
    rank with no sample of its own waits on nobody."""
    held_out = HeldOutSamples(loader.dataset, held_out_read(held_out_available(loader.dataset), eval_samples))
    workers = loader.num_workers
    return DataLoader(held_out, batch_size=loader.batch_size, drop_last=False, num_workers=workers,
                      sampler=dist.get_sampler(held_out, shuffle=False, drop_last=False),
                      pin_memory=loader.pin_memory, persistent_workers=workers > 0,
                      prefetch_factor=loader.prefetch_factor if workers > 0 else None)


def validation_evaluator(loader: DataLoader, microbatch: int | float | str | None,
                         eval_samples: int | None) -> Evaluator:
    """Composer's evaluator of the validation loss on every held-out sample `loader`'s dataset holds
    (the first --eval_samples of them), each once, at the training microbatch (when it is a number)."""
    return Evaluator(label=EVAL_LABEL, dataloader=held_out_loader(loader, eval_samples),
                     metric_names=["ValidationLoss"],
                     device_eval_microbatch_size=microbatch if isinstance(microbatch, int) else None)
