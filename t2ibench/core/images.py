"""Images as training sees them: decoded, made RGB, resized and center-cropped, the same in convert.py
and in training (Pillow and NumPy only).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps

_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}

# Micro-conditioning (SDXL: `ModelFamily.micro_conditioning`): each image's size before it was
# resized and where the square crop began, batch keys of two int64 numbers each (`ImageGeometry`).
ORIGINAL_SIZE_KEY = "original_size"  # (height, width) in pixels, after EXIF orientation
CROP_KEY = "crop_top_left"  # (top, left) in pixels of the image resized so its shorter side is the training size
GEOMETRY_KEYS = (ORIGINAL_SIZE_KEY, CROP_KEY)


def image_shape(size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) in pixels of a training image given by its side (square) or by (height, width)
    (an aspect-ratio bucket): the counts of FLOPs and memory take either."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow image as 8-bit RGB: transparency composited on white, grayscale/CMYK/16-bit converted.

    Composite on white (not black, and not by dropping alpha) because transparent areas of logos
    and product photos are meant to be seen on a white page; dropping alpha would expose whatever
    colors the encoder left under the transparent pixels.
    """
    if image.mode == "I" or image.mode.startswith("I;16"):
        # 16-bit grayscale PNG/TIFF: Pillow's convert("RGB") clips at 255; scale 0..65535 to 0..255.
        image = Image.fromarray((np.asarray(image, dtype=np.float32) / 257.0).clip(0, 255).astype(np.uint8))
    if "transparency" in image.info and image.mode in ("P", "L", "RGB"):
        image = image.convert("RGBA")  # a palette entry or one gray/RGB value (PNG tRNS) is transparent
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        white.alpha_composite(rgba)
        return white.convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(data: bytes) -> Image.Image:
    """Decode encoded image bytes (format detected from the content, never from a file name)."""
    image = Image.open(io.BytesIO(data))
    image.load()  # decode now: a truncated or corrupt file fails here, not later in a resize
    return image


@dataclass(frozen=True)
class ImageGeometry:
    """Where a training square came from: the original image's size and the crop's top-left corner, pixels.

    The size is the full image's, after EXIF orientation; the corner is in the image resized so that
    its shorter side is the training size (the convention of SDXL's micro-conditioning, and of
    diffusers' SDXL training script and pipeline).
    """

    original_height: int
    original_width: int
    crop_top: int
    crop_left: int


def center_crop_geometry(width: int, height: int, size: int) -> ImageGeometry:
    """The geometry of a `width` x `height` image resized to shorter side `size`, center-cropped square."""
    side = min(width, height)
    return ImageGeometry(height, width, round((height * size / side - size) / 2),
                         round((width * size / side - size) / 2))


_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def decode_pixels(data: bytes, size: int) -> np.ndarray:
    """Encoded image bytes -> (size, size, 3) uint8 array, as training sees the image.

    The image is oriented by its EXIF tag, converted to RGB (`to_rgb`), resized so that its shorter
    side is `size` pixels (bicubic, antialiased: Pillow filters over the whole footprint when it
    downsamples) and center-cropped to a square. Resize and crop are one `resize(box=...)` call,
    which only resamples the pixels that survive the crop.
    """
    return decode_pixels_with_geometry(data, size)[0]


def decode_pixels_with_geometry(data: bytes, size: int) -> tuple[np.ndarray, ImageGeometry]:
    """`decode_pixels`' array, and where it came from (`ImageGeometry`, from the full image's size:
    a big JPEG decoded at a reduced scale reports the size it was stored at)."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    if image.getexif().get(ExifTags.Base.Orientation, 1) in _TRANSPOSING_ORIENTATIONS:
        geometry = center_crop_geometry(height, width, size)
    else:
        geometry = center_crop_geometry(width, height, size)
    if min(width, height) >= 4 * size:
        # A big JPEG can be decoded at 1/2, 1/4 or 1/8 scale by the IDCT itself, several times
        # faster. Stay at >= 2x the target so the bicubic filter still does the final antialiasing
        # (the same rule as Pillow's thumbnail(), reducing_gap=2).
        scale = 2 * size / min(width, height)
        image.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
    image.load()
    ImageOps.exif_transpose(image, in_place=True)  # phone photos are stored sideways plus a tag
    image = to_rgb(image)
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    image = image.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    return np.array(image, dtype=np.uint8), geometry  # (size, size, 3), a writable copy


# Aspect-ratio buckets (t2ibench.datasets.buckets decides the bucket and the crop; this decodes into it).
def oriented_size(data: bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes as training sees them (after EXIF orientation), from the
    header alone: nothing is decoded, so a bucket is chosen for the cost of opening the file."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    if image.getexif().get(ExifTags.Base.Orientation, 1) in _TRANSPOSING_ORIENTATIONS:
        return height, width
    return width, height


@dataclass(frozen=True)
class Placement:
    """An image in its bucket: resized (aspect kept) to `resized_height` x `resized_width`, which covers
    the bucket, then cropped to `height` x `width` from (`crop_top`, `crop_left`) of the resized image."""

    height: int
    width: int
    resized_height: int
    resized_width: int
    crop_top: int
    crop_left: int


def decode_pixels_placed(data: bytes, placement: Placement) -> tuple[np.ndarray, ImageGeometry]:
    """Encoded image bytes -> (height, width, 3) uint8 array as `placement` says, and its geometry (the
    full image's size after EXIF orientation, the crop corner in the resized image: SDXL's convention).

    Oriented and made RGB as `decode_pixels`; resize and crop are one `resize(box=...)` of the region
    that survives the crop, in the coordinates of the image as decoded (a big JPEG decoded at a reduced
    scale by its IDCT, as `decode_pixels` does, keeps the same region)."""
    p = placement
    image = Image.open(io.BytesIO(data))
    stored_width, stored_height = image.size
    transposed = image.getexif().get(ExifTags.Base.Orientation, 1) in _TRANSPOSING_ORIENTATIONS
    width, height = (stored_height, stored_width) if transposed else (stored_width, stored_height)
    geometry = ImageGeometry(height, width, p.crop_top, p.crop_left)
    scale = max(p.resized_height / height, p.resized_width / width)
    if scale <= 0.25:  # as decode_pixels: stay at >= 2x the target so the bicubic filter still antialiases
        image.draft("RGB", (max(1, round(2 * stored_width * scale)), max(1, round(2 * stored_height * scale))))
    image.load()
    ImageOps.exif_transpose(image, in_place=True)
    image = to_rgb(image)
    decoded_width, decoded_height = image.size
    x, y = decoded_width / p.resized_width, decoded_height / p.resized_height  # resized pixels -> decoded
    box = (p.crop_left * x, p.crop_top * y, (p.crop_left + p.width) * x, (p.crop_top + p.height) * y)
    image = image.resize((p.width, p.height), Image.Resampling.BICUBIC, box=box)
    return np.array(image, dtype=np.uint8), geometry
