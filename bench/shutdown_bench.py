"""Signal → process gone for a rank with ``--size-gib`` of CPU state, against ``dd`` in the same run.

    .venv/bin/python bench/shutdown_bench.py [--size-gib 1.0] [--rounds 3] [--dir /tmp/shutbench]
    .venv/bin/python bench/shutdown_bench.py --mode raise     # a plain script: no RANK, no SLURM
    .venv/bin/python bench/shutdown_bench.py --thp            # the state on transparent huge pages
    .venv/bin/python bench/shutdown_bench.py --no-early-writeback   # A/B of the writeback hints

Each round starts a fresh rank process (``python bench/shutdown_bench.py --child``: gloo
process group of one, ``ResilientRun`` with the state, ``checkpoint.dir`` under ``--dir``),
sends it SIGUSR1 once it is stepping, and times from the signal to ``waitpid`` returning, from
outside the process. In the same round, in alternating order (on a thin-provisioned disk
whichever writes first into fresh blocks is slower), ``dd if=/dev/zero bs=1M conv=fsync``
writes the same number of bytes into the same filesystem. The ratio printed is dd's time over
the shutdown's: 1.0x means signal → gone took as long as writing the bytes durably with ``dd``
(the target is >= 0.9x). ``plain`` is a third writer in the same round, in rotating order: this
process writes the same number of random bytes (dd writes zeros, which a virtual disk may store
for free) with plain ``os.write`` calls and one fsync: the disk's speed for data like the
state's, without any format, checksum or process around it.

Each writer first gets warm free memory: the bench touches ``2 x --size-gib`` and frees it
just before (``--no-warm``: not). On this VM, memory the guest has freed is handed back to the
host within seconds, and the first touch of such a page costs a host fault: touching 3 GiB
takes 6-7 s. A writer's page cache is taken from free memory, so without this whoever finds the
free lists cold pays ~1 s per GiB more, and it was always the shutdown (its rank process had
just taken the warm pages for the state itself): signal → gone 1.34-1.95 s cold against
0.66-0.91 s warm for the same save. Bare-metal nodes, and VMs whose memory is pinned for GPU
passthrough, have no such faults.

The breakdown comes from the ledger's ``exit`` event (``shutdown/timing.py``): agree (signal →
every rank agreed, the sequence began), save (the emergency checkpoint, durable and committed),
requeue, teardown, then ``leave``: the exit event → the process gone, measured from outside
(the ledger, the run report and the tracker finish are written by then; what remains is the
interpreter's exit and the kernel freeing the process's memory).

``--mode exit`` (default) is a launched rank (``RANK`` set, as under ``srun`` or a launcher:
``watchdog.exit_mode: auto`` resolves to ``exit``); ``--mode raise`` a plain script run without
them, whose ``SystemExit`` reaches the script's top level. ``--thp`` sets torch's
``THP_MEM_ALLOC_ENABLE=1`` in the rank (its large CPU tensors on 2 MiB pages: the kernel frees
them several times faster at exit). The load average (1 min) is printed: other jobs on the
machine skew the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
HERE = Path(__file__).resolve().parent


def child(ckdir: str, size_gib: float, tensors: int) -> None:
    """One rank: steps until the signal; the shutdown sequence then ends the process."""
    import kempner_resilience as kr  # before torch, as the examples do

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from checkpoint_bench import Params

    if os.environ.get("KR_BENCH_NO_EARLY_WRITEBACK") == "1":
        from kempner_resilience.checkpoint import outfile
        outfile._EARLY_WRITEBACK = False

    dist.init_process_group("gloo", rank=0, world_size=1)
    state = {"model": Params(int(size_gib * GIB), tensors)}
    with kr.ResilientRun({"checkpoint": {"dir": ckdir}}, state=state) as run:
        for step in run.steps(10**9):
            if step == 2:
                sys.stdout.write("ready\n")
                sys.stdout.flush()
            time.sleep(0.01)


def shutdown_round(root: Path, args: argparse.Namespace, port: int,
                   before_signal=lambda: None) -> dict[str, float]:
    env = dict(os.environ, WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               KEMPNER_RESTART_COUNT="0")
    for k in ("RANK", "LOCAL_RANK", "SLURM_JOB_ID", "THP_MEM_ALLOC_ENABLE"):
        env.pop(k, None)
    if args.mode == "exit":
        env.update(RANK="0", LOCAL_RANK="0")
    if args.thp:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    env["KR_BENCH_NO_EARLY_WRITEBACK"] = "1" if args.no_early_writeback else "0"
    ckdir = root / "ck"
    p = subprocess.Popen([sys.executable, __file__, "--child", str(ckdir), "--size-gib",
                          str(args.size_gib), "--tensors", str(args.tensors)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert p.stdout is not None
    if p.stdout.readline().strip() != b"ready":
        raise SystemExit(f"the rank did not start (exit {p.wait()})")
    before_signal()        # the rank holds its state now: warm what is left for the save
    time.sleep(0.3)
    sent_wall, sent = time.time(), time.monotonic()
    os.kill(p.pid, signal.SIGUSR1)
    code = p.wait()
    gone, gone_wall = time.monotonic(), time.time()
    events = [json.loads(line) for line in (ckdir / "ledger.jsonl").read_text().splitlines()]
    ex = [e for e in events if e["ev"] == "exit"][-1]
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"code": code, "total": gone - sent, "agree": ex.get("agree_s", float("nan")),
            "save": ex.get("save_s", float("nan")), "requeue": ex.get("requeue_s", float("nan")),
            "teardown": ex.get("teardown_s", float("nan")),
            "to_exit_event": ex["t"] - sent_wall, "leave": gone_wall - ex["t"]}


def dd_round(root: Path, nbytes: int) -> float:
    out = root / "dd.bin"
    t0 = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=1M", f"count={nbytes // 2**20}",
                    "conv=fsync"], check=True, capture_output=True)
    t = time.monotonic() - t0
    out.unlink()
    return t


def warm(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it: the free lists hold warm pages."""
    block = b"\x01" * nbytes
    del block


def plain_round(root: Path, data: memoryview) -> float:
    out = root / "plain.bin"
    t0 = time.monotonic()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        step = 64 << 20
        for i in range(0, data.nbytes, step):
            view = data[i:i + step]
            while view.nbytes:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    t = time.monotonic() - t0
    out.unlink()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=1400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shutbench")
    ap.add_argument("--mode", choices=("exit", "raise"), default="exit")
    ap.add_argument("--thp", action="store_true")
    ap.add_argument("--no-warm", action="store_true",
                    help="no warm-up of free memory before each writer (see the docstring)")
    ap.add_argument("--no-early-writeback", action="store_true",
                    help="the writer without its sync_file_range hints (A/B)")
    ap.add_argument("--child", metavar="CKDIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.size_gib, args.tensors)
        return
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    nbytes = int(args.size_gib * GIB)
    print(f"{args.size_gib:g} GiB of CPU state in {args.tensors} tensors, mode {args.mode}"
          f"{', THP' if args.thp else ''}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.2f}")
    data = memoryview(os.urandom(1 << 20) * (nbytes >> 20))   # random, like the state
    ratios, leaves, plains = [], [], []
    for i in range(args.rounds):
        port = 29400 + (os.getpid() + i) % 500
        got: dict[str, object] = {}
        prepare = (lambda: None) if args.no_warm else (lambda: warm(2 * nbytes))
        runs = {"dd": lambda: (prepare(), dd_round(root, nbytes))[1],
                "plain": lambda: (prepare(), plain_round(root, data))[1],
                "shutdown": lambda: shutdown_round(root, args, port, prepare)}
        order = list(runs)[i % 3:] + list(runs)[:i % 3]      # whoever goes first, in turn
        for name in order:
            got[name] = runs[name]()
        r, dd, plain = got["shutdown"], got["dd"], got["plain"]
        ratios.append(dd / r["total"])
        plains.append(plain / r["total"])
        leaves.append(r["leave"])
        print(f"round {i + 1} ({', '.join(order)}): dd {dd:.2f} s, plain {plain:.2f} s, "
              f"signal -> gone {r['total']:.2f} s (exit "
              f"{r['code']}) = {ratios[-1]:.2f}x dd, {plains[-1]:.2f}x plain | agree "
              f"{r['agree']:.3f} save "
              f"{r['save']:.2f} requeue {r['requeue']:.3f} teardown {r['teardown']:.3f} "
              f"(exit event at {r['to_exit_event']:.2f} s) leave {r['leave']:.2f} s | load "
              f"{os.getloadavg()[0]:.2f}")
    print(f"median: {statistics.median(ratios):.2f}x dd (target >= 0.9x), "
          f"{statistics.median(plains):.2f}x plain, leave {statistics.median(leaves):.2f} s")


if __name__ == "__main__":
    main()
