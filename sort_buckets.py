"""Sort an MDS dataset written without aspect-ratio buckets into one MDS folder per bucket, for
benchmark.py --aspect_buckets (the LAION shards you have, or latents of an older latents.py).

    python sort_buckets.py /data/mds/laion --out /data/mds/laion-buckets                 # default list at 1024
    python sort_buckets.py /data/mds/laion --out /data/mds/laion-512 --image_size 512 --aspect_buckets my.txt
    python sort_buckets.py /data/latents-old --out /data/latents-buckets                 # latents: their own buckets

INPUT: a local MDS folder (copy a remote one first: the sorted output is about its size). Images go to
the bucket nearest their aspect ratio (their header alone is read), latents to the bucket they were
stored at. Each sample is read once, by --workers processes; a progress line shows how far it is; the
output is published whole, its record (buckets.json) last; a rerun after a kill resumes at the input
shards not done. The layout: docs/data.md#aspect-ratio-buckets---aspect_buckets.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from t2ibench.core import errors
from t2ibench.datasets.bucket_folders import IMAGES, LATENTS, RECORD_FILE
from t2ibench.datasets.bucket_sort import BUCKET_COLUMN, SORTING, SortJob, sort_dataset, stored_buckets
from t2ibench.datasets.buckets import DEFAULT, resolve_buckets
from t2ibench.core.cli import IMAGE_SIZE, POSITIVE_INT, Parser
from t2ibench.core.errors import fail
from t2ibench.core.files import STAGING_FOLDER, hold_output
from t2ibench.core.locations import check_output, file_kind, is_remote
from t2ibench.core.mds import INDEX_FILE, codec_problem, size_limit_problem

PATCH_PX = 8  # sides of the default list in multiples of SDXL's latent patch; runs map folders by aspect ratio


def build_parser() -> Parser:
    p = Parser("sort_buckets.py", description=__doc__)
    p.add_argument("input", metavar="INPUT", help="a local MDS folder written without buckets")
    p.add_argument("--out", required=True, help="a new or empty local folder for the bucket folders")
    p.add_argument("--aspect_buckets", nargs="?", const=DEFAULT, default=DEFAULT, metavar="FILE",
                   help="images: the list to sort into, the default one at --image_size (the default) or FILE, one "
                        "HEIGHTxWIDTH a line; latents keep the buckets they were stored at")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=1024,
                   help="images: the side of the square whose pixels the default list's buckets hold")
    p.add_argument("--image_key", default="jpg", help="images: the column of the encoded image")
    p.add_argument("--workers", type=POSITIVE_INT, default=os.cpu_count() or 1,
                   help="processes sorting, one input shard at a time each (default: all cores)")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd, zstd:<level>, gz, br, none")
    p.add_argument("--hashes", default="sha1,xxh64", help="comma-separated hashes stored per shard ('' for none)")
    p.add_argument("--size_limit", default="64mb", help="shard size before compression, e.g. 64mb")
    p.add_argument("--no_progress", action="store_true", help="no progress line")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return p


def validate(args: argparse.Namespace) -> tuple[SortJob, dict, dict[str, str]]:
    """The job, the writers' settings and the files copied beside the output; one line for each problem."""
    from t2ibench.core.cli import check_workers

    source = Path(args.input).expanduser()
    if is_remote(args.input):
        fail(f"INPUT {args.input} is remote: sort_buckets.py reads a local MDS folder; copy the dataset here first")
    if not source.is_dir():
        kind = file_kind(source) if source.exists() else None
        fail(f"INPUT {args.input} is {kind or 'a file'}, not a folder; give a local MDS folder" if source.exists()
             else f"INPUT {args.input}: no such folder; give a local MDS folder")
    if not (source / INDEX_FILE).is_file():
        if (source / RECORD_FILE).is_file():
            fail(f"INPUT {args.input} is sorted into bucket folders already ({RECORD_FILE}): train on it with "
                 "benchmark.py --aspect_buckets")
        fail(f"INPUT {args.input} is not an MDS folder (no {INDEX_FILE}); give the folder convert.py or MDSWriter wrote")
    try:
        index = json.loads((source / INDEX_FILE).read_text())
        shard = index["shards"][0]
        columns = list(shard["column_names"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
        fail(f"INPUT {args.input}: {INDEX_FILE} is not a readable MDS index with shards ({error})")
    compression = None if args.compression.lower() in ("", "none") else args.compression
    hashes = sorted(h for h in args.hashes.split(",") if h.strip())
    problem = codec_problem(compression, hashes) or size_limit_problem(args.size_limit) \
        or check_workers("--workers", args.workers) \
        or check_output("--out", args.out, folder=True, inputs=[("INPUT", str(source))])
    if problem:
        fail(problem)
    if is_remote(args.out):
        fail(f"--out {args.out}: sort into a local folder, then copy it to the store whole, {RECORD_FILE} last")
    extra: dict[str, str] = {}
    if "latent_mean" in columns:
        if BUCKET_COLUMN not in columns:
            fail(f"INPUT {args.input} holds square latents: nothing to sort; compute latents per bucket with "
                 "latents.py --aspect_buckets")
        from t2ibench.datasets.precomputed import RECORD_FILE as PRECOMPUTE_RECORD

        buckets = stored_buckets(index, str(source))
        recorded = json.loads((source / PRECOMPUTE_RECORD).read_text())
        recorded["aspect_buckets"] = [b.name for b in buckets]
        extra[PRECOMPUTE_RECORD] = json.dumps(recorded, indent=2, sort_keys=True) + "\n"
        kind, image_size = LATENTS, int(recorded.get("image_size") or args.image_size)
    else:
        if args.image_key not in columns:
            fail(f"--image_key {args.image_key} is not a column of INPUT {args.input}; its columns are {columns}")
        kind, image_size = IMAGES, args.image_size
        buckets = resolve_buckets(args.aspect_buckets, image_size, PATCH_PX)
    out = Path(args.out).expanduser()
    foreign = sorted(set(os.listdir(out)) - {SORTING, STAGING_FOLDER}) if out.is_dir() else []
    if foreign:
        fail(f"--out {args.out} is not empty ({foreign[0]}...): choose a new or empty folder")
    job = SortJob(str(source.resolve()), kind, buckets, image_size, args.image_key, index)
    return job, dict(compression=compression, hashes=hashes, size_limit=args.size_limit), extra


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with errors.command("sort_buckets.py", debug=args.debug), hold_output("--out", args.out):
        job, writer_kwargs, extra = validate(args)
        report = sort_dataset(job, str(Path(args.input).expanduser()), str(Path(args.out).expanduser()),
                              args.workers, not args.no_progress, writer_kwargs,
                              say=lambda line: print(line, file=sys.stderr, flush=True), extra_files=extra)
    buckets = ", ".join(f"{name}: {n:,}" for name, n in report["buckets"].items())
    print(f"sorted {report['samples']:,} samples into {len(report['buckets'])} bucket folder(s) in {args.out} "
          f"({buckets})" + (f"; {report['unreadable']:,} unreadable image(s) left out" if report["unreadable"] else ""),
          flush=True)
    return report


if __name__ == "__main__":
    main()
