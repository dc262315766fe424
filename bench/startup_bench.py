"""What the package adds to a rank's start-up, against ``import torch`` alone: its import, and a
``ResilientRun``'s entry (the config, the lease, the lineage scan, the resume) on a directory
that already holds a run, as a requeued or relaunched rank finds it.

Each round runs one fresh interpreter (one rank, no process group), which times its own parts
with ``time.perf_counter``:

- ``import torch``;
- ``import kempner_resilience`` after it (the package's own modules);
- ``ResilientRun.__enter__`` on a small model and AdamW, resuming from the newest of the
  lineage's checkpoints (``--keep`` of them, written by a first run), and ``__exit__``.

The package's part is the last two. Python's bytecode caches are written by the first, untimed
run (``PYTHONDONTWRITEBYTECODE`` is dropped for the ranks), as an installed package has them;
without them every rank compiles the package's modules again. The median of ``--rounds`` rounds
is printed, with the machine's load (compare the package's part with ``import torch`` in the same run of the bench,
not with another machine's numbers).

    python bench/startup_bench.py [--rounds 7] [--keep 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_RANK = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kempner_resilience as kr
t2 = time.perf_counter()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=1",
                                f"checkpoint.keep_last={sys.argv[2]}",
                                "watchdog.hang_timeout_s=0"])
t3 = time.perf_counter()
run = kr.ResilientRun(cfg, {"model": model, "optim": optim}, exit_mode="raise")
run.__enter__()
t4 = time.perf_counter()
steps = int(sys.argv[3])
for step in run.steps(10**6):
    if step >= steps:
        break                      # the run goes on later: no completion is recorded
    model(torch.randn(4, 256)).sum().backward()
    optim.step()
    optim.zero_grad()
t5 = time.perf_counter()
run.__exit__(None, None, None)
t6 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "package": t2 - t1, "enter": t4 - t3,
                  "exit": t6 - t5, "resumed": run.resumed_from is not None}))
"""


def _rank(ckpt: Path, keep: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("KEMPNER_RESILIENCE_CONFIG", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)    # the first run leaves the caches, as pip does
    # Run outside any checkout: ``python -c`` puts its working directory first on sys.path.
    out = subprocess.run([sys.executable, "-c", _RANK, str(ckpt), str(keep), str(steps)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ckpt.parent)
    if out.returncode != 0:
        raise SystemExit(f"the rank failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--keep", type=int, default=3, help="checkpoints in the lineage")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kr_startup_") as tmp:
        ckpt = Path(tmp) / "ckpt"
        _rank(ckpt, args.keep, args.keep + 2)       # a first run leaves its checkpoints
        rows = [_rank(ckpt, args.keep, 0) for _ in range(args.rounds)]
    assert all(r["resumed"] for r in rows), rows

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    part = statistics.median(r["package"] + r["enter"] for r in rows)
    print(f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, "
          f"lineage of {args.keep} checkpoints\n")
    print("| part | median |\n| --- | --- |")
    print(f"| `import torch` | {med('torch'):.3f} s |")
    print(f"| `import kempner_resilience` after it | {med('package'):.3f} s |")
    print(f"| `ResilientRun.__enter__` (lease, lineage scan, resume) | {med('enter'):.3f} s |")
    print(f"| the package's part (import + enter) | {part:.3f} s |")
    print(f"| `ResilientRun.__exit__` | {med('exit'):.3f} s |")


if __name__ == "__main__":
    main()
