"""Samples an epoch trains and leaves out with one Streaming stream per aspect-ratio bucket (per_stream
batching), for photo-like aspect ratios on any world of nodes x ranks x loader workers.

    python bench/bucket_epoch.py                                   # 100,000 photos, 1 node x 8 ranks x 8 workers
    python bench/bucket_epoch.py --samples 1000000 --nodes 2 --ranks_per_node 4 --batch_size 4

The aspect ratios are drawn from a fixed mix (4:3, 3:2, 16:9 landscapes, their portraits, squares, a tail
of panoramas: one bucket holds 0.05% of the photos), each photo sorted into the nearest bucket of the
default list at 1024 (as convert.py --aspect_buckets does). Each bucket's epoch is Streaming 0.13's own
partition of its stream (streaming.base.partition, as its per_stream batching calls it); a step is a
full global batch of one stream. docs/results.md compares it with the planner of before.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

from t2ibench.datasets.buckets import default_buckets, nearest_bucket  # noqa: E402
from t2ibench.core.cli import BATCH_SIZE, POSITIVE_INT, Parser  # noqa: E402

# (aspect ratio width / height, share of photos)
PHOTO_MIX = ((4 / 3, .30), (3 / 2, .20), (16 / 9, .12), (3 / 4, .15), (2 / 3, .10), (1.0, .10), (3.0, .02),
             (1 / 3, .0095), (8.0, .0005))


def photo_buckets(samples: int, seed: int = 0, image_size: int = 1024) -> Counter:
    """Photos per bucket of the default list at `image_size` for `samples` aspect ratios drawn from PHOTO_MIX."""
    rng = np.random.default_rng(seed)
    ratios = np.array([ratio for ratio, _ in PHOTO_MIX])
    shares = np.array([share for _, share in PHOTO_MIX])
    aspect = ratios[rng.choice(len(PHOTO_MIX), samples, p=shares / shares.sum())] * np.exp(rng.normal(0, .03, samples))
    listed = default_buckets(image_size, 8)
    sizes = Counter(zip(np.round(image_size * aspect ** .5).astype(int), np.round(image_size / aspect ** .5).astype(int)))
    counts: Counter = Counter()
    for (width, height), n in sizes.items():
        counts[nearest_bucket(int(width), int(height), listed, image_size)] += n
    return counts


def epoch(counts: Counter, nodes: int, ranks_per_node: int, workers: int, batch_size: int) -> dict:
    """Steps, samples trained and left out, and buckets never trained, of one epoch of Streaming's partition."""
    from streaming.base.partition import get_partitions

    global_batch = nodes * ranks_per_node * batch_size
    steps, trained, never = 0, 0, []
    for bucket, n in counts.items():
        if n < global_batch:  # data.bucket_streams leaves such a folder out, named
            never.append(bucket)
            continue
        work = get_partitions("orig", n, nodes, nodes, ranks_per_node, workers, batch_size)
        batches = work.transpose(3, 2, 0, 1, 4).reshape(-1, global_batch)
        full = batches[batches.min(axis=1) >= 0]
        steps += len(full)
        trained += len(np.unique(full))  # distinct photos (canonical-node padding repeats a few)
    total = sum(counts.values())
    return {"steps": steps, "trained": trained, "left_out": total - trained, "never": never, "total": total}


def main(argv: list[str] | None = None) -> dict:
    p = Parser("bucket_epoch.py", description=__doc__)
    p.add_argument("--samples", type=POSITIVE_INT, default=100_000, help="photos of the dataset")
    p.add_argument("--nodes", type=POSITIVE_INT, default=1)
    p.add_argument("--ranks_per_node", type=POSITIVE_INT, default=8)
    p.add_argument("--workers", type=POSITIVE_INT, default=8, help="loader workers per rank")
    p.add_argument("--batch_size", type=BATCH_SIZE, default=4, help="per-device batch size")
    args = p.parse_args(argv)
    counts = photo_buckets(args.samples)
    result = epoch(counts, args.nodes, args.ranks_per_node, args.workers, args.batch_size)
    smallest = min(counts.items(), key=lambda kv: kv[1])
    print(f"{result['total']:,} photos in {len(counts)} buckets (smallest {smallest[0].name}: {smallest[1]}), "
          f"{args.nodes} node(s) x {args.ranks_per_node} ranks x {args.workers} workers, {args.batch_size} a device")
    print(f"an epoch: {result['steps']:,} steps, {result['trained']:,} photos trained "
          f"({100 * result['trained'] / result['total']:.2f}%), {result['left_out']:,} left out "
          f"({100 * result['left_out'] / result['total']:.2f}%); buckets never trained: "
          f"{', '.join(b.name for b in result['never']) or 'none'}")
    return result


if __name__ == "__main__":
    main()
