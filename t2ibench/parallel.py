"""Data parallelism of a run: DDP, or FSDP2 on the denoiser through Composer (`--fsdp`).

`FSDP_CHOICES` are the flag's values; `resolve_mode` turns `auto` into the family's default (FSDP
full_shard for a model whose training state does not fit one GPU, such as Flux.1; DDP otherwise);
`fsdp_parallelism` is the config handed to Composer's Trainer; `average_gradients_over_gloo` fixes
gloo's reduce-scatter on CPU where it sums (torch 2.7), so that the CPU tests compute the gradients
the GPUs do.
"""
from __future__ import annotations

import warnings

import torch
from composer.utils import FSDP2Config, ParallelismConfig, dist

FSDP_MODES = ("none", "shard_grad_op", "full_shard")  # what a run applies: DDP, ZeRO-2, ZeRO-3
FSDP_CHOICES = ("auto", *FSDP_MODES)  # --fsdp; auto: the family's default (resolve_mode)


def resolve_mode(mode: str, parallelism: str, world_size: int) -> str:
    """`--fsdp` as the run applies it: `auto` is full_shard for a family whose default parallelism is
    FSDP and the run has several ranks, else none (DDP, or one rank)."""
    if mode != "auto":
        return mode
    return "full_shard" if parallelism == "fsdp" and world_size > 1 else "none"


def fsdp_parallelism(mode: str) -> ParallelismConfig | None:
    """Composer's parallelism config for `--fsdp`: FSDP2 on the denoiser, or None for DDP.

    Composer 0.32.1 has two FSDP paths. FSDP1 (`FSDPConfig`, `composer.distributed.prepare_fsdp_module`)
    builds torch's `FullyShardedDataParallel` with `device_id=torch.cuda.current_device()`, so it
    cannot run without CUDA. FSDP2 (`FSDP2Config`, `parallelize_composer_model`) calls torch's
    `fully_shard`, whose default mesh is the accelerator's or the CPU's (gloo), so the code path the
    GPUs run is the one the CPU tests run. `reshard_after_forward` is the mode: True frees each
    block's gathered weights after its forward and gathers them again for its backward (FSDP1's
    FULL_SHARD, ZeRO-3); False keeps them from the forward to the end of that microbatch's backward
    (SHARD_GRAD_OP, ZeRO-2: one all-gather per block per microbatch instead of two, more memory).
    Gradients and AdamW moments are sharded in both. Mixed precision is Composer's DEFAULT: weights
    gathered in the autocast dtype, gradients reduced in fp32. Checkpoints are 'full': Composer
    gathers the model and optimizer to rank 0, which writes one file as under DDP, so
    `--autoresume`, `latest-rank0.pt`, export.py and a change of world size work unchanged.
    """
    if mode == "none":
        return None
    with warnings.catch_warnings():  # "FSDP2 Config/APIs are experimental": said once in the README instead
        warnings.simplefilter("ignore", UserWarning)
        config = FSDP2Config(reshard_after_forward=mode == "full_shard", state_dict_type="full")
    return ParallelismConfig(fsdp2=config)


def gloo_reduce_scatter_sums() -> bool:
    """Whether this torch's gloo reduce-scatter sums when asked for `ReduceOp.AVG` (all ranks call it).

    Measured with two ranks holding 1 and 2: torch 2.7.0 gives 3 (a sum), torch 2.14.1 gives 1.5
    (the average FSDP2 asked for). The torch release in between that changed it is not pinned down,
    so each run asks gloo itself, once, with a collective of `world_size` floats: a rule keyed on
    the version would halve the gradients of every release it misjudges.
    """
    world_size = dist.get_world_size()
    probe = torch.ones(world_size)
    reduced = torch.empty(1)
    # The collective FSDP2 calls: reduce_scatter_single where it exists (torch 2.14.1, which deprecates
    # reduce_scatter_tensor with a FutureWarning), reduce_scatter_tensor before (torch 2.7).
    reduce_scatter = (getattr(torch.distributed, "reduce_scatter_single", None)
                      or torch.distributed.reduce_scatter_tensor)
    reduce_scatter(reduced, probe, op=torch.distributed.ReduceOp.AVG)
    if reduced.item() == world_size:
        return True
    if reduced.item() == 1:
        return False
    raise RuntimeError(f"gloo's reduce-scatter with ReduceOp.AVG of {world_size} ones gave "
                       f"{reduced.item()}, neither their sum nor their average (torch {torch.__version__})")


def average_gradients_over_gloo(denoiser: torch.nn.Module) -> None:
    """Make FSDP2 average the denoiser's gradients over the ranks on CPU (gloo), as it does on GPUs.

    FSDP2 (`_fsdp_collectives.foreach_reduce`, torch 2.7 to 2.14) reduce-scatters fp32 and bf16
    gradients with `ReduceOp.AVG`, which NCCL applies; torch 2.7's gloo `reduce_scatter_tensor`
    silently sums instead (its all_reduce refuses AVG). So on CPU every gradient shard would be the
    world size times DDP's: AdamW's step hardly shows it (it is scale-invariant but for eps), while
    gradient clipping and the AdamW moments saved in checkpoints do. Where gloo sums
    (`gloo_reduce_scatter_sums`), FSDP2's hook on the reduce-scatter output divides it by the world
    size: exact for a power of two, so the CPU runs compute DDP's gradients. Where gloo averages
    (torch 2.14.1), the hook would halve them again, so none is set. NCCL runs never come here.
    """
    from torch.distributed.fsdp import FSDPModule
    if not gloo_reduce_scatter_sums():
        return
    world_size = dist.get_world_size()
    for module in denoiser.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda shard: shard.div_(world_size))
