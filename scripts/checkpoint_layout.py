"""Print the layout of benchmark.py checkpoints (tensor names and shapes per part, digested), to
compare two releases: equal lines mean the newer code loads the older checkpoints.

    python scripts/checkpoint_layout.py runs/ep0-ba2-rank0.pt                # one line per part
    python scripts/checkpoint_layout.py --full runs/ep0-ba2-rank0.pt         # every name and shape
    python scripts/checkpoint_layout.py --json tests/data/checkpoint_layouts.json tiny=a.pt sdxl-tiny=b.pt
"""
from __future__ import annotations

import argparse
import json

from t2ibench.train.checkpoints import layout, layout_digests


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="checkpoint files, or LABEL=FILE with --json")
    p.add_argument("--full", action="store_true", help="print every tensor's name and shape, not digests")
    p.add_argument("--json", default=None, help="write {LABEL: digests} for every LABEL=FILE to this file")
    args = p.parse_args(argv)
    if args.json:
        labelled = dict(item.split("=", 1) for item in args.checkpoints)
        with open(args.json, "w") as f:
            json.dump({label: layout_digests(layout(path)) for label, path in labelled.items()}, f, indent=1)
            f.write("\n")
        return
    for path in args.checkpoints:
        full = layout(path)
        print(json.dumps(full, indent=1) if args.full else
              "\n".join(f"{part}: {digest}" for part, digest in layout_digests(full).items()))


if __name__ == "__main__":
    main()
