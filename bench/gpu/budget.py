"""The budget rule of bench/gpu_report.py (docs/gpu-runs.md): each row's seconds estimated from the rows that
ran before it (before any row of its kind, first estimates: start-up, compilation, and its batches' FLOPs
at an assumed share of the GPUs' peak), and its timeout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from gpu.rows import Setting
from t2ibench.datasets.precomputed import TEXT_STATES

# Before any row of the kind ran (each errs long on an H100): a launch up to its first batch, planning
# included; regional compilation's targets on an H100 (SD2 60 s, SDXL 90 s); a blocks row (the node's
# set-up planned, blocks timed and compiled, the harness).
FIRST_STARTUP_SECONDS = 90.0
FIRST_COMPILE_SECONDS = 120.0
FIRST_BLOCKS_SECONDS = 180.0
# The first FLOP/s of a row: this share of the GPUs' peak (this project's estimate for SD2 on an H100: 45-55
# images/s online, 70-85 precomputed, about 18% MFU; taken for every row, so it errs long for the
# transformer), and on a CPU (--smoke) what the tiny UNet ran at on a loaded 2-core machine.
ASSUMED_MFU = 0.18
CPU_FIRST_FLOPS_PER_SECOND = 1e8
# A row's own timeout: twice its estimate (at least a minute more), never past the budget; a row that
# hangs is ended with its process group and recorded, and the report goes on.
TIMEOUT_FACTOR, TIMEOUT_SLACK_SECONDS = 2.0, 60.0
# The first estimates' peak for a GPU outside t2ibench.core.devices' table: an A10's dense bf16 (125 TFLOP/s),
# slower than any GPU of the table, so that its rows err long.
UNKNOWN_GPU_PEAK_TFLOPS = 125.0


@functools.lru_cache(maxsize=None)
def flops_per_image(model_config: str, image_size: int, precomputed: bool, text_format: str | None,
                    activation_checkpointing: bool) -> float:
    """FLOPs one training image of a row costs the GPUs (encoders included where they run, the
    denoiser's forward once more under activation checkpointing), counted on meta tensors."""
    from t2ibench import memory
    from t2ibench.families import family_of

    flops = family_of(model_config).flops_per_image(model_config, image_size, vae=not precomputed,
                                                    text_encoders=text_format != TEXT_STATES)["total"]
    if activation_checkpointing:  # the recomputed forward: about a third of forward + backward
        flops += memory.train_flops_per_image(model_config, image_size) / 3
    return flops


def flops_of(setting: Setting, checkpointing: bool) -> float:
    """FLOPs one training image of a set-up costs the GPUs."""
    return flops_per_image(setting.model_config, setting.resolution, setting.precomputed, setting.text_format,
                           checkpointing)


@dataclass
class Estimator:
    """Each row's seconds, predicted from the rows before it (docs/gpu-runs.md, the budget rule)."""

    first_flops_per_second: float
    startup_s: list[float] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)
    flops_per_second: list[float] = field(default_factory=list)
    blocks_s: list[float] = field(default_factory=list)

    def fixed_seconds(self, setting: Setting) -> float:
        """A training row's seconds besides its batches: the launch's start-up, and its compilation."""
        startup = max(self.startup_s, default=FIRST_STARTUP_SECONDS)
        return startup + (max(self.compile_s, default=FIRST_COMPILE_SECONDS) if setting.compile else 0.0)

    def run_seconds(self, setting: Setting, batches: int) -> float:
        # Checkpointing left to `auto` is counted on: the longer estimate.
        flops = batches * setting.global_batch * flops_of(setting, setting.activation_checkpointing != "off")
        return self.fixed_seconds(setting) + flops / min(self.flops_per_second, default=self.first_flops_per_second)

    def blocks_seconds(self) -> float:
        return max(self.blocks_s, default=FIRST_BLOCKS_SECONDS)

    def observe_run(self, setting: Setting, batches: int, wall_s: float, result: dict) -> None:
        """Learn from a finished training row: the FLOP/s its batches ran at, and the rest of its wall time
        (start-up, and compilation: `compile_seconds` where the run reports it)."""
        per_batch = result["measured_seconds"] / max(1, result["measured_batches"])
        overhead = max(0.0, wall_s - batches * per_batch)
        checkpointing = bool(result.get("activation_checkpointing"))  # as the run resolved it
        self.flops_per_second.append(result["images_per_sec"] * flops_of(setting, checkpointing))
        if not setting.compile:
            self.startup_s.append(overhead)
        elif result.get("compile_seconds") is not None:
            self.compile_s.append(result["compile_seconds"])
            self.startup_s.append(max(0.0, overhead - result["compile_seconds"]))
        else:
            self.compile_s.append(max(0.0, overhead - max(self.startup_s, default=FIRST_STARTUP_SECONDS)))

    def observe_blocks(self, wall_s: float) -> None:
        self.blocks_s.append(wall_s)


def row_timeout(estimate_s: float, left_s: float) -> float:
    return min(left_s, max(TIMEOUT_FACTOR * estimate_s, estimate_s + TIMEOUT_SLACK_SECONDS))
