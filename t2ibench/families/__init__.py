"""The registry of model families: which family each `--model_config` belongs to.

A family is one module here with a `ModelFamily` subclass (families/family.py) and one entry in
`FAMILIES`; its configurations then work in every command, in the FLOPs and memory figures, and in export.
Beside the families, what they are built on: `family.py` (the interface every family shares), `objectives.py`
(noising and target) and `flops.py` (FLOP counting).

May import: `core/`.
"""
from __future__ import annotations

import torch

from t2ibench.core.errors import fail
from t2ibench.families.family import ModelFamily, Parts, build_aside, require_pretrained
from t2ibench.families.flux import Flux
from t2ibench.families.sd2 import SD2
from t2ibench.families.sdxl import SDXL

FAMILIES: tuple[ModelFamily, ...] = (SD2(), SDXL(), Flux())  # one entry per family

MODEL_CONFIGS: dict[str, ModelFamily] = {config: family for family in FAMILIES for config in family.configs}

__all__ = ["FAMILIES", "MODEL_CONFIGS", "ModelFamily", "Parts", "build_aside", "detect_config", "family_of",
           "require_pretrained"]


def family_of(config: str, flag: str = "--model_config") -> ModelFamily:
    """The family of a --model_config value (one line naming the flag for an unknown one)."""
    if config not in MODEL_CONFIGS:
        fail(f"{flag} '{config}' is unknown; choose one of {sorted(MODEL_CONFIGS)}")
    return MODEL_CONFIGS[config]


def detect_config(denoiser_weights: dict[str, torch.Tensor]) -> str | None:
    """The configuration whose denoiser has exactly these weight names and shapes (None: none has)."""
    shapes = {k: tuple(v.shape) for k, v in denoiser_weights.items()}
    for config, family in MODEL_CONFIGS.items():
        meta = family.meta_parts(config).denoiser
        if {k: tuple(v.shape) for k, v in meta.state_dict().items()} == shapes:
            return config
    return None
