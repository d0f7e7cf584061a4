"""What one bucket per global step saves on N GPUs, counted: with each rank drawing its own bucket (as
the loaders did before), every step waits in its collectives for the rank whose bucket costs most, so a
step costs the maximum of N draws; with one bucket per step (t2ibench.bucket_plan) it costs one draw.
Costs are the trained network's FLOPs per image of each bucket (the family's count on the meta device,
t2ibench.callbacks.buckets.BucketFlops: a few buckets counted, the rest from their quadratic), the
buckets drawn with the given weights (the data's shares; uniform by default).

    python bench/bucket_steps.py                                              # SDXL base's default list at 1024
    python bench/bucket_steps.py --model_config flux1-schnell --image_size 256 --gpus 8 64 512
    python bench/bucket_steps.py --synthetic_bucket_weights 1024x1024=4,832x1216=1 --json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

import numpy as np  # noqa: E402

from t2ibench.datasets.buckets import UNIFORM, Bucket, resolve_buckets, synthetic_weights  # noqa: E402
from t2ibench.callbacks.buckets import BucketFlops  # noqa: E402
from t2ibench.core.cli import IMAGE_SIZE, Parser  # noqa: E402
from t2ibench.core.errors import command  # noqa: E402
from t2ibench.families import MODEL_CONFIGS, family_of  # noqa: E402


def expected_max(costs: np.ndarray, weights: np.ndarray, draws: int) -> float:
    """E[max of `draws` independent draws], exactly: P(max <= c_k) = F(c_k)^draws over the sorted costs."""
    order = np.argsort(costs)
    cumulative = np.cumsum(weights[order])
    below = np.concatenate([[0.0], cumulative[:-1]])
    return float(np.sum(costs[order] * (np.minimum(cumulative, 1.0) ** draws - below ** draws)))


def wait_fractions(costs: np.ndarray, weights: np.ndarray, gpus: list[int]) -> dict[int, float]:
    """Per GPU count: the share of a per-rank-bucket step spent waiting for the costliest rank, i.e.
    1 - E[cost] / E[max cost] (what one bucket per step saves of each step)."""
    mean = float(np.sum(costs * weights))
    return {n: 1 - mean / expected_max(costs, weights, n) for n in gpus}


def main(argv: list[str] | None = None) -> dict:
    p = Parser("bucket_steps.py", description=__doc__)
    p.add_argument("--model_config", default="sdxl-base", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--image_size", type=IMAGE_SIZE, default=None, help="the list's size (default: the family's)")
    p.add_argument("--aspect_buckets", default="default", help="a bucket list file, or `default` (the default list)")
    p.add_argument("--synthetic_bucket_weights", default=UNIFORM, help="each bucket's share: uniform or HxW=W,...")
    p.add_argument("--gpus", type=int, nargs="+", default=[2, 8, 64], help="GPU counts to count for")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    family = family_of(args.model_config)
    size = args.image_size or family.default_image_size(args.model_config)
    buckets = resolve_buckets(args.aspect_buckets, size, family.latent_downsample * family.patch_size)
    weights = np.array(synthetic_weights(args.synthetic_bucket_weights, buckets))

    def count(bucket: Bucket) -> tuple[float, float]:
        flops = family.flops_per_image(args.model_config, (bucket.height, bucket.width), vae=False,
                                       text_encoders=False)
        return flops["total"], flops["total"]

    counted = BucketFlops(buckets, count, family.latent_downsample, family.flops_exact_multiple(args.model_config))
    counted.count_shared()
    costs = np.array([counted.trained_network[bucket.name] for bucket in buckets])
    waits = wait_fractions(costs, weights, args.gpus)
    result = {"model_config": args.model_config, "image_size": size, "buckets": len(buckets),
              "flops_relative_range": [float(costs.min() / costs.max()), 1.0],
              "wait_fraction_by_gpus": {str(n): waits[n] for n in args.gpus}}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model_config} at {size}: {len(buckets)} buckets, trained-network FLOPs per image "
              f"{costs.min() / costs.max():.3f} to 1.000 of the largest, weights {args.synthetic_bucket_weights}")
        for n in args.gpus:
            print(f"  {n:>5} GPUs: each rank its own bucket waits {100 * waits[n]:.1f}% of every step for the "
                  f"costliest rank; one bucket per step saves it ({1 / (1 - waits[n]):.3f}x the images/s)")
    return result


if __name__ == "__main__":
    with command("bucket_steps.py"):
        main()
