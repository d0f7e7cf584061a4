"""What checking every precomputed sample's values costs the loader: StreamingLatents.get_item with and
without `_value_problem` (latents and text states finite, token ids within the vocabulary).

    python bench/value_check.py                      # SD2 base at 512 px: 4 x 64 x 64 fp16 latents, token ids
    python bench/value_check.py --samples 1024 --repeats 9

Writes the shards once (MDSWriter, uncompressed, into --workdir), then alternates the two readings
--repeats times and prints the median microseconds per sample of each, and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

import data  # noqa: E402
from t2ibench.datasets import precomputed  # noqa: E402
from t2ibench.core.cli import POSITIVE_INT, REPEATS, Parser  # noqa: E402
from t2ibench.families import MODEL_CONFIGS  # noqa: E402


def build_parser() -> Parser:
    p = Parser("value_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=POSITIVE_INT, default=512, help="samples written and read per repeat")
    p.add_argument("--repeats", type=REPEATS, default=7, help="alternated readings of each kind")
    p.add_argument("--workdir", default=None, help="where the shards go (default: a temporary folder)")
    return p


def write_latents(out: str, samples: int) -> None:
    family = MODEL_CONFIGS["sd2-base"]
    columns = precomputed.mds_columns(4, 64, None, "fp16", True, family=family, config="sd2-base")
    rng = np.random.default_rng(0)
    from streaming import MDSWriter
    with MDSWriter(out=out, columns=columns, compression=None) as writer:
        for i in range(samples):
            mean = rng.standard_normal((4, 64, 64)).astype(np.float16)
            writer.write({"index": i, "latent_mean": mean, "latent_logvar": mean, "caption": "c",
                          precomputed.token_column("captions", family): rng.integers(0, 49408, 77).astype(np.uint16)})


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(args.workdir or tmp, "latents-512"))
        write_latents(out, args.samples)
        dataset = data.StreamingLatents(local=out, batch_size=1, shuffle=False, family=MODEL_CONFIGS["sd2-base"],
                                        config="sd2-base", image_size=512)

        def per_sample_us(check: bool) -> float:
            if check:
                dataset.__dict__.pop("_value_problem", None)
            else:
                dataset._value_problem = lambda sample: None
            start = time.perf_counter()
            for i in range(args.samples):
                dataset.get_item(i)
            return (time.perf_counter() - start) / args.samples * 1e6

        per_sample_us(True)  # warm the page cache and the readers
        without, with_check = [], []
        for _ in range(args.repeats):
            without.append(per_sample_us(False))
            with_check.append(per_sample_us(True))
    figures = {"us_per_sample_without": statistics.median(without), "us_per_sample_with": statistics.median(with_check)}
    figures["ratio"] = figures["us_per_sample_with"] / figures["us_per_sample_without"]
    print(f"get_item, SD2 512 px latents: {figures['us_per_sample_without']:.1f} us per sample without the value "
          f"check, {figures['us_per_sample_with']:.1f} with it (median of {args.repeats}, alternated); "
          f"ratio {figures['ratio']:.3f}")
    return figures


if __name__ == "__main__":
    main()
