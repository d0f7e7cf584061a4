"""A command killed with SIGKILL at a chosen point of writing its output, injected from outside its code
(what a preempted job meets):

    PYTHONPATH=. python tests/kill_run.py --on makedirs|replace --match TEXT [--nth N] COMMAND.py <its flags>

The Nth call of os.makedirs or os.replace in this process whose first argument contains TEXT sends
SIGKILL to the process before it does anything (tests.helpers.kill_at_call); COMMAND.py runs as
`python COMMAND.py <its flags>` would. Exits 3 if the point was never reached.
"""
from __future__ import annotations

import argparse
import runpy
import sys

from tests.helpers import ROOT, kill_at_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--on", choices=("makedirs", "replace"), required=True)
    parser.add_argument("--match", required=True)
    parser.add_argument("--nth", type=int, default=1)
    parser.add_argument("command", help="COMMAND.py, then its flags")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    ours = parser.parse_args()
    kill_at_call(ours.on, ours.match, ours.nth)
    sys.argv = [str(ROOT / ours.command), *ours.flags]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        print(f"kill_run.py: {ours.command} ran past the kill point ({ours.on} {ours.match!r} #{ours.nth})",
              file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    main()
