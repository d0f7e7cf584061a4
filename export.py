"""Turn a Composer checkpoint of benchmark.py into a diffusers pipeline folder (SD2: StableDiffusionPipeline,
Flux.1: FluxPipeline).

    python export.py runs/sd2/ep0-ba1000-rank0.pt --out sd2-pipeline          # trained UNet
    python export.py s3://bucket/run/latest-rank0.pt --out sd2-pipeline --ema  # EMA UNet
    python -c "from diffusers import StableDiffusionPipeline as P; P.from_pretrained('sd2-pipeline')"

    python export.py runs/flux/latest-rank0.pt --out flux-pipeline             # Flux: transformer/, text_encoder_2/...

The folder holds unet/ (Flux: transformer/), vae/, text_encoder/, tokenizer/ (Flux also text_encoder_2/,
tokenizer_2/), scheduler/ and model_index.json. The
model's configuration is recognised from the denoiser's weight shapes. The VAE and text encoder
are the ones in the checkpoint when the run trained with them; after a run on precomputed latents
they are loaded from `--model_name` (or, for the tiny model, rebuilt from `--seed` as latents.py
built them). No safety checker is included (`requires_safety_checker=False`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

from t2ibench import errors
from t2ibench.cli import Parser
from t2ibench.errors import fail
from t2ibench.families import FAMILIES, MODEL_CONFIGS, build_aside, detect_config
from t2ibench.locations import LOAD_SCHEMES, is_remote, normalise, unwritable
from t2ibench.sampling import SAMPLERS, write_pipeline


def load_checkpoint(path: str) -> dict:
    """The checkpoint's state, from a local path or an object-store URI (Composer's get_file)."""
    if not is_remote(path):
        if not Path(path).is_file():
            fail(f"CHECKPOINT {path} is not a file")
        return torch.load(path, map_location="cpu", weights_only=False)
    from composer.utils import get_file
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "checkpoint.pt")
        try:
            get_file(path, local)
        except Exception as e:  # noqa: BLE001 - any download failure is the user's path or credentials
            fail(f"CHECKPOINT {path} could not be downloaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return torch.load(local, map_location="cpu", weights_only=False)


def ema_shadow(state: dict) -> dict[str, torch.Tensor]:
    """The EMA's averaged weights (names as in the model: unet.*) from the checkpoint's algorithms."""
    for entry in state.get("algorithms", []):
        name, algo_state = entry if isinstance(entry, (tuple, list)) else (None, entry)
        if isinstance(algo_state, dict) and "shadow" in algo_state:
            if not algo_state.get("initialized"):
                fail("--ema: the checkpoint's EMA has not started yet (before --ema_start); export without --ema")
            return algo_state["shadow"]
        if isinstance(algo_state, dict) and "shadow_shards" in algo_state:
            fail("--ema: the EMA was saved as FSDP shards; export from a checkpoint of an unsharded run")
    fail("--ema: the checkpoint holds no EMA state (trained without --use_ema)")


def build_parser() -> Parser:
    p = Parser("export.py", description=__doc__)
    p.add_argument("checkpoint", help="Composer checkpoint of benchmark.py: a path or s3://, gs://, oci://... URI")
    p.add_argument("--out", required=True, help="folder to write the pipeline to (must be empty or absent)")
    p.add_argument("--ema", action="store_true", help="export the EMA weights of the denoiser (run with --use_ema)")
    p.add_argument("--scheduler", default=None, choices=sorted(SAMPLERS),
                   help="the pipeline's sampler (default: ddim for SD2, euler, flow-matching, for Flux)")
    p.add_argument("--model_name", default=None,
                   help="where the VAE/text encoders come from when the checkpoint has none (precomputed runs); "
                        "default: the model's hub id (stabilityai/stable-diffusion-2-base, black-forest-labs/FLUX.1-schnell)")
    p.add_argument("--seed", type=int, default=17, help="benchmark.py --seed of a tiny precomputed run (random encoders)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    with errors.command("export.py"):
        return export(args)


def export(args: argparse.Namespace) -> Path:
    checkpoint = normalise("CHECKPOINT", args.checkpoint, LOAD_SCHEMES)
    out = Path(normalise("--out", args.out, ()))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out {out} exists and is not an empty folder; choose a new one (nothing is overwritten)")
    problem = unwritable("--out", str(out), folder=True)
    if problem:
        fail(problem)
    state = load_checkpoint(checkpoint).get("state")
    if not isinstance(state, dict) or "model" not in state:
        fail(f"CHECKPOINT {checkpoint} is not a Composer checkpoint (no state.model)")
    weights = {k.removeprefix("module."): v for k, v in state["model"].items()}
    if args.ema:
        weights.update(ema_shadow(state))
    for family in FAMILIES:
        prefix = family.denoiser_name + "."
        denoiser_weights = {k[len(prefix):].replace("_orig_mod.", ""): v  # "_orig_mod.": --compile
                            for k, v in weights.items() if k.startswith(prefix)}
        if denoiser_weights:
            break
    else:
        fail(f"CHECKPOINT {checkpoint} holds no denoiser weights (not a benchmark.py checkpoint?)")
    config = detect_config(denoiser_weights)
    if config is None:
        fail("the checkpoint's denoiser matches none of the model configurations " + str(sorted(MODEL_CONFIGS)))
    family = MODEL_CONFIGS[config]
    if args.scheduler is not None and args.scheduler not in family.samplers:
        fail(f"--scheduler {args.scheduler} does not sample {config}; choose {' or '.join(family.samplers)}")
    args.model_name = args.model_name or family.default_model_name
    denoiser = family.build(config, denoiser=True, vae=False, text_encoders=False, tokenizers=False).denoiser
    denoiser.load_state_dict({k: v.float() for k, v in denoiser_weights.items()})

    parts = build_aside(family, config, args.model_name, args.seed)
    if config in family.pretrained_configs and parts.random_encoders:
        fail(f"--model_name {args.model_name}: pretrained {' and '.join(parts.random_encoders)} not found; "
             "pass a local diffusers folder of the model the run trained with")
    for name, module in [("vae", parts.vae), *parts.text_encoders.items()]:
        trained_with = {k[len(name) + 1:]: v for k, v in weights.items() if k.startswith(name + ".")}
        if trained_with:  # the encoders the run itself used
            module.load_state_dict(trained_with)
    write_pipeline(out, family, dataclasses.replace(parts, denoiser=denoiser), args.scheduler)
    print(f"wrote a {family.pipeline_class} ({config}, {'EMA' if args.ema else 'trained'} "
          f"{family.denoiser_name}) to {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
