"""GPU throughput matrix: SD2 base at 512x512 and SDXL base at 1024x1024 with EMA at the global batch
of the cost table (2048), and Flux.1-schnell at 256x256 as MLPerf Training v5.1 runs it (no EMA,
global batch 512); one `benchmark.py` run per setting.

    python bench/bench_gpu.py --out results/h100x8              # every setting, all visible GPUs
    python bench/bench_gpu.py --out results/h100x8-flux --only flux-precomputed-states-bf16-fsdp   # MLPerf's set-up
    python bench/bench_gpu.py --out /tmp/b --quick              # two settings
    python bench/bench_gpu.py --dry_run --gpus 8 --gpu_memory_gib 79.1   # plan a node you are not on
    python bench/bench_gpu.py --out /tmp/b --only online-bf16 flux-precomputed-states-bf16-fsdp
    python bench/bench_gpu.py --out /tmp/b --smoke              # no GPU: the tiny models on CPU, to check the tool
    python bench/bench_gpu.py --out results/h100x8-flux-fp8 --only flux-precomputed-states-bf16-fsdp --fp8 tensorwise

It needs only the project's requirements. Each setting runs in its own launch (`composer -n GPUS
benchmark.py ...`: a fresh CUDA context, so peak memory and compile caches do not leak between
settings) at its global batch (2048, the batch `cost.py` prices; Flux.1: MLPerf's 512) by gradient
accumulation: per-step costs
(AdamW over the denoiser's parameters, the EMA, the gradient all-reduce or reduce-scatter) are
spread over the same images as in a real run. Each row's microbatch is the largest the memory model
(t2ibench.memory) fits in the GPU's memory with that row's model, resolution and settings, and rows
that do not set activation checkpointing take benchmark.py's default (`auto`: with or without it,
as t2ibench.gpu_setup picks for the node); the printed commands say it. Before starting it prints the rows, their microbatches and an estimate of
the time the matrix takes; `--dry_run` stops there.

A launch that runs past `--timeout_s` is ended with its whole process group (Composer's launcher,
its ranks and their loader workers), so no rank lives on holding a GPU while the next row runs.
SD2 rows whose step runs the VAE or the text encoder need them pretrained, from a local folder or
the Hugging Face cache (`--model_name`), or every rank of every row would try to download them:
without them the matrix refuses at start, unless `--allow_random_encoders` (throughput does not
depend on the weights; the ranks then do not try the hub). The SDXL and Flux.1 rows train on
precomputed text states (no frozen part in the step) and never look for pretrained parts.

It leaves in `--out`:

    <setting>.json     benchmark.py's results (images/s, MFU and the trained network's MFU, memory,
                       device, versions...) plus the memory model's prediction; cost.py reads it:
                       python cost.py OUT/<setting>.json
    logs/<setting>.log the launch's full output, command first
    table.md           the table of all settings, under a line with device, versions and date
    environment.json   device, GPU count, library versions, date, the command line
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project root
sys.path.insert(0, str(ROOT))

from t2ibench.fp8 import FP8_MODES, MIN_CAPABILITY  # noqa: E402
from t2ibench.cli import GPU_COUNT, GPU_MEMORY_GIB, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, Parser  # noqa: E402
from t2ibench.files import write_text  # noqa: E402
from t2ibench.locations import check_output  # noqa: E402
from t2ibench.precomputed import TEXT_STATES, batch_text_format  # noqa: E402

GLOBAL_BATCH = 2048  # cost.py's batch (the 2023 benchmark's and the SD2 recipe's)
# MLPerf Training v5.1's Flux.1 global batch in NVIDIA's 16-GPU entries (its 512-GPU ones use 2048).
MLPERF_FLUX_GLOBAL_BATCH = 512
DEFAULT_MODEL_NAME = "stabilityai/stable-diffusion-2-base"  # --model_name: the SD2 rows' pretrained parts
# --smoke: each family's tiny configuration (same structure, a few million parameters).
SMOKE_CONFIGS = {"sd2-base": "tiny", "sdxl-base": "sdxl-tiny", "flux1-schnell": "flux1-tiny"}


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
    fp8: str = "off"  # --fp8: float8 training of the denoiser's Linear layers (t2ibench.fp8)

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
QUICK = ["online-bf16", "precomputed-bf16"]
# --smoke: the same settings on each family's tiny model at 32x32 on CPU, a small batch.
SMOKE_IMAGE_SIZE = 32
SMOKE_MICROBATCH = 2

# The time estimate: seconds per launch before the first batch (imports, model, loader workers,
# NCCL), seconds of compilation per --compile row (UNet, VAE encoder and text encoder with
# inductor), and the share of peak FLOP/s a step reaches (this project's estimate for SD2 on an
# H100: 45-55 images/s online, 70-85 precomputed, about 18% MFU; taken for every row, so the
# estimate errs long for the transformer).
STARTUP_SECONDS = 90
COMPILE_SECONDS = 300
ASSUMED_MFU = 0.18
# Peak dense bf16 FLOP/s by device name (Composer's table, which needs a Trainer state to ask).
PEAK_TFLOPS = (("h200", 989.5), ("h100", 989.5), ("a100", 312.0), ("a10", 125.0))
TERMINATE_GRACE_SECONDS = 30


def fail(message: str) -> None:
    raise SystemExit(f"bench_gpu.py: error: {message}")


@dataclass
class Row:
    """A setting planned for a node: its command and what the memory model predicts."""

    name: str
    setting: Setting
    microbatch: int
    batch_size: int
    command: list[str]
    plan: dict = field(default_factory=dict)
    activation_checkpointing: bool = False  # as the run resolves the row's flag on this node


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


def plan_options(setting: Setting, gpus: int, on_gpu: bool = True) -> dict:
    """The memory model's options for a row's step (t2ibench.memory.plan, gpu_setup.choose_setup) but
    checkpointing, which the node decides."""
    from t2ibench.weight_casts import resolve_weight_casts

    return dict(norm_precision=setting.norm_precision, precomputed=setting.precomputed,
                precomputed_format=setting.text_format, fsdp=setting.fsdp, num_gpus=gpus,
                use_ema=setting.use_ema, fp8=setting.fp8,
                weight_casts=resolve_weight_casts(setting.weight_casts, on_gpu=on_gpu, precision="amp_bf16",
                                                  world_size=gpus))


def plan_row(name: str, setting: Setting, gpus: int, gpu_memory_bytes: float, out: Path, batches: int,
             warmup: int, smoke: bool, model_name: str) -> Row:
    """The row's set-up (checkpointing as benchmark.py's flag resolves it on this node, and the memory
    model's largest microbatch for it) and its full command."""
    from t2ibench import memory
    from t2ibench.gpu_setup import choose_setup, from_flag

    per_device = setting.global_batch // gpus
    plan = {}
    checkpointing = from_flag(setting.activation_checkpointing)[0]  # --smoke runs on a CPU
    if smoke:
        microbatch, batch_size = SMOKE_MICROBATCH, smoke_setting(setting, gpus).global_batch
    else:
        options = plan_options(setting, gpus)
        # Microbatches are powers of two: the largest one at most the per-GPU batch caps them.
        setup = choose_setup(setting.model_config, setting.resolution, gpu_memory_bytes,
                             1 << (per_device.bit_length() - 1),
                             activation_checkpointing=setting.activation_checkpointing, **options)
        checkpointing = setup.activation_checkpointing
        plan = memory.plan(setting.model_config, setting.resolution, gpu_memory_bytes,
                           activation_checkpointing=checkpointing, **options)
        microbatch = max(1, min(plan["microbatch"], per_device) // setting.microbatch_divisor)
        # The row's global batch when the GPU count divides it; else the largest per-device multiple of
        # the microbatch below it.
        batch_size = gpus * max(microbatch, per_device // microbatch * microbatch)
        plan = {**plan, "microbatch": microbatch, "activation_checkpointing_reason": setup.reason,
                "predicted_bytes_at_microbatch": memory.predicted_bytes(plan, microbatch)}
    launcher = [sys.executable, "-m", "composer.cli.launcher", "-n", str(gpus)]
    # Only rows whose step runs a frozen part look it up (--model_name is SD2's); the others build none.
    pretrained = ["--model_name", model_name] if setting.needs_pretrained else []
    command = [*launcher, str(ROOT / "benchmark.py"), "--use_synth_data", *(["--use_ema"] if setting.use_ema else []), "--precision", "amp_bf16",
               "--batch_size", str(batch_size), "--device_train_microbatch_size", str(microbatch),
               "--max_duration", f"{batches}ba", "--warmup_batches", str(warmup), "--num_workers", "8",
               "--log_interval", "5ba", *pretrained, "--results_json", str(out / f"{name}.json"), *setting.flags(),
               *(smoke_flags(setting, gpus) if smoke else [])]  # later flags win: --smoke's override
    return Row(name, setting, microbatch, batch_size, command, plan, checkpointing)


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


def estimate_seconds(row: Row, gpus: int, batches: int, peak_flops: float) -> float:
    """Wall time of one row: start-up, compilation, and the batches at ASSUMED_MFU."""
    setting = row.setting
    flops = flops_per_image(setting.model_config, setting.resolution, setting.precomputed, setting.text_format,
                            row.activation_checkpointing)
    images_per_sec = gpus * peak_flops * ASSUMED_MFU / flops
    return STARTUP_SECONDS + (COMPILE_SECONDS if row.setting.compile else 0) + batches * row.batch_size / images_per_sec


def run_command(command: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> int | str:
    """Run `command` in its own session, output to `log_path`; past `timeout_s` end its whole process
    group (SIGTERM, then SIGKILL after TERMINATE_GRACE_SECONDS) and return "timeout".

    subprocess.run(timeout=) kills only the process it started: Composer's launcher. Its ranks
    (plain Popen children, in the launcher's process group) would live on holding the GPUs, and
    every later row would measure a shared or full GPU. A new session makes the launcher the leader
    of a group that holds the ranks and their loader workers.
    """
    with open(log_path, "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.write(f"\nbench_gpu.py: timeout after {timeout_s:.0f} s: ending the launch's process group\n")
            log.flush()
            return_code: int | str = "timeout"
        except BaseException:  # Ctrl-C: the launch must not outlive the matrix either
            return_code = "interrupted"
            _end_group(process)
            raise
        _end_group(process)
        return return_code


def _end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the launch's process group, SIGKILL to what is left of it after the grace period."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the whole group is gone already
    try:
        process.wait(timeout=TERMINATE_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # ranks or workers that outlived the launcher
    except ProcessLookupError:
        pass
    process.wait()


def launch_env(setting: Setting, pretrained: bool) -> dict:
    """The environment of a row's launch: without the pretrained parts, or for a row whose step runs
    none, HF_HUB_OFFLINE=1, so that no rank tries the hub (the run builds random parts instead)."""
    env = {**os.environ}
    if not pretrained or not setting.needs_pretrained:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_row(row: Row, out: Path, timeout_s: float, env: dict, announce: bool = True) -> dict:
    start = time.time()
    log_path = out / "logs" / f"{row.name}.log"
    write_text(log_path, shlex.join(row.command) + "\n")
    code = run_command(row.command, log_path, timeout_s, env)
    # The model as launched: the command's last --model_config and --image_size (--smoke's override them).
    flags = {row.command[i]: row.command[i + 1] for i in range(len(row.command) - 1) if row.command[i].startswith("--")}
    result = {"name": row.name, "model": f"{flags['--model_config']} {flags['--image_size']}",
              "status": "ok" if code == 0 else f"failed ({code}), see logs/{row.name}.log",
              "wall_s": time.time() - start, "predicted_bytes": row.plan.get("predicted_bytes_at_microbatch")}
    if code == 0:
        result.update(json.loads((out / f"{row.name}.json").read_text()))
        if row.plan:  # the prediction beside the measurement, in the JSON cost.py reads
            result["memory_model"] = row.plan
            write_text(out / f"{row.name}.json", json.dumps({**json.loads((out / f"{row.name}.json").read_text()),
                                                            "memory_model": row.plan}, indent=2) + "\n")
    if announce:
        print(f"{row.name}: {result['status']} in {result['wall_s']:.0f}s", flush=True)
    return result


def table(results: list[dict]) -> str:
    rows = ["| setting | model | microbatch | images/s | per GPU | MFU | trained-network MFU "
            "| peak memory GiB (reserved) | predicted GiB | data wait | final loss | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        predicted = f"{r['predicted_bytes'] / 2**30:.1f}" if r.get("predicted_bytes") else ""
        if not r["status"].startswith("ok"):
            rows.append(f"| {r['name']} | {r['model']} | | | | | | | {predicted} | | | {r['status']} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        unet_mfu = f"{100 * r['mfu_trained_network']:.1f}%" if r.get("mfu_trained_network") else "n/a"
        reserved = f" ({r['peak_memory_reserved_bytes'] / 2**30:.1f})" if r.get("peak_memory_reserved_bytes") else ""
        wait = f"{100 * r['data_wait_fraction']:.1f}%" if r.get("data_wait_fraction") is not None else "n/a"
        rows.append(f"| {r['name']} | {r['model']} | {r['device_train_microbatch_size']} | {r['images_per_sec']:.1f} "
                    f"| {r['images_per_sec_per_device']:.1f} | {mfu} | {unet_mfu} "
                    f"| {r['peak_memory_bytes'] / 2**30:.1f}{reserved} | {predicted} | {wait} "
                    f"| {r['final_loss']:.4f} | ok |")
    return "\n".join(rows)


def environment(gpus: int, smoke: bool, argv: list[str]) -> dict:
    import torch

    from t2ibench import stack

    return {
        "device": "cpu (--smoke)" if smoke else torch.cuda.get_device_name(0),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": stack.versions(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
    }


def pretrained_available(model_name: str) -> bool:
    """Whether the VAE and text encoder of `model_name` load without the network: a local diffusers
    folder, or a hub id whose configs and weights are in the local Hugging Face cache."""
    if Path(model_name).is_dir():
        return all(Path(model_name, part, "config.json").is_file() for part in ("vae", "text_encoder"))
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        try:
            return isinstance(try_to_load_from_cache(model_name, filename), str)
        except ValueError:  # not a hub id either (HFValidationError): a path that does not exist
            return False

    return all(cached(f"{part}/config.json") and any(cached(f"{part}/{weights}") for weights in (
        "diffusion_pytorch_model.safetensors", "model.safetensors", "diffusion_pytorch_model.bin", "pytorch_model.bin"))
        for part in ("vae", "text_encoder"))


def peak_tflops_of(device_name: str) -> float | None:
    name = device_name.lower()
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def build_parser() -> Parser:
    p = Parser("bench_gpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="results folder (JSON per setting, logs, table)")
    p.add_argument("--gpus", type=GPU_COUNT, default=None, help="GPUs per setting (default: all visible)")
    p.add_argument("--gpu_memory_gib", type=GPU_MEMORY_GIB, default=None,
                   help="memory of one GPU in GiB for the microbatches (default: the visible GPU's, as torch "
                        "reports it; an 80 GB A100/H100 reports 79.1)")
    p.add_argument("--peak_tflops", type=POSITIVE_FLOAT, default=None,
                   help="peak bf16 TFLOP/s of one GPU for the time estimate (default: the visible GPU's, else an H100's)")
    p.add_argument("--batches", type=POSITIVE_INT, default=25, help="batches of 2048 images per setting, warm-up included")
    p.add_argument("--warmup_batches", type=NON_NEGATIVE_INT, default=5, help="batches left out of the measurement")
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--only", nargs="+", default=None, help=f"settings to run, from {list(MATRIX)}")
    p.add_argument("--timeout_s", type=POSITIVE_INT, default=1800,
                   help="limit per setting, seconds; past it the launch's whole process group is ended")
    p.add_argument("--dry_run", action="store_true",
                   help="print each setting's full command, microbatch and the time estimate; run nothing")
    p.add_argument("--model_name", default=DEFAULT_MODEL_NAME,
                   help="local diffusers folder or cached hub id with SD2's pretrained VAE and text encoder (the "
                        "SD2 rows that run them; the SDXL and Flux.1 rows need none)")
    p.add_argument("--allow_random_encoders", action="store_true",
                   help="run without the pretrained VAE/text encoder (random ones; no rank tries the hub)")
    p.add_argument("--fp8", default="off", choices=FP8_MODES,
                   help="float8 training of the denoiser's Linear layers in every row, compiled (benchmark.py's --fp8 "
                        "--compile; needs compute capability 8.9: Ada, Hopper, Blackwell)")
    p.add_argument("--smoke", action="store_true",
                   help="check the tool without a GPU: each family's tiny model, 32x32, on CPU (figures mean nothing)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    names = args.only or (QUICK if args.quick else list(MATRIX))
    unknown = [n for n in names if n not in MATRIX]
    if unknown:
        fail(f"--only: unknown settings {unknown}; choose from {list(MATRIX)}")
    if args.batches <= args.warmup_batches:
        fail(f"--batches {args.batches} must exceed --warmup_batches {args.warmup_batches}")
    if args.gpus is not None and args.gpus < 1:
        fail(f"--gpus {args.gpus} must be >= 1")
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0:
        fail(f"--gpu_memory_gib {args.gpu_memory_gib} must be positive")
    if args.timeout_s <= 0:
        fail(f"--timeout_s {args.timeout_s} must be positive")
    if not args.dry_run and args.out is None:
        fail("--out is required (the folder for the results), unless --dry_run")
    problem = check_output("--out", str(args.out) if args.out else None, folder=True)
    if problem:  # an existing file, or a place that cannot be written: refused before any run
        fail(problem)
    return argparse.Namespace(**vars(args), names=names)  # the parsed namespace is left as it was parsed


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    # Only rows whose step runs the VAE or a text encoder look for pretrained parts (SD2's, --model_name).
    needed = any(MATRIX[name].needs_pretrained for name in args.names)
    pretrained = args.smoke or not needed or pretrained_available(args.model_name)
    refusal = (f"pretrained VAE and text encoder of --model_name {args.model_name} are neither a local folder nor in "
               "the Hugging Face cache: every rank of every SD2 row that runs them would try the hub (1.7 GB each, "
               "or time out offline); download them once and pass --model_name /path/to/stable-diffusion-2-base, "
               "or pass --allow_random_encoders (throughput does not depend on the weights)")
    if not pretrained and not args.allow_random_encoders and not args.dry_run:
        fail(refusal)

    import torch

    visible = torch.cuda.device_count()
    if not (args.smoke or args.dry_run) and visible == 0:
        fail("no CUDA GPU visible (torch.cuda.device_count() is 0): run it on a GPU node, plan one with --dry_run "
             "--gpus N --gpu_memory_gib M, or pass --smoke to check the tool on CPU")
    if args.dry_run and visible == 0 and not args.smoke and (args.gpus is None or args.gpu_memory_gib is None):
        fail("--dry_run without a visible GPU needs --gpus and --gpu_memory_gib (the node to plan for)")
    gpus = args.gpus or (visible if not args.smoke else 1)
    if not (args.smoke or args.dry_run) and gpus > visible:
        fail(f"--gpus {gpus}: only {visible} visible")
    if args.gpu_memory_gib is not None:
        gpu_memory_bytes = args.gpu_memory_gib * 2**30
    else:
        gpu_memory_bytes = torch.cuda.get_device_properties(0).total_memory if visible else 0
    device_name = torch.cuda.get_device_name(0) if visible else ""
    peak_tflops = args.peak_tflops or peak_tflops_of(device_name) or 989.5
    if not pretrained and not args.allow_random_encoders:  # --dry_run plans for another node: a note only
        print(f"note: on this machine, {refusal}", flush=True)
    out = (args.out or Path("bench-gpu-results")).absolute()
    if args.fp8 != "off" and not (args.smoke or args.dry_run) and torch.cuda.get_device_capability() < MIN_CAPABILITY:
        fail(f"--fp8 {args.fp8}: {torch.cuda.get_device_name()} has no float8 tensor cores (compute capability "
             f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} and up: Ada, Hopper, Blackwell); drop --fp8")
    # Float8 runs compiled (benchmark.py refuses --fp8 without --compile: eager float8 is slower than bf16).
    settings = {n: dataclasses.replace(MATRIX[n], fp8=args.fp8, compile=True) if args.fp8 != "off" else MATRIX[n]
                for n in args.names}
    rows = [plan_row(n, settings[n], gpus, gpu_memory_bytes, out, args.batches, args.warmup_batches, args.smoke,
                     args.model_name) for n in args.names]
    seconds = [estimate_seconds(row, gpus, args.batches, peak_tflops * 1e12) for row in rows] if not args.smoke else []
    memory_gib = gpu_memory_bytes / 2**30
    print(f"{len(rows)} settings on {gpus} GPU(s){f' of {memory_gib:.1f} GiB' if not args.smoke else ''}, "
          f"{args.batches} batches each ({args.warmup_batches} warm-up)"
          + ("; each row at its global batch by gradient accumulation" if not args.smoke else ""), flush=True)
    for row, row_s in zip(rows, seconds or [None] * len(rows)):
        accumulation = row.batch_size // gpus // row.microbatch
        predicted = row.plan.get("predicted_bytes_at_microbatch")
        print(f"  {row.name} ({row.setting.model_config} {row.setting.resolution}): microbatch {row.microbatch} "
              f"x {accumulation} per GPU per step, global batch {row.batch_size}, activation checkpointing "
              f"{'on' if row.activation_checkpointing else 'off'}"
              + (f", predicted {predicted / 2**30:.1f} GiB" if predicted else "")
              + (f", about {row_s / 60:.1f} min" if row_s else ""), flush=True)
        if args.dry_run:
            if row.plan:
                print(f"    checkpointing: {row.plan['activation_checkpointing_reason']}", flush=True)
            print(f"    {shlex.join(row.command)}", flush=True)
    if seconds:
        compiles = sum(row.setting.compile for row in rows)
        print(f"estimated time: about {sum(seconds) / 60:.0f} minutes ({len(rows)} launches of about "
              f"{STARTUP_SECONDS / 60:.1f} min start-up, {compiles} compiling about {COMPILE_SECONDS / 60:.0f} min, "
              f"steps at an assumed {100 * ASSUMED_MFU:.0f}% MFU of {peak_tflops:.0f} TFLOP/s)", flush=True)
    if args.dry_run:
        return [{"name": row.name, "model_config": row.setting.model_config, "image_size": row.setting.resolution,
                 "microbatch": row.microbatch, "activation_checkpointing": row.activation_checkpointing,
                 "batch_size": row.batch_size, "command": row.command, "plan": row.plan,
                 "estimated_seconds": s} for row, s in zip(rows, seconds or [None] * len(rows))]

    (out / "logs").mkdir(parents=True, exist_ok=True)
    info = environment(gpus, args.smoke, argv)
    write_text(out / "environment.json", json.dumps(info, indent=2) + "\n")
    results = []
    for row in rows:
        results.append(run_row(row, out, args.timeout_s, launch_env(row.setting, pretrained)))

    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    header = (f"{gpus} x {info['device']}, {versions}, Python {info['python']}, {info['date_utc']}; "
              f"{'tiny models at 32x32 (--smoke), ' if args.smoke else ''}synthetic data, amp_bf16, EMA and "
              f"global batch {GLOBAL_BATCH} (Flux.1: no EMA, global batch {MLPERF_FLUX_GLOBAL_BATCH}), microbatch from the memory "
              f"model (t2ibench.memory), {args.batches} batches ({args.warmup_batches} warm-up); MFU counts the "
              f"encoders' forward passes, trained-network MFU the denoiser's forward and backward only. Cost: "
              f"python cost.py {out}/<setting>.json")
    text = header + "\n\n" + table(results) + "\n"
    write_text(out / "table.md", text)
    print("\n" + text)
    return results


if __name__ == "__main__":
    main()
