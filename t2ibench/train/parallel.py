"""Data parallelism of a run: DDP, or FSDP2 on the denoiser through Composer (`--fsdp`).

`FSDP_CHOICES` are the flag's values; `resolve_mode` turns `auto` into the family's default (FSDP
full_shard for a model whose training state does not fit one GPU, such as Flux.1; DDP otherwise);
`fsdp_parallelism` is the config handed to Composer's Trainer; `traffic_bytes_per_gpu` counts what a
step of each mode sends per GPU (bench/blocks.py's prediction, gpu_setup's choice of microbatch and
checkpointing); `average_gradients_over_gloo` fixes
gloo's reduce-scatter on CPU where it sums (torch 2.7), so that the CPU tests compute the gradients
the GPUs do; `enable_block_checkpointing` turns on the denoiser's activation checkpointing so that it
composes with FSDP2's mixed precision.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.utils.checkpoint
from composer.utils import FSDP2Config, ParallelismConfig, dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils._pytree import tree_map

from t2ibench.core import devices

FSDP_MODES = ("none", "shard_grad_op", "full_shard")  # what a run applies: DDP, ZeRO-2, ZeRO-3
FSDP_CHOICES = ("auto", *FSDP_MODES)  # --fsdp; auto: the family's default (resolve_mode)
# The rate a GPU's collectives are timed at, in gigabytes per second per direction per GPU, where no
# device is named: the reference GPU's (t2ibench.core.devices: an H100 SXM's NVLink 4, 450 each way), the GPU
# the speed figures were fitted on. A named device's is its own (bench/blocks.py --device, gpu_setup's
# weighing); a multi-node run's collectives go at its slower inter-node rate.
NVLINK4_GB_PER_SEC = devices.reference().link_gb_per_sec


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


def traffic_bytes_per_gpu(mode: str, gpus: int, params: int, root_params: int, precision: str
                          ) -> tuple[float, float]:
    """Bytes each GPU sends for the sharding `mode` of a denoiser of `params` parameters, (once per
    step, per microbatch), as the run sends them (ring collectives: (G-1)/G of the buffer, twice for
    an all-reduce; weights gathered in the autocast dtype, gradients reduced in fp32, Composer's FSDP2
    mixed precision, `fsdp_parallelism`).

    Composer 0.32.1 runs a FSDP2 step's microbatches with the gradients synchronised in each (no_sync
    is DDP's only; FSDP2's `set_requires_gradient_sync` is never called) and lets FSDP2 reshard after
    each backward (its default), so every microbatch gathers the weights again and reduce-scatters
    its gradients: full_shard gathers each block for its forward and again for its backward (with
    checkpointing too: the recompute runs inside the backward's gather) and the root unit
    (`root_params`: what no block holds, which FSDP2 keeps from the root's forward to its backward)
    once, shard_grad_op every unit once. DDP all-reduces once per step: Composer's default
    `DDPSyncStrategy.SINGLE_AUTO_SYNC` runs every microbatch but the last under DDP's `no_sync`.
    One GPU sends nothing. tests/bench/test_blocks.py counts what two CPU ranks send (tests/traffic_run.py)."""
    if gpus == 1:
        return 0.0, 0.0
    share, weight_bytes = (gpus - 1) / gpus, 4 if precision == "fp32" else 2
    if mode == "none":
        return 2 * share * 4 * params, 0.0
    gathered = 2 * params - root_params if mode == "full_shard" else params
    return 0.0, share * (weight_bytes * gathered + 4 * params)


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


def fsdp_input_casts(block: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """`inputs` as FSDP2's pre-forward hook hands them to `block`'s forward: floating-point tensors
    (also inside tuples, such as Flux.1's rotary embedding) cast to the unit's `param_dtype` when its
    mixed precision policy casts forward inputs, as Composer's does; unchanged for a module that is
    not an FSDP unit."""
    if not isinstance(block, FSDPModule):
        return inputs
    # A private field (torch 2.7 to today's FSDPState): a torch without it gets diffusers' behavior.
    policy = getattr(fully_shard.state(block), "_mp_policy", None)
    if policy is None or not (policy.cast_forward_inputs and policy.param_dtype):
        return inputs
    dtype = policy.param_dtype

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, inputs)


def checkpoint_block(block: torch.nn.Module, *inputs: Any) -> Any:
    """diffusers' `_gradient_checkpointing_func`: run `block` under non-reentrant
    `torch.utils.checkpoint`, casting its inputs as FSDP2 does inside the checkpointed region.

    diffusers checkpoints a block from outside (`checkpoint(block.__call__, *inputs)`), so where the
    block is an FSDP2 unit (Flux.1's blocks, `Family.fsdp_blocks`) its pre-forward hook runs inside
    the region. In the forward that hook casts the inputs to the policy's `param_dtype`; in
    backward's recomputation torch 2.7's hook returns at once (the unit is in its PRE_BACKWARD state,
    the gathering is its pre-backward hook's job; torch 2.14 casts there too), so the recomputation would run on the uncast inputs and
    checkpoint's check stops the step on tensors saved in another dtype (on a GPU: the fp32 rotary
    embedding, cast to bf16 in the forward; on a CPU, where Composer is given fp32: bf16 activations,
    cast to fp32). Casting here, in the recomputed function, gives both passes the inputs the forward
    saw; FSDP's own cast then finds nothing left to do. The casts' copies are freed with the region's
    other intermediates, so the checkpoint keeps what diffusers' own function keeps.
    """

    def run(*args: Any) -> Any:
        return block(*fsdp_input_casts(block, args))

    return torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)


def enable_block_checkpointing(denoiser: torch.nn.Module) -> None:
    """`--activation_checkpointing`: diffusers' per-block checkpointing, with `checkpoint_block` as its
    function (identical to diffusers' own where no block is an FSDP unit: DDP, one rank, a UNet's
    FSDP units, which hold their checkpointed resnets and transformers whole). Call it before or after
    FSDP wraps the blocks: `checkpoint_block` asks the block at each call."""
    denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_block)
