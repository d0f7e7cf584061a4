"""Turn a Composer checkpoint of benchmark.py into a diffusers StableDiffusionPipeline folder.

    python export.py runs/sd2/ep0-ba1000-rank0.pt --out sd2-pipeline          # trained UNet
    python export.py s3://bucket/run/latest-rank0.pt --out sd2-pipeline --ema  # EMA UNet
    python -c "from diffusers import StableDiffusionPipeline as P; P.from_pretrained('sd2-pipeline')"

The folder holds unet/, vae/, text_encoder/, tokenizer/, scheduler/ and model_index.json. The
UNet's configuration is recognised from the checkpoint's weight shapes. The VAE and text encoder
are the ones in the checkpoint when the run trained with them; after a run on precomputed latents
they are loaded from the run's `--model_name` (or, for the tiny model, rebuilt from the seed the run
built them from), both recorded in the checkpoint: `--model_name` points elsewhere (a note names
both), and a `--seed` other than the recorded one is refused. No safety checker is included (`requires_safety_checker=False`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel

import paths
from flags import SEED, Parser
from model import MODEL_CONFIGS, build_encoders_aside
from sample import SAMPLERS, make_sampler


DEFAULT_MODEL_NAME = "stabilityai/stable-diffusion-2-base"  # benchmark.py's default --model_name
DEFAULT_SEED = 17  # benchmark.py's default --seed


def fail(message: str) -> NoReturn:
    raise SystemExit(f"export.py: error: {message}")


def write_pipeline(out: str | os.PathLike, unet: UNet2DConditionModel, vae, text_encoder, tokenizer,
                   noise_scheduler_config, sampler: str = "ddim") -> None:
    """Save a complete StableDiffusionPipeline folder; the scheduler is `sampler` on the training schedule."""
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=make_sampler(sampler, noise_scheduler_config), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipeline.save_pretrained(out, safe_serialization=True)


def read_checkpoint(path: str, name: str) -> dict:
    """torch.load of a local file that must be a Composer checkpoint: anything else is one line naming it."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a text file, a truncated archive, a foreign pickle: the user's file
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        fail(f"CHECKPOINT {name} cannot be read as a PyTorch checkpoint ({type(e).__name__}: {first}); "
             "give a file that benchmark.py --save_folder wrote (a truncated copy: copy it again)")
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state"), dict) \
            or not isinstance(checkpoint["state"].get("model"), dict):
        fail(f"CHECKPOINT {name} is not a Composer checkpoint (it holds {type(checkpoint).__name__}, no state.model); "
             "give a file that benchmark.py --save_folder wrote")
    return checkpoint


def load_checkpoint(path: str) -> dict:
    """The checkpoint, from a local path or an object-store URI (Composer's get_file)."""
    if "://" not in path:
        if not Path(path).is_file():
            fail(f"CHECKPOINT {path} is not a file")
        return read_checkpoint(path, path)
    from composer.utils import get_file
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "checkpoint.pt")
        try:
            get_file(path, local)
        except Exception as e:  # noqa: BLE001 - any download failure is the user's path or credentials
            fail(f"CHECKPOINT {path} could not be downloaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return read_checkpoint(local, path)


def recorded_settings(state: dict) -> dict:
    """What benchmark.py recorded in the checkpoint (its RunRecord callback; older checkpoints have
    only Composer's rank_zero_seed, the --seed, which then built the encoders)."""
    recorded = dict((state.get("callbacks") or {}).get("RunRecord") or {})
    if recorded.get("encoders_seed") is None and isinstance(state.get("rank_zero_seed"), int):
        recorded["encoders_seed"] = state["rank_zero_seed"]
    return recorded


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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="export.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="Composer checkpoint of benchmark.py: a path or s3://, gs://, oci://... URI")
    p.add_argument("--out", required=True, help="folder to write the pipeline to (must be empty or absent)")
    p.add_argument("--ema", action="store_true", help="export the EMA weights of the UNet (run with --use_ema)")
    p.add_argument("--scheduler", default="ddim", choices=sorted(SAMPLERS), help="the pipeline's sampler")
    p.add_argument("--model_name", default=None,
                   help="where the VAE/text encoder come from when the checkpoint has none (precomputed runs); "
                        f"default: the run's, recorded in the checkpoint (or {DEFAULT_MODEL_NAME})")
    p.add_argument("--seed", type=SEED, default=None,
                   help="seed of the random encoders of a tiny precomputed run; default: the one recorded in the "
                        "checkpoint (another value is refused: it would give other encoders)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    try:  # file:///path is the path /path, for every command
        args.checkpoint = paths.from_file_uri("CHECKPOINT", args.checkpoint)
        args.out = paths.from_file_uri("--out", args.out)
    except ValueError as error:
        fail(str(error))
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out {out} exists and is not an empty folder; choose a new one (nothing is overwritten)")
    if paths.scheme(args.out):
        fail(f"--out {args.out}: give a local folder (diffusers writes a pipeline to disk), not a URI")
    problem = paths.check_output(
        "--out", args.out, folder=True, inputs=[("CHECKPOINT", None if "://" in args.checkpoint else args.checkpoint),
                                                ("--model_name", args.model_name if args.model_name and
                                                 Path(args.model_name).is_dir() else None)])
    if problem:
        fail(problem)
    state = load_checkpoint(args.checkpoint)["state"]
    weights = {k.removeprefix("module."): v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    if args.ema:
        weights.update(ema_shadow(state))
    unet_weights = {k[len("unet."):]: v for k, v in weights.items() if k.startswith("unet.")}
    if not unet_weights:
        fail(f"CHECKPOINT {args.checkpoint} holds no unet.* weights (not a benchmark.py checkpoint?)")
    unet_weights = {k.replace("_orig_mod.", ""): v for k, v in unet_weights.items()}  # --compile
    config = detect_config(unet_weights)
    unet = UNet2DConditionModel(**MODEL_CONFIGS[config]["unet"])
    unet.load_state_dict({k: v.float() for k, v in unet_weights.items()})

    recorded = recorded_settings(state)
    rebuilt = [name for name in ("vae", "text_encoder") if not any(k.startswith(name + ".") for k in weights)]
    seed = recorded.get("encoders_seed", DEFAULT_SEED) if args.seed is None else args.seed
    if rebuilt and args.seed is not None and recorded.get("encoders_seed") not in (None, args.seed):
        fail(f"--seed {args.seed}: the run built its {' and '.join(rebuilt)} from seed {recorded['encoders_seed']} "
             f"(recorded in CHECKPOINT); drop --seed, or pass --seed {recorded['encoders_seed']}")
    model_name = args.model_name or recorded.get("model_name") or DEFAULT_MODEL_NAME
    if rebuilt and config != "tiny" and args.model_name and recorded.get("model_name") not in (None, args.model_name):
        print(f"note: the run trained with --model_name {recorded['model_name']}; the {' and '.join(rebuilt)} "
              f"come from --model_name {args.model_name} as given", file=sys.stderr)
    parts = build_encoders_aside(config, model_name, seed)
    missing = [name for name in parts.random if name in rebuilt]
    if config != "tiny" and missing:
        fail(f"--model_name {model_name}: pretrained {' and '.join(missing)} not found; "
             "pass a local diffusers folder of the model the run trained with")
    for name in ("vae", "text_encoder"):
        trained_with = {k[len(name) + 1:]: v for k, v in weights.items() if k.startswith(name + ".")}
        if trained_with:  # the encoders the run itself used
            getattr(parts, name).load_state_dict(trained_with)
    try:
        write_pipeline(out, unet, parts.vae, parts.text_encoder, parts.tokenizer, parts.noise_scheduler.config,
                       args.scheduler)
    except OSError as error:  # probed above; a disk that fills up while writing
        fail(f"--out {out}: the pipeline could not be written ({type(error).__name__}: {error})")
    print(f"wrote a StableDiffusionPipeline ({config}, {'EMA' if args.ema else 'trained'} UNet) to {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
