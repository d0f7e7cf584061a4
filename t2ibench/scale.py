"""The size of a full training run, as the 2023 benchmark priced it (cost.py, latents.py's projection)."""
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
