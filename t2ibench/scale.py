"""The size of a full training run, as the 2023 benchmark priced it (cost.py, latents.py's projection)."""
from __future__ import annotations

# MosaicML's 2023 table: 1.4M steps at global batch 2048, at $2 per A100-hour.
SAMPLES = 1_400_000 * 2048  # 2,867,200,000 images
USD_PER_GPU_HOUR = 2.0
