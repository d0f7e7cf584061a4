"""How Streaming's memory and start-up time grow with the dataset, measured small and projected to LAION.

    python bench/index_scale.py                                      # the default ladder, a few minutes
    python bench/index_scale.py --shards 1000 10000 --samples_per_shard 100 --workers 2   # quick look
    python bench/index_scale.py --aspect_buckets 41      # the same, bucketed: 41 folders, one stream each, per_stream

A StreamingDataset holds its whole index (an object per shard) in every process that opens it: each
training rank, and each of its DataLoader workers (forked from the rank: pages are shared until
Python's reference counting writes to them). At the start of every epoch, one process per node
(the first worker of local rank 0) builds the node's partition of the epoch, a sample id per
sample of the epoch, shuffled, and shares it with the node's other workers through shared memory;
each worker copies out its own part. So the index costs per shard and per process, the epoch per
sample and per node.

This script writes MDS index.json files that describe N shards of S samples (no shard data: the
columns and sizes of latents.py's and convert.py's shards, nothing is downloaded), and for each one
runs a fresh process that (1) opens the dataset, as a rank does, and (2) starts an epoch in W
DataLoader workers, as training does (it runs Streaming's own epoch set-up, StreamingDataset's
_resume_incr_epoch and _get_work, then stops, since there are no samples to read). It measures
wall time, resident memory (RSS), the process's own memory (USS: private pages) and its
proportional share (PSS) from /proc/<pid>/smaps_rollup, and the peak RSS of the process that built
the partition. Then it fits each figure linearly (per shard for opening, per sample for the
epoch) and projects to 2 billion samples at the shard sizes of convert.py (256px JPEGs of about
20 KB) and latents.py (the tokens format at 256 and 512 px), for an 8-GPU node with 8 workers per
GPU, with and without --epoch_size. With --aspect_buckets N the shards are split over N bucket folders (as
convert.py --aspect_buckets writes them), opened as one Streaming stream each and batched per_stream, as
benchmark.py --aspect_buckets trains: run it beside a square run and compare the two projections.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streaming.base.shuffle import algos  # noqa: E402

from t2ibench.core import errors  # noqa: E402
from t2ibench.core.cli import (BATCH_SIZE, BUDGET_SECONDS, NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT,  # noqa: E402
                           POSITIVE_INT, SECONDS, Parser, read_text)
from t2ibench.core.errors import fail  # noqa: E402
from t2ibench.core.locations import check_output, check_outputs_apart, normalise  # noqa: E402

# Columns and sample sizes of the two kinds of shards (before compression).
KINDS = {
    "latents": dict(names=["caption", "index", "latent_logvar", "latent_mean", "token_ids"],
                    encodings=["str", "int64", "ndarray:float16:4,64,64", "ndarray:float16:4,64,64", "ndarray:uint16:77"],
                    sizes=[None, 8, None, None, None]),
    "images": dict(names=["caption", "jpg", "key"], encodings=["str", "bytes", "str"], sizes=[None, None, None]),
}
SHARD_LIMIT = 64 * 2**20  # convert.py's default --size_limit (64mb), latents.py's former default
SHARD_LIMITS = {"64mb": 64 * 2**20, "256mb": 256 * 2**20}  # projected: the old default and latents.py's new one
TARGET_SAMPLES = 2_000_000_000
# Bytes per sample of each dataset projected (before compression): a 256px JPEG as convert.py writes
# it (about 20 KB), latents in the tokens format (precomputed.bytes_per_sample: 2 x 4 x 32 x 32 x 2 + 154 + 8
# = 16,546 at 256px, 65,698 at 512px) plus a 50-byte caption and MDS's per-sample offsets (about 70).
PROJECTED = {"jpeg-256px": 20_000, "latents-256px": 16_546 + 70, "latents-512px": 65_698 + 70}


def memory() -> dict[str, float]:
    """This process's memory in MiB: rss, uss (private), pss (proportional), shared, and the peak RSS."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {"rss": fields.get("Rss", 0.0), "uss": uss, "pss": fields.get("Pss", 0.0),
            "shared": fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0), "peak_rss": peak}


def write_dataset(folder: Path, kind: str, num_shards: int, samples_per_shard: int, buckets: int) -> None:
    """One index (buckets 0: square), or the shards split over `buckets` folders, an index each."""
    if not buckets:
        write_index(folder, kind, num_shards, samples_per_shard)
        return
    for k in range(buckets):
        share = num_shards // buckets + (k < num_shards % buckets)
        if share:
            write_index(folder / f"bucket{k:03d}", kind, share, samples_per_shard)


def write_index(folder: Path, kind: str, num_shards: int, samples_per_shard: int) -> None:
    """index.json of `num_shards` shards of `samples_per_shard` samples, as MDSWriter writes it."""
    spec = KINDS[kind]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "index.json", "w") as f:
        f.write('{"version": 2, "shards": [')
        for i in range(num_shards):
            shard = {"column_encodings": spec["encodings"], "column_names": spec["names"], "column_sizes": spec["sizes"],
                     "compression": "zstd", "format": "mds", "hashes": ["xxh64"], "samples": samples_per_shard,
                     "size_limit": SHARD_LIMIT, "version": 2,
                     "raw_data": {"basename": f"shard.{i:06d}.mds", "bytes": SHARD_LIMIT, "hashes": {}},
                     "zip_data": {"basename": f"shard.{i:06d}.mds.zstd", "bytes": SHARD_LIMIT // 2,
                                  "hashes": {"xxh64": f"{i:016x}"}}}
            f.write(("," if i else "") + json.dumps(shard))
        f.write("]}\n")


# -----------------------------------------------------------------------------------------------
# The measured process (one per configuration, so every measurement starts from a clean process).
# -----------------------------------------------------------------------------------------------

def child(args: argparse.Namespace) -> dict:
    import torch
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    if getattr(args, "streaming_spanner", False):
        import streaming.base.dataset
        from streaming.base.spanner import Spanner

        streaming.base.dataset.Spanner = Spanner  # Streaming's own, for the "before" figures
    else:
        import data  # noqa: F401  what training runs: data.CompactSpanner instead of Streaming's Spanner

    class EpochStart(StreamingDataset):
        """Runs the start of an epoch exactly as StreamingDataset.__iter__ does (world detection,
        resumption state, the node's partition), then yields this process's figures instead of samples."""

        def __iter__(self):
            started = time.perf_counter()
            before = memory()
            self._unique_worker_world = self._unique_rank_world.detect_workers()
            self._parallel_worker_world = self._parallel_rank_world.detect_workers()
            epoch, sample_in_epoch = self._resume_incr_epoch()
            ids = self._get_work(epoch, sample_in_epoch)
            yield {"seconds": time.perf_counter() - started, "samples": len(ids), "before": before, "after": memory(),
                   "leader": self._unique_worker_world.is_local_leader, "pid": os.getpid()}

    base = memory()
    started = time.perf_counter()
    if getattr(args, "aspect_buckets", 0):  # one stream per bucket folder, batched per_stream (data.StreamBuckets)
        from streaming import Stream

        folders = sorted(p for p in Path(args.local).iterdir() if p.is_dir())
        where = {"streams": [Stream(local=str(folder)) for folder in folders], "batching_method": "per_stream"}
    else:
        where = {"local": args.local, "remote": None}
    dataset = EpochStart(**where, batch_size=args.batch_size, shuffle=True, shuffle_algo=args.shuffle_algo,
                         epoch_size=args.epoch_size, num_canonical_nodes=args.num_canonical_nodes)
    opened = {"seconds": time.perf_counter() - started, "memory": memory(), "base": base}
    if args.workers:
        loader = DataLoader(dataset, batch_size=None, num_workers=args.workers)
        workers = list(loader)
    else:
        workers = list(dataset)
    return {"open": opened, "workers": workers, "epoch_samples": int(dataset.epoch_size),
            "torch_threads": torch.get_num_threads()}


def measure(local: Path, args: argparse.Namespace, workers: int, epoch_size: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--local", str(local), "--workers", str(workers),
           "--shuffle_algo", args.shuffle_algo, "--batch_size", str(args.batch_size)]
    if args.streaming_spanner:
        cmd.append("--streaming_spanner")
    if args.aspect_buckets:
        cmd += ["--aspect_buckets", str(args.aspect_buckets)]
    if epoch_size:
        cmd += ["--epoch_size", str(epoch_size)]
    if args.num_canonical_nodes:
        cmd += ["--num_canonical_nodes", str(args.num_canonical_nodes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one rank, alone
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode:
        raise RuntimeError(f"measurement failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarize(num_shards: int, samples_per_shard: int, r: dict) -> dict:
    """One row: the rank's open cost; the epoch start in the workers (slowest worker, mean worker's
    private memory, the building worker's peak)."""
    opened = r["open"]
    workers = r["workers"]
    leader = next(w for w in workers if w["leader"])
    others = [w for w in workers if not w["leader"]] or workers
    return {
        "shards": num_shards, "samples": num_shards * samples_per_shard, "epoch_samples": r["epoch_samples"],
        "open_s": opened["seconds"], "open_rss_mib": opened["memory"]["rss"] - opened["base"]["rss"],
        # Opening also builds a sample -> shard table (streaming.base.spanner: an int64 per sample, then
        # one small array per 1,024 samples): a peak per sample above what stays resident.
        "open_peak_extra_mib": max(0.0, opened["memory"]["peak_rss"] - opened["base"]["rss"]),
        "epoch_s": max(w["seconds"] for w in workers),
        "leader_peak_extra_mib": leader["after"]["peak_rss"] - leader["before"]["rss"],
        "worker_uss_mib": float(np.mean([w["after"]["uss"] for w in others])),
        "worker_uss_growth_mib": float(np.mean([w["after"]["uss"] - w["before"]["uss"] for w in others])),
        "worker_pss_mib": float(np.mean([w["after"]["pss"] for w in others])),
        "partition_shm_mib": r["epoch_samples"] * 8 / 2**20,  # int64 sample ids, one copy per node
    }


def fit_open(rows: list[dict], key: str) -> tuple[float, float]:
    """Least squares y = a + b shards + c samples over both ladders (they differ in samples per
    shard, so the two costs separate): (per shard, per sample), each at least 0."""
    x = np.array([[1.0, r["shards"], r["samples"]] for r in rows])
    coef = np.linalg.lstsq(x, np.array([r[key] for r in rows], float), rcond=None)[0]
    return max(0.0, float(coef[1])), max(0.0, float(coef[2]))


def fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x: (a, b)."""
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(a), float(b)


def build_parser() -> argparse.ArgumentParser:
    p = Parser("index_scale.py", description=__doc__)
    p.add_argument("--shards", type=POSITIVE_INT, nargs="+", default=[10_000, 30_000, 100_000, 300_000],
                   help="shard counts of the index ladder (opening cost per shard)")
    p.add_argument("--samples_per_shard", type=POSITIVE_INT, default=100,
                   help="samples per shard of the index ladder (kept small: it measures the per-shard cost)")
    p.add_argument("--epoch_samples", type=POSITIVE_INT, nargs="+", default=[3_000_000, 10_000_000, 30_000_000],
                   help="dataset sizes of the epoch ladder, in samples (per-sample cost of an epoch's start)")
    p.add_argument("--epoch_shard_samples", type=POSITIVE_INT, default=3000, help="samples per shard of the epoch ladder")
    p.add_argument("--workers", type=POSITIVE_INT, default=8, help="DataLoader workers of the measured rank")
    p.add_argument("--shuffle_algo", type=str, default="py1e", choices=sorted(algos),
                   help="Streaming's shuffle algorithm")
    p.add_argument("--batch_size", type=BATCH_SIZE, default=32, help="per-device batch size")
    p.add_argument("--epoch_size", type=POSITIVE_INT, default=None, help="Streaming epoch_size (default: the dataset)")
    p.add_argument("--num_canonical_nodes", type=POSITIVE_INT, default=None, help="Streaming's canonical nodes (default: its own)")
    p.add_argument("--gpus_per_node", type=POSITIVE_INT, default=8, help="ranks per node, for the projection")
    p.add_argument("--budget_gib", type=POSITIVE_FLOAT, default=4.0, help="memory budget per rank (rank + its workers)")
    p.add_argument("--budget_s", type=BUDGET_SECONDS, default=60.0, help="start-up budget per rank (open + epoch start)")
    p.add_argument("--projected_epoch_size", type=POSITIVE_INT, default=200_000_000,
                   help="--epoch_size of the projection's 'with epoch_size' rows")
    p.add_argument("--out", type=str, default=None, help="folder for the indexes (default: a temporary one, deleted)")
    p.add_argument("--json", type=str, default=None, help="also write the table and the fits to this file")
    p.add_argument("--timeout", type=SECONDS, default=600.0, help="seconds per measurement")
    p.add_argument("--open_s_per_shard", type=NON_NEGATIVE_FLOAT, default=None,
                   help="project with this opening time per shard instead of the fitted one (times depend on the "
                        "machine's load; memory does not)")
    p.add_argument("--epoch_s_per_sample", type=NON_NEGATIVE_FLOAT, default=None,
                   help="project with this epoch start time per sample instead of the fitted one")
    p.add_argument("--streaming_spanner", action="store_true",
                   help="open with Streaming's own Spanner (an int64 per sample) instead of data.CompactSpanner")
    p.add_argument("--from_json", type=str, default=None,
                   help="project from the rows of an earlier --json instead of measuring (e.g. another budget)")
    p.add_argument("--aspect_buckets", type=NON_NEGATIVE_INT, default=0,
                   help="0: one square dataset; N: the shards split over N bucket folders, one stream each, per_stream")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local", type=str, default=None, help=argparse.SUPPRESS)
    return p


def read_rows(path: str) -> dict:
    """The rows of an earlier --json, or one line naming the file."""
    text = read_text(path, f"--from_json {path}", "give a --json file of this script")
    try:
        rows = json.loads(text)["rows"]
        if not all(isinstance(rows.get(k), list) for k in ("index", "epoch")):
            raise ValueError("no 'index' and 'epoch' rows")
        return rows
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        fail(f"--from_json {path} is not a --json file of this script ({type(error).__name__}: {error})")


def validate(parsed: argparse.Namespace) -> tuple[argparse.Namespace, dict | None]:
    """Locations and loader processes, before any index is written. Returns the flags with the locations
    normalised, in a new namespace (the parsed one is left as it was parsed), and the rows of --from_json, if given."""
    # file:///path is the path /path (locations.normalise); everything here is local.
    paths = {flag: normalise(f"--{flag}", getattr(parsed, flag), ())
             for flag in ("out", "json", "from_json") if getattr(parsed, flag) is not None}
    args = argparse.Namespace(**{**vars(parsed), **paths})
    outputs = [("--out", args.out, "folder"), ("--json", args.json, "file")]
    for flag, location, kind in outputs:
        problem = check_output(flag, location, folder=kind == "folder", inputs=[("--from_json", args.from_json)])
        if problem:
            fail(problem)
    problem = check_outputs_apart(outputs)
    if problem:
        fail(problem)
    if args.from_json:
        return args, read_rows(args.from_json)
    # Imported here, not at the top: t2ibench.commands.flags loads the model families (diffusers), and every
    # measured --child process starts this script again, whose memory is what is measured.
    from t2ibench.core.cli import check_workers
    problem = check_workers("--workers", args.workers)  # the one measured rank's loader workers
    if problem:
        fail(problem)
    return args, None


def main(argv: list[str] | None = None) -> dict:
    parsed = build_parser().parse_args(argv)
    if parsed.child:
        print(json.dumps(child(parsed)), flush=True)
        return {}
    with errors.command("index_scale.py"):
        args, rows = validate(parsed)
    if rows is not None:  # --from_json: projected again (e.g. for another budget), and --json written as well
        return report(rows, args)

    root = Path(args.out or tempfile.mkdtemp(prefix="index-scale-"))
    rows = {"index": [], "epoch": []}
    try:
        for ladder, configs in (("index", [(n, args.samples_per_shard) for n in args.shards]),
                                ("epoch", [(max(1, s // args.epoch_shard_samples), args.epoch_shard_samples)
                                           for s in args.epoch_samples])):
            for num_shards, per_shard in configs:
                local = root / f"{ladder}-{num_shards}x{per_shard}"
                started = time.perf_counter()
                write_dataset(local, "latents", num_shards, per_shard, args.aspect_buckets)
                written = time.perf_counter() - started
                row = summarize(num_shards, per_shard, measure(local, args, args.workers, args.epoch_size))
                rows[ladder].append(row)
                print(f"{ladder:5s} {num_shards:>9,} shards x {per_shard:>5,} = {row['samples']:>12,} samples "
                      f"(index written in {written:.1f} s): open {row['open_s']:6.2f} s {row['open_rss_mib']:8.1f} MiB (peak +{row['open_peak_extra_mib']:.1f}); "
                      f"epoch start {row['epoch_s']:6.2f} s, builder peak +{row['leader_peak_extra_mib']:8.1f} MiB, "
                      f"worker USS {row['worker_uss_mib']:7.1f} MiB (+{row['worker_uss_growth_mib']:.1f} at epoch "
                      f"start), PSS {row['worker_pss_mib']:7.1f} MiB, partition {row['partition_shm_mib']:.1f} MiB "
                      "shared", flush=True)
                shutil.rmtree(local, ignore_errors=True)
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    return report(rows, args)


def report(rows: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The rows with their fits and projection, also written to --json."""
    result = {"rows": rows, **project(rows, args)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def project(rows: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """Fit the growth and print the projection to TARGET_SAMPLES samples."""
    index, epoch = rows["index"], rows["epoch"]
    fits = {}
    if len(index) >= 2 and len(epoch) >= 2:
        both = index + epoch
        fits["open_s_per_shard"], fits["open_s_per_sample"] = fit_open(both, "open_s")
        fits["open_mib_per_shard"], fits["open_mib_per_sample"] = fit_open(both, "open_rss_mib")
        if all("open_peak_extra_mib" in r for r in both):
            fits["open_peak_mib_per_shard"], fits["open_peak_mib_per_sample"] = fit_open(both, "open_peak_extra_mib")
        fits["worker_uss_mib_per_shard"] = fit([r["shards"] for r in index], [r["worker_uss_mib"] for r in index])[1]
    if len(epoch) >= 2:
        x = [r["epoch_samples"] for r in epoch]
        fits["epoch_s_per_sample"] = fit(x, [r["epoch_s"] for r in epoch])[1]
        fits["builder_peak_mib_per_sample"] = fit(x, [r["leader_peak_extra_mib"] for r in epoch])[1]
        fits["worker_growth_mib_per_sample"] = fit(x, [r["worker_uss_growth_mib"] for r in epoch])[1]
    if len(fits) < 8:
        print("(fewer than two sizes per ladder: no fit, no projection)")
        return {"fits": fits, "projection": []}
    print("\nlinear fits: " + ", ".join(f"{k} {v:.3g}" for k, v in fits.items()))
    for name in ("open_s_per_shard", "epoch_s_per_sample"):
        if getattr(args, name, None) is not None:
            fits[name] = getattr(args, name)
            print(f"projected with {name} {fits[name]:.3g} (--{name}) instead of the fit")
    print(f"\nprojection for {TARGET_SAMPLES:,} samples, {args.gpus_per_node} ranks x {args.workers} workers per "
          f"node (the same per node on 64 nodes: each node holds the index and its own copy of the partition), "
          f"{f'{args.aspect_buckets} bucket streams per_stream' if getattr(args, 'aspect_buckets', 0) else 'square'}, "
          f"shuffle {args.shuffle_algo}; budget {args.budget_gib:g} GiB and {args.budget_s:g} s per rank. "
          "'rank' = the larger of the open peak and the rank's index + its workers' private memory + (local rank 0) "
          "the partition builder's peak; "
          "'node' adds the other ranks and the shared partition")
    print(f"{'dataset':14s} {'shard':>6s} {'samples/shard':>13s} {'shards':>10s} {'epoch_size':>13s} "
          f"{'open':>8s} {'index':>9s} {'open peak':>10s} {'rank':>9s} {'node':>9s} {'start':>8s} {'fits':>5s} {'max epoch':>13s}")
    table = []
    gib = 1024.0
    for name, sample_bytes in PROJECTED.items():
        for limit_name, limit in SHARD_LIMITS.items():
            per_shard = limit // sample_bytes
            shards = -(-TARGET_SAMPLES // per_shard)
            for epoch_size in (TARGET_SAMPLES, args.projected_epoch_size):
                open_s = fits["open_s_per_shard"] * shards + fits["open_s_per_sample"] * TARGET_SAMPLES
                index_mib = fits["open_mib_per_shard"] * shards + fits["open_mib_per_sample"] * TARGET_SAMPLES
                # Every rank opens the dataset at once: the open peak is per rank, over what stays resident.
                open_peak_mib = fits.get("open_peak_mib_per_shard", 0.0) * shards + \
                    fits.get("open_peak_mib_per_sample", 0.0) * TARGET_SAMPLES
                # A worker (forked: the index pages stay shared until written): its private memory, and
                # its own copy of its part of the epoch (measured with one rank: on a node, 1/ranks of it).
                worker_per_sample = fits["worker_growth_mib_per_sample"] / args.gpus_per_node
                worker_index_mib = max(0.0, fits["worker_uss_mib_per_shard"]) * shards
                worker_mib = worker_index_mib + worker_per_sample * epoch_size
                builder_mib = fits["builder_peak_mib_per_sample"] * epoch_size  # one process per node
                partition_mib = epoch_size * 8 / 2**20  # int64 sample ids in shared memory, once per node
                rank_mib = max(open_peak_mib, index_mib + args.workers * worker_mib + builder_mib)
                node_mib = args.gpus_per_node * (index_mib + args.workers * worker_mib) + builder_mib + partition_mib
                start_s = open_s + fits["epoch_s_per_sample"] * epoch_size
                ok = rank_mib / gib <= args.budget_gib and start_s <= args.budget_s
                # The largest epoch_size whose start fits the budget, memory and time (0: none does).
                left_mib = args.budget_gib * gib - index_mib - args.workers * worker_index_mib
                if open_peak_mib > args.budget_gib * gib:
                    left_mib = 0.0  # opening alone is over budget, whatever the epoch
                per_sample_mib = fits["builder_peak_mib_per_sample"] + args.workers * worker_per_sample
                left_s = args.budget_s - open_s
                max_epoch = int(max(0.0, min(left_mib / per_sample_mib, left_s / fits["epoch_s_per_sample"])))
                row = {"dataset": name, "shard_limit": limit_name, "samples_per_shard": per_shard, "shards": shards,
                       "epoch_size": epoch_size, "open_s": open_s, "index_gib": index_mib / gib,
                       "open_peak_gib": open_peak_mib / gib,
                       "rank_gib": rank_mib / gib, "node_gib": node_mib / gib, "start_s": start_s,
                       "within_budget": bool(ok), "max_epoch_size": max_epoch}
                table.append(row)
                print(f"{name:14s} {limit_name:>6s} {per_shard:>13,} {shards:>10,} {epoch_size:>13,} {open_s:6.1f} s "
                      f"{index_mib / gib:5.2f} GiB {open_peak_mib / gib:6.2f} GiB {rank_mib / gib:5.2f} GiB {node_mib / gib:5.1f} GiB {start_s:6.1f} s "
                      f"{'yes' if ok else 'NO':>5s} {max_epoch:>13,}")
    return {"fits": fits, "projection": table}


if __name__ == "__main__":
    main()
