"""The CPU shutdown in an independent setting, against ``dd`` and
``torch.save`` of the same bytes, interleaved, with no warm-up of any kind.

    .venv/bin/python bench/shutdown_vs_dd_bench.py [--rounds 5] [--dir /tmp/kr-shutdown-dd]

The state: 20 ``Linear(2048, 2048)`` layers with Adam, stepped once so the moments exist
(40 parameters and 80 moments, 0.94 GiB). A real rank process (``RANK`` set: exit mode, gloo
group of one) runs ``ResilientRun`` with it and idles at step boundaries; the bench sends
SIGUSR1 and times signal -> process gone, plus an fsync of the checkpoint directory (what a
reader of the directory may rely on). Baselines in the same round, order rotating:

* ``dd``: ``dd if=<page-cached file> of=<fresh file> bs=1M conv=fsync`` of the same byte count
  (the source is random bytes, read once at start so it sits in the page cache);
* ``torch.save``: this process holds an identical state (same seed) and times
  ``torch.save({"model": ..., "optim": ...})`` into a fresh file + fsync.

Ratios are baseline time over shutdown time (1.0x: as fast as the baseline; target >= 0.95x
dd, >= 1.0x torch.save). Nothing is warmed before any writer: each pays whatever cold free
memory the machine hands it. The load average is printed: other jobs skew the figures, which
is why only ratios within a round are compared and the medians reported. The rank's ledger
``exit`` event splits the shutdown (agree, save, teardown, leave: exit event -> process gone).
``--env KEMPNER_RESILIENCE_DIRECT_IO=0`` is the A/B: the files written through the page cache.
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


def build_state():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def child(ckdir: str) -> None:
    import kempner_resilience as kr  # before torch, as the examples do
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    model, opt = build_state()
    with kr.ResilientRun({"checkpoint": {"dir": ckdir}}, state={"model": model, "optim": opt}) \
            as run:
        for step in run.steps(10**9):
            if step == 2:
                sys.stdout.write("ready\n")
                sys.stdout.flush()
            time.sleep(0.01)


def fsync_dir_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def shutdown_round(root: Path, port: int, extra_env: dict[str, str]) -> dict[str, float]:
    env = dict(os.environ, WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               KEMPNER_RESTART_COUNT="0", RANK="0", LOCAL_RANK="0", **extra_env)
    env.pop("SLURM_JOB_ID", None)
    ckdir = root / "ck"
    p = subprocess.Popen([sys.executable, __file__, "--child", str(ckdir)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None
    if p.stdout.readline().strip() != b"ready":
        raise SystemExit(f"the rank did not start (exit {p.wait()}): "
                         f"{p.stderr.read().decode()[-2000:] if p.stderr else ''}")
    time.sleep(0.3)
    sent_wall, sent = time.time(), time.monotonic()
    os.kill(p.pid, signal.SIGUSR1)
    p.communicate()
    gone = time.monotonic()
    fsync_dir_tree(ckdir)
    done = time.monotonic()
    events = [json.loads(line) for line in (ckdir / "ledger.jsonl").read_text().splitlines()]
    ex = [e for e in events if e["ev"] == "exit"][-1]
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"code": p.returncode, "total": done - sent, "gone": gone - sent,
            "agree": ex.get("agree_s", float("nan")), "save": ex.get("save_s", float("nan")),
"teardown": ex.get("teardown_s", float("nan")),
            "leave": (sent_wall + (gone - sent)) - ex["t"]}


def dd_round(root: Path, src: Path) -> float:
    out = root / "dd.bin"
    t0 = time.monotonic()
    subprocess.run(["dd", f"if={src}", f"of={out}", "bs=1M", "conv=fsync"], check=True,
                   capture_output=True)
    t = time.monotonic() - t0
    out.unlink()
    return t


def torch_save_round(root: Path, model, opt) -> float:
    import torch
    out = root / "ts.pt"
    t0 = time.monotonic()
    with open(out, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    t = time.monotonic() - t0
    out.unlink()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/kr-shutdown-dd")
    ap.add_argument("--child", metavar="CKDIR", help=argparse.SUPPRESS)
    ap.add_argument("--env", action="append", default=[],
                    help="KEY=VALUE for the rank process (A/B of library switches)")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    import torch
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model, opt = build_state()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    src = root / "src.bin"
    src.write_bytes(os.urandom(1 << 20) * (nbytes >> 20))
    src.read_bytes()                       # page-cached, as the dd source was
    extra = dict(kv.split("=", 1) for kv in args.env)
    print(f"setting: {nbytes / GIB:.2f} GiB (20 x Linear(2048, 2048) + Adam), "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, no warm-up"
          f"{', env ' + str(extra) if extra else ''}")
    r_dd, r_ts = [], []
    for i in range(args.rounds):
        port = 29400 + (os.getpid() + i) % 500
        runs = {"dd": lambda: dd_round(root, src),
                "torch.save": lambda: torch_save_round(root, model, opt),
                "shutdown": lambda: shutdown_round(root, port, extra)}
        order = list(runs)[i % 3:] + list(runs)[:i % 3]
        got = {name: runs[name]() for name in order}
        r, dd, ts = got["shutdown"], got["dd"], got["torch.save"]
        r_dd.append(dd / r["total"])
        r_ts.append(ts / r["total"])
        print(f"round {i + 1} ({', '.join(order)}): dd {dd:.2f} s, torch.save {ts:.2f} s, "
              f"signal -> gone + fsync {r['total']:.2f} s (exit {r['code']}) = "
              f"{r_dd[-1]:.2f}x dd, {r_ts[-1]:.2f}x torch.save | agree {r['agree']:.3f} save "
              f"{r['save']:.2f} teardown {r['teardown']:.3f} "
              f"leave {r['leave']:.2f} dir fsync {r['total'] - r['gone']:.3f} | load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"median: {statistics.median(r_dd):.2f}x dd (target >= 0.95x), "
          f"{statistics.median(r_ts):.2f}x torch.save (target >= 1.0x)")


if __name__ == "__main__":
    main()
