"""A StreamingDataset mix-in for `--aspect_buckets`: one bucket per global step on every rank, each
batch (and microbatch) of one bucket, resumable mid-epoch bit for bit. The plan is
`t2ibench.bucket_plan`'s; this module runs it inside Streaming's loader workers.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from threading import Event
from typing import Any, Iterator

import numpy as np
import torch
from streaming.base.batching import generate_work
from streaming.base.dataset import _Iterator
from streaming.base.world import World

from t2ibench.bucket_plan import epoch_batches
from t2ibench.buckets import Bucket, batches_before

PROGRESS_EVERY_S = 10.0  # reading every sample's bucket prints a line this often


class BucketedStream:
    """Each loader worker yields its part of the epoch as batches of one bucket, the bucket of each
    step the same on every rank (`t2ibench.bucket_plan`).

    The plan needs the bucket of every sample of the epoch, every rank's (`bucket_table`, read once a
    run, in the main process before the loader starts: an image's header, a stored column; on several
    nodes every node reads every shard for it, where Streaming would split the shards between nodes),
    and Streaming's partition of the epoch between ranks and workers. A worker downloads and decodes
    only its own samples, in its stream's order: a batch is yielded once the stream has reached the
    position where the plan emitted it.

    Resuming mid-epoch: a checkpoint records the samples trained (Streaming's state); a resumed worker
    plans the same epoch and skips the batches it had handed out (`buckets.batches_before`).
    """

    # Whether the epoch's leftovers are cut into batches in other buckets (images can be cropped into
    # any); stored latents cannot change shape: their epoch has only the full batches every rank fills.
    regroup_leftovers = True
    buckets: tuple[Bucket, ...]
    _bucket_table: np.ndarray | None = None

    def bucket_of(self, index: int) -> tuple[Bucket, int]:
        raise NotImplementedError

    def item_in(self, index: int, bucket: Bucket, epoch: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def bucket_table(self, show_progress: bool = False) -> np.ndarray:
        """The bucket (position in the list) of every sample of the dataset, read once and kept."""
        if self._bucket_table is None:
            position = {bucket: i for i, bucket in enumerate(self.buckets)}
            table = np.empty(self.num_samples, dtype=np.int32)
            started = last = time.monotonic()
            for index in range(self.num_samples):
                table[index] = position[self.bucket_of(index)[0]]
                if show_progress and time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    print(f"--aspect_buckets: read the bucket of {index + 1:,} of {self.num_samples:,} samples "
                          f"({last - started:.0f} s)", file=sys.stderr, flush=True)
            self._bucket_table = table
        return self._bucket_table

    def epoch_steps(self, num_workers: int) -> int:
        """The steps the first epoch holds on every rank with `num_workers` loader workers per rank,
        planned in the main process (before the loader starts), as the workers will plan it."""
        ranks = self._parallel_rank_world
        workers = max(1, num_workers)
        world = World(ranks.num_nodes, ranks.ranks_per_node, workers, ranks.rank * workers)
        self._resume(world, 0)  # resolves Streaming's defaults (canonical nodes) as a worker does
        work = generate_work(self.batching_method, self, world, 0, 0)
        slots = epoch_batches(work, self.bucket_table(), self.batch_size, self.buckets, self.regroup_leftovers)
        return sum(len(slot) for slot in slots)

    def _epoch_work(self, epoch: int, world: Any) -> np.ndarray:
        """Streaming's partition of the whole epoch, [node, rank of node, worker of rank, ...], from its
        start: what `_get_work` computes before it keeps this worker's part (the local leader computes
        it once and shares it through shared memory, as there)."""
        unique = self._unique_worker_world
        if unique.is_local_leader:
            work = generate_work(self.batching_method, self, world, epoch, 0)
            shape_shm, data_shm = self._share_work(work)
            self._shared_barrier(unique.workers_per_node)
        else:
            self._shared_barrier(unique.workers_per_node)
            work, shape_shm, data_shm = self._attach_work()
        work = np.array(work)  # a copy: the shared memory goes next
        self._shared_barrier(unique.workers_per_node)
        shape_shm.cleanup()
        if data_shm is not None:
            data_shm.cleanup()
        return work

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This worker's batches of the epoch's plan (Streaming 0.13's __iter__, with the epoch's part
        always taken from its start: see the class doc)."""
        if hasattr(self, "_iterator"):
            self._iterator.exit()
        if not hasattr(self, "_executor"):
            self._executor = ThreadPoolExecutor()
        if not hasattr(self, "_event"):
            self._event = Event()
        elif self._event.is_set():
            raise RuntimeError("Background thread failed. Check other traceback.")
        self._unique_worker_world = self._unique_rank_world.detect_workers()
        self._parallel_worker_world = world = self._parallel_rank_world.detect_workers()
        if not hasattr(self._shared_barrier, "lock"):
            from filelock import FileLock
            self._shared_barrier.lock = FileLock(self._shared_barrier.filelock_path)
        epoch, sample_in_epoch = self._resume_incr_epoch()
        work = self._epoch_work(epoch, world)
        slots = epoch_batches(work, self.bucket_table(), self.batch_size, self.buckets, self.regroup_leftovers)
        slot = slots[world.worker_of_rank] if slots else []
        skip = batches_before(sample_in_epoch, world.num_ranks, world.workers_per_rank, world.worker_of_rank,
                              self.batch_size)
        if skip >= len(slot):
            return
        self._iterator = it = _Iterator(work[world.node, world.rank_of_node, world.worker_of_rank].reshape(-1))
        futures = [self._executor.submit(self._prepare_thread, it), self._executor.submit(self._ready_thread, it)]
        for future in futures:
            future.add_done_callback(self.on_exception)
        samples = self._each_sample_id(it)
        try:
            reached: set[int] = set()  # this worker's samples its stream has brought in (downloaded)
            for planned in slot[skip:]:
                wanted = planned.samples[world.rank]
                while not reached.issuperset(wanted):
                    sample = next(samples, None)
                    if sample is None:  # the stream ended: what is left is read on demand
                        break
                    reached.add(int(sample))
                for index in wanted:
                    yield self.item_in(index, self.buckets[planned.bucket], epoch)
        finally:
            samples.close()
            it.exit()  # the download threads stop, whether the epoch's samples ran out or not
        wait(futures, return_when="FIRST_EXCEPTION")


def check_first_epoch(dataset: BucketedStream, num_workers: int, show_progress: bool) -> int:
    """Read every sample's bucket (with progress) and plan the first epoch; refuse in one line a dataset
    whose epoch would hold no step. Returns the epoch's steps."""
    from t2ibench.errors import fail

    table = dataset.bucket_table(show_progress)
    steps = dataset.epoch_steps(num_workers)
    if steps == 0:
        counts = np.bincount(table, minlength=len(dataset.buckets))
        held = sum(int(count) // dataset.batch_size for count in counts)
        listed = ", ".join(f"{dataset.buckets[b].name}: {int(counts[b])}" for b in np.argsort(-counts) if counts[b])
        ranks = dataset._parallel_rank_world.num_ranks
        fail(f"--aspect_buckets: the data holds {held} full batch(es) of {dataset.batch_size} samples in one bucket "
             f"({listed} samples), too few for one step in which each of the {ranks} rank(s) x {max(1, num_workers)} "
             f"loader worker(s) takes a batch of the same bucket from its part of the data: use more data, a "
             f"smaller --batch_size or fewer --num_workers")
    return steps
