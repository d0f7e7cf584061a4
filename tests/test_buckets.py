"""Aspect-ratio buckets (t2ibench/buckets.py): the default list (SDXL's at 1024, the same rule at other
sizes), a user's list and its one-line errors, the nearest bucket without more upscaling than the square
path, the cover-and-crop placement, real photographs decoded into their buckets (EXIF-rotated, a 3000 x 1
line), and one worker's stream of samples turned into one-bucket batches, replayed after a restart."""
from __future__ import annotations

import io
import math
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from t2ibench import bucket_plan, buckets
from t2ibench.buckets import Bucket
from t2ibench.errors import UserError
from t2ibench.images import decode_pixels, decode_pixels_placed, oriented_size
from tests.helpers import MIXED_ASPECT_PHOTOS, photo

# SDXL's buckets as its paper's appendix lists them (height x width): the check of the rule, not its source.
SDXL_PAPER = """512x2048 512x1984 512x1920 512x1856 576x1792 576x1728 576x1664 640x1600 640x1536 704x1472 704x1408
704x1344 768x1344 768x1280 832x1216 832x1152 896x1152 896x1088 960x1088 960x1024 1024x1024 1024x960 1088x960 1088x896
1152x896 1152x832 1216x832 1280x768 1344x768 1408x704 1472x704 1536x640 1600x640 1664x576 1728x576 1792x576 1856x512
1920x512 1984x512 2048x512""".split()


def test_default_list_at_1024_is_sdxls_with_the_mirror_its_table_leaves_out():
    names = [b.name for b in buckets.default_buckets(1024, 8)]
    assert set(names) == set(SDXL_PAPER) | {"1344x704"} and len(names) == len(SDXL_PAPER) + 1
    aspects = [Bucket(*map(int, n.split("x"))).aspect for n in names]
    assert aspects == sorted(aspects)  # tallest to widest
    assert buckets.default_buckets(1024, 16) == buckets.default_buckets(1024, 8)  # Flux.1's patch: the same at 1024


@pytest.mark.parametrize("size, multiple", [(64, 8), (256, 16), (512, 8), (768, 16), (1040, 16), (32, 8)])
def test_default_list_follows_the_rule_at_every_size(size, multiple):
    found = buckets.default_buckets(size, multiple)
    step = buckets.bucket_step(size, multiple)
    assert step % multiple == 0 and step >= multiple
    assert any(b.height <= size and b.width <= size for b in found)  # nothing upscaled beyond the square path
    for b in found:
        assert b.height % step == 0 and b.width % step == 0, b
        assert 0.25 <= b.aspect <= 4 and b.pixels <= size * size, b
        assert b.pixels >= 0.9 * size * size or b.height == b.width, b
    assert min(b.aspect for b in found) < 0.5 < 2 < max(b.aspect for b in found)  # portraits to panoramas


def error_of(path, image_size: int = 64, multiple: int = 8) -> str:
    with pytest.raises(UserError) as raised:
        buckets.resolve_buckets(str(path), image_size, multiple)
    assert "\n" not in raised.value.message
    return raised.value.message


@pytest.mark.parametrize("text, expected", [
    ("64x64\n64 by 96\n", "line 2: '64 by 96' is not HEIGHTxWIDTH"),
    ("64x64\n0x64\n", "line 2: '0x64' is not HEIGHTxWIDTH"),
    ("64x64\n60x64\n", "line 2: 60x64 must have both sides multiples of 8"),
    ("64x64\n# comment\n64X64\n", "line 3: 64x64 is listed twice"),
    ("# nothing\n\n", "lists no bucket"),
    ("96x128\n128x96\n", "no bucket fits in 64x64 (--image_size)"),
])
def test_a_users_list_is_checked_line_by_line_naming_the_file(tmp_path, text, expected):
    path = tmp_path / "buckets.txt"
    path.write_text(text)
    message = error_of(path)
    assert message.startswith(f"--aspect_buckets {path}") and expected in message, message


def test_a_users_list_reads_with_comments_and_missing_files_are_one_line(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("# portrait, square, landscape\n96x48  # tall\n64x64\n\n48x96\n")
    assert buckets.resolve_buckets(str(path), 64, 16) == (Bucket(96, 48), Bucket(64, 64), Bucket(48, 96))
    assert "no such file" in error_of(tmp_path / "gone.txt")
    assert "is a folder" in error_of(tmp_path)
    assert buckets.resolve_buckets(None, 64, 8) == ()
    assert buckets.resolve_buckets(buckets.DEFAULT, 64, 8) == buckets.default_buckets(64, 8)


def test_each_image_goes_to_the_bucket_nearest_its_aspect_ratio():
    listed = buckets.default_buckets(1024, 8)
    assert buckets.nearest_bucket(3000, 1000, listed, 1024).name == "576x1728"  # 3:1 panorama
    assert buckets.nearest_bucket(1000, 3000, listed, 1024).name == "1728x576"
    assert buckets.nearest_bucket(3000, 1, listed, 1024).name == "512x2048"  # beyond 4:1: the widest
    assert buckets.nearest_bucket(800, 800, listed, 1024).name == "1024x1024"
    assert buckets.nearest_bucket(4032, 3024, listed, 1024).name == "896x1152"  # a 4:3 phone photo
    for width, height in [(640, 480), (480, 640), (5000, 1300), (700, 2200)]:
        chosen = buckets.nearest_bucket(width, height, listed, 1024)
        gap = abs(math.log(chosen.aspect * height / width))
        assert all(gap <= abs(math.log(b.aspect * height / width)) + 1e-12 for b in listed)


def test_no_image_is_upscaled_more_than_the_square_path_would():
    listed = (Bucket(88, 64), Bucket(64, 64))
    # 40 x 30 (h x w) is nearest to 88x64 by aspect ratio, but covering it takes 2.2x where the square path
    # takes 64 / 30 = 2.13x: it goes to 64x64. A large image of that shape is only shrunk: 88x64.
    assert buckets.nearest_bucket(30, 40, listed, 64) == Bucket(64, 64)
    assert buckets.nearest_bucket(300, 400, listed, 64) == Bucket(88, 64)
    for width, height in [(30, 40), (1, 3000), (3000, 1), (20, 20), (64, 500)]:
        for listed in (buckets.default_buckets(64, 8), buckets.default_buckets(64, 16)):
            chosen = buckets.nearest_bucket(width, height, listed, 64)
            square = 64 / min(width, height)
            assert buckets.cover_scale(width, height, chosen) <= max(1.0, square) * (1 + 1e-9)


def test_placement_covers_the_bucket_and_crops_inside_it():
    bucket = Bucket(64, 128)
    center = buckets.place(300, 200, bucket)
    assert (center.resized_height, center.resized_width) == (85, 128)
    assert (center.crop_top, center.crop_left) == (10, 0)  # round(21 / 2)
    tops = Counter()
    for index in range(200):
        placed = buckets.place(300, 200, bucket, buckets.crop_generator(17, 0, index))
        assert 0 <= placed.crop_top <= 21 and placed.crop_left == 0
        tops[placed.crop_top] += 1
        assert placed == buckets.place(300, 200, bucket, buckets.crop_generator(17, 0, index))  # seeded
    assert len(tops) > 10  # random corners
    epochs = [[buckets.place(300, 200, bucket, buckets.crop_generator(17, epoch, i)) for i in range(20)]
              for epoch in (1, 2)]
    assert epochs[0] != epochs[1]  # every epoch draws its crops anew


@pytest.mark.parametrize("name, width, height, orientation", MIXED_ASPECT_PHOTOS)
def test_real_photographs_decode_into_their_bucket_with_sdxls_geometry(name, width, height, orientation):
    data = photo(3, width, height, orientation)
    shown = (height, width) if orientation == 6 else (width, height)
    assert oriented_size(data) == shown
    listed = buckets.default_buckets(64, 8)
    bucket = buckets.nearest_bucket(*shown, listed, 64)
    placed = buckets.place(*shown, bucket, buckets.crop_generator(0, 0, 1))
    pixels, geometry = decode_pixels_placed(data, placed)
    assert pixels.shape == (bucket.height, bucket.width, 3) and pixels.dtype == np.uint8
    assert (geometry.original_width, geometry.original_height) == shown
    assert (geometry.crop_top, geometry.crop_left) == (placed.crop_top, placed.crop_left)
    if name == "square":  # a square photo in the square bucket, centered: what the square path decodes
        centered, _ = decode_pixels_placed(data, buckets.place(*shown, bucket))
        assert np.abs(centered.astype(int) - decode_pixels(data, 64).astype(int)).max() <= 1


def test_the_phone_portrait_is_decoded_upright():
    # Stored 120 x 90 with orientation 6 (rotate 90 degrees clockwise to show): a left-right split
    # becomes a top-bottom one.
    pixels = np.zeros((90, 120, 3), np.uint8)
    pixels[:, 60:] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", exif=exif.tobytes())
    data = buffer.getvalue()
    bucket = Bucket(80, 48)
    decoded, _ = decode_pixels_placed(data, buckets.place(*oriented_size(data), bucket))
    assert decoded.shape == (80, 48, 3)
    assert decoded[:30].mean() < 60 and decoded[50:].mean() > 200  # dark above, light below


# -----------------------------------------------------------------------------------------------
# One worker's stream as one-bucket batches.
# -----------------------------------------------------------------------------------------------

LISTED = (Bucket(2, 1), Bucket(1, 1), Bucket(1, 2), Bucket(1, 4))


def partition(num_samples: int, ranks: int, workers: int, seed: int) -> np.ndarray:
    """A shuffled epoch split as Streaming's is: [node, rank of node, worker of rank, samples], -1 padding."""
    ids = np.random.default_rng(seed).permutation(num_samples)
    per_slot = -(-num_samples // (ranks * workers))
    padded = np.concatenate([ids, -np.ones(per_slot * ranks * workers - num_samples, dtype=ids.dtype)])
    return padded.reshape(1, ranks, workers, per_slot)


TABLE = np.array([(i * 7919) % 13 % len(LISTED) for i in range(600)])  # sample -> bucket position in LISTED


@pytest.mark.parametrize("ranks, workers, batch, regroup", [(1, 1, 4, False), (2, 2, 3, False), (4, 2, 2, True),
                                                            (8, 1, 5, True), (3, 3, 4, True)])
def test_every_rank_trains_the_same_bucket_at_every_step(ranks, workers, batch, regroup):
    work = partition(600, ranks, workers, seed=ranks * 10 + workers)
    slots = bucket_plan.epoch_batches(work, TABLE, batch, LISTED, regroup)
    assert len({len(slot) for slot in slots}) == 1 and len(slots) == workers  # the slots cut to the shortest
    used = []
    for worker, slot in enumerate(slots):
        for planned in slot:
            assert len(planned.samples) == ranks and all(len(samples) == batch for samples in planned.samples)
            for rank, samples in enumerate(planned.samples):
                assert set(samples) <= set(work[0, rank, worker].tolist())  # each rank from its own part
            used.extend(s for samples in planned.samples for s in samples)
    assert len(used) == len(set(used))  # no sample twice
    full = [planned for slot in slots for planned in slot
            if all(TABLE[s] == planned.bucket for samples in planned.samples for s in samples)]
    if not regroup:  # stored latents: every batch wholly its bucket's
        assert len(full) == sum(len(slot) for slot in slots)


def test_stored_latents_hold_every_full_batch_every_rank_can_fill():
    # One worker slot: per bucket, the batches are the fewest any rank can fill (its count // batch).
    work = partition(400, ranks=2, workers=1, seed=3)
    slot = bucket_plan.slot_batches([work[0, r, 0] for r in range(2)], TABLE, 4, LISTED, regroup=False)
    for bucket in range(len(LISTED)):
        fill = min(int((TABLE[work[0, r, 0]] == bucket).sum()) // 4 for r in range(2))
        assert sum(planned.bucket == bucket for planned in slot) == fill
    # Images can be cropped into any bucket: the leftovers become batches too, all but the last few.
    regrouped = bucket_plan.slot_batches([work[0, r, 0] for r in range(2)], TABLE, 4, LISTED, regroup=True)
    assert len(regrouped) == 200 // 4


def test_the_plan_depends_on_the_partition_and_the_table_alone():
    work = partition(300, ranks=2, workers=2, seed=5)
    first = bucket_plan.epoch_batches(work, TABLE, 3, LISTED, True)
    assert bucket_plan.epoch_batches(work.copy(), TABLE.copy(), 3, LISTED, True) == first
    assert bucket_plan.global_batches(work, TABLE, 3, LISTED, True) == sum(len(slot) for slot in first)


def test_batches_before_counts_each_workers_share_of_the_trained_batches():
    # 2 ranks x 3 workers, 4 images a device: 40 samples trained = 5 batches per rank, from workers 0,1,2,0,1.
    assert [buckets.batches_before(40, 2, 3, w, 4) for w in range(3)] == [2, 2, 1]
    assert [buckets.batches_before(0, 2, 3, w, 4) for w in range(3)] == [0, 0, 0]
    assert buckets.batches_before(24, 2, 1, 0, 4) == 3


def test_the_memory_model_counts_the_largest_bucket_in_tokens_for_flux_and_pixels_for_sdxl():
    from t2ibench import memory
    from t2ibench.families import MODEL_CONFIGS

    sdxl, flux = MODEL_CONFIGS["sdxl-tiny"], MODEL_CONFIGS["flux1-tiny"]
    listed = buckets.default_buckets(1024, 8)
    assert buckets.largest_bucket(listed, sdxl.latent_downsample, sdxl.patch_size)[1] == \
        {"bucket": "1024x1024", "pixels": 1024 * 1024}  # 512x2048 has as many: the square is named
    mine = (Bucket(64, 64), Bucket(48, 96), Bucket(96, 32))
    assert buckets.largest_bucket(mine, flux.latent_downsample, flux.patch_size) == \
        (Bucket(48, 96), {"bucket": "48x96", "tokens": 3 * 6})
    # The count takes the bucket's own shape: twice the square's pixels (tokens), more activation bytes
    # per image, though not twice (the text's are the same).
    def activations(size):
        return memory.plan("flux1-tiny", size, 80 * 2**30, per_device_batch=4, num_gpus=1)["activation_bytes_per_image"]
    square, double = activations(64), activations((64, 128))
    assert 1.3 * square < double < 2 * square, (square, double)
