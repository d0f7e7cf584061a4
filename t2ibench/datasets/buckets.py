"""Aspect-ratio buckets (`--aspect_buckets`, SDXL and Flux.1): the list a run trains on (the default one
scaled to --image_size, or a user's file), the bucket each image goes to and where it is cropped, and the
synthetic steps' buckets (streamed ones: one Streaming stream per bucket folder, t2ibench.datasets.bucket_folders). The rules, SDXL's
list and a picture of the default one are in docs/data.md#aspect-ratio-buckets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from t2ibench.core.cli import MAX_IMAGE_SIZE, parse_digits, parse_number, read_text
from t2ibench.core.errors import fail
from t2ibench.core.images import Placement

DEFAULT = "default"  # --aspect_buckets without a file: the default list at --image_size
MAX_ASPECT = 4.0  # the default list spans 1:4 to 4:1, as SDXL's
MIN_FILL = 0.9  # ... and holds 90% to 100% of image_size^2 pixels (SDXL's smallest: 576x1664, 91.4%)
# Sides step by image_size / 16 (SDXL's 64 px at 1024), never finer than the family's latent patch.
STEPS_PER_SIDE = 16
# Beside an exported pipeline of a bucketed run: the sizes it trained at, in the format of --aspect_buckets FILE.
EXPORT_FILE = "aspect_buckets.txt"
CROPS = ("random", "center")  # --bucket_crop: training's default is random (SDXL's), latents.py stores center crops
# Two aspect ratios closer than this (in log ratio) are a tie, broken by the larger bucket: floating noise
# must not pick a bucket.
ASPECT_TIE = 1e-12


@dataclass(frozen=True, order=True)
class Bucket:
    """A training shape in pixels; named "HxW" (height first), as the results JSON's keys."""

    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.height}x{self.width}"

    @property
    def pixels(self) -> int:
        return self.height * self.width

    @property
    def aspect(self) -> float:
        """width / height: above 1 for a landscape bucket."""
        return self.width / self.height


def parse_bucket(text: str) -> Bucket | None:
    """"768x1344" -> Bucket(768, 1344); None when `text` is not two sides of 1 to MAX_IMAGE_SIZE pixels
    (the bound of --image_size: a side of 99999992 trained until the allocator failed) in ASCII digits
    joined by x. The one parser of a size, in a flag, a bucket list or a results file."""
    parts = text.strip().lower().split("x")
    sides = [parse_digits(part.strip()) for part in parts]
    if len(sides) != 2 or not all(side is not None and 0 < side <= MAX_IMAGE_SIZE for side in sides):
        return None
    return Bucket(*sides)


# How a refusal says what a size is; MAX_BUCKETS bounds a list (SDXL's has 40, the default list at most
# 136 at any --image_size): each bucket is a shape to count, compile and hold a worker's samples for.
SIZE_FORMAT = f"HEIGHTxWIDTH in pixels, each side 1 to {MAX_IMAGE_SIZE:,} (e.g. 768x1344)"
MAX_BUCKETS = 256


def sides_problem(bucket: Bucket, multiple: int) -> str | None:
    """Why `bucket` cannot be a latent grid's size: a side that is not a multiple of `multiple` pixels
    (the family's latent patch), or None. The one rule of a bucket's file and of --sample_size."""
    if bucket.height % multiple or bucket.width % multiple:
        return (f"{bucket.name} must have both sides multiples of {multiple} (the model's latent patch in pixels)")
    return None


def parse_size(text: str, multiple: int, flag: str) -> Bucket:
    """A flag's HEIGHTxWIDTH in pixels (--sample_size 768x1344), both sides multiples of `multiple`;
    one line naming the flag otherwise."""
    size = parse_bucket(text)
    if size is None:
        fail(f"{flag} {text}: not {SIZE_FORMAT}")
    problem = sides_problem(size, multiple)
    if problem:
        fail(f"{flag} {text}: {problem}")
    return size


def bucket_step(image_size: int, multiple: int) -> int:
    """Pixels between two sides of the default list: image_size / 16 (64 at 1024) rounded down to a
    multiple of `multiple` (the family's latent patch: 8 px for SDXL, 16 for Flux.1), at least one patch."""
    return max(multiple, image_size // STEPS_PER_SIDE // multiple * multiple)


def default_buckets(image_size: int, multiple: int) -> tuple[Bucket, ...]:
    """The default list at `image_size`: every height x width in steps of `bucket_step` with aspect ratios
    1:4 to 4:1 and 90% to 100% of image_size^2 pixels, and the largest square within image_size. At 1024
    this is SDXL's list of 40 and the one mirror its table leaves out (1344x704): docs/data.md. No side
    exceeds MAX_IMAGE_SIZE (the 4:1 buckets above --image_size 8192 would). Ordered from the tallest to
    the widest."""
    step = bucket_step(image_size, multiple)
    area = image_size * image_size
    square = image_size // step * step
    found = {Bucket(square, square)}
    for height in range(step, min(2 * image_size, MAX_IMAGE_SIZE) + 1, step):
        for width in range(step, min(area // height, MAX_IMAGE_SIZE) + 1, step):
            bucket = Bucket(height, width)
            if bucket.pixels >= MIN_FILL * area and 1 / MAX_ASPECT <= bucket.aspect <= MAX_ASPECT:
                found.add(bucket)
    return tuple(sorted(found, key=lambda b: (b.aspect, -b.pixels)))


def read_buckets(path: str, image_size: int, multiple: int, flag: str = "--aspect_buckets") -> tuple[Bucket, ...]:
    """A user's list: one HEIGHTxWIDTH a line (768x1344), `#` starts a comment; every problem is one line
    naming the file (and the line). Sides must be multiples of `multiple` (the latent patch), and one
    bucket at least must fit in image_size x image_size, so that no image is upscaled more than the
    square path would (see `nearest_bucket`). The file is read by `cli.read_text` (at most
    MAX_TEXT_FILE_BYTES, a byte-order mark skipped) and holds at most MAX_BUCKETS buckets."""
    content = read_text(path, f"{flag} {path}", "give a file of HEIGHTxWIDTH lines (e.g. 768x1344), or the bare "
                                                "flag for the default list")
    buckets: list[Bucket] = []
    for number, line in enumerate(content.splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        bucket = parse_bucket(text)
        if bucket is None:
            fail(f"{flag} {path}, line {number}: {text!r} is not {SIZE_FORMAT}")
        problem = sides_problem(bucket, multiple)
        if problem:
            fail(f"{flag} {path}, line {number}: {problem}")
        if bucket in buckets:
            fail(f"{flag} {path}, line {number}: {bucket.name} is listed twice")
        if len(buckets) == MAX_BUCKETS:
            fail(f"{flag} {path}, line {number}: more than {MAX_BUCKETS} buckets (SDXL's list has 40); each is a "
                 "shape the run counts, compiles and keeps samples waiting for: list fewer")
        buckets.append(bucket)
    if not buckets:
        fail(f"{flag} {path} lists no bucket; give one HEIGHTxWIDTH a line (e.g. 768x1344)")
    if not any(b.height <= image_size and b.width <= image_size for b in buckets):
        fail(f"{flag} {path}: no bucket fits in {image_size}x{image_size} (--image_size), so small images would be "
             f"upscaled more than the square path does; add one, e.g. {image_size}x{image_size}")
    return tuple(sorted(buckets, key=lambda b: (b.aspect, -b.pixels)))


def buckets_text(buckets: tuple[Bucket, ...], heading: str) -> str:
    """The list as a file `read_buckets` reads back (one HEIGHTxWIDTH a line), `heading` as # comments."""
    return "".join(f"# {line}\n" for line in heading.splitlines()) + "".join(f"{b.name}\n" for b in buckets)


def resolve_buckets(spec: str | None, image_size: int, multiple: int, flag: str = "--aspect_buckets"
                    ) -> tuple[Bucket, ...]:
    """The buckets a run trains on: none without the flag, the default list for the bare flag, else the file's."""
    if spec is None:
        return ()
    if spec == DEFAULT:  # a file named so is given as ./default
        return default_buckets(image_size, multiple)
    return read_buckets(spec, image_size, multiple, flag)


UNIFORM = "uniform"  # --synthetic_bucket_weights' default: every bucket of the list equally often


def synthetic_weights(spec: str, buckets: tuple[Bucket, ...], flag: str = "--synthetic_bucket_weights"
                      ) -> tuple[float, ...]:
    """The share of synthetic batches in each bucket: `uniform`, or `HxW=WEIGHT,...` (relative weights of
    buckets of the list; those left out get none). Every problem is one line naming the flag."""
    if spec == UNIFORM:
        return tuple(1 / len(buckets) for _ in buckets)
    weights: dict[Bucket, float] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        bucket = parse_bucket(name)
        weight = parse_number(value.strip())
        if bucket is None or weight is None or not math.isfinite(weight) or weight < 0:
            fail(f"{flag} {spec}: {part.strip()!r} is not HEIGHTxWIDTH=WEIGHT with a weight >= 0 (e.g. 1024x1024=2)")
        if bucket not in buckets:
            fail(f"{flag} {spec}: {bucket.name} is not one of the run's buckets ({buckets[0].name} ... "
                 f"{buckets[-1].name}; python -m t2ibench.datasets.buckets lists the default ones)")
        if bucket in weights:
            fail(f"{flag} {spec}: {bucket.name} is given twice")
        weights[bucket] = weight
    total = sum(weights.values())
    if math.isinf(total):  # each weight finite, their sum not (1e308 twice): the weights relative to the largest
        largest = max(weights.values())
        weights = {bucket: weight / largest for bucket, weight in weights.items()}
        total = sum(weights.values())
    if total <= 0:
        fail(f"{flag} {spec}: the weights add up to 0; give one bucket a positive weight")
    return tuple(weights.get(b, 0.0) / total for b in buckets)


def synthetic_bucket(weights: tuple[float, ...], seed: int, epoch: int, batch: int) -> int:
    """The bucket (its position in the list) of a synthetic step: drawn from `weights`, the same for the
    same seed, epoch and batch on every rank (one bucket per global step) whatever the workers or a restart."""
    return int(np.random.default_rng((seed, epoch, batch)).choice(len(weights), p=weights))


def largest_bucket(buckets: tuple[Bucket, ...], latent_downsample: int, patch_size: int) -> tuple[Bucket, dict]:
    """The bucket whose step needs the most memory, which the memory model sizes the microbatch for, and
    its size in the unit that decides it: the denoiser's tokens for a patch transformer (Flux.1: one per
    2x2 latent pixels), else pixels (SDXL's UNet: activations grow with the pixels). A tie goes to the
    one nearest a square (the default list's 1024x1024 rather than its 512x2048 of as many pixels)."""
    def measure(bucket: Bucket) -> dict:
        if patch_size > 1:
            side = latent_downsample * patch_size
            return {"tokens": (bucket.height // side) * (bucket.width // side)}
        return {"pixels": bucket.pixels}

    largest = max(buckets, key=lambda b: (next(iter(measure(b).values())), -abs(math.log(b.aspect))))
    return largest, {"bucket": largest.name, **measure(largest)}


def cover_scale(width: int, height: int, bucket: Bucket) -> float:
    """The scale at which a width x height image just covers `bucket` (keeping its aspect ratio)."""
    return max(bucket.height / height, bucket.width / width)


def nearest_bucket(width: int, height: int, buckets: tuple[Bucket, ...], image_size: int) -> Bucket:
    """The bucket nearest the image's aspect ratio (in log ratio; a tie goes to the larger bucket), among
    those that upscale it no more than the square path would (max(1, image_size / shorter side)): a list
    always holds one (a bucket within image_size x image_size covers any image at no larger scale)."""
    limit = max(1.0, image_size / min(width, height)) * (1 + 1e-9)
    allowed = [b for b in buckets if cover_scale(width, height, b) <= limit] or list(buckets)
    aspect = math.log(width / height)

    def distance(bucket: Bucket) -> tuple[float, int]:
        gap = abs(math.log(bucket.aspect) - aspect)
        return (round(gap / ASPECT_TIE) * ASPECT_TIE, -bucket.pixels)

    return min(allowed, key=distance)


def place(width: int, height: int, bucket: Bucket, rng: np.random.Generator | None = None) -> Placement:
    """Where a width x height image goes in `bucket`: resized to cover it, then cropped at a random corner
    drawn from `rng` (training), or centered (rng None)."""
    scale = cover_scale(width, height, bucket)
    resized_height = max(bucket.height, round(height * scale))
    resized_width = max(bucket.width, round(width * scale))
    spare_height, spare_width = resized_height - bucket.height, resized_width - bucket.width
    if rng is None:
        top, left = round(spare_height / 2), round(spare_width / 2)
    else:
        top, left = int(rng.integers(0, spare_height + 1)), int(rng.integers(0, spare_width + 1))
    return Placement(bucket.height, bucket.width, resized_height, resized_width, top, left)


def crop_generator(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random crop of sample `index` in `epoch`: the same on every rank, worker count and restart."""
    return np.random.default_rng((seed, epoch, index))


def picture(buckets: tuple[Bucket, ...], image_size: int) -> str:
    """The list as a text picture: a grid of heights (rows) by widths (columns) in steps of the list's
    sides, # where a bucket is (they lie along height x width = image_size^2), then each bucket's aspect
    ratio and share of image_size^2 pixels."""
    heights = sorted({b.height for b in buckets}, reverse=True)
    widths = sorted({b.width for b in buckets})
    listed = set(buckets)
    label = max(len(str(side)) for side in heights)
    lines = [f"{h:>{label}} " + " ".join("#" if Bucket(h, w) in listed else "." for w in widths) for h in heights]
    lines.append(f"{'':>{label}} widths {widths[0]} to {widths[-1]}, heights {heights[-1]} to {heights[0]} "
                 f"(one column or row per side)")
    lines.append("")
    lines.append(f"{'bucket':>11}  {'aspect':>6}  {'pixels':>6}")
    for b in buckets:
        ratio = f"{b.aspect:.2f}" if b.aspect >= 1 else f"1/{1 / b.aspect:.2f}"
        lines.append(f"{b.name:>11}  {ratio:>6}  {b.pixels / image_size ** 2:6.1%}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m t2ibench.datasets.buckets [IMAGE_SIZE [PATCH_PX]]: the default list, drawn
    from t2ibench.core import errors
    from t2ibench.core.cli import IMAGE_SIZE, Parser

    PROG = "python -m t2ibench.datasets.buckets"
    parser = Parser(PROG, description="Draws the default list of --aspect_buckets at IMAGE_SIZE.")
    parser.add_argument("image_size", type=IMAGE_SIZE, nargs="?", default=1024, help="--image_size in pixels")
    # The patch is a side in pixels too, so it takes --image_size's range.
    parser.add_argument("patch_px", type=IMAGE_SIZE, nargs="?", default=8,
                        help="the family's latent patch in pixels: 8 for SDXL, 16 for Flux.1")
    parsed = parser.parse_args()
    with errors.command(PROG):
        if parsed.image_size % parsed.patch_px:
            fail(f"image_size {parsed.image_size} must be a multiple of patch_px {parsed.patch_px}, as --image_size "
                 "must be of the model's latent patch")
        print(picture(default_buckets(parsed.image_size, parsed.patch_px), parsed.image_size))
