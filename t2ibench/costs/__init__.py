"""What a full run costs: cost.py's measurements (`results`), its arithmetic and scaling fit
(`scaling`), its table and outputs (`table`), the size of a full run (`scale`), and
MLPerf's own files as the installed mlperf-logging package has them (`mlperf`: benchmark names, ruleset,
reference convergence points).

May import: `core/`, `families/`, `datasets/`. (Not named `cost/`: the root's `cost.py` is the command.)
"""
