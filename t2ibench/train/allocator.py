"""The CUDA caching allocator's setting a run uses: expandable segments unless the user set the
allocator's variable, decided before CUDA starts (`configure`) and known without a GPU (`planned`), so
that the memory model plans with the reserve of the allocator the run will have. Why and what it
leaves: docs/speed.md, "The allocator's setting".
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.torch_version import TorchVersion

# The variables torch reads its allocator settings from, in its order of preference: torch 2.9 reads
# PYTORCH_ALLOC_CONF first and keeps PYTORCH_CUDA_ALLOC_CONF with a deprecation warning; torch 2.7
# reads only PYTORCH_CUDA_ALLOC_CONF.
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
FIRST_TORCH_WITH_ALLOC_CONF = "2.9"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
DEFAULT_SOURCE = "default"  # the setting is this benchmark's, not the user's


@dataclass(frozen=True)
class AllocatorSetting:
    conf: str  # the allocator's settings, as the variable holds them
    source: str  # DEFAULT_SOURCE, or the variable the user set

    @property
    def expandable_segments(self) -> bool:
        return expandable(self.conf)

    def describe(self) -> str:
        """In words, for the set-up line: the settings and whose they are."""
        whose = "the default" if self.source == DEFAULT_SOURCE else f"{self.source}, the user's"
        return f"{self.conf or 'torch defaults'} ({whose})"


def expandable(conf: str) -> bool:
    """Whether an allocator settings string (`key:value,key:value`) turns expandable segments on."""
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def variable_torch_reads() -> str:
    """The variable this torch reads first (the one `configure` sets)."""
    return ALLOC_CONF_VARIABLES[0] if TorchVersion(torch.__version__) >= FIRST_TORCH_WITH_ALLOC_CONF \
        else ALLOC_CONF_VARIABLES[1]


def planned(environ: Mapping[str, str] | None = None) -> AllocatorSetting:
    """The setting a CUDA run started in `environ` (this process's by default) computes with: the user's
    variable where one is set (empty counts as set: torch's defaults), else expandable segments."""
    environ = os.environ if environ is None else environ
    for variable in ALLOC_CONF_VARIABLES:
        if variable in environ:
            return AllocatorSetting(environ[variable], variable)
    return AllocatorSetting(EXPANDABLE_SEGMENTS, DEFAULT_SOURCE)


def configure() -> AllocatorSetting | None:
    """On CUDA, before the first CUDA allocation: make `planned()` the allocator's setting and return
    it; None without CUDA. A user's variable is left as it is. Ours is set as the variable torch reads
    (children started later inherit it) and, since torch may have read its variables already (at
    import or when CUDA started), also through torch's own setter, which governs every segment the
    allocator makes from then on."""
    if not torch.cuda.is_available():
        return None
    setting = planned()
    if setting.source == DEFAULT_SOURCE:
        os.environ[variable_torch_reads()] = setting.conf
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)  # private: absent in some torch
        if setter is not None:
            setter(setting.conf)
    return setting


def memory_outside_torch_bytes() -> int:
    """Device memory in use that the caching allocator does not hold (the CUDA context and its kernels,
    cuBLAS/cuDNN workspaces, NCCL's buffers): the driver's used bytes less what torch has reserved, now.
    The memory model's CUDA_CONTEXT_BYTES is the budget this is measured against."""
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())
