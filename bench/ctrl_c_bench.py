"""Soak of Ctrl+C delivery through the local launcher: many rounds of the light test.

    .venv/bin/python bench/ctrl_c_bench.py [--rounds 20]

Runs ``tests/test_launcher_ctrl_c.py::test_one_ctrl_c_is_one_graceful_stop_for_every_rank_round_after_round``
with ``KR_CTRL_C_ROUNDS`` set: every round is a launcher and two ranks pressed with one Ctrl+C,
each rank must stop gracefully at a step boundary (exit 130, "stopping at step", no "second
SIGINT"). The suite runs 5 rounds; a race in the delivery that shows once in dozens of rounds
needs this. Prints the pytest outcome and the seconds per round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = ("tests/test_launcher_ctrl_c.py::"
        "test_one_ctrl_c_is_one_graceful_stop_for_every_rank_round_after_round")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    env = dict(os.environ, KR_CTRL_C_ROUNDS=str(args.rounds))
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
                        cwd=REPO, env=env).returncode
    took = time.monotonic() - t0
    print(f"{args.rounds} rounds: {'passed' if rc == 0 else 'FAILED'} in {took:.1f} s "
          f"({took / args.rounds:.2f} s per round, pytest start included)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
