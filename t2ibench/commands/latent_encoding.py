"""Encoding a batch for latents.py: the VAE posterior and the text states on the device, then their
asynchronous copy to the host in the storage dtype, checked for values that do not fit it."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch

from t2ibench.families import ModelFamily
from t2ibench.train.model import scale_images, vae_overflows_in
from t2ibench.datasets.precomputed import GEOMETRY_DTYPE, LATENT_KEYS, STORAGE_DTYPES, TOKEN_IDS_DTYPE

FP16_MAX = float(np.finfo(np.float16).max)  # 65504


@torch.no_grad()
def encode(family: ModelFamily, vae: torch.nn.Module, text_encoders: dict[str, torch.nn.Module], images: torch.Tensor,
           ids: dict[str, torch.Tensor], device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """VAE posterior mean and log-variance, and the text states (the family's conditioning by key,
    SD2: text_states, Flux: t5_states and clip_pooled; empty without text encoders: the token ids
    are stored instead), as float32 on `device`."""
    images = scale_images(images.to(device, non_blocking=True))  # uint8 pixels -> [-1, 1] on the device
    ids = {key: value.to(device, non_blocking=True) for key, value in ids.items()}
    # Contiguous, not channels-last: eager CUDA GroupNorm returns contiguous tensors, so in a
    # channels-last VAE every convolution after a norm would convert its input back.
    autocast = (torch.autocast("cuda", dtype=dtype) if device.type == "cuda" and dtype != torch.float32
                else contextlib.nullcontext())
    vae_autocast = contextlib.nullcontext() if not vae_overflows_in(vae, dtype) else \
        torch.autocast(device.type, enabled=False)  # SDXL's own VAE overflows in fp16: fp32 for it
    with autocast:
        with vae_autocast:
            posterior = vae.encode(images).latent_dist
        text_states = ({key: value.float() for key, value in family.encode_text(text_encoders, ids).items()}
                       if text_encoders else {})
    return posterior.mean.float(), posterior.logvar.float(), text_states


STAT_NAMES = ("max_abs_mean", "min_logvar", "max_logvar", "max_abs_text")


class Stats:
    """What this rank wrote, and the value ranges it saw (evidence that the storage dtype fits)."""

    def __init__(self):
        self.written = self.bad = 0
        self.max_abs_mean = self.max_abs_text = 0.0
        self.min_logvar, self.max_logvar = math.inf, -math.inf

    def update(self, values: list[float]) -> None:
        for name, value in zip(STAT_NAMES, values):
            pick = min if name.startswith("min") else max
            setattr(self, name, pick(getattr(self, name), value))


class Encoded:
    """One batch's outputs on their way to the host: copied asynchronously (pinned memory on GPU),
    so that the GPU encodes the next batch while this process writes this one."""

    def __init__(self, indices: list[int], captions: list[str], outputs: tuple[Any, ...],
                 storage_dtype: str, device: torch.device, token_ids: dict[str, torch.Tensor] | None = None,
                 geometry: dict[str, torch.Tensor] | None = None):
        mean, logvar, text = outputs  # text {}: the token ids are stored instead of text states
        self.indices, self.captions = indices, captions
        self.token_ids = {key: ids.numpy().astype(TOKEN_IDS_DTYPE) for key, ids in (token_ids or {}).items()}
        self.geometry = {key: value.numpy().astype(GEOMETRY_DTYPE) for key, value in (geometry or {}).items()}
        self.keys = [*LATENT_KEYS, *text]  # the stored arrays, in order
        dtype = getattr(torch, STORAGE_DTYPES[storage_dtype])
        text_max = (torch.stack([t.abs().amax() for t in text.values()]).amax() if text
                    else torch.zeros((), device=mean.device))
        ranges = torch.stack([mean.abs().amax(), logvar.amin(), logvar.amax(), text_max])
        pinned = device.type == "cuda"
        tensors = [mean, logvar, *text.values(), ranges]
        self.host = [torch.empty(t.shape, dtype=t.dtype if t is ranges else dtype, pin_memory=pinned) for t in tensors]
        for host, tensor in zip(self.host, tensors):
            host.copy_(tensor.to(host.dtype), non_blocking=pinned)
        self.event = None
        if pinned:
            self.event = torch.cuda.Event()
            self.event.record()

    def arrays(self, storage_dtype: str, compute_dtype: str) -> tuple[list[np.ndarray], list[float]]:
        """Wait for the copies; the arrays (mean, logvar[, conditioning]) and the value ranges. Stops on
        a value that is not finite or does not fit the storage dtype (it would be stored as inf)."""
        if self.event is not None:
            self.event.synchronize()
        arrays = [t.numpy() for t in self.host[:-1]]
        ranges = self.host[-1].tolist()
        for key, array in zip(self.keys, arrays):
            rows = ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
            if not rows.any():
                continue
            which = [self.indices[i] for i in np.flatnonzero(rows)][:10]
            if np.isfinite(ranges).all():  # finite in float32, so too big for the storage dtype
                raise OverflowError(f"{key} of samples {which} exceeds the {storage_dtype} range "
                                    f"(+-{FP16_MAX:g}): rerun with --storage_dtype fp32")
            raise FloatingPointError(f"{key} of samples {which} is not finite (computed in {compute_dtype}): "
                                     "rerun with --dtype bf16 or --dtype fp32")
        return arrays, ranges
