"""The held-out images' FID statistics as a file (`--fid_real_stats`): computed once, read by later runs so
that no evaluation pays for them. torchmetrics' own sums (FrechetInceptionDistance's real_* states), with
what they were computed from; the format and the checks: docs/metrics.md, "FID and CLIP score".
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from t2ibench.core.errors import fail
from t2ibench.core.files import atomic_file
from t2ibench.core.locations import check_output, is_remote

REAL_STATES = ("real_features_sum", "real_features_cov_sum", "real_features_num_samples")
HASH_CHUNK_BYTES = 1 << 20
FLAG = "--fid_real_stats"


def file_sha256(path: str) -> str:
    """The SHA-256 of a file, read in chunks (InceptionV3's weights are 92 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def check_location(path: str) -> None:
    """Before anything loads: a local regular file (read) or a writable place for a new one (written)."""
    if is_remote(path):
        fail(f"{FLAG} {path}: give a local file (it is read at set-up, or written at the first evaluation)")
    where = Path(path)
    if where.exists() or where.is_symlink():
        if not where.is_file():  # a FIFO would block the read, a folder cannot be one
            fail(f"{FLAG} {path} is not a regular file: name the statistics file to read, or a new one to write")
        return
    problem = check_output(FLAG, path, folder=False)
    if problem:
        fail(problem)


def describe(weights_sha256: str, image_size: int, num_images: int) -> dict[str, Any]:
    """What the statistics were computed from: the extractor's file, the image size, the image count."""
    return {"fid_weights_sha256": weights_sha256, "image_size": image_size, "num_images": num_images}


def read(path: str, expected: dict[str, Any], num_features: int) -> dict[str, torch.Tensor]:
    """The real-image states in `path`, refused in one line when computed from anything else than
    `expected` (`describe`) or of another feature size."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            found = {key: stored[key] for key in stored.files}
    except Exception as error:  # noqa: BLE001  zip, pickle and format errors of every kind
        fail(f"{FLAG} {path} is not a statistics file this project wrote ({type(error).__name__}); remove it, or "
             "name a new file, and the next run computes it")
    missing = [key for key in (*REAL_STATES, *expected) if key not in found]
    if missing:
        fail(f"{FLAG} {path} is not a statistics file this project wrote (no {missing[0]}); remove it, or name a new "
             "file, and the next run computes it")
    for key, value in expected.items():
        if found[key].item() != value:
            fail(f"{FLAG} {path} was computed with {key} {found[key].item()}, this run has {value}: name another "
                 "file (the run writes it) for this --fid_weights, --image_size and --image_eval_samples")
    states = {key: torch.from_numpy(np.array(found[key])) for key in REAL_STATES}
    if tuple(states["real_features_sum"].shape) != (num_features,) or \
            tuple(states["real_features_cov_sum"].shape) != (num_features, num_features):
        fail(f"{FLAG} {path} holds {tuple(states['real_features_sum'].shape)} features, the extractor gives "
             f"{num_features}: name another file (the run writes it)")
    if not all(bool(torch.isfinite(value.double()).all()) for value in states.values()):
        fail(f"{FLAG} {path} holds NaN or infinite statistics; remove it and the next run computes it again")
    return {"real_features_sum": states["real_features_sum"].double(),
            "real_features_cov_sum": states["real_features_cov_sum"].double(),
            "real_features_num_samples": states["real_features_num_samples"].long().reshape(())}


def write(path: str, states: dict[str, torch.Tensor], described: dict[str, Any]) -> None:
    """The real-image states (summed over every rank) and what they were computed from, replaced whole."""
    arrays = {key: states[key].detach().cpu().numpy() for key in REAL_STATES}
    with atomic_file(path, "wb") as handle:
        np.savez(handle, **arrays, **{key: np.asarray(value) for key, value in described.items()})
