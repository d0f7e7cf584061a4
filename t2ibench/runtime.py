"""Where a training run runs: ranks, device, precision and microbatch, set up once before anything is built.

`Runtime.start(args, family)` sets the process up (CUDA device per rank, threads per CPU rank,
Composer's node signal files, seeds) and decides the precision and the microbatch; the rest of the
run reads them from the `Runtime` it returns.
"""
from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass

import torch
from composer.utils import dist, reproducibility

from t2ibench.families import ModelFamily


@dataclass(frozen=True)
class Runtime:
    world_size: int
    on_gpu: bool
    precision: str  # what runs: fp32, amp_bf16 or amp_fp16 ("auto" resolved)
    trainer_precision: str  # what Composer is told: it refuses AMP on CPU, where the model autocasts itself
    batch_size_per_device: int
    microbatch: int | str  # images per device per forward/backward, or Composer's "auto" search

    @property
    def is_rank_zero(self) -> bool:
        return dist.get_global_rank() == 0

    @classmethod
    def start(cls, args: argparse.Namespace, family: ModelFamily) -> "Runtime":
        world_size = dist.get_world_size()
        on_gpu = torch.cuda.is_available()
        if not on_gpu and "OMP_NUM_THREADS" not in os.environ:
            # Composer's launcher leaves every CPU rank using all cores: N ranks oversubscribe N-fold.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_local_world_size()))
        if on_gpu:
            # Before anything touches CUDA: otherwise every rank creates a context on GPU 0.
            torch.cuda.set_device(dist.get_local_rank())
            # Fixed shapes every step: let cuDNN time its convolution algorithms once and keep the fastest.
            torch.backends.cudnn.benchmark = True
        precision = args.precision if args.precision != "auto" else ("amp_bf16" if on_gpu else "fp32")
        per_device = args.batch_size // world_size
        microbatch = args.device_train_microbatch_size
        if microbatch == "auto" and not on_gpu:
            microbatch = per_device  # Composer's auto microbatching needs a GPU
        elif microbatch == "auto" and world_size > 1:
            microbatch = safe_auto_microbatch(family, torch.cuda.get_device_properties(0).total_memory, per_device,
                                              args.precomputed)
            if dist.get_global_rank() == 0:
                print(f"--device_train_microbatch_size auto with {world_size} ranks: using {microbatch} "
                      f"(from memory arithmetic for this GPU's memory; see docs/gpu-runs.md), not Composer's OOM "
                      "search", flush=True)
        if args.channels_last and not args.compile and dist.get_global_rank() == 0:
            warnings.warn("--channels_last without --compile: eager GroupNorm returns contiguous tensors, so every "
                          "convolution after a norm converts its input back to channels-last; add --compile "
                          "(inductor keeps one layout), or measure before keeping the flag.", stacklevel=1)
        per_node_signal_files()
        reproducibility.seed_all(args.seed)
        return cls(world_size, on_gpu, precision, precision if on_gpu else "fp32", per_device, microbatch)


def safe_auto_microbatch(family: ModelFamily, total_memory_bytes: int, per_device: int, precomputed: bool) -> int:
    """`auto` for several ranks: a fixed microbatch from the GPU's memory size, not an OOM search.

    Composer's auto microbatching catches an OOM and retries the batch with half the microbatch.
    Under DDP an OOM in the backward pass leaves the gradient reducer mid-reduction (buckets marked
    ready on one rank and not on another), and the size found on batch 1 ignores the AdamW and EMA
    state that is only allocated after it; so with several ranks `auto` takes the largest power of
    two that divides the per-device batch and is at most the family's size for this memory
    (`ModelFamily.microbatch_by_memory_gib`; twice that on precomputed latents).
    """
    gib = total_memory_bytes / 2**30
    limit = family.min_microbatch
    for memory_gib, size in family.microbatch_by_memory_gib:
        if gib >= memory_gib:
            limit = size
    if precomputed:
        limit *= 2
    size = 1
    while size * 2 <= min(limit, per_device) and per_device % (size * 2) == 0:
        size *= 2
    return size


def per_node_signal_files() -> None:
    """Make Composer's node signal files per node, so --autoresume works when nodes share --save_folder.

    Composer 0.32.1 (autoresume, checkpoint loading) names the file by which each node's local rank 0
    tells the node's other ranks it is done after node 0 plus a random suffix broadcast from rank 0,
    so every node uses the same name in the same folder, and every node's local rank 0 deletes it:
    on a file system shared by the nodes the second delete fails (FileNotFoundError) and the run
    dies before training. Adding this node's rank keeps the name equal within a node only.
    """
    original = dist.get_node_signal_file_name
    if getattr(original, "per_node", False):
        return

    def per_node(rng=None) -> str:
        return f"{original(rng)}_n{dist.get_node_rank()}"

    per_node.per_node = True
    dist.get_node_signal_file_name = per_node
