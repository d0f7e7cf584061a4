"""Streaming's shared memory on a node shared by several jobs (t2ibench.streaming): a job registers its
dataset's shared-memory prefix only while it holds the node's lock, so two jobs started together cannot
pick the same prefix."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
from filelock import FileLock

from t2ibench.streaming import SHM_PREFIX_LOCK_NAME
from tests.helpers import ROOT, offline_env, write_images

# A process that builds the image dataset of a folder of shards, saying when it is about to and when it has.
BUILD = """
import sys
import data
from t2ibench.tokenizer import bundled_tokenizer
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
        job = subprocess.Popen([sys.executable, "-c", BUILD, str(shards)], cwd=ROOT, env=offline_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert job.stdout.readline().strip() == "ready", job.stderr.read()
        time.sleep(2.0)  # a local dataset builds in a fraction of that
        assert job.poll() is None, "the dataset was built while another job held the lock"
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0 and out.strip() == "built", err[-3000:]
