"""Streaming's shared memory on a node shared by several jobs (t2ibench.datasets.streaming): a job registers its
dataset's shared-memory prefix only while it holds the node's lock, so two jobs started together cannot
pick the same prefix."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
from filelock import FileLock

from t2ibench.datasets.streaming import SHM_PREFIX_LOCK_NAME
from tests import preloaded
from tests.helpers import ROOT, offline_env, write_images

# A process that builds the image dataset of a folder of shards, saying when it is about to and when it has.
BUILD = """
import sys
import data
from t2ibench.core.tokenizer import bundled_tokenizer
tokenizer = bundled_tokenizer()
print("ready", flush=True)
data.StreamingImageCaptions(local=sys.argv[1], tokenizer=tokenizer, image_size=32, batch_size=2)
print("built", flush=True)
"""


@pytest.mark.multirank  # the subject is a lock two processes share
def test_a_dataset_is_registered_only_while_its_job_holds_the_nodes_lock(tmp_path):
    shards = write_images(tmp_path / "mds", 4)
    lock = FileLock(os.path.join(tempfile.gettempdir(), SHM_PREFIX_LOCK_NAME))
    with lock:  # another job registering its dataset
        job = preloaded.PreloadedPopen([sys.executable, "-c", BUILD, str(shards)], cwd=ROOT, env=offline_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert job.stdout.readline().strip() == "ready", job.stderr.read()
        time.sleep(2.0)  # a local dataset builds in a fraction of that
        assert job.poll() is None, "the dataset was built while another job held the lock"
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0 and out.strip() == "built", err[-3000:]


def test_a_leader_that_waits_too_long_stops_in_one_line_and_other_ranks_never_wait(monkeypatch, tmp_path):
    import streaming.base.dataset

    import data  # noqa: F401  (installs the registration under the lock)
    from t2ibench.datasets import streaming as settings
    from t2ibench.core.errors import UserError

    monkeypatch.setattr(settings, "SHM_PREFIX_LOCK_TIMEOUT_S", 0.2)
    register = streaming.base.dataset.get_shm_prefix
    with FileLock(os.path.join(tempfile.gettempdir(), SHM_PREFIX_LOCK_NAME)):  # a stuck job holds it
        with pytest.raises(UserError) as stopped:
            register([str(tmp_path)], [None], SimpleNamespace(is_local_leader=True))
        message = str(stopped.value)
        assert SHM_PREFIX_LOCK_NAME in message and "another job on this node" in message and "\n" not in message
        # A rank that is not its node's leader only looks up what its leader registered (a leader of the
        # same job waits for it at a barrier): here there is none, and Streaming says so at once.
        with pytest.raises(RuntimeError, match="was not registered by local leader"):
            register([str(tmp_path)], [None], SimpleNamespace(is_local_leader=False))
