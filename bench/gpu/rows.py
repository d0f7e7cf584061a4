"""The rows bench/gpu_report.py runs: a benchmark.py set-up (`Setting`) trained on synthetic data, blocks.py
timing the blocks of one, or blocks.py predicting a training row's run. The report's rows (what one GPU
shows in ten minutes, highest first) and the GPU matrix (SD2 base at 512x512 and SDXL base at 1024x1024
with EMA at the cost table's global batch, 2048; Flux.1-schnell at 256x256 as MLPerf Training v5.1 runs
it, no EMA, global batch 512), and the tiny models --smoke runs in their place (docs/gpu-runs.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from t2ibench.datasets.precomputed import TEXT_STATES, batch_text_format

GLOBAL_BATCH = 2048  # cost.py's batch (the 2023 benchmark's and the SD2 recipe's)
# MLPerf Training v5.1's Flux.1 global batch in NVIDIA's 16-GPU entries (its 512-GPU ones use 2048).
MLPERF_FLUX_GLOBAL_BATCH = 512
DEFAULT_MODEL_NAME = "stabilityai/stable-diffusion-2-base"  # --model_name: the SD2 rows' pretrained parts
# --smoke: each family's tiny configuration (same structure, a few million parameters), at small images,
# two images per microbatch.
SMOKE_CONFIGS = {"sd2-base": "tiny", "sdxl-base": "sdxl-tiny", "flux1-schnell": "flux1-tiny"}
SMOKE_IMAGE_SIZE = 32
SMOKE_MICROBATCH = 2
# The report's training rows: a global batch that takes a few seconds per batch on an H100
# (results/h100-2026-11-26: SD2 114.6 images/s precomputed and 69.0 online, SDXL 14.8 with checkpointing).
SD2_PRECOMPUTED_BATCH, SD2_ONLINE_BATCH, SDXL_BATCH = 512, 256, 64
# The matrix's Flux.1 set-up (MLPerf's), whose blocks blocks.py times for a node of NODE_GPUS of this GPU;
# float8 in the recipe measured before.
FLUX_ROW, FLUX_FP8, NODE_GPUS = "flux-precomputed-states-bf16-fsdp", "tensorwise", 8


@dataclass(frozen=True)
class Setting:
    """One row: the model and its benchmark.py settings, from which both the command and the memory
    model's plan are made (so the two cannot disagree)."""

    model_config: str = "sd2-base"
    image_size: int | None = None  # None: the family's training resolution (512 for SD2, 1024 for SDXL)
    precomputed: bool = False
    precomputed_format: str | None = None  # with precomputed: TOKENS or TEXT_STATES (None: the family's)
    norm_precision: str = "autocast"
    fsdp: str = "none"  # passed as --fsdp: none (DDP), shard_grad_op or full_shard
    activation_checkpointing: str = "auto"  # benchmark.py's --activation_checkpointing (auto: its default's choice)
    compile: bool = False
    channels_last: bool = False
    microbatch_divisor: int = 1  # 2: half the largest microbatch (is the largest the fastest?)
    global_batch: int = GLOBAL_BATCH
    use_ema: bool = True  # MLPerf's Flux.1 reference trains without one
    weight_casts: str = "auto"  # benchmark.py's --weight_casts (auto: step on one GPU without FSDP)
    fp8: str = "off"  # --fp8: float8 training of the denoiser's Linear layers (t2ibench.train.fp8)

    @property
    def family(self):
        from t2ibench.families import family_of

        return family_of(self.model_config)

    @property
    def resolution(self) -> int:
        return self.image_size or self.family.default_image_size(self.model_config)

    @property
    def text_format(self) -> str | None:
        """What the batches carry for the text: None online, else the precomputed format."""
        return batch_text_format(self.family, self.precomputed, self.precomputed_format)

    @property
    def needs_pretrained(self) -> bool:
        """Whether the step runs SD2's frozen parts (VAE or text encoder), which the run looks up by
        --model_name; the other families' rows run random ones where they run any (synthetic data)."""
        return self.model_config == "sd2-base" and self.text_format != TEXT_STATES

    def flags(self) -> list[str]:
        """benchmark.py flags of this row beyond the common ones."""
        flags = ["--model_config", self.model_config, "--image_size", str(self.resolution), "--fsdp", self.fsdp]
        if self.precomputed:
            flags += ["--precomputed", "--precomputed_format", self.text_format]
        if self.norm_precision != "autocast":
            flags += ["--norm_precision", self.norm_precision]
        if self.weight_casts != "auto":
            flags += ["--weight_casts", self.weight_casts]
        if self.fp8 != "off":
            flags += ["--fp8", self.fp8]
        if self.activation_checkpointing != "auto":
            flags += ["--activation_checkpointing", self.activation_checkpointing]
        flags += [flag for flag, on in (("--compile", self.compile), ("--channels_last", self.channels_last)) if on]
        return flags

    def describe(self) -> str:
        """The set-up in a few words, for a matrix row's line of the report."""
        data = {None: "images and captions encoded in the step", TEXT_STATES: "precomputed latents and text states"
                }.get(self.text_format, "precomputed latents and token ids")
        words = [f"{self.model_config} {self.resolution}", data, "EMA" if self.use_ema else "no EMA",
                 f"global batch {self.global_batch}"]
        words += [f"--{flag} {value}" for flag, value, default in (
            ("fsdp", self.fsdp, "none"), ("activation_checkpointing", self.activation_checkpointing, "auto"),
            ("norm_precision", self.norm_precision, "autocast"), ("weight_casts", self.weight_casts, "auto"),
            ("fp8", self.fp8, "off")) if value != default]
        words += [flag for flag, on in (("--compile", self.compile), ("--channels_last", self.channels_last),
                                        ("half the microbatch", self.microbatch_divisor == 2)) if on]
        return ", ".join(words)


_TEXT_STATES = dict(precomputed=True, precomputed_format=TEXT_STATES)
_MLPERF_FLUX = dict(global_batch=MLPERF_FLUX_GLOBAL_BATCH, use_ema=False)
MATRIX: dict[str, Setting] = {
    "online-bf16": Setting(),
    "online-bf16-half-microbatch": Setting(microbatch_divisor=2),
    "online-bf16-fp32norms": Setting(norm_precision="fp32"),
    "online-bf16-compile": Setting(compile=True),
    "online-bf16-compile-cl": Setting(compile=True, channels_last=True),
    "precomputed-bf16": Setting(precomputed=True),
    # Precomputed batches carry token ids by default (the text encoder runs); these, text states.
    "precomputed-states-bf16": Setting(**_TEXT_STATES),
    "precomputed-bf16-compile": Setting(precomputed=True, compile=True),
    "precomputed-states-bf16-compile": Setting(**_TEXT_STATES, compile=True),
    # MosaicML's later SD2 trainer: precomputed latents under FSDP SHARD_GRAD_OP.
    "precomputed-bf16-fsdp": Setting(precomputed=True, fsdp="shard_grad_op"),
    # SDXL base at 1024 on precomputed latents and text states (its two text encoders out of the step):
    # under DDP its 2.6B parameters' training state leaves an 80 GB GPU room for one image; sharded,
    # for more.
    "sdxl-precomputed-states-bf16": Setting("sdxl-base", **_TEXT_STATES),
    "sdxl-precomputed-states-bf16-fsdp": Setting("sdxl-base", **_TEXT_STATES, fsdp="shard_grad_op"),
    # Launch-bound on one GPU (docs/speed.md): weight casts per microbatch (autocast's, the old default)
    # against once per step (the default on one GPU); then each block recomputed in backward, which
    # lets a microbatch of 32 fit (bench/step_ops.py: 265 kernels per image instead of 3,411).
    "sdxl-precomputed-states-bf16-castsmb": Setting("sdxl-base", **_TEXT_STATES, weight_casts="microbatch"),
    "sdxl-precomputed-states-bf16-ckpt": Setting("sdxl-base", **_TEXT_STATES, activation_checkpointing="on"),
    "sdxl-precomputed-states-bf16-ckpt-compile": Setting("sdxl-base", **_TEXT_STATES, activation_checkpointing="on",
                                                         compile=True),
    # Without checkpointing: what `auto` weighs against checkpointing (on one H100, 9.4 images/s at
    # microbatch 2 against 14.8 with it at 32: docs/speed.md).
    "sdxl-precomputed-states-bf16-nockpt": Setting("sdxl-base", **_TEXT_STATES, activation_checkpointing="off"),
    "precomputed-bf16-castsmb": Setting(precomputed=True, weight_casts="microbatch"),
    # Flux.1-schnell as MLPerf Training v5.1 trains it: 256x256, T5 and CLIP outputs precomputed, the
    # 11.9B-parameter transformer sharded (its training state fits no single GPU). The default row is
    # the set-up docs/flux.md derives: every block recomputed in backward, so that the whole per-GPU
    # batch (64 on 8 GPUs) is one microbatch, under shard_grad_op, so that each step gathers the bf16
    # weights once and reduce-scatters the gradients once (62 GB per GPU on 8, against 666 GB for
    # full_shard at microbatch 8 without checkpointing: bench/blocks.py, predicted from an H100's
    # blocks). Then full_shard with checkpointing (one microbatch too, the weights gathered again for
    # backward) and without (microbatch 8: eight gathers and reduce-scatters per step).
    "flux-precomputed-states-bf16-fsdp": Setting("flux1-schnell", 256, **_TEXT_STATES, fsdp="shard_grad_op",
                                                 activation_checkpointing="on", **_MLPERF_FLUX),
    "flux-precomputed-states-bf16-fsdp-ckpt": Setting("flux1-schnell", 256, **_TEXT_STATES, fsdp="full_shard",
                                                      activation_checkpointing="on", **_MLPERF_FLUX),
    "flux-precomputed-states-bf16-fsdp-nockpt": Setting("flux1-schnell", 256, **_TEXT_STATES, fsdp="full_shard",
                                                        activation_checkpointing="off", **_MLPERF_FLUX),
    # The same with T5-XXL, CLIP and the VAE in the step (online encoding; not MLPerf's set-up): their 9 GiB
    # leave shard_grad_op room for 32 images only, two microbatches, so full_shard, whose one checkpointed
    # microbatch of 64 sends less (83 GB per GPU per step against 125).
    "flux-online-bf16-fsdp": Setting("flux1-schnell", 256, fsdp="full_shard", activation_checkpointing="on",
                                     **_MLPERF_FLUX),
}


@dataclass(frozen=True)
class ReportRow:
    """One row: a benchmark.py run of `setting`, blocks.py timing the blocks of `blocks_of`, or blocks.py
    predicting the run of row `compare_with` and compared with it."""

    name: str
    what: str
    setting: Setting | None = None
    blocks_of: Setting | None = None
    compare_with: str | None = None
    baseline: str | None = None  # the row of this report its figure is divided by, if any


REPORT_ROWS = [
    ReportRow("sd2-512-precomputed", "SD2 base 512, precomputed latents and token ids, EMA, eager",
              setting=dataclasses.replace(MATRIX["precomputed-bf16"], global_batch=SD2_PRECOMPUTED_BATCH)),
    ReportRow("sd2-512-precomputed-compile", "the same, --compile",
              setting=dataclasses.replace(MATRIX["precomputed-bf16-compile"], global_batch=SD2_PRECOMPUTED_BATCH),
              baseline="sd2-512-precomputed"),
    ReportRow("sdxl-1024-compile", "SDXL base 1024, precomputed latents and text states, EMA, the defaults "
              "(checkpointing as auto picks it), --compile",
              setting=dataclasses.replace(MATRIX["sdxl-precomputed-states-bf16"], compile=True,
                                          global_batch=SDXL_BATCH)),
    ReportRow("sd2-512-online", "SD2 base 512, VAE and text encoder in the step, EMA, eager",
              setting=dataclasses.replace(MATRIX["online-bf16"], global_batch=SD2_ONLINE_BATCH)),
    ReportRow("flux-blocks-bf16", "Flux.1-schnell 256 blocks, bf16, compiled",
              blocks_of=dataclasses.replace(MATRIX[FLUX_ROW], compile=True)),
    ReportRow("flux-blocks-fp8", f"the same in float8 ({FLUX_FP8})",
              blocks_of=dataclasses.replace(MATRIX[FLUX_ROW], compile=True, fp8=FLUX_FP8), baseline="flux-blocks-bf16"),
    ReportRow("blocks-sd2", "blocks.py's prediction of sd2-512-precomputed", compare_with="sd2-512-precomputed"),
    ReportRow("blocks-sdxl", "blocks.py's prediction of sdxl-1024-compile", compare_with="sdxl-1024-compile"),
]
# The whole matrix, each setting as a training row of its own name.
MATRIX_ROWS = [ReportRow(name, setting.describe(), setting=setting) for name, setting in MATRIX.items()]
ROWS = REPORT_ROWS + MATRIX_ROWS  # the order rows run in, whichever are chosen
ROW_NAMES = [row.name for row in ROWS]
# --rows names for several rows: the report's (the default), the whole matrix, or every row.
ROW_GROUPS = {"report": [row.name for row in REPORT_ROWS], "matrix": list(MATRIX), "all": ROW_NAMES}


def smoke_setting(setting: Setting, gpus: int) -> Setting:
    """The row as --smoke runs it: the family's tiny model at small images, two microbatches per rank; DDP
    on one rank (benchmark.py refuses to shard over a single rank)."""
    return dataclasses.replace(setting, model_config=SMOKE_CONFIGS[setting.model_config], image_size=SMOKE_IMAGE_SIZE,
                               fsdp="none" if gpus == 1 else setting.fsdp, global_batch=gpus * 2 * SMOKE_MICROBATCH)


def smoke_flags(setting: Setting, gpus: int) -> list[str]:
    """--smoke's overrides (smoke_setting's), and no loader workers."""
    tiny = smoke_setting(setting, gpus)
    flags = ["--model_config", tiny.model_config, "--image_size", str(tiny.resolution), "--num_workers", "0"]
    if tiny.fsdp != setting.fsdp:
        flags += ["--fsdp", tiny.fsdp]
    return flags
