"""Resume from a cold page cache against a cold ``dd`` read of the same bytes, on CPU.

    .venv/bin/python bench/resume_bench.py [--sizes-gib 4] [--rounds 3] [--dir /tmp/resumebench]

For each size: Adam-like CPU state (``checkpoint_bench.adam_state``) saved once by us and once
by ``dcp.save``, and a ``dd`` file of the same byte count; then ``--rounds`` interleaved rounds
(the order rotates each round), each read preceded by evicting its files from the page cache
(``pagecache.make_cold``, which says how and how much stayed cached):

- ``dd if=... of=/dev/null bs=64M`` of the same bytes (the disk, one sequential reader);
- ours: ``CheckpointManager.resume`` (the library's load path, every CRC verified) into the
  live CPU tensors;
- stock ``dcp.load`` of the ``dcp.save`` checkpoint into the same tensors;
- with ``--before``, also ours with zlib's CRC instead of ``crc.crc32`` (libdeflate).

Prints each round and the medians of the ratios to ``dd``, and the CPU seconds per GiB each
reader spent (this process's threads, or ``dd``'s): on a busy 2-core machine a reader that
needs more CPU per byte than ``dd`` loses to it however well it overlaps. Target: ours >= 0.9x.
Everything is written under ``--dir``, which is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch.distributed.checkpoint as dcp

import pagecache
from checkpoint_bench import GIB, adam_state, flat_state, load, timed
from kempner_resilience.checkpoint import CheckpointManager, reader
from kempner_resilience.config import CheckpointConfig


def one_size(args: argparse.Namespace, size_gib: float) -> float:
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        model, optim = adam_state(int(size_gib * GIB), args.tensors)
        flat = flat_state(model, optim)
        nbytes = sum(t.numel() * t.element_size() for t in flat.values())
        cfg = CheckpointConfig(dir=str(root / "ours"), keep_last=2, io_threads=args.threads)
        mgr = CheckpointManager(cfg, {"model": model, "optim": optim})
        mgr.check_dir()
        mgr.save(1)
        mgr.close()
        dcp.save({"s": flat}, checkpoint_id=str(root / "dcp"))
        bs = 64 << 20
        subprocess.run(["dd", "if=/dev/zero", f"of={root / 'dd.bin'}", f"bs={bs}",
                        f"count={-(-nbytes // bs)}", "conv=fsync"], check=True,
                       capture_output=True)
        files = len(list((root / "ours").rglob("*.distcp")))
        print(f"\n{nbytes / GIB:.2f} GiB in {len(flat)} tensors, our checkpoint {files} data "
              f"files, io_threads {args.threads}; {os.cpu_count()} CPUs; {load()}", flush=True)

        def cpu() -> float:
            """CPU seconds so far of this process's threads and its waited-for children."""
            me = resource.getrusage(resource.RUSAGE_SELF)
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

        def dd() -> float:
            return timed(lambda: subprocess.run(
                ["dd", f"if={root / 'dd.bin'}", "of=/dev/null", "bs=64M"], check=True,
                capture_output=True))

        def ours() -> float:
            lmgr = CheckpointManager(cfg, {"model": model, "optim": optim})
            t = timed(lambda: lmgr.resume())
            lmgr.close()
            return t

        def before() -> float:
            fast = reader.crc32
            reader.crc32 = zlib.crc32
            try:
                return ours()
            finally:
                reader.crc32 = fast

        def stock() -> float:
            return timed(lambda: dcp.load({"s": flat}, checkpoint_id=str(root / "dcp")))

        runs = {"dd": (dd, root / "dd.bin"), "ours": (ours, root / "ours"),
                "dcp.load": (stock, root / "dcp")}
        if args.before:
            runs["ours before"] = (before, root / "ours")
        order = list(runs)
        ratios: dict[str, list[float]] = {k: [] for k in order if k != "dd"}
        cpus: dict[str, list[float]] = {k: [] for k in order}
        for r in range(args.rounds):
            secs: dict[str, float] = {}
            hows = []
            for name in order[r % len(order):] + order[:r % len(order)]:
                fn, path = runs[name]
                hows.append(pagecache.make_cold(path))
                c0 = cpu()
                secs[name] = fn()
                cpus[name].append((cpu() - c0) / (nbytes / GIB))
            rate = {k: nbytes / v / GIB for k, v in secs.items()}
            for k in ratios:
                ratios[k].append(rate[k] / rate["dd"])
            print(f"round {r + 1}: dd {rate['dd']:.2f} GiB/s, " + ", ".join(
                f"{k} {rate[k]:.2f} ({ratios[k][-1]:.2f}x)" for k in ratios)
                + f"; cold by {sorted(set(hows))}; {load()}", flush=True)
        med = {k: statistics.median(v) for k, v in ratios.items()}
        print(f"{nbytes / GIB:.2f} GiB: median x cold dd over {args.rounds} rounds: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in med.items()) + " (target: ours >= 0.9)", flush=True)
        print("median CPU s/GiB: " + ", ".join(
            f"{k} {statistics.median(v):.2f}" for k, v in cpus.items()), flush=True)
        return med["ours"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", default="4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=1400)
    ap.add_argument("--threads", type=int, default=4, help="checkpoint.io_threads")
    ap.add_argument("--dir", default="/tmp/resumebench")
    ap.add_argument("--before", action="store_true",
                    help="also ours with zlib's CRC (as before the CRC change)")
    args = ap.parse_args()
    meds = [one_size(args, float(s)) for s in args.sizes_gib.split(",")]
    return 0 if all(m >= 0.9 for m in meds) else 1


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"resume_bench: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
