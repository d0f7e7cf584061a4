"""Aspect-ratio buckets (t2ibench/datasets/buckets.py): the default list (SDXL's at 1024, the same rule at other
sizes), a user's list and its one-line errors, the nearest bucket without more upscaling than the square
path, the cover-and-crop placement, real photographs decoded into their buckets (EXIF-rotated, a 3000 x 1
line), and Streaming's per_stream partition of one MDS folder per bucket: every bucket trains, one bucket a
step on every rank, a resume off a worker boundary takes the same steps, the node layout decides the order."""
from __future__ import annotations

import io
import math
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from t2ibench.datasets import buckets
from t2ibench.datasets.buckets import Bucket
from t2ibench.core.errors import UserError
from t2ibench.core.images import decode_pixels, decode_pixels_placed, oriented_size
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

# -----------------------------------------------------------------------------------------------
# One stream per bucket folder, batched per_stream by Streaming (t2ibench.datasets.bucket_folders): Streaming's
# own partition of real MDS folders, on the world of 8 ranks x 8 loader workers the old planner failed on.
# -----------------------------------------------------------------------------------------------

# Samples per bucket folder: a long tail as photos have, one bucket holding 0.05% of the data (8 of
# 16,008) and one fewer than a global batch of 8 (7).
FOLDER_SAMPLES = {"64x64": 6000, "48x80": 4000, "80x48": 3000, "40x96": 2000, "96x40": 993, "32x128": 8, "128x32": 7}


@pytest.fixture(scope="module")
def bucket_folders(tmp_path_factory):
    """One small MDS folder per bucket (an int a sample: the partition is what is tested, not the data)."""
    from streaming import MDSWriter

    root = tmp_path_factory.mktemp("folders")
    start = 0
    for name, count in FOLDER_SAMPLES.items():
        with MDSWriter(out=str(root / name), columns={"id": "int"}, size_limit=1 << 14) as writer:
            for i in range(start, start + count):
                writer.write({"id": i})
        start += count
    return root


def per_stream_work(root, names, batch_size: int, nodes: int, ranks_per_node: int, workers: int,
                    sample_in_epoch: int = 0, epoch: int = 0):
    """Streaming 0.13's per_stream partition of the folders `names`: [node, rank, worker, batch, sample]."""
    from streaming import Stream, StreamingDataset
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    dataset = StreamingDataset(streams=[Stream(local=str(root / name)) for name in names], batch_size=batch_size,
                               batching_method="per_stream", shuffle=True, shuffle_seed=17, num_canonical_nodes=nodes)
    world = World(nodes, ranks_per_node, workers, 0)
    dataset._set_shuffle_block_size(world)  # what Streaming's _resume does before an epoch
    return dataset, generate_work("per_stream", dataset, world, epoch, sample_in_epoch)


def global_batches(work) -> list[tuple[int, ...]]:
    """The steps in the order the ranks' DataLoaders take them (batch j from worker j % workers), each the
    samples of every rank; padding (-1) batches dropped."""
    nodes, ranks, workers, rows, batch = work.shape
    steps = work.transpose(3, 2, 0, 1, 4).reshape(rows * workers, nodes * ranks * batch)
    return [tuple(step) for step in steps.tolist() if min(step) >= 0]


@pytest.mark.parametrize("nodes, ranks_per_node, workers, batch", [(1, 8, 8, 1), (2, 4, 8, 1), (1, 2, 2, 3)])
def test_every_bucket_with_a_global_batch_trains_and_an_epoch_leaves_out_less_than_a_batch_a_bucket(
        bucket_folders, nodes, ranks_per_node, workers, batch):
    from t2ibench.datasets.bucket_folders import stream_steps

    global_batch = nodes * ranks_per_node * batch
    names = [name for name, count in FOLDER_SAMPLES.items() if count >= global_batch]  # bucket_streams' rule
    dataset, work = per_stream_work(bucket_folders, names, batch, nodes, ranks_per_node, workers)
    steps = global_batches(work)
    bounds = np.cumsum([0] + [FOLDER_SAMPLES[name] for name in names])
    for step in steps:  # one bucket a step, on every rank
        assert len({int(np.searchsorted(bounds, sample, side="right")) for sample in step}) == 1
    trained = Counter(int(np.searchsorted(bounds, sample, side="right")) - 1 for step in steps for sample in step)
    total = sum(FOLDER_SAMPLES[name] for name in names)
    assert set(trained) == set(range(len(names)))  # the 0.05% bucket too (the old planner never trained it)
    assert total - sum(trained.values()) < len(names) * global_batch  # at most a part-filled batch a bucket
    # The steps Streaming makes are those the loader's length counts (--max_duration Nep's schedule).
    assert len(steps) == sum(stream_steps(FOLDER_SAMPLES[name], nodes, nodes, ranks_per_node, batch) for name in names)


@pytest.mark.parametrize("samples, canonical, nodes, ranks_per_node, batch", [
    (7, 1, 1, 8, 1), (8, 1, 1, 8, 1), (993, 4, 2, 4, 2), (1001, 8, 2, 3, 4), (5, 8, 1, 2, 1), (640, 2, 4, 2, 8)])
def test_stream_steps_counts_the_full_global_batches_of_streamings_partition(samples, canonical, nodes,
                                                                              ranks_per_node, batch):
    from streaming.base.partition import get_partitions

    from t2ibench.datasets.bucket_folders import stream_steps

    work = get_partitions("orig", samples, canonical, nodes, ranks_per_node, 2, batch)
    batches = work.transpose(3, 2, 0, 1, 4).reshape(-1, nodes * ranks_per_node * batch)
    full = int(np.count_nonzero(batches.min(axis=1) >= 0))
    assert stream_steps(samples, canonical, nodes, ranks_per_node, batch) == full


def test_a_mid_epoch_resume_off_a_worker_boundary_takes_the_same_steps_in_the_same_order(bucket_folders):
    names = [name for name, count in FOLDER_SAMPLES.items() if count >= 4]
    _, whole = per_stream_work(bucket_folders, names, 2, 1, 2, 2)
    uninterrupted = global_batches(whole)
    for trained_steps in (1, 3, 4):  # 1 and 3: the next step is worker 1's
        _, resumed = per_stream_work(bucket_folders, names, 2, 1, 2, 2, sample_in_epoch=trained_steps * 4)
        assert global_batches(resumed) == uninterrupted[trained_steps:]


def test_the_node_layout_is_part_of_the_order_the_resume_check_compares(bucket_folders):
    from types import SimpleNamespace

    from t2ibench.train.data_order import data_order
    from t2ibench.datasets.sources import Source

    names = [name for name, count in FOLDER_SAMPLES.items() if count >= 8]
    _, one_node = per_stream_work(bucket_folders, names, 1, 1, 8, 1)
    _, two_nodes = per_stream_work(bucket_folders, names, 1, 2, 4, 1)
    by_rank = [work.reshape(8, -1)[:, :20].tolist() for work in (one_node, two_nodes)]
    assert by_rank[0] != by_rank[1]  # the same 8 ranks take other samples: the order is not the same
    settings = SimpleNamespace(use_synth_data=False, precomputed=False, seed=17, batch_size=8, num_workers=2,
                               buckets=(Bucket(64, 64),), sources=(Source(None, "/data/x"),), shuffle=True,
                               shuffle_algo="py1e", shuffle_block_size=None, epoch_size=None, sampling_granularity=1,
                               num_canonical_nodes=None, image_size=64, bucket_crop="random")
    assert data_order(settings, 8, 1) != data_order(settings, 8, 2)
    assert data_order(settings, 8, 1)["nodes"] == 1 and "--num_workers" not in data_order(settings, 8, 1)


@pytest.mark.slow
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


def test_two_sources_mix_as_their_proportions_say_each_with_its_own_buckets(bucket_folders):
    from streaming import Stream, StreamingDataset

    from t2ibench.datasets.bucket_folders import IMAGES, BucketFolder, BucketRecord, plan_streams
    from t2ibench.datasets.sources import Source

    # Source A: the two largest folders; source B: three others (folders of the fixture, read as two datasets).
    a_names, b_names = ["64x64", "48x80"], ["80x48", "40x96", "96x40"]
    record = {name: BucketRecord(IMAGES, 64, tuple(BucketFolder(buckets.parse_bucket(n), FOLDER_SAMPLES[n])
                                                   for n in names)) for name, names in (("a", a_names), ("b", b_names))}
    sources = [Source(None, str(bucket_folders), 0.3), Source(None, str(bucket_folders), 0.7)]
    listed = tuple(buckets.parse_bucket(n) for n in FOLDER_SAMPLES)
    planned = plan_streams(sources, [record["a"], record["b"]], listed, 64, epoch_size=None)
    dataset = StreamingDataset(streams=[Stream(local=s.local, proportion=s.proportion) for s in planned], batch_size=1,
                               batching_method="per_stream", shuffle=False)
    drawn = [int(stream.choose) for stream in dataset.streams]
    # The plan (which decides what is left out) counts what Streaming draws, to the one sample Streaming's
    # rounding hands to a stream drawn at random; the steps are counted from Streaming's own draws.
    assert all(abs(n - s.samples_per_epoch) <= 1 for n, s in zip(drawn, planned))
    total = sum(drawn)
    assert abs(sum(drawn[:2]) / total - 0.3) < 1e-3 and abs(sum(drawn[2:]) / total - 0.7) < 1e-3
    # Within a source, its buckets keep their mix.
    assert abs(drawn[0] / drawn[1] - FOLDER_SAMPLES["64x64"] / FOLDER_SAMPLES["48x80"]) < 1e-2
    assert abs(drawn[2] / drawn[4] - FOLDER_SAMPLES["80x48"] / FOLDER_SAMPLES["96x40"]) < 1e-2
