"""The Composer callbacks of a benchmark run, one per module; what each logs: docs/metrics.md.

May import: `core/`, `families/`, `datasets/`, `eval/`, `train/`, `costs/` (the MLPerf log reads MLPerf's
benchmark names from `costs/mlperf.py`).
"""
