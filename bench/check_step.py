"""Is the fast training step still correct? Loss and gradients of each speed setting vs plain fp32.

    python bench/check_step.py                                   # tiny model, CPU: fp32 vs channels-last (+ bf16 if asked)
    python bench/check_step.py --settings bf16 bf16-fp32norms     # norms in bf16 (the default) and in fp32, vs fp32
    python bench/check_step.py --model_config sd2-base --image_size 512 --batch_size 8 --settings bf16 bf16-cl bf16-compile

Every setting starts from the same weights and sees the same batch, noise, timesteps and VAE
sample (the RNG is reseeded before each step), so the only differences are numerical. On a CPU,
bf16 runs under CPU autocast with the same norm classes as on a GPU, so `bf16` (norms in bf16, the
benchmark's default) and `bf16-fp32norms` (CUDA autocast's fp32 norms) are both the GPU's step
numerics. Printed per
setting: the loss, its relative difference from fp32, and the cosine similarity of the UNet
gradient with fp32's. Exits 1 when a setting is off by more than `--max_rel_loss_diff` or its
gradient cosine is below `--min_grad_cosine`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

from t2ibench.core.cli import BATCH_SIZE, IMAGE_SIZE, NON_NEGATIVE_FLOAT, SEED, Parser, Range
from t2ibench.families import MODEL_CONFIGS, family_of
from t2ibench.train.model import DiffusionModel
from t2ibench.train.norms import set_norm_precision

# name -> (autocast dtype or None, channels_last, compile, norm precision under autocast). As in
# benchmark.py, under autocast the frozen encoders are stored in its dtype and GroupNorm/LayerNorm
# run in it ("autocast") unless the setting says fp32 norms (CUDA autocast's own behaviour; on a
# CPU, whose autocast leaves norms in the input's dtype, norms.Fp32GroupNorm emulates it).
SETTINGS = {
    "fp32": (None, False, False, "autocast"),
    "fp32-cl": (None, True, False, "autocast"),
    "bf16": (torch.bfloat16, False, False, "autocast"),
    "bf16-fp32norms": (torch.bfloat16, False, False, "fp32"),
    "bf16-cl": (torch.bfloat16, True, False, "autocast"),
    "bf16-compile": (torch.bfloat16, False, True, "autocast"),
    "bf16-cl-compile": (torch.bfloat16, True, True, "autocast"),
    "fp16": (torch.float16, False, False, "autocast"),
    "fp16-fp32norms": (torch.float16, False, False, "fp32"),
}


def step(setting: str, args: argparse.Namespace, device: torch.device, batch: dict) -> tuple[float, torch.Tensor]:
    """Loss and flattened UNet gradient of one forward/backward under `setting`."""
    dtype, channels_last, compile_modules, norm_precision = SETTINGS[setting]
    torch.manual_seed(args.seed)
    family = family_of(args.model_config)
    model = DiffusionModel(family, family.build(args.model_config, args.model_name, tokenizers=False)).to(device)
    if dtype is not None:
        for frozen in model.frozen():
            frozen.to(dtype)
        set_norm_precision(model, norm_precision)
    if channels_last:
        model.denoiser.to(memory_format=torch.channels_last)
        model.vae.to(memory_format=torch.channels_last)
        model.vae_channels_last = True
    if compile_modules:  # every module that runs per step, as benchmark.py --compile
        model.denoiser.compile()
        model.vae.encoder.compile()
        for encoder in model.text_encoders.values():
            encoder.compile()
    torch.manual_seed(args.seed + 1)  # the same noise, timesteps and VAE sample for every setting
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = model.loss(model(batch), batch)
    loss.backward()
    grad = torch.cat([p.grad.double().flatten() for p in model.denoiser.parameters()])  # fp64: exact cosine
    return float(loss), grad


def build_parser() -> Parser:
    p = Parser("check_step.py", description=__doc__)
    p.add_argument("--model_config", default="tiny", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--model_name", default=None, help="pretrained VAE/text encoder (sd2-base only)")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=64)
    p.add_argument("--batch_size", type=BATCH_SIZE, default=4)
    p.add_argument("--settings", nargs="+", default=["fp32-cl"], help=f"compared with fp32, from {list(SETTINGS)}")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--max_rel_loss_diff", type=NON_NEGATIVE_FLOAT, default=0.02,
                   help="allowed |loss - fp32 loss| / fp32 loss")
    # bf16 keeps 8 mantissa bits: on the random tiny model its UNet gradient has cosine 0.96 with fp32's
    # (loss within 0.1%); a broken step (wrong noise, dtype or layout) lands far lower (0.25 was seen).
    p.add_argument("--min_grad_cosine", type=Range(float, -1, 1), default=0.95, help="required cosine(grad, fp32 grad)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    g = torch.Generator().manual_seed(args.seed)
    family = family_of(args.model_config)
    tokenizers = family.build(args.model_config, args.model_name, denoiser=False, vae=False, text_encoders=False).tokenizers
    captions = family.tokenize(tokenizers, [f"a photo of thing number {i}" for i in range(args.batch_size)])
    batch = {"image": (torch.rand(args.batch_size, 3, args.image_size, args.image_size, generator=g) * 2 - 1).to(device),
             **{key: ids.to(device) for key, ids in captions.items()}}
    base_loss, base_grad = step("fp32", args, device, batch)
    print(f"{'setting':<16} {'loss':>10} {'rel diff':>9} {'grad cos':>9}")
    print(f"{'fp32':<16} {base_loss:>10.6f} {'-':>9} {'-':>9}")
    failed = []
    for setting in args.settings:
        loss, grad = step(setting, args, device, batch)
        rel = abs(loss - base_loss) / abs(base_loss)
        cosine = float(torch.nn.functional.cosine_similarity(grad, base_grad, dim=0))
        ok = rel <= args.max_rel_loss_diff and cosine >= args.min_grad_cosine
        failed += [] if ok else [setting]
        print(f"{setting:<16} {loss:>10.6f} {rel:>9.2e} {cosine:>9.5f}{'' if ok else '  <-- off'}")
    if failed:
        sys.exit(f"check_step.py: {failed} differ from fp32 beyond --max_rel_loss_diff/--min_grad_cosine")


if __name__ == "__main__":
    main()
