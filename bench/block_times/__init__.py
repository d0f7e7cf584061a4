"""bench/blocks.py's parts, one job each, imported, never run: the set-up and its parts (`parts`), the
timing of blocks (`timing`), the harness's seconds per step (`harness`), the files read and written (`files`).
"""
