"""One bucket per global step: the epoch's batches of a bucketed stream, planned alike on every rank.

Every rank trains the same bucket in each step, so no rank waits in a collective for another's larger
bucket, and each bucket's step time is its own (SDXL's practice; docs/data.md#aspect-ratio-buckets).
Streaming gives each rank (and each loader worker of a rank) its own part of the epoch; the plan
needs, besides those parts, only the bucket of every sample (`bucket_table`), which every rank reads
alike. For one loader-worker slot (worker w of every rank) the ranks' streams are walked in lockstep:
each sample waits in its bucket on its rank, and a bucket is emitted as soon as every rank holds a
batch of it, each rank taking its own first `batch_size`. What a stream holds when it ends is cut
into batches of other buckets where images can be cropped into any (`regroup`); stored latents keep
their shape, so their epoch is the full batches every rank can fill. Slots are cut to the shortest,
so that PyTorch's DataLoader, which takes batch j from worker j % workers, hands every rank the same
bucket at every step, and a resumed worker can skip by counting (`buckets.batches_before`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from t2ibench.buckets import Bucket


@dataclass(frozen=True)
class PlannedBatch:
    """One global step of one worker slot: its bucket (a position in the list) and each rank's samples."""

    bucket: int
    samples: tuple[tuple[int, ...], ...]  # [rank] -> that rank's sample ids


def slot_batches(streams: Sequence[np.ndarray], table: np.ndarray, batch_size: int, buckets: Sequence[Bucket],
                 regroup: bool) -> list[PlannedBatch]:
    """The batches of one worker slot: `streams[r]` is rank r's sample ids in Streaming's order (padding
    removed), `table[i]` the bucket (position in `buckets`) of sample i."""
    ranks = len(streams)
    waiting: list[dict[int, list[int]]] = [{} for _ in range(ranks)]
    planned: list[PlannedBatch] = []
    longest = max((len(stream) for stream in streams), default=0)
    for position in range(longest):
        touched = set()
        for rank, stream in enumerate(streams):
            if position < len(stream):
                sample = int(stream[position])
                bucket = int(table[sample])
                waiting[rank].setdefault(bucket, []).append(sample)
                touched.add(bucket)
        for bucket in sorted(touched):  # a fixed order where two buckets fill at one position
            if all(len(queue.get(bucket, ())) >= batch_size for queue in waiting):
                taken = []
                for queue in waiting:
                    taken.append(tuple(queue[bucket][:batch_size]))
                    del queue[bucket][:batch_size]
                planned.append(PlannedBatch(bucket, tuple(taken)))
    if regroup:
        planned.extend(_regrouped(waiting, batch_size, buckets))
    return planned


def _regrouped(waiting: list[dict[int, list[int]]], batch_size: int, buckets: Sequence[Bucket]) -> list[PlannedBatch]:
    """What the streams left, as batches in other buckets: each rank's samples sorted by their bucket's
    aspect ratio and cut into batches; batch k goes into the bucket of rank 0's middle sample of it (the
    other ranks' samples are cropped into it: images are resized to cover any bucket)."""
    def order(rank_waiting: dict[int, list[int]]) -> list[tuple[tuple[float, int, int], int]]:
        return sorted(((buckets[b].aspect, -buckets[b].pixels, b), sample)
                      for b, queue in rank_waiting.items() for sample in queue)

    left = [order(rank_waiting) for rank_waiting in waiting]
    count = min(len(samples) for samples in left) // batch_size if left else 0
    regrouped = []
    for k in range(count):
        chunks = [samples[k * batch_size:(k + 1) * batch_size] for samples in left]
        bucket = chunks[0][batch_size // 2][0][2]
        regrouped.append(PlannedBatch(bucket, tuple(tuple(sample for _, sample in chunk) for chunk in chunks)))
    return regrouped


def epoch_batches(work: np.ndarray, table: np.ndarray, batch_size: int, buckets: Sequence[Bucket],
                  regroup: bool) -> list[list[PlannedBatch]]:
    """Every worker slot's batches of the epoch, cut to the shortest slot. `work` is Streaming's
    partition of the epoch, [node, rank of node, worker of rank, ...] (-1 for padding)."""
    nodes, ranks_per_node, workers = work.shape[:3]
    slots = []
    for worker in range(workers):
        streams = [ids[ids != -1] for ids in (work[node, rank, worker].reshape(-1)
                                              for node in range(nodes) for rank in range(ranks_per_node))]
        slots.append(slot_batches(streams, table, batch_size, buckets, regroup))
    shortest = min((len(slot) for slot in slots), default=0)
    return [slot[:shortest] for slot in slots]


def global_batches(work: np.ndarray, table: np.ndarray, batch_size: int, buckets: Sequence[Bucket],
                   regroup: bool) -> int:
    """How many steps the epoch holds (every slot's batches; the same on every rank)."""
    slots = epoch_batches(work, table, batch_size, buckets, regroup)
    return sum(len(slot) for slot in slots)
