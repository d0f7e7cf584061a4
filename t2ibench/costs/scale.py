"""The size of a full training run, as the 2023 benchmark priced it (cost.py, latents.py's projection),
and MLPerf Training's Flux.1 set-up and published results (cost.py's reference rows and its samples to
MLPerf's target)."""
from __future__ import annotations

# MosaicML's 2023 table: 1.4M steps at global batch 2048, at $2 per A100-hour.
SAMPLES = 1_400_000 * 2048  # 2,867,200,000 images
USD_PER_GPU_HOUR = 2.0

# The models a cost table is labelled for, by --model_config: (the name it goes by, the resolution
# it trains at, its VAE encoder's FLOPs per image at that resolution, counted by its family's
# flops_per_image on meta tensors). Results of anything else are labelled by their config name.
PRICED_MODELS = {
    "sd2-base": ("SD2 base", 512, 1_117e9),
    "sdxl-base": ("SDXL base 1.0", 1024, 4_879e9),
}

# MLPerf Training v5.1 text-to-image (Flux.1-schnell from scratch), published elsewhere (the v5.1
# results and the benchmark's reference): its training set, its quality target, the FLOPs NVIDIA
# declares per sample, and per-GPU samples/s in the result logs (MXFP8, full-iteration CUDA graphs;
# GB300 entries range 62-70). No Hopper result was published.
MLPERF_FLUX_TRAIN_SAMPLES = 1_099_776  # the CC12M subset, 256x256
MLPERF_FLUX_TARGET_EVAL_LOSS = 0.586  # validation loss over 8 timesteps
# The samples MLPerf's reference takes to the target, by global batch, are MLCommons' reference
# convergence points, read from the installed mlperf-logging package (t2ibench.costs.mlperf).
NVIDIA_FLUX_DECLARED_FLOP_PER_SAMPLE = 20.3e12
MLPERF_FLUX_SAMPLES_PER_SEC_PER_GPU = {"B200": 51.0, "GB200": 56.0, "GB300": 62.0, "GB300 (best)": 70.0}
