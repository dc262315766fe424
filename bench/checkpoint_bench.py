"""Checkpoint throughput on this machine, compared with ``dd`` in the same run (disks are noisy).

    .venv/bin/python bench/checkpoint_bench.py [--size-gib 1.0] [--dir /tmp/ckbench] [--tensors 1400]

Model + Adam-like state of ``--size-gib`` in about ``--tensors`` tensors (a quarter params, a
quarter step counters, half moments, as Adam has). Measured, each into a fresh directory:
``dd conv=fsync`` (the disk), ``torch.save`` + fsync, ``dcp.save`` with defaults, our emergency
save, our async save (caller-blocked time and total; first save allocates staging buffers, the
second reuses them), our load (resume, checksums verified) and stock ``dcp.load`` vs a cold
``dd`` read (page cache dropped when permitted). Prints GiB/s and the ratio to ``dd``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.config import CheckpointConfig

GIB = 2**30


class Params(torch.nn.Module):
    """``n`` parameters: a few large matrices carry the bytes, many small vectors the count."""

    def __init__(self, nbytes: int, n: int) -> None:
        super().__init__()
        n_big = max(1, n // 3)
        small = 1024
        per_big = max((nbytes // 4 - (n - n_big) * small) // n_big, 1)
        side = int(per_big ** 0.5)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(side, per_big // side)) for _ in range(n_big)]
            + [torch.nn.Parameter(torch.randn(small)) for _ in range(n - n_big)])


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dd_write(path: Path, nbytes: int) -> float:
    bs = 64 << 20
    count = max(1, nbytes // bs)
    t = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}",
                                      f"count={count}", "conv=fsync"], check=True,
                                     capture_output=True))
    return count * bs / t / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=1400)
    ap.add_argument("--dir", default="/tmp/ckbench")
    ap.add_argument("--threads", type=int, default=4, help="checkpoint.io_threads")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    # Adam has params + exp_avg + exp_avg_sq (+ a scalar step each): params are ~1/3 of bytes.
    model = Params(int(args.size_gib * GIB / 3), args.tensors // 4)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    flat = {f"p{i}": p.detach() for i, p in enumerate(model.parameters())}
    for i, st in enumerate(optim.state.values()):
        flat.update({f"o{i}.{k}": v for k, v in st.items()})
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    print(f"state: {nbytes / GIB:.3f} GiB in {len(flat)} tensors; {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}; dir {root}")

    rows: list[tuple[str, float]] = []
    dd = dd_write(root / "dd.bin", nbytes)
    rows.append(("dd if=/dev/zero conv=fsync", dd))

    def torch_save() -> None:
        with open(root / "torch.pt", "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())
    rows.append(("torch.save + fsync", nbytes / timed(torch_save) / GIB))
    (root / "torch.pt").unlink()

    t = timed(lambda: dcp.save({"s": flat}, checkpoint_id=str(root / "dcp_default")))
    rows.append(("dcp.save (defaults)", nbytes / t / GIB))

    cfg = CheckpointConfig(dir=str(root / "ours"), keep_last=10, io_threads=args.threads)
    mgr = CheckpointManager(cfg, {"model": model, "optim": optim})
    mgr.check_dir()
    t = timed(lambda: mgr.emergency_save(1))
    rows.append(("ours: emergency_save (sync, crc32)", nbytes / t / GIB))
    t = timed(lambda: mgr.save(2))
    rows.append(("ours: save (sync, crc32) again", nbytes / t / GIB))

    acfg = CheckpointConfig(dir=str(root / "ours"), keep_last=10, io_threads=args.threads,
                            every_steps=1, **{"async_": True})
    amgr = CheckpointManager(acfg, {"model": model, "optim": optim})
    for step in (3, 4):
        t0 = time.perf_counter()
        amgr.maybe_save(step)
        blocked = time.perf_counter() - t0
        amgr.wait()
        total = time.perf_counter() - t0
        rows.append((f"ours: async save #{step - 2} caller blocked {blocked:.3f}s "
                     f"({blocked / max(total, 1e-9):.2f} of total)", nbytes / blocked / GIB))
        rows.append((f"ours: async save #{step - 2} total {total:.3f}s", nbytes / total / GIB))
    amgr.close()

    dropped = drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={root / 'dd.bin'}", "of=/dev/null", "bs=64M"], check=True,
                   capture_output=True)
    dd_read = nbytes / (time.perf_counter() - t0) / GIB
    rows.append((f"dd read ({'cold' if dropped else 'page cache NOT dropped'})", dd_read))
    drop_caches()
    lmgr = CheckpointManager(cfg, {"model": model, "optim": optim})
    t = timed(lmgr.resume)
    rows.append(("ours: resume (verified crc32, cold)", nbytes / t / GIB))
    drop_caches()
    target = {"s": {k: torch.empty_like(v) for k, v in flat.items()}}
    t = timed(lambda: dcp.load(target, checkpoint_id=str(root / "dcp_default")))
    rows.append(("stock dcp.load of dcp.save output (cold)", nbytes / t / GIB))
    drop_caches()
    msd, osd = get_state_dict(model, optim)
    t = timed(lambda: dcp.load({"model": msd, "optim": osd},
                               checkpoint_id=str(lmgr.latest().path)))
    rows.append(("stock dcp.load of OUR checkpoint (cold)", nbytes / t / GIB))

    print(f"{'what':58s} {'GiB/s':>7s} {'x dd-write':>10s} {'x dd-read':>9s}")
    for name, gbs in rows:
        print(f"{name:58s} {gbs:7.2f} {gbs / dd:10.2f} {gbs / dd_read:9.2f}")
    emerg = rows[3][1]
    print(f"emergency save vs dd: {emerg / dd:.2f}x (target >= 0.9); vs dcp.save defaults: "
          f"{emerg / rows[2][1]:.2f}x (target >= 1.8)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
