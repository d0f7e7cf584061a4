"""The CUDA caching allocator's setting (t2ibench.train.allocator): expandable segments by default, a user's
variable never overridden, and the memory model's reserve following the setting a run will have."""
from __future__ import annotations

import os

import pytest
import torch

from t2ibench.train import allocator
from t2ibench import memory
from t2ibench.commands.summary import allocator as setup_words
from tests.helpers import bench_script

USER_VARIABLES = allocator.ALLOC_CONF_VARIABLES


@pytest.fixture
def clean_environ(monkeypatch):
    for variable in USER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_the_setting_a_run_plans_with_is_the_users_variable_or_expandable_segments():
    assert allocator.planned({}) == allocator.AllocatorSetting("expandable_segments:True", "default")
    assert allocator.planned({}).expandable_segments
    cuda_only = allocator.planned({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert (cuda_only.source, cuda_only.expandable_segments) == ("PYTORCH_CUDA_ALLOC_CONF", False)
    both = allocator.planned({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true",
                              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert (both.source, both.expandable_segments) == ("PYTORCH_ALLOC_CONF", True)  # torch reads it first
    empty = allocator.planned({"PYTORCH_CUDA_ALLOC_CONF": ""})  # set, though empty: torch's defaults, the user's
    assert not empty.expandable_segments
    assert empty.describe() == "torch defaults (PYTORCH_CUDA_ALLOC_CONF, the user's)"
    assert not allocator.expandable("expandable_segments:False,garbage_collection_threshold:0.8")


def test_configure_sets_expandable_segments_on_cuda_only_and_never_over_the_users(clean_environ):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path and a stand-in for CUDA")
    assert allocator.configure() is None  # no CUDA: nothing set
    assert not any(variable in os.environ for variable in USER_VARIABLES)
    applied: list[str] = []
    clean_environ.setattr(torch.cuda, "is_available", lambda: True)
    clean_environ.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append)
    setting = allocator.configure()
    assert setting == allocator.AllocatorSetting("expandable_segments:True", "default")
    # torch 2.7 reads only PYTORCH_CUDA_ALLOC_CONF; 2.9 on PYTORCH_ALLOC_CONF first.
    assert allocator.variable_torch_reads() == ("PYTORCH_ALLOC_CONF" if torch.__version__ >= "2.9"
                                                else "PYTORCH_CUDA_ALLOC_CONF")
    assert os.environ[allocator.variable_torch_reads()] == "expandable_segments:True"
    assert applied == ["expandable_segments:True"]
    for variable in USER_VARIABLES:
        clean_environ.delenv(variable, raising=False)
    clean_environ.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    applied.clear()
    assert allocator.configure() == allocator.AllocatorSetting("max_split_size_mb:512", "PYTORCH_CUDA_ALLOC_CONF")
    assert applied == [] and "PYTORCH_ALLOC_CONF" not in os.environ
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_the_plans_reserve_follows_the_allocator_setting(clean_environ):
    gpu_bytes = memory.CUDA_CONTEXT_BYTES + 150 * 2**20
    options = dict(precision="amp_bf16", weight_casts="step", num_gpus=1)
    default = memory.plan("tiny", 64, gpu_bytes, expandable_segments=False, **options)
    expandable = memory.plan("tiny", 64, gpu_bytes, expandable_segments=True, **options)
    assert (default["allocator_reserve_fraction"], expandable["allocator_reserve_fraction"]) == (0.10, 0.05)
    assert expandable["microbatch"] >= default["microbatch"] > 0
    usable = memory.usable_bytes(gpu_bytes)  # the device less the plan's headroom
    for plan in (default, expandable):
        assert plan["predicted_bytes_at_microbatch"] <= usable
        doubled = memory.predicted_bytes(plan, 2 * plan["microbatch"])
        assert doubled > usable  # the largest power of two that fits, by this plan's own reserve
    # Unsaid, the plan takes the setting a run from this environment would have.
    assert memory.plan("tiny", 64, gpu_bytes, **options)["expandable_segments"] is True
    clean_environ.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert memory.plan("tiny", 64, gpu_bytes, **options)["allocator_reserve_fraction"] == 0.10


def test_the_setup_line_and_the_gpu_report_say_the_setting_and_its_retries():
    gpu_run = {"cuda_allocator_conf": "expandable_segments:True", "cuda_allocator_conf_source": "default",
               "cuda_alloc_retries": 0}
    assert setup_words(gpu_run) == ", allocator expandable_segments:True (the default)"
    assert setup_words({"cuda_allocator_conf": None}) == "" and setup_words({}) == ""  # CPU, older results
    words = bench_script("gpu/record").allocator_words({**gpu_run, "cuda_memory_outside_torch_bytes": 814546944})
    assert "expandable_segments:True" in words and "0 allocation retries" in words
    assert "0.76 GiB outside torch at the end" in words
