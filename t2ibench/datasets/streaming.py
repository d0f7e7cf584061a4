"""The Streaming settings of the real-data loaders: one record from the flags to `StreamingDataset`,
shared by the image and the precomputed loaders.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

SHUFFLE_ALGOS = ("py1e", "py1br", "py1s", "py2s", "naive")  # Streaming 0.13 has no py1b
# The bad-data policy of the image loaders (data.StreamingImageCaptions): a loader process stops the
# run when more than MAX_BAD_FRACTION of the images it decoded failed, once it has decoded at least
# BAD_CHECK_AFTER of them (the minimum keeps one bad image early in an epoch from counting as "100%
# bad"). Loader workers are separate processes, so the counts (and the check) are per worker.
MAX_BAD_FRACTION = 0.01
BAD_CHECK_AFTER = 1000


@dataclass(frozen=True)
class StreamingSettings:
    """`StreamingDataset` arguments other than the data's location and the batch size.

    Defaults are Streaming's, except `predownload` (None: Streaming's 8 x the per-device batch) and
    `shuffle_algo` (py1e, Streaming's default, named so the results say which one ran).
    """

    shuffle: bool = True
    predownload: int | None = None  # samples each loader worker downloads ahead
    download_retry: int = 2  # attempts per shard
    download_timeout: float = 60.0  # seconds per shard download
    cache_limit: str | None = None  # e.g. "500gb"; None keeps every shard
    validate_hash: str | None = None  # "sha1" or "xxh64", from index.json
    shuffle_algo: str = "py1e"
    shuffle_block_size: int | None = None  # samples per shuffle block
    epoch_size: str | None = None  # samples per epoch over all sources, e.g. "200m"
    num_canonical_nodes: int | None = None
    sampling_granularity: int = 1  # samples taken from a shard at a time when an epoch picks part of it

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StreamingSettings":
        """The settings the flags of `flags.add_streaming` hold (a flag that is absent keeps its default)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def dataset_kwargs(self, seed: int) -> dict[str, Any]:
        """Keyword arguments of `StreamingDataset`; `seed` seeds the shuffle (the same on every rank)."""
        return {**dataclasses.asdict(self), "shuffle_seed": seed}


class ResumesAfterItsEpoch:
    """A StreamingDataset mix-in: a checkpoint saved at an epoch's end resumes with the next epoch.

    Composer 0.32.1 saves its epoch checkpoint after moving its timestamp to the next epoch, and asks
    the dataset for its state with the samples of that epoch so far, 0 (`State._dataset_state_dict`:
    `state_dict(sample_in_epoch, True)`). Streaming 0.13 records the epoch it last started
    (`next_epoch - 1`), the finished one, at sample 0, so a run resumed from that checkpoint plays the
    finished epoch's order again (with --epoch_size, one subset of the data trained twice and another
    never). Composer's sample count goes back to 0 only once an epoch is over, so a state asked for at
    sample 0 of an epoch this process started is that of the next epoch's start. Also what every
    bucketed dataset inherits (data.py).
    """

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        state = super().state_dict(num_samples, from_beginning)
        if from_beginning and num_samples == 0 and self.next_epoch > state["epoch"]:
            # The epoch in the state was started by this process (its loader ran it): it is finished.
            state["epoch"] += 1
        return state


# Streaming 0.13 names a dataset's shared memory by the first prefix number not in use on the node: each
# rank scans /dev/shm, then the local leader creates `<prefix>_locals`. Two jobs starting together on a
# node (two users' runs, a test suite's parallel workers) can scan at once, pick the same number, and the
# second leader fails with `FileExistsError: [Errno 17] File exists: '/000374_locals'`. Leaders of
# different jobs therefore pick and create one at a time under a node-wide file lock; the other local
# ranks of a job scan only once their leader holds it (a barrier), so all of them see the same /dev/shm.
# Streaming's own scan already steps over prefixes a killed job left behind. A job holds the lock for as
# long as its ranks take to reach the dataset; the wait is bounded so a stuck job stops another one with
# a message, not a hang.
SHM_PREFIX_LOCK_NAME = "t2ibench-streaming-shm-prefix.lock"
SHM_PREFIX_LOCK_TIMEOUT_S = 600


def register_shm_prefixes_one_job_at_a_time() -> None:
    """Make Streaming's `get_shm_prefix` (in this process) pick and create under the node-wide lock."""
    import os
    import tempfile

    import streaming.base.dataset
    import torch.distributed
    from filelock import FileLock, Timeout

    from t2ibench.core.errors import fail

    pick = streaming.base.dataset.get_shm_prefix
    if getattr(pick, "one_job_at_a_time", False):
        return

    def get_shm_prefix(streams_local, streams_remote, world, retry=100):
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not world.is_local_leader:
            if distributed:
                torch.distributed.barrier()  # the leader holds the lock from here
            return pick(streams_local, streams_remote, world, retry)
        lock = FileLock(os.path.join(tempfile.gettempdir(), SHM_PREFIX_LOCK_NAME))
        try:
            lock.acquire(timeout=SHM_PREFIX_LOCK_TIMEOUT_S)
        except Timeout:
            fail(f"another job on this node has held {lock.lock_file} for {SHM_PREFIX_LOCK_TIMEOUT_S} s while "
                 "registering its Streaming dataset: end that job (or start this one after it)")
        try:
            if distributed:
                torch.distributed.barrier()
            return pick(streams_local, streams_remote, world, retry)
        finally:
            lock.release()

    get_shm_prefix.one_job_at_a_time = True
    streaming.base.dataset.get_shm_prefix = get_shm_prefix
