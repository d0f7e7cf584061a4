"""Training data: the synthetic dataset of the 2023 benchmark, and (below) LAION-style MDS shards.

Every dataset yields dicts with `image` (3, S, S) float in [-1, 1] and `captions` (77,) int64
token ids, which is what `model.StableDiffusion` consumes.
"""
from __future__ import annotations

import torch
from composer.utils import dist
from torch.utils.data import DataLoader, Dataset

from tokenizer import MAX_LENGTH, VOCAB_SIZE


class SyntheticImageCaptions(Dataset):
    """Random images and random token ids: measures the model, not the data pipeline.

    Samples are generated from their index, so every epoch and every rank sees the same data for
    the same index, and no memory is spent storing them.
    """

    def __init__(self, image_size: int, num_samples: int = 100_000, seed: int = 0):
        self.image_size, self.num_samples, self.seed = image_size, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.rand(3, self.image_size, self.image_size, generator=g) * 2 - 1
        captions = torch.randint(0, VOCAB_SIZE, (MAX_LENGTH,), generator=g)
        return {"image": image, "captions": captions}


def loader_kwargs(num_workers: int) -> dict:
    """DataLoader settings of the 2023 benchmark: pinned memory, persistent workers, drop_last."""
    return dict(
        num_workers=num_workers, pin_memory=torch.cuda.is_available(), drop_last=True,
        persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers > 0 else None,
    )


def synthetic_dataloader(image_size: int, batch_size_per_device: int, num_workers: int,
                         num_samples: int = 100_000, seed: int = 0) -> DataLoader:
    """Synthetic samples, each rank reading its own shard through Composer's distributed sampler."""
    dataset = SyntheticImageCaptions(image_size, num_samples, seed)
    sampler = dist.get_sampler(dataset, shuffle=True, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size_per_device, sampler=sampler, **loader_kwargs(num_workers))
