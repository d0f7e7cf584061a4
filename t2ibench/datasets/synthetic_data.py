"""Synthetic training data: random images or latents and captions generated from each sample's index
(the same sample for an index on every rank, epoch and restart, nothing stored), and the DataLoader
settings every loader shares. What each yields: docs/data.md. data.py (the root command's module)
re-exports these under the 2023 benchmark's names."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from composer.utils import dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from t2ibench.datasets.buckets import Bucket, synthetic_bucket
from t2ibench.families import ModelFamily
from t2ibench.families.family import TEXT_STATES_KEY
from t2ibench.families.sd2 import LATENT_SCALE as SD2_LATENT_SCALE
from t2ibench.core.images import CROP_KEY, ORIGINAL_SIZE_KEY, ImageGeometry
from t2ibench.datasets.precomputed import DEFAULT_FAMILY, TEXT_FORMATS, TEXT_STATES, TOKENS
from t2ibench.core.tokenizer import MAX_LENGTH


def geometry_tensors(geometry: ImageGeometry) -> dict[str, torch.Tensor]:
    """The batch entries of one image's geometry (GEOMETRY_KEYS)."""
    return {ORIGINAL_SIZE_KEY: torch.tensor([geometry.original_height, geometry.original_width]),
            CROP_KEY: torch.tensor([geometry.crop_top, geometry.crop_left])}



def sample_generator(seed: int, index: int) -> torch.Generator:
    """The generator of synthetic sample `index`: the same sample for an index on every rank and epoch."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticImageCaptions(Dataset):
    """Random images and random token ids: measures the model, not the data pipeline.

    Samples are generated from their index, so every epoch and every rank sees the same data for
    the same index, and no memory is spent storing them.
    """

    def __init__(self, image_size: int, num_samples: int = 100_000, seed: int = 0, family: ModelFamily | None = None,
                 config: str | None = None):
        self.image_size, self.num_samples, self.seed = image_size, num_samples, seed
        self.family = family or DEFAULT_FAMILY
        self.config = config or self.family.configs[0]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = sample_generator(self.seed, index)
        image = torch.randint(0, 256, (3, self.image_size, self.image_size), generator=g, dtype=torch.uint8)
        item = {"image": image, **self.family.random_text_inputs(g, self.config), "sample_index": torch.tensor(index)}
        if self.family.micro_conditioning:  # generated at the training size: nothing was resized or cropped
            item.update(geometry_tensors(ImageGeometry(self.image_size, self.image_size, 0, 0)))
        return item


def loader_kwargs(num_workers: int) -> dict:
    """DataLoader settings of the 2023 benchmark: pinned memory, persistent workers, drop_last."""
    return dict(
        num_workers=num_workers, pin_memory=torch.cuda.is_available(), drop_last=True,
        persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers > 0 else None,
    )


class SyntheticBucketedImages(SyntheticImageCaptions):
    """Synthetic samples in aspect-ratio buckets: indexed by (sample index, bucket position), which
    `BucketBatchSampler` hands out, one bucket a batch. An image of the bucket's size, uncropped."""

    def __init__(self, buckets: tuple[Bucket, ...], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.buckets = buckets

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        index, position = key
        bucket = self.buckets[position]
        g = sample_generator(self.seed, index)
        image = torch.randint(0, 256, (3, bucket.height, bucket.width), generator=g, dtype=torch.uint8)
        item = {"image": image, **self.family.random_text_inputs(g, self.config), "sample_index": torch.tensor(index)}
        if self.family.micro_conditioning:
            item.update(geometry_tensors(ImageGeometry(bucket.height, bucket.width, 0, 0)))
        return item


class BucketBatchSampler(DistributedSampler):
    """Composer's distributed sampler (each rank its shard of the shuffled indices), handing out batches
    of `batch_size` indices, each batch paired with a bucket drawn from `weights` (`buckets.synthetic_bucket`:
    the same on every rank at every step).

    A DistributedSampler itself, so that Composer sets its epoch (it looks for one as the loader's
    batch sampler too) and spins it to a resumed batch like any sampler."""

    def __init__(self, dataset: Dataset, batch_size: int, weights: tuple[float, ...], shuffle: bool = True,
                 draw_seed: int = 0):
        # The shuffle's seed is Composer's get_sampler default (0), as the square synthetic loader's.
        super().__init__(dataset, num_replicas=dist.get_world_size(), rank=dist.get_global_rank(), shuffle=shuffle,
                         seed=0, drop_last=True)
        self.batch_size, self.weights, self.draw_seed = batch_size, weights, draw_seed

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        indices = list(super().__iter__())
        for batch in range(len(self)):
            position = synthetic_bucket(self.weights, self.draw_seed, self.epoch, batch)
            yield [(index, position) for index in indices[batch * self.batch_size:(batch + 1) * self.batch_size]]

    def __len__(self) -> int:
        return self.num_samples // self.batch_size


def synthetic_dataloader(image_size: int, batch_size_per_device: int, num_workers: int,
                         num_samples: int = 100_000, seed: int = 0, family: ModelFamily | None = None,
                         config: str | None = None, shuffle: bool = True, buckets: tuple[Bucket, ...] = (),
                         bucket_weights: tuple[float, ...] = ()) -> DataLoader:
    """Synthetic samples, each rank reading its own shard through Composer's distributed sampler; with
    `buckets`, every batch in one of them, drawn with `bucket_weights` (SyntheticBucketedImages)."""
    if buckets:
        dataset = SyntheticBucketedImages(buckets, image_size, num_samples, seed, family, config)
        sampler = BucketBatchSampler(dataset, batch_size_per_device, bucket_weights, shuffle=shuffle, draw_seed=seed)
        kwargs = {k: v for k, v in loader_kwargs(num_workers).items() if k != "drop_last"}  # the sampler drops
        return DataLoader(dataset, batch_sampler=sampler, **kwargs)
    dataset = SyntheticImageCaptions(image_size, num_samples, seed, family, config)
    sampler = dist.get_sampler(dataset, shuffle=shuffle, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size_per_device, sampler=sampler, **loader_kwargs(num_workers))



class SyntheticLatents(Dataset):
    """Random latent distributions and token ids or text states of the right shapes: the model without the data.

    Like SyntheticImageCaptions, samples are generated from their index (same data for the same
    index on every rank and epoch, nothing stored). Means have the spread of SD2's latents (unit
    variance after scaling by 0.18215), log-variances are around -10, in `dtype` (fp16, as the
    precomputed shards store them); then "captions" (random token ids, the default "tokens"
    format) or "text_states" (standard normal, in `dtype`) for `text_format="text_states"`. With
    `config`, the family's keys and shapes at that config (Flux: `t5_states` and `clip_pooled`, or
    `clip_ids` and `t5_ids`), means around `latent_shift`; for a family with micro-conditioning
    (SDXL), the geometry of an uncropped image of the training size. Every sample carries its
    `sample_index`.
    """

    def __init__(self, image_size: int, text_dim: int, num_samples: int = 100_000, seed: int = 0,
                 latent_channels: int = 4, dtype: torch.dtype = torch.float16, text_format: str = TOKENS,
                 family: ModelFamily | None = None, latent_scale: float = SD2_LATENT_SCALE, config: str | None = None,
                 latent_shift: float = 0.0):
        if text_format not in TEXT_FORMATS:
            raise ValueError(f"text_format {text_format!r} is not one of {TEXT_FORMATS}")
        self.image_size = image_size
        self.latent_shape = (latent_channels, image_size // 8, image_size // 8)
        self.text_dim, self.num_samples, self.seed, self.dtype = text_dim, num_samples, seed, dtype
        self.text_format, self.family, self.latent_scale = text_format, family or DEFAULT_FAMILY, latent_scale
        self.config, self.latent_shift = config or self.family.configs[0], latent_shift
        self.state_shapes = (self.family.conditioning_shapes(config) if config is not None
                             else {TEXT_STATES_KEY: (MAX_LENGTH, text_dim)})

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = sample_generator(self.seed, index)
        mean = torch.randn(self.latent_shape, generator=g) / self.latent_scale + self.latent_shift
        logvar = torch.randn(self.latent_shape, generator=g) * 0.5 - 10.0
        item = {"latent_mean": mean.to(self.dtype), "latent_logvar": logvar.to(self.dtype)}
        if self.text_format == TEXT_STATES:
            for key, shape in self.state_shapes.items():
                item[key] = torch.randn(shape, generator=g).to(self.dtype)
        else:
            item.update(self.family.random_text_inputs(g, self.config))
        if self.family.micro_conditioning:
            item.update(geometry_tensors(ImageGeometry(self.image_size, self.image_size, 0, 0)))
        item["sample_index"] = torch.tensor(index)
        return item


