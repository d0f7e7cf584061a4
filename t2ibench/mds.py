"""What an MDS dataset consists of on disk, for the commands that write one (convert.py, latents.py)
and may delete only what they wrote (--overwrite)."""
from __future__ import annotations

import re

INDEX_FILE = "index.json"  # written last by MDSWriter: a folder with it holds a complete dataset
SHARD_NAME = re.compile(r"shard\.\d{5,}\.mds(\.[a-z0-9:]+)?")  # how MDSWriter names shard files
