"""Proof, on a CPU, that training learns the text conditioning: captioned shapes -> convert.py ->
benchmark.py (tiny model) -> score sampled latents against each caption's encoded images.

    python bench/learns.py                                        # generated "a red square" / "a blue circle"
    python bench/learns.py --model_config sdxl-tiny --captions "a teal diamond" "a pink ellipse"   # SDXL's miniature
    python bench/learns.py --captions "a green triangle" "an orange star" "a purple circle"
    python bench/learns.py --data my_images/                       # images + same-named .txt captions
    python bench/learns.py --data my_mds/ --batches 800            # MDS shards (convert.py's columns)
    python bench/learns.py --make_data pictures                    # only the captioned pictures, for convert.py
    python bench/learns.py --model_config flux1-tiny --precomputed --captions "a green triangle" "a purple circle"

`--model_config flux1-tiny` trains Flux.1's structure; `--precomputed` encodes the pictures once with
latents.py (VAE moments, T5 and CLIP states, MLPerf's set-up) and trains the denoiser alone on them.

Without --data, images are drawn for each caption: a shape in the caption's colour at a random
position and size on a plain grey background (the caption must name a colour PIL knows and one of
the shapes below). With --data, the classes are its distinct captions (or the --captions among them).

The score: for each caption, latents are sampled with the project's sampler (t2ibench/eval/sampling.py: diffusers
DDIM for SD2, flow-matching Euler for Flux; fixed seeds) from the denoiser, and each sample counts as
right when the nearest (L2) of the
encoded latents of all the dataset's images (VAE posterior means, scaled) belongs to its own
caption. It is judged in latent space because the tiny VAE is random: its decoded pictures mean
nothing, while its latents still separate the pictures. The score is printed for the UNet before
training (its initialization under --seed) and after, beside chance (1 / number of captions).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageColor, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from t2ibench.core import errors  # noqa: E402
from t2ibench.core.cli import BATCH_SIZE, IMAGE_SIZE, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, SEED, Parser  # noqa: E402
from t2ibench.core.errors import fail  # noqa: E402
from t2ibench.families import MODEL_CONFIGS  # noqa: E402
from t2ibench.core.locations import check_output, check_outputs_apart, normalise  # noqa: E402
from t2ibench.train.model import DiffusionModel  # noqa: E402
from t2ibench.commands.flags import CAPTION_DROP_PROB, GUIDANCE_SCALE, SAMPLE_STEPS  # noqa: E402
from t2ibench.eval.sampling import make_sampler, sample_latents  # noqa: E402

# The miniatures: random encoders are all they have, so scoring is in latent space (see above).
LEARNING_CONFIGS = ("tiny", "sdxl-tiny", "flux1-tiny")
# Both miniatures train on SD2's DDPM schedule (SDXL's is the same): DDIM takes at most this many steps.
DEFAULT_WARMUP_BATCHES = 50  # of the default 1000-1500 batches; a short run warms up over a tenth of itself
SHAPES = ("square", "rectangle", "circle", "ellipse", "triangle", "diamond", "star", "cross", "hexagon")


def parse_caption(caption: str) -> tuple[tuple[int, int, int], str]:
    """(RGB colour, shape) named by a caption such as 'a red square'; ValueError if it names none."""
    words = caption.lower().replace(",", " ").split()
    colours = [w for w in words if w in ImageColor.colormap]
    shapes = [w.rstrip("s") if w.rstrip("s") in SHAPES else w for w in words if w.rstrip("s") in SHAPES or w in SHAPES]
    if not colours or not shapes:
        raise ValueError(f"caption '{caption}' must name a colour (e.g. red, teal, orange) and a shape "
                         f"({', '.join(SHAPES)}); or pass your own pictures with --data")
    return ImageColor.getrgb(colours[0])[:3], shapes[0]


def draw_shape(colour: tuple[int, int, int], shape: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One picture: `shape` in `colour`, random size (30-70% of the side) and position, plain grey background."""
    grey = int(rng.integers(90, 170))
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    side = int(rng.integers(int(0.3 * size), int(0.7 * size) + 1))
    x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, 2))
    x1, y1 = x0 + side, y0 + side
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, side / 2
    if shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=colour)
    elif shape == "rectangle":
        draw.rectangle([x0, y0 + side // 4, x1, y1 - side // 4], fill=colour)
    elif shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=colour)
    elif shape == "ellipse":
        draw.ellipse([x0, y0 + side // 4, x1, y1 - side // 4], fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x0, y1), (x1, y1)], fill=colour)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=colour)
    elif shape == "cross":
        t = side // 6
        draw.rectangle([cx - t, y0, cx + t, y1], fill=colour)
        draw.rectangle([x0, cy - t, x1, cy + t], fill=colour)
    else:  # star and hexagon: regular polygons
        n, inner = (5, 0.45) if shape == "star" else (6, 1.0)
        points = []
        for k in range(2 * n):
            radius = r if k % 2 == 0 else r * inner
            angle = math.pi * k / n - math.pi / 2
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=colour)
    return image


def write_shapes(folder: Path, captions: list[str], per_caption: int, size: int, seed: int) -> None:
    """An images folder as convert.py reads it: NAME.png + NAME.txt."""
    rng = np.random.default_rng(seed)
    parsed = [parse_caption(c) for c in captions]  # fail on a bad caption before drawing anything
    folder.mkdir(parents=True, exist_ok=True)
    for c, (caption, (colour, shape)) in enumerate(zip(captions, parsed)):
        for i in range(per_caption):
            draw_shape(colour, shape, size, rng).save(folder / f"c{c:02d}_{i:04d}.png")
            (folder / f"c{c:02d}_{i:04d}.txt").write_text(caption)


def read_dataset(shards: Path, size: int) -> tuple[torch.Tensor, list[str]]:
    """All images of an MDS dataset (float in [-1, 1], resized as training does) and their captions."""
    from streaming.base.compression import decompress
    from streaming.base.format import reader_from_json

    import data
    index = json.loads((shards / "index.json").read_text())
    images, captions = [], []
    with tempfile.TemporaryDirectory() as raw:  # compressed shards are read from an uncompressed copy
        for info in index["shards"]:
            folder = shards
            if info.get("compression"):
                zipped = (shards / info["zip_data"]["basename"]).read_bytes()
                (Path(raw) / info["raw_data"]["basename"]).write_bytes(decompress(info["compression"], zipped))
                folder = Path(raw)
            reader = reader_from_json(str(folder), None, info)
            for i in range(reader.samples):
                sample = reader.get_item(i)
                image = data.decode_image(sample["jpg"], size)
                images.append(image.float() / 127.5 - 1 if image.dtype == torch.uint8 else image)
                captions.append(sample["caption"])
    return torch.stack(images), captions


def run(main, argv: list[str], what: str):
    """A command's main() in this process (the same code path as its CLI, without a second start-up)."""
    try:
        return main(argv)
    except SystemExit as e:
        if e.code not in (None, 0):
            fail(f"{what} failed: {e.code}")
    except Exception as error:  # noqa: BLE001 - what benchmark.py's command line reports in one line
        import benchmark
        line = benchmark.user_error(error)
        if line is None:
            raise  # a bug: the traceback
        fail(f"{what} failed: {line}")


@torch.no_grad()
def score(model: DiffusionModel, tokenizers, classes: list[str], encoded: torch.Tensor, labels: torch.Tensor,
          samples_per_class: int, steps: int, guidance_scale: float, seed: int) -> tuple[float, list[int]]:
    """Fraction of sampled latents whose nearest encoded latent has their caption; per-class hits."""
    model.eval()
    states = model.encode_text(model.family.tokenize(tokenizers, classes + [""]))
    hits = []
    latent_shape = tuple(encoded.shape[1:])
    flat = encoded.flatten(1)
    for c in range(len(classes)):
        seeds = [seed + 1000 * c + k for k in range(samples_per_class)]
        sampler = make_sampler(next(iter(model.family.samplers)), model.noise_scheduler.config, model.family)
        cond = {k: v[c:c + 1].expand(samples_per_class, *v.shape[1:]) for k, v in states.items()}
        empty = model.family.as_unconditional({k: v[-1:] for k, v in states.items()})
        latents = sample_latents(model.family, model.denoiser, cond, empty, sampler, steps, guidance_scale, seeds,
                                 latent_shape)
        nearest = torch.cdist(latents.flatten(1), flat).argmin(dim=1)
        hits.append(int((labels[nearest] == c).sum()))
    return sum(hits) / (samples_per_class * len(classes)), hits


def load_trained(model: DiffusionModel, checkpoint: Path) -> None:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]["model"]
    state = {k.removeprefix("module."): v for k, v in state.items()}
    # A run on precomputed latents saves the denoiser only: the encoders stay those built here.
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(k.startswith(model.denoiser_name + ".") for k in missing):
        raise SystemExit(f"learns.py: error: {checkpoint} does not fit the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")


def build_parser() -> Parser:
    p = Parser("learns.py", description=__doc__)
    p.add_argument("--model_config", default="tiny", choices=LEARNING_CONFIGS,
                   help="the miniature to train: tiny (SD2's structure), sdxl-tiny (SDXL's) or flux1-tiny (Flux.1's)")
    p.add_argument("--precomputed", action="store_true",
                   help="train as MLPerf's Flux.1 set-up does: latents.py encodes the pictures once (VAE moments and "
                        "text states), and training runs the denoiser only")
    p.add_argument("--captions", nargs="+", default=None,
                   help="captions to generate pictures for (default: 'a red square' 'a blue circle'), or to score in --data")
    p.add_argument("--data", type=str, default=None,
                   help="your own data: an MDS dataset (index.json) or an images folder with same-named .txt captions")
    p.add_argument("--images_per_caption", type=POSITIVE_INT, default=48, help="generated pictures per caption")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=64, help="picture side in pixels (multiple of 8)")
    p.add_argument("--batches", type=POSITIVE_INT, default=None,
                   help="training batches (default: 500 per caption: 2 captions 1000, 3 captions 1500)")
    p.add_argument("--batch_size", type=BATCH_SIZE, default=16, help="global batch size of the training run")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=2e-3, help="AdamW learning rate of the training run")
    p.add_argument("--lr_warmup_batches", type=NON_NEGATIVE_INT, default=None,
                   help="linear warm-up of the learning rate (default: 50 batches, at most a tenth of the run)")
    p.add_argument("--caption_drop_prob", type=CAPTION_DROP_PROB, default=0.1,
                   help="caption dropout while training (for classifier-free guidance)")
    p.add_argument("--samples_per_caption", type=POSITIVE_INT, default=16, help="latents sampled per caption to score")
    p.add_argument("--sample_steps", type=SAMPLE_STEPS, default=25, help="DDIM steps per sample")
    p.add_argument("--guidance_scale", type=GUIDANCE_SCALE, default=4.0,
                   help="classifier-free guidance when scoring (the run trains with caption dropout for it); "
                        "the unguided score (1) is printed too")
    p.add_argument("--seed", type=SEED, default=17, help="seeds the pictures, the model and the samples")
    p.add_argument("--workdir", type=str, default=None, help="keep the pictures, shards and checkpoint here")
    p.add_argument("--make_data", type=str, default=None, metavar="DIR",
                   help="only draw the captioned pictures into DIR (NAME.png + NAME.txt, what convert.py reads) and stop")
    p.add_argument("--results_json", type=str, default=None, help="also write the scores to this JSON file")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """Mistakes that would otherwise surface after minutes of drawing, converting or scoring. Returns the
    flags with the locations normalised, in a new namespace: the parsed one is left as it was parsed."""
    family = MODEL_CONFIGS[parsed.model_config]
    multiple = family.latent_downsample * family.patch_size
    if parsed.image_size % multiple:
        fail(f"--image_size {parsed.image_size} must be a multiple of {multiple} (the VAE downsamples by "
             f"{family.latent_downsample})")
    if parsed.batches is not None and parsed.lr_warmup_batches is not None \
            and parsed.lr_warmup_batches >= parsed.batches:
        fail(f"--lr_warmup_batches {parsed.lr_warmup_batches} does not end before the run "
             f"(--batches {parsed.batches})")
    # file:///path is the path /path (locations.normalise); everything here is local.
    paths = {flag: normalise(f"--{flag}", getattr(parsed, flag), ())
             for flag in ("data", "workdir", "make_data", "results_json") if getattr(parsed, flag) is not None}
    args = argparse.Namespace(**{**vars(parsed), **paths})
    if args.data and not Path(args.data).is_dir():
        fail(f"--data {args.data} is not a folder")
    # Outputs probed before minutes of work: writable, of their kind, apart from --data and each other.
    inputs = [("--data", args.data)]
    outputs = [("--workdir", args.workdir, "folder"), ("--make_data", args.make_data, "folder"),
               ("--results_json", args.results_json, "file")]
    for flag, location, kind in outputs:
        problem = check_output(flag, location, folder=kind == "folder", inputs=inputs)
        if problem:
            fail(problem)
    problem = check_outputs_apart(outputs)
    if problem:
        fail(problem)
    return args


def main(argv: list[str] | None = None) -> dict:
    parsed = parse_args(argv)
    with errors.command("learns.py"):
        return learn(validate(parsed))


def learn(args: argparse.Namespace) -> dict:
    """Draw or read the data, score the untrained model, train it with benchmark.py, score it again."""
    started = time.perf_counter()
    # The captions to draw (two shapes when none are given and there is no --data) and to score.
    wanted = args.captions
    if args.data is None:
        wanted = wanted or ["a red square", "a blue circle"]
        if len(set(wanted)) < 2:
            fail("--captions needs at least two different captions")
        try:
            [parse_caption(c) for c in wanted]
        except ValueError as e:
            fail(f"--captions: {e}")
    if args.make_data:
        if Path(args.make_data).exists() and any(Path(args.make_data).iterdir()):
            fail(f"--make_data {args.make_data} is not empty; give a new folder")
        write_shapes(Path(args.make_data), wanted, args.images_per_caption, args.image_size, args.seed)
        print(f"wrote {len(wanted) * args.images_per_caption} captioned pictures to {args.make_data}")
        return {"pictures": args.make_data}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="learns-"))
    work.mkdir(parents=True, exist_ok=True)

    # 1. Data: generated pictures or the user's, as MDS shards written by convert.py.
    if args.data and (Path(args.data) / "index.json").is_file():
        shards = Path(args.data)
    else:
        pictures = Path(args.data) if args.data else work / "pictures"
        if not args.data:
            write_shapes(pictures, wanted, args.images_per_caption, args.image_size, args.seed)
        shards = work / "mds"
        import convert
        run(convert.main, [str(pictures), "--out", str(shards), "--workers", "1", "--no_progress", "--overwrite"],
            "convert.py")
    try:
        images, captions = read_dataset(shards, args.image_size)
    except Exception as error:  # noqa: BLE001 - the user's --data: unreadable index, other columns, bad images
        first = (str(error).strip().splitlines() or [""])[0][:200]
        fail(f"--data {args.data or shards}: cannot read {shards} as convert.py's MDS image-caption shards "
             f"({type(error).__name__}: {first})")
    classes = wanted or sorted(set(captions))
    keep = [i for i, c in enumerate(captions) if c in classes]
    missing = sorted(set(classes) - {captions[i] for i in keep})
    if missing or len(classes) < 2:
        fail(f"the data needs pictures of at least two captions; none of {missing}" if missing
             else "the data holds fewer than two distinct captions")
    labels = torch.tensor([classes.index(captions[i]) for i in keep])
    images = images[keep]
    data_seconds = time.perf_counter() - started
    # Defaults that depend on the data: 500 batches per class, a tenth of them warming up (at most the default).
    batches = args.batches or 500 * len(classes)
    lr_warmup_batches = args.lr_warmup_batches
    if lr_warmup_batches is None:
        lr_warmup_batches = min(DEFAULT_WARMUP_BATCHES, batches // 10)

    # 2. The model before training: benchmark.py's initialization under --seed.
    torch.manual_seed(args.seed)
    family = MODEL_CONFIGS[args.model_config]
    parts = family.build(args.model_config)
    model = DiffusionModel(family, parts)
    with torch.no_grad():
        encoded = model.to_latent_space(torch.cat([model.vae.encode(x).latent_dist.mean for x in images.split(64)]))
    kwargs = dict(samples_per_class=args.samples_per_caption, steps=args.sample_steps, seed=args.seed)
    score_start = time.perf_counter()
    before, before_hits = score(model, parts.tokenizers, classes, encoded, labels, guidance_scale=args.guidance_scale,
                                **kwargs)
    before_unguided, _ = score(model, parts.tokenizers, classes, encoded, labels, guidance_scale=1.0, **kwargs)
    score_seconds = time.perf_counter() - score_start

    # 3. Train with benchmark.py's command line.
    threads = torch.get_num_threads()
    train_start = time.perf_counter()
    save = work / "checkpoints"
    import benchmark
    source = shards
    if args.precomputed:  # the encoders once per picture, with the seed the scoring model was built with
        import latents
        source = work / "latents"
        run(latents.main, ["--model_config", args.model_config, "--local", str(shards), "--out", str(source),
                           "--image_size", str(args.image_size), "--seed", str(args.seed), "--num_workers", "0",
                           "--store_text_states", "--no_progress", "--overwrite"], "latents.py")
    trained = run(benchmark.main, ["--model_config", args.model_config, "--remote", str(source),
         *(["--precomputed"] if args.precomputed else []),
         "--local", str(work / "cache"), "--image_size", str(args.image_size), "--batch_size", str(args.batch_size),
         "--max_duration", f"{batches}ba", "--lr", str(args.lr), "--lr_warmup_batches", str(lr_warmup_batches),
         "--caption_drop_prob", str(args.caption_drop_prob), "--seed", str(args.seed), "--num_workers", "1",
         "--save_folder", str(save), "--save_interval", f"{batches}ba", "--log_interval", "50ba", "--warmup_batches", "1"], "benchmark.py")
    torch.set_num_threads(threads)  # benchmark.py sets its own
    train_seconds = time.perf_counter() - train_start
    checkpoint = sorted(save.glob("ep*-ba*-rank0.pt"), key=lambda p: int(p.name.split("-ba")[1].split("-")[0]))[-1]
    load_trained(model, checkpoint)
    after, after_hits = score(model, parts.tokenizers, classes, encoded, labels, guidance_scale=args.guidance_scale,
                              **kwargs)
    after_unguided, _ = score(model, parts.tokenizers, classes, encoded, labels, guidance_scale=1.0, **kwargs)

    result = {
        "model_config": args.model_config, "precomputed": args.precomputed,
        "classes": classes, "images": len(keep), "image_size": args.image_size, "batches": batches,
        "batch_size": args.batch_size, "samples_per_caption": args.samples_per_caption,
        "score_before": before, "score_after": after, "chance": 1 / len(classes),
        "hits_before": before_hits, "hits_after": after_hits, "guidance_scale": args.guidance_scale,
        "score_before_unguided": before_unguided, "score_after_unguided": after_unguided,
        "score_minutes_per_model": score_seconds / 60,
        "train_minutes": train_seconds / 60, "total_minutes": (time.perf_counter() - started) / 60,
        "data_minutes": data_seconds / 60, "final_loss": trained["final_loss"],
        "loss_by_timestep_bin": trained["loss_by_timestep_bin"],
    }
    print(f"{args.model_config}: classes {classes} ({len(keep)} pictures, {args.image_size}px), {batches} batches "
          f"of {args.batch_size}")
    print(f"nearest-class score before training {before:.1%}  after {after:.1%}  chance {1 / len(classes):.1%} "
          f"(guidance {args.guidance_scale:g}; per caption after: {after_hits} of {args.samples_per_caption})")
    print(f"without guidance: before {before_unguided:.1%}  after {after_unguided:.1%}")
    print(f"minutes: data {data_seconds / 60:.1f}, scoring {score_seconds / 60:.1f} per model, "
          f"training {train_seconds / 60:.1f}, total {result['total_minutes']:.1f}")
    if args.results_json:
        Path(args.results_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
