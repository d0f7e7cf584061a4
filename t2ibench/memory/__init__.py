"""GPU memory of a training step, counted for any model family on the meta device: bytes saved for
backward, fixed bytes per GPU, and the largest microbatch that fits (`plan`). One module per job:
`autocast` (CUDA autocast's rules without a GPU), `saved` (counting what a step keeps), `step` (the
step measured), `planning` (the microbatch); and `kernels`, the CUDA kernels a step launches, counted on the
same meta-device step. The method and its checks: docs/gpu-runs.md, "The memory model".

    python bench/memory.py --model_config sd2-base --image_size 512 --gpu_memory_gib 80 --json

May import: `core/`, `families/`, `datasets/`, `eval/`, `train/`.
"""
from t2ibench.memory.autocast import (CUDA_AUTOCAST, AutocastPolicy, AutocastRules, autocast_dtype,
                                      probe_cpu_autocast)
from t2ibench.memory.planning import (ALLOCATOR_RESERVE_FRACTION, CUDA_CONTEXT_BYTES,
                                      EXPANDABLE_SEGMENTS_RESERVE_FRACTION, GIB, GPU_MEMORY_GIB, HEADROOM_FRACTION,
                                      MAX_MICROBATCH,
                                      ActivationModel, activation_model, auto_microbatch, fixed_bytes, fsdp_unit_params,
                                      gib, largest_microbatch, plan, predicted_bytes, reserve_fraction,
                                      train_flops_per_image, usable_bytes)
from t2ibench.memory.saved import LiveBytes, SavedForBackward
from t2ibench.memory.step import (COUNTED_MICROBATCHES, MetaStep, StepCount, build_meta_model, build_meta_step,
                                  count_step, linear_rows_per_sample, meta_batch, use_checkpointing, use_float8)
# The values the functions above accept, each list defined by its owner.
from t2ibench.train.norms import NORM_PRECISIONS
from t2ibench.train.parallel import FSDP_MODES
from t2ibench.train.precision import PRECISIONS
from t2ibench.datasets.precomputed import TEXT_FORMATS
from t2ibench.train.weight_casts import WEIGHT_CASTS

__all__ = [
    "ALLOCATOR_RESERVE_FRACTION", "COUNTED_MICROBATCHES", "CUDA_AUTOCAST", "CUDA_CONTEXT_BYTES",
    "EXPANDABLE_SEGMENTS_RESERVE_FRACTION", "FSDP_MODES", "GIB", "GPU_MEMORY_GIB", "HEADROOM_FRACTION", "MAX_MICROBATCH", "NORM_PRECISIONS",
    "PRECISIONS", "TEXT_FORMATS", "WEIGHT_CASTS", "ActivationModel",
    "AutocastPolicy", "AutocastRules", "LiveBytes", "MetaStep", "SavedForBackward", "StepCount", "activation_model",
    "auto_microbatch", "autocast_dtype", "build_meta_model", "build_meta_step", "count_step", "fixed_bytes",
    "fsdp_unit_params", "gib", "largest_microbatch", "linear_rows_per_sample", "meta_batch", "plan", "predicted_bytes",
    "probe_cpu_autocast", "reserve_fraction", "train_flops_per_image", "usable_bytes", "use_checkpointing",
    "use_float8",
]
