"""Turn a Composer checkpoint of benchmark.py into a diffusers pipeline folder (SD2: StableDiffusionPipeline,
SDXL: StableDiffusionXLPipeline; Flux.1: FluxPipeline).

    python export.py runs/sd2/ep0-ba1000-rank0.pt --out sd2-pipeline          # trained UNet
    python export.py s3://bucket/run/latest-rank0.pt --out sd2-pipeline --ema  # EMA UNet
    python -c "from diffusers import StableDiffusionPipeline as P; P.from_pretrained('sd2-pipeline')"
    python -c "from diffusers import StableDiffusionXLPipeline as P; P.from_pretrained('sdxl-pipeline')"

    python export.py runs/flux/latest-rank0.pt --out flux-pipeline             # Flux: transformer/, text_encoder_2/...

The folder holds unet/ (Flux: transformer/), vae/, text_encoder/, tokenizer/ (SDXL and Flux also
text_encoder_2/, tokenizer_2/), scheduler/ and model_index.json, and after a run with --aspect_buckets
aspect_buckets.txt, the sizes it trained at (the pipeline generates at any: height=, width=). The
model's configuration is recognised from the denoiser's weight shapes. The VAE and text encoders
are the ones in the checkpoint when the run trained with them; after a run on precomputed latents
they are loaded from the run's `--model_name` (or, for the tiny models, rebuilt from the seed the run
built them from), both recorded in the checkpoint: `--model_name` points elsewhere (a note names
both), and a `--seed` other than the recorded one is refused. No safety checker is included
(`requires_safety_checker=False`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

from t2ibench.core import errors
from t2ibench.datasets.buckets import MAX_BUCKETS, SIZE_FORMAT, Bucket, parse_bucket, sides_problem
from t2ibench.core.cli import SEED, Parser
from t2ibench.core.errors import fail
from t2ibench.families import FAMILIES, MODEL_CONFIGS, build_aside, detect_config
from t2ibench.core.files import hold_output, killed_writer_leftovers, staged_folder, write_error
from t2ibench.core.locations import LOAD_SCHEMES, check_output, file_problem, is_remote, normalise
from t2ibench.eval.sampling import SAMPLERS, write_pipeline

DEFAULT_SEED = 17  # benchmark.py's default --seed: what built the encoders of a checkpoint that records none


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
    if not is_remote(path):
        problem = file_problem(f"CHECKPOINT {path}", path)
        if problem:
            fail(f"{problem}; give a file that benchmark.py --save_folder wrote")
        return read_checkpoint(path, path)
    from composer.utils import get_file
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "checkpoint.pt")
        try:
            get_file(path, local)
        except Exception as e:  # noqa: BLE001 - any download failure is the user's path or credentials
            fail(f"CHECKPOINT {path} could not be downloaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return read_checkpoint(local, path)


def listed(names: list[str]) -> str:
    """'vae', 'vae and text_encoder', 'vae, text_encoder and text_encoder_2'."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


DAMAGED = "the file is damaged or was not written by benchmark.py; export another checkpoint (nothing was written)"


def recorded_settings(state: dict, checkpoint: str) -> dict:
    """What benchmark.py recorded in the checkpoint (its RunRecord callback; older checkpoints have
    only Composer's rank_zero_seed, the --seed, which then built the encoders), each value used here
    checked first: a record of other types is one line naming the checkpoint."""
    from t2ibench.callbacks.run_record import RunRecord  # Composer keys a callback's state by its class name

    callbacks = state.get("callbacks")
    record = callbacks.get(RunRecord.__qualname__) if isinstance(callbacks, dict) else None
    if record is not None and not isinstance(record, dict):
        fail(f"CHECKPOINT {checkpoint}: its record of the run ({RunRecord.__qualname__}) is a "
             f"{type(record).__name__}, not a dict: {DAMAGED}")
    recorded = dict(record or {})
    if recorded.get("encoders_seed") is None and isinstance(state.get("rank_zero_seed"), int):
        recorded["encoders_seed"] = state["rank_zero_seed"]
    seed, model_name = recorded.get("encoders_seed"), recorded.get("model_name")
    if seed is not None and SEED.problem(seed):
        fail(f"CHECKPOINT {checkpoint}: its recorded encoders_seed {str(seed)[:40]!r} {SEED.problem(seed)}: {DAMAGED}")
    if model_name is not None and not isinstance(model_name, str):
        fail(f"CHECKPOINT {checkpoint}: its recorded model_name is a {type(model_name).__name__}, not a name: "
             f"{DAMAGED}")
    return recorded


def trained_buckets(recorded: dict, patch_px: int, checkpoint: str) -> tuple[Bucket, ...]:
    """The --aspect_buckets list the run recorded (none for a square run or an older checkpoint), checked
    by the rules of a list --aspect_buckets reads (t2ibench.datasets.buckets: each HEIGHTxWIDTH within --image_size's
    bound, both sides multiples of `patch_px`, none twice, at most MAX_BUCKETS), since the exported
    aspect_buckets.txt is read back as one. A break of any is one line naming the checkpoint."""
    names = recorded.get("aspect_buckets") or []
    where = f"CHECKPOINT {checkpoint}: its recorded aspect_buckets"
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        fail(f"{where} is {str(names)[:60]!r}, not a list of HEIGHTxWIDTH names: {DAMAGED}")
    if len(names) > MAX_BUCKETS:
        fail(f"{where} holds {len(names):,} buckets, more than the {MAX_BUCKETS} a list may hold: {DAMAGED}")
    buckets: list[Bucket] = []
    for name in names:
        bucket = parse_bucket(name)
        if bucket is None:
            fail(f"{where} holds {name[:40]!r}, not {SIZE_FORMAT}: {DAMAGED}")
        problem = sides_problem(bucket, patch_px)
        if problem:
            fail(f"{where}: {problem}: {DAMAGED}")
        if bucket in buckets:
            fail(f"{where} lists {bucket.name} twice: {DAMAGED}")
        buckets.append(bucket)
    return tuple(buckets)


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


def build_parser() -> Parser:
    p = Parser("export.py", description=__doc__)
    p.add_argument("checkpoint", help="Composer checkpoint of benchmark.py: a path or s3://, gs://, oci://... URI")
    p.add_argument("--out", required=True, help="folder to write the pipeline to (must be empty or absent)")
    p.add_argument("--ema", action="store_true", help="export the EMA weights of the denoiser (run with --use_ema)")
    p.add_argument("--scheduler", default=None, choices=sorted(SAMPLERS),
                   help="the pipeline's sampler (default: the family's: ddim for SD2, euler for SDXL, euler, "
                        "flow-matching, for Flux)")
    p.add_argument("--model_name", default=None,
                   help="where the VAE/text encoders come from when the checkpoint has none (precomputed runs); "
                        "default: the run's, recorded in the checkpoint (else the model's own: "
                        "stabilityai/stable-diffusion-2-base, stabilityai/stable-diffusion-xl-base-1.0, "
                        "black-forest-labs/FLUX.1-schnell)")
    p.add_argument("--seed", type=SEED, default=None,
                   help="seed of the random encoders of a tiny precomputed run; default: the one recorded in the "
                        f"checkpoint (else {DEFAULT_SEED}); another value is refused: it would give other encoders")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    with errors.command("export.py"):
        return export(args)


def load_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], name: str, where: str) -> None:
    """`weights` into `module` (the checkpoint's `name`), refusing damaged or non-finite ones in one line:
    a pipeline of NaN weights draws black images, and a wrong shape is a traceback deep in torch."""
    for key, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            fail(f"CHECKPOINT {where}: {name}.{key} holds NaN or infinite values: the run diverged or the file "
                 "is damaged; export an earlier checkpoint (nothing was written)")
    try:
        module.load_state_dict(weights)
    except RuntimeError as error:
        first = str(error).strip().splitlines()
        detail = " ".join(line.strip() for line in first[1:3])[:200] if len(first) > 1 else first[0][:200]
        fail(f"CHECKPOINT {where}: its {name} weights do not fit the {name} of this model ({detail}): the file is "
             "damaged or was not written by benchmark.py (nothing was written)")


def export(args: argparse.Namespace) -> Path:
    checkpoint = normalise("CHECKPOINT", args.checkpoint, LOAD_SCHEMES)
    out = Path(normalise("--out", args.out, ()))
    # What a killed export left (its staging folder, parts it was moving out) is taken over once --out
    # is held (staged_folder); anything else in --out is the user's.
    if out.exists() and (not out.is_dir() or set(os.listdir(out)) - killed_writer_leftovers(out)):
        fail(f"--out {out} exists and is not an empty folder; choose a new one (nothing is overwritten)")
    # Probed before the checkpoint is read (it may be gigabytes, or a download): the pipeline must be
    # writable, and may not be written into the checkpoint's folder or a local --model_name folder.
    problem = check_output("--out", str(out), folder=True, inputs=[
        ("CHECKPOINT", None if is_remote(checkpoint) else checkpoint),
        ("--model_name", args.model_name if args.model_name and Path(args.model_name).is_dir() else None)])
    if problem:
        fail(problem)
    # Held from here to the end (a second export into --out is refused before it reads a checkpoint).
    with hold_output("--out", out):
        return export_held(args, checkpoint, out)


def export_held(args: argparse.Namespace, checkpoint: str, out: Path) -> Path:
    """export, with --out probed and held: read the checkpoint, check its weights, write the pipeline."""
    state = load_checkpoint(checkpoint)["state"]  # read_checkpoint made sure it holds state.model
    # Only tensors are weights: a sharded save may keep other entries (extra state) beside them.
    weights = {k.removeprefix("module."): v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
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
    # What the run recorded, checked before anything is built (benchmark.py's RunRecord).
    recorded = recorded_settings(state, checkpoint)
    buckets = trained_buckets(recorded, family.latent_downsample * family.patch_size, checkpoint)
    denoiser = family.build(config, denoiser=True, vae=False, text_encoders=False, tokenizers=False).denoiser
    load_weights(denoiser, {k: v.float() for k, v in denoiser_weights.items()},
                 family.denoiser_name + (" (EMA)" if args.ema else ""), checkpoint)

    # Frozen networks the run did not train with (precomputed latents): rebuilt as the run built them,
    # from the model name and seed it recorded (benchmark.py's RunRecord), so that the pipeline
    # decodes the latent space and encodes captions exactly as the trained denoiser expects.
    rebuilt = [name for name in family.frozen_parts if not any(k.startswith(name + ".") for k in weights)]
    recorded_seed = recorded.get("encoders_seed")
    if rebuilt and args.seed is not None and recorded_seed not in (None, args.seed):
        fail(f"--seed {args.seed}: the run built its {listed(rebuilt)} from seed {recorded_seed} "
             f"(recorded in CHECKPOINT); drop --seed, or pass --seed {recorded_seed}")
    seed = args.seed if args.seed is not None else recorded_seed if recorded_seed is not None else DEFAULT_SEED
    model_name = args.model_name or recorded.get("model_name") or family.default_model_name
    pretrained = config in family.pretrained_configs  # the tiny configs never load pretrained parts
    if rebuilt and pretrained and args.model_name and recorded.get("model_name") not in (None, args.model_name):
        print(f"note: the run trained with --model_name {recorded['model_name']}; the {listed(rebuilt)} "
              f"come from --model_name {args.model_name} as given", file=sys.stderr)
    parts = build_aside(family, config, model_name, seed)
    # Random parts matter only where the checkpoint does not replace them with the run's own.
    missing = [name for name in parts.random_encoders if name in rebuilt]
    if pretrained and missing:
        fail(f"--model_name {model_name}: pretrained {listed(missing)} not found; "
             "pass a local diffusers folder of the model the run trained with")
    for name, module in [("vae", parts.vae), *parts.text_encoders.items()]:
        trained_with = {k[len(name) + 1:]: v for k, v in weights.items() if k.startswith(name + ".")}
        if trained_with:  # the encoders the run itself used
            load_weights(module, trained_with, name, checkpoint)
    # Written into a staging folder and moved into place with model_index.json last: a full disk
    # leaves --out as it was.
    try:
        with staged_folder(out, last="model_index.json") as staging:
            write_pipeline(staging, family, dataclasses.replace(parts, denoiser=denoiser), args.scheduler,
                           buckets=buckets)
    except OSError as error:  # probed above; a disk that fills up while writing
        fail(write_error(f"--out {out}: the pipeline", error))
    print(f"wrote a {family.pipeline_class} ({config}, {'EMA' if args.ema else 'trained'} "
          f"{family.denoiser_name}) to {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
