"""A bucketed run counts a few buckets' FLOPs and fits the rest (t2ibench.callbacks.buckets.BucketFlops):
the fitted counts are the direct ones, and a list the quadratic does not fit is counted whole."""
from __future__ import annotations

import pytest

import benchmark
from t2ibench.datasets.buckets import Bucket
from t2ibench.callbacks.buckets import FIT_COUNTS, BucketFlops


def bucket_list(*sides: tuple[int, int]) -> tuple[Bucket, ...]:
    return tuple(Bucket(height, width) for height, width in sides)


class Recorded:
    """A count that notes which buckets it was asked for."""

    def __init__(self, count):
        self.count, self.asked = count, []

    def __call__(self, bucket: Bucket) -> tuple[float, float]:
        self.asked.append(bucket.name)
        return self.count(bucket)


@pytest.mark.parametrize("model_config", ["sdxl-tiny", "flux1-tiny"])
@pytest.mark.slow
def test_the_fitted_buckets_flops_are_those_counted_directly(model_config, tmp_path, capsys):
    # The run's own counter (benchmark.bucket_flops) on a list of sides the family divides evenly at
    # every level: pixel counts from 1 to 16 times the smallest's, two buckets of the same count.
    settings = benchmark.validate(benchmark.parse_args(["--model_config", model_config, "--use_synth_data"]), 1)
    multiple = settings.family.flops_exact_multiple(model_config)
    sides = [(1, 1), (1, 4), (2, 2), (2, 3), (3, 3), (4, 2), (4, 4)]
    listed = tmp_path / "buckets.txt"
    listed.write_text("".join(f"{h * multiple}x{w * multiple}\n" for h, w in sides))
    settings = benchmark.validate(benchmark.parse_args(
        ["--model_config", model_config, "--use_synth_data", "--image_size", str(4 * multiple),
         "--aspect_buckets", str(listed)]), 1)
    flops = benchmark.bucket_flops(settings, None)
    flops.count = recorded = Recorded(flops.count)
    flops.count_shared()
    assert len(recorded.asked) == FIT_COUNTS and set(flops.step) == {bucket.name for bucket in settings.buckets}
    assert f"{FIT_COUNTS} of the {len(sides)} buckets" in capsys.readouterr().out
    family = settings.family
    for bucket in settings.buckets:
        if bucket.name in recorded.asked:
            continue
        direct = family.flops_per_image(model_config, (bucket.height, bucket.width))
        assert flops.step[bucket.name] == pytest.approx(direct["total"], rel=1e-9, abs=0)
        trained = direct["total"] - direct["vae_encoder"] - direct["text_encoder"]
        assert flops.trained_network[bucket.name] == pytest.approx(trained, rel=1e-9, abs=0)


SIDES = bucket_list((16, 16), (16, 64), (32, 32), (32, 48), (48, 48), (64, 32), (64, 64))


def quadratic_count(bucket: Bucket) -> tuple[float, float]:
    return 7.0 + 3.0 * bucket.pixels + 0.5 * bucket.pixels ** 2, 2.0 * bucket.pixels + 0.25 * bucket.pixels ** 2


def test_a_quadratic_count_is_fitted_and_same_pixel_counts_reuse_a_counted_one():
    count = Recorded(quadratic_count)
    flops = BucketFlops(SIDES, count, 8, 16)
    flops.count_shared()
    assert len(count.asked) == FIT_COUNTS
    assert flops.step == {b.name: pytest.approx(quadratic_count(b)[0], rel=1e-12) for b in SIDES}
    assert flops.trained_network == {b.name: pytest.approx(quadratic_count(b)[1], rel=1e-12) for b in SIDES}
    # 32x32 and 16x64 hold as many pixels: when one is counted, the other takes its count as it is.
    same = [name for name in ("32x32", "16x64", "64x16") if name in flops.step]
    assert len({flops.step[name] for name in same}) == 1


def test_a_count_off_the_quadratic_is_counted_for_every_bucket(capsys):
    def cubic(bucket: Bucket) -> tuple[float, float]:  # what a rounded side somewhere would be like
        return float(bucket.pixels ** 3), float(bucket.pixels)

    count = Recorded(cubic)
    flops = BucketFlops(SIDES, count, 8, 16)
    flops.count_shared()
    assert sorted(count.asked) == sorted(b.name for b in SIDES)
    assert flops.step == {b.name: cubic(b)[0] for b in SIDES}
    assert "counting the other 3 buckets too" in capsys.readouterr().out


@pytest.mark.parametrize("sides", [
    SIDES + bucket_list((24, 64)),  # 24 px: not a multiple of 16, some level would round it
    bucket_list((16, 16), (32, 32), (48, 48), (16, 64)),  # three pixel counts only
])
def test_a_list_that_cannot_be_fitted_is_counted_whole(sides):
    count = Recorded(quadratic_count)
    flops = BucketFlops(sides, count, 8, 16)
    flops.count_shared()
    assert sorted(count.asked) == sorted(b.name for b in sides)
    assert flops.step == {b.name: quadratic_count(b)[0] for b in sides}
