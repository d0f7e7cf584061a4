"""What a full run costs: cost.py's measurements (`results`), its arithmetic and scaling fit
(`scaling`), its table and outputs (`table`), and the size of a full run (`scale`).

May import: `core/`, `families/`, `datasets/`. (Not named `cost/`: the root's `cost.py` is the command.)
"""
