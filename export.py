"""Turn a Composer checkpoint of benchmark.py into a diffusers StableDiffusionPipeline folder.

    python export.py runs/sd2/ep0-ba1000-rank0.pt --out sd2-pipeline          # trained UNet
    python export.py s3://bucket/run/latest-rank0.pt --out sd2-pipeline --ema  # EMA UNet
    python -c "from diffusers import StableDiffusionPipeline as P; P.from_pretrained('sd2-pipeline')"

The folder holds unet/, vae/, text_encoder/, tokenizer/, scheduler/ and model_index.json. The
UNet's configuration is recognised from the checkpoint's weight shapes. The VAE and text encoder
are the ones in the checkpoint when the run trained with them; after a run on precomputed latents
they are loaded from `--model_name` (or, for the tiny model, rebuilt from `--seed` as latents.py
built them). No safety checker is included (`requires_safety_checker=False`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel

from model import MODEL_CONFIGS, build_encoders_aside
from sample import SAMPLERS, make_sampler


def fail(message: str) -> None:
    raise SystemExit(f"export.py: error: {message}")


def write_pipeline(out: str | os.PathLike, unet: UNet2DConditionModel, vae, text_encoder, tokenizer,
                   noise_scheduler_config, sampler: str = "ddim") -> None:
    """Save a complete StableDiffusionPipeline folder; the scheduler is `sampler` on the training schedule."""
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=make_sampler(sampler, noise_scheduler_config), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipeline.save_pretrained(out, safe_serialization=True)


def load_checkpoint(path: str) -> dict:
    """The checkpoint's state, from a local path or an object-store URI (Composer's get_file)."""
    if "://" not in path:
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
            fail("--ema: the EMA was saved as FSDP1 flat shards (benchmark.py's --fsdp saves whole tensors); "
                 "export from a checkpoint of benchmark.py")
    fail("--ema: the checkpoint holds no EMA state (trained without --use_ema)")


def detect_config(unet_weights: dict[str, torch.Tensor]) -> str:
    """The MODEL_CONFIGS entry whose UNet has exactly these weight names and shapes."""
    for name, cfg in MODEL_CONFIGS.items():
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in UNet2DConditionModel(**cfg["unet"]).state_dict().items()}
        if shapes == {k: tuple(v.shape) for k, v in unet_weights.items()}:
            return name
    fail("the checkpoint's UNet matches none of the model configurations " + str(sorted(MODEL_CONFIGS)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="Composer checkpoint of benchmark.py: a path or s3://, gs://, oci://... URI")
    p.add_argument("--out", required=True, help="folder to write the pipeline to (must be empty or absent)")
    p.add_argument("--ema", action="store_true", help="export the EMA weights of the UNet (run with --use_ema)")
    p.add_argument("--scheduler", default="ddim", choices=sorted(SAMPLERS), help="the pipeline's sampler")
    p.add_argument("--model_name", default="stabilityai/stable-diffusion-2-base",
                   help="where the VAE/text encoder come from when the checkpoint has none (precomputed runs)")
    p.add_argument("--seed", type=int, default=17, help="benchmark.py --seed of a tiny precomputed run (random encoders)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out {out} exists and is not an empty folder; choose a new one (nothing is overwritten)")
    state = load_checkpoint(args.checkpoint).get("state")
    if not isinstance(state, dict) or "model" not in state:
        fail(f"CHECKPOINT {args.checkpoint} is not a Composer checkpoint (no state.model)")
    weights = {k.removeprefix("module."): v for k, v in state["model"].items()}
    if args.ema:
        weights.update(ema_shadow(state))
    unet_weights = {k[len("unet."):]: v for k, v in weights.items() if k.startswith("unet.")}
    if not unet_weights:
        fail(f"CHECKPOINT {args.checkpoint} holds no unet.* weights (not a benchmark.py checkpoint?)")
    unet_weights = {k.replace("_orig_mod.", ""): v for k, v in unet_weights.items()}  # --compile
    config = detect_config(unet_weights)
    unet = UNet2DConditionModel(**MODEL_CONFIGS[config]["unet"])
    unet.load_state_dict({k: v.float() for k, v in unet_weights.items()})

    parts = build_encoders_aside(config, args.model_name, args.seed)
    if config != "tiny" and parts.random:
        fail(f"--model_name {args.model_name}: pretrained {' and '.join(parts.random)} not found; "
             "pass a local diffusers folder of the model the run trained with")
    for name in ("vae", "text_encoder"):
        trained_with = {k[len(name) + 1:]: v for k, v in weights.items() if k.startswith(name + ".")}
        if trained_with:  # the encoders the run itself used
            getattr(parts, name).load_state_dict(trained_with)
    write_pipeline(out, unet, parts.vae, parts.text_encoder, parts.tokenizer, parts.noise_scheduler.config, args.scheduler)
    print(f"wrote a StableDiffusionPipeline ({config}, {'EMA' if args.ema else 'trained'} UNet) to {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
