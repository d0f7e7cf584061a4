"""How many images per second the data loader alone delivers, so you can check it outruns the GPUs.

    python bench/bench_data.py                                              # generated photos, 1 and all cores
    python bench/bench_data.py --num_workers 1,4,8 --local /data/mds/laion  # your shards, already local
    python bench/bench_data.py --num_workers 8 --remote s3://bucket/laion/mds --local /tmp/bench-cache
    python bench/bench_data.py --num_workers 2 --image_dtype uint8,float32   # bytes vs floats from the workers
    python bench/bench_data.py --num_workers 2 --aspect_buckets              # bucketed vs square, mixed photos

It times the real training loader (`data.laion_dataloader`: Streaming, JPEG decode, resize, center
crop, tokenization, collation, transfer from the worker processes) on MDS shards, with no model.
Without --remote/--local it first writes shards of photo-like JPEGs (1024x768 by default, about
the file size of real photos; random pixels would be far larger and slower to decode, flat colors
far faster) into a temporary folder, streams them from there, and deletes them at the end.
`--image_dtype float32` makes the workers send float32 images in [-1, 1] (what the loader did
before images crossed as uint8), to compare both in one run. `--aspect_buckets` generates photos of six aspect ratios, writes them both as
one dataset and sorted into bucket folders (as convert.py --aspect_buckets does), and times the square
loader against the bucketed one (one Streaming stream per bucket) side by side, alternating.

What to compare with: the 2023 benchmark trained at 16 images/s per A100 (48 to 150 on an H100,
depending on the code) with 8 loader workers per GPU, and claimed loading ran >= 30x ahead of the
model. Loader throughput scales with cores, so the per-worker figure is what carries over to
another machine (one worker per free CPU core; workers beyond the cores only share them).
"""
from __future__ import annotations

import argparse
import sys
import gc
import io
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate
from streaming import MDSWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

import data
from convert import COLUMNS
from t2ibench.core.cli import BATCH_SIZE, IMAGE_SIZE, NON_NEGATIVE_INT, POSITIVE_INT, REPEATS, Parser
from t2ibench.core.tokenizer import bundled_tokenizer

A100_IMAGES_PER_SEC = 16.0  # the 2023 benchmark, per A100 at 512x512
H100_IMAGES_PER_SEC = 150.0  # the fast end on an H100 (precomputed latents, tuned kernels)


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A synthetic image with the statistics of a photo: large smooth shapes, then finer and weaker
    detail at each octave (a roughly 1/f spectrum), plus a little sensor noise."""
    canvas = np.zeros((height, width, 3), np.float32)
    weight = 1.0
    cells = 3
    while cells < width // 2:
        grid = rng.random((max(2, cells * height // width), cells, 3), dtype=np.float32)
        layer = Image.fromarray((grid * 255).astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC)
        canvas += weight * np.asarray(layer, np.float32)
        weight *= 0.65
        cells *= 2
    canvas = (canvas - canvas.min()) / (np.ptp(canvas) + 1e-6) * 255
    canvas += rng.normal(0.0, 4.0, canvas.shape).astype(np.float32)
    return Image.fromarray(canvas.clip(0, 255).astype(np.uint8))


def write_photo_shards(out: Path, num_samples: int, width: int, height: int, distinct: int = 64,
                       seed: int = 0) -> float:
    """MDS shards (zstd, sha1+xxh64, as convert.py writes them) of `num_samples` JPEGs (quality 90),
    cycling through `distinct` generated images. Returns the mean JPEG size in bytes."""
    rng = np.random.default_rng(seed)
    jpegs = []
    for _ in range(min(distinct, num_samples)):
        buffer = io.BytesIO()
        photo_like(rng, width, height).save(buffer, format="JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    with MDSWriter(out=str(out), columns=COLUMNS, compression="zstd", hashes=["sha1", "xxh64"]) as writer:
        for i in range(num_samples):
            writer.write({"jpg": jpegs[i % len(jpegs)], "caption": f"a photo, number {i}", "key": str(i)})
    return float(np.mean([len(j) for j in jpegs]))


MIXED_SIZES = ((1024, 768), (768, 1024), (1024, 1024), (1536, 640), (1152, 768), (640, 1536))  # --aspect_buckets


def write_mixed_photos(out: Path, num_samples: int, image_size: int) -> Path:
    """`num_samples` photo-like JPEGs cycling through MIXED_SIZES, as one MDS dataset (out/square) and sorted
    into the default list's bucket folders at `image_size` (out/buckets). Returns `out`."""
    from t2ibench.datasets.bucket_folders import IMAGES, RECORD_FILE, BucketWriters, record_of
    from t2ibench.datasets.buckets import default_buckets, nearest_bucket

    rng = np.random.default_rng(0)
    jpegs = []
    for i in range(min(48, num_samples)):
        buffer = io.BytesIO()
        photo_like(rng, *MIXED_SIZES[i % len(MIXED_SIZES)]).save(buffer, format="JPEG", quality=90)
        jpegs.append((buffer.getvalue(), MIXED_SIZES[i % len(MIXED_SIZES)]))
    listed = default_buckets(image_size, 8)
    buckets = BucketWriters(out / "buckets", lambda bucket: COLUMNS, compression="zstd", hashes=["sha1", "xxh64"])
    with MDSWriter(out=str(out / "square"), columns=COLUMNS, compression="zstd", hashes=["sha1", "xxh64"]) as writer:
        for i in range(num_samples):
            jpeg, (width, height) = jpegs[i % len(jpegs)]
            sample = {"jpg": jpeg, "caption": f"a photo, number {i}", "key": str(i)}
            writer.write(sample)
            buckets.write(nearest_bucket(width, height, listed, image_size), sample)
    counts = buckets.finish()
    (out / "buckets" / RECORD_FILE).write_text(record_of(IMAGES, image_size, counts, listed).to_json())
    return out


def float32_collate(samples: list[dict]) -> dict:
    """Collate in the worker, then scale images to float32 [-1, 1] there: the previous loader's output."""
    batch = default_collate(samples)
    batch["image"] = batch["image"].float().div_(127.5).sub_(1.0)
    return batch


def measure(remote: str | None, local: str, tokenizer, image_size: int, batch_size: int, num_workers: int,
            max_batches: int, image_dtype: str = "uint8", buckets: tuple = ()) -> tuple[int, float, float]:
    """Images timed, wall seconds and CPU seconds of this process, over one epoch (or `max_batches`).

    The clock starts when the first round of batches has arrived (one per worker: they are built
    in parallel and arrive together), so worker start-up and the first shard download are left out.
    With num_workers=0 all the work happens in this process, so its CPU time per image is the cost
    of a sample on one core, whatever else the machine is doing; wall time is not.
    """
    loader = data.laion_dataloader(remote=remote, local=local, tokenizer=tokenizer, image_size=image_size,
                                   batch_size_per_device=batch_size, num_workers=num_workers, seed=0, buckets=buckets)
    if image_dtype == "float32":
        loader.collate_fn = float32_collate  # read when the workers start, so this takes effect
    warmup = max(1, num_workers)
    if len(loader) <= warmup:
        raise SystemExit(f"bench_data.py: error: {len(loader)} batches per epoch is too few to time with "
                         f"{num_workers} workers; use more samples or a smaller --batch_size")
    images, start, cpu_start = 0, 0.0, 0.0
    for i, batch in enumerate(loader):
        if i == warmup - 1:
            start, cpu_start = time.perf_counter(), time.process_time()
        elif i >= warmup:
            images += len(batch["image"])
            if max_batches and i - warmup + 1 >= max_batches:
                break
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    del loader, batch
    gc.collect()  # the next loader may reuse the cache folder: Streaming wants this one released
    return images, seconds, cpu_seconds


def build_parser() -> Parser:
    p = Parser("bench_data.py", description=__doc__)
    p.add_argument("--remote", default=None, help="MDS shards to stream (s3://..., a path); default: generate")
    p.add_argument("--local", default=None, help="cache folder (or the shards themselves without --remote)")
    p.add_argument("--image_size", type=IMAGE_SIZE, default=512, help="output side in pixels")
    p.add_argument("--batch_size", type=BATCH_SIZE, default=16, help="per-device batch size")
    p.add_argument("--num_workers", default=None,
                   help="comma-separated worker counts to time; 0: in this process (default: 0, 1, all cores)")
    p.add_argument("--max_batches", type=NON_NEGATIVE_INT, default=0, help="timed batches per setting (0: one whole epoch)")
    p.add_argument("--num_samples", type=POSITIVE_INT, default=512, help="generated samples (without --remote/--local)")
    p.add_argument("--source_size", default="1024x768", help="generated image size WIDTHxHEIGHT")
    p.add_argument("--aspect_buckets", action="store_true",
                   help="generated photos of six aspect ratios: the square loader against the bucketed one")
    p.add_argument("--repeats", type=REPEATS, default=1, help="times each setting is timed (the median is shown)")
    p.add_argument("--image_dtype", default="uint8",
                   help="comma-separated: uint8 (what training uses) and/or float32 (images scaled in the workers)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    p = build_parser()
    args = p.parse_args(argv)
    dtypes = args.image_dtype.split(",")
    if not dtypes or any(d not in ("uint8", "float32") for d in dtypes):
        p.error(f"--image_dtype {args.image_dtype}: give uint8, float32 or uint8,float32")
    try:
        workers = [NON_NEGATIVE_INT(w) for w in args.num_workers.split(",")] if args.num_workers else None
        width, height = (IMAGE_SIZE(v) for v in args.source_size.lower().split("x"))
    except (argparse.ArgumentTypeError, ValueError):
        p.error(f"--num_workers {args.num_workers} / --source_size {args.source_size}: give worker counts such as "
                "0,2,8 and a size such as 1024x768")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = workers or sorted({0, 1, cores})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker, so 0 workers measures one core
    tokenizer = bundled_tokenizer()
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        remote, local, source = args.remote, args.local, args.remote or args.local
        if args.aspect_buckets:
            return compare_buckets(args, workers, tokenizer, scratch)
        if not source:
            started = time.perf_counter()
            mean_bytes = write_photo_shards(scratch / "mds", args.num_samples, width, height)
            source = f"{args.num_samples} generated {width}x{height} JPEGs, {mean_bytes / 1024:.0f} KiB each on average"
            print(f"wrote {source} in {time.perf_counter() - started:.1f} s", flush=True)
            remote = str(scratch / "mds")
        print(f"data: {source}\nloader: {args.image_size}x{args.image_size}, batch {args.batch_size}, "
              f"{cores} CPU cores\n", flush=True)

        rows = []
        print(f"{'dtype':>7} | {'workers':>7} | {'images/s':>9} | {'per worker':>10} | {'ms/image/worker':>15} | "
              f"{'CPU ms/image':>12} | {'images timed':>12}")
        print("-" * 91)
        for n, dtype in itertools.product(workers, dtypes):  # dtypes side by side: machine noise hits both
            # A fresh cache per setting when we own the data, so every setting streams the same way.
            cache = str(scratch / f"cache-{n}-{dtype}") if remote and not args.local else local
            images, seconds, cpu_seconds = measure(remote, cache, tokenizer, args.image_size, args.batch_size, n,
                                                   args.max_batches, dtype)
            rate = images / seconds
            per_worker = rate / max(1, n)
            cpu_ms = 1000 * cpu_seconds / images if n == 0 else None
            rows.append({"workers": n, "image_dtype": dtype, "images_per_sec": rate, "per_worker": per_worker,
                         "images": images, "cpu_ms_per_image": cpu_ms})
            cpu = f"{cpu_ms:>12.1f}" if cpu_ms else f"{'-':>12}"
            print(f"{dtype:>7} | {n:>7} | {rate:>9.1f} | {per_worker:>10.1f} | {1000 / per_worker:>15.1f} | {cpu} | "
                  f"{images:>12}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        torch.set_num_threads(threads)  # main() also runs inside other programs (the tests)

    rows_used = [row for row in rows if row["image_dtype"] == "uint8"] or rows
    best = max(row["per_worker"] for row in rows_used)
    cpu_ms = [row["cpu_ms_per_image"] for row in rows_used if row["cpu_ms_per_image"]]
    if cpu_ms:
        # A worker with a core to itself does about this; a busy machine shows less in the table.
        best = max(best, 1000 / cpu_ms[0])
        print(f"\none sample costs {cpu_ms[0]:.1f} ms of CPU: {1000 / cpu_ms[0]:.1f} images/s per free core")
    per_gpu = 8 * best
    print(f"per worker: {best:.1f} images/s. With 8 workers per GPU on 8 free cores (the 2023 setting): "
          f"~{per_gpu:.0f} images/s per GPU = {per_gpu / A100_IMAGES_PER_SEC:.0f}x the model on an A100 "
          f"({A100_IMAGES_PER_SEC:.0f} images/s), {per_gpu / H100_IMAGES_PER_SEC:.1f}x on an H100 at "
          f"{H100_IMAGES_PER_SEC:.0f} images/s.")
    return rows


def compare_buckets(args: argparse.Namespace, workers: list[int], tokenizer, scratch: Path) -> list[dict]:
    """The square loader and the bucketed one on the same generated photos, alternating, --repeats times."""
    import statistics

    from t2ibench.datasets.buckets import default_buckets

    write_mixed_photos(scratch, args.num_samples, args.image_size)
    print(f"data: {args.num_samples} generated JPEGs of {len(MIXED_SIZES)} aspect ratios; loader {args.image_size} px, "
          f"batch {args.batch_size}\n{'loader':>9} | {'workers':>7} | {'images/s (median)':>17} | each", flush=True)
    rows = []
    for n in workers:
        rates: dict[str, list[float]] = {"square": [], "bucketed": []}
        for repeat in range(args.repeats):
            for name, buckets in (("square", ()), ("bucketed", default_buckets(args.image_size, 8))):
                folder = scratch / ("buckets" if buckets else "square")
                images, seconds, _ = measure(str(folder), str(scratch / f"cache-{name}-{n}-{repeat}"), tokenizer,
                                             args.image_size, args.batch_size, n, args.max_batches, buckets=buckets)
                rates[name].append(images / seconds)
        for name, each in rates.items():
            rows.append({"loader": name, "workers": n, "images_per_sec": statistics.median(each), "each": each})
            print(f"{name:>9} | {n:>7} | {statistics.median(each):>17.1f} | "
                  + ", ".join(f"{rate:.1f}" for rate in each), flush=True)
    return rows


if __name__ == "__main__":
    main()
