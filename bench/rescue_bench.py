"""The just-in-time rescue's costs, with real gloo ranks (2 processes on this machine).

1. Per-step bookkeeping (``Rescuer.mark`` at every step boundary: the RNG/object snapshot, the
   persistent-buffer copies, the non-blocking send to the buddy rank), microseconds per step,
   for the demo's state (DDP MLP, Adam, StepLR, data iterator) and for a model with 100
   BatchNorm layers (300 buffers to copy). Target: <= 250 us, 0.5 % of a 50 ms step.
   The snapshot's parts are timed alone too (``encode``: RNG streams + state_dict()s, pickled).
   ``--sharded``: the same for sharded state, 4 ranks of HSDP (``fully_shard`` on a 2 x 2
   ``("replicate", "shard")`` mesh): the demo's model, and 100 Linear + BatchNorm layers each
   ``fully_shard``ed (their buffers stay whole: 300 to copy); and HSDP 2 x 1 on 2 ranks, as many
   processes as the DDP rows (4 ranks on a 2-core machine also time the wait for a core: the
   mark's CPU time is printed too).
2. Rescue time: a replicated model with Adam holding SIZE of state (parameters + optimizer),
   rank 1 SIGKILLed between steps; rank 0 detects it in its next collective, writes the rescue
   checkpoint and commits it. Reported: kill -> committed (wall clock, from the manifest's commit
   time), and the writer's own part (detection -> committed).
3. ``--nodes 2``: the same on 2 nodes of the namespace SLURM cluster
   (``tests/cluster/multinode_cluster.sh``, needs root; started when not running), one rank per
   node under srun; instead of rank 1's process, its whole node is killed (every process,
   ``kill-node``) while it waits between steps 3 and 4. The node is started again afterwards.

    python bench/rescue_bench.py [--steps 1000] [--sizes 200M,2G] [--nodes 2] [--sharded]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _spawn(args: list[str], world: int = 2) -> list[subprocess.CompletedProcess]:
    from kempner_resilience.demo.launcher import free_port

    port = free_port()
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=str(REPO))
    env.pop("KEMPNER_RESILIENCE_CONFIG", None)
    procs = [subprocess.Popen([sys.executable, __file__, *args], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    return [subprocess.CompletedProcess(p.args, p.wait(), *p.communicate()) for p in procs]


# ------------------------------------------------------------------------ 1. per-step cost

def _worker_mark(steps: int, kind: str, ckpt: str) -> None:
    import timeit

    import torch
    import torch.distributed as dist
    from torch import nn

    import kempner_resilience as kr
    from kempner_resilience.demo.train import build
    from kempner_resilience.rescue.boundary import encode

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sharded = kind.startswith("hsdp")
    # "hsdp": 2 x 2 on 4 ranks; "hsdp1": 2 x 1 on 2 ranks (as many processes as the DDP rows)
    state = build(rank, world, hsdp={"hsdp": 2, "hsdp1": 1}.get(kind, 0))
    if kind in ("bn", "hsdp-bn"):
        torch.manual_seed(0)
        layers = [m for _ in range(100) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64))]
        model = nn.Sequential(*layers)
        if sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        state["model"] = model
        state["optim"] = torch.optim.Adam(model.parameters())
        state["sched"] = torch.optim.lr_scheduler.StepLR(state["optim"], 7)
    cfg = kr.load_config(None, [f"checkpoint.dir={ckpt}", "watchdog.hang_timeout_s=600"])
    with kr.ResilientRun(cfg, state=state, exit_mode="raise") as run:
        rescue = run._state.parts.rescue
        assert rescue is not None, "rescue is off"
        others = rescue.boundary.state.others
        busy = torch.randn(370, 370)
        rounds = []
        for _ in range(3):
            dist.barrier()
            took = sent = cpu = 0.0
            for i in range(steps):
                c0 = time.thread_time()
                t0 = time.perf_counter()
                payload = rescue.boundary.mark(i)      # what rescue.mark(i) does, timed apart
                t1 = time.perf_counter()
                rescue.link.send(i, payload)
                t2 = time.perf_counter()
                # The thread's CPU time too: with more ranks than cores (4 HSDP ranks on 2),
                # the wall clock also counts the time the rank waited for a core.
                cpu += time.thread_time() - c0
                took, sent = took + t2 - t0, sent + t2 - t1
                # The step: ~2 ms of compute (a sleep lets the core idle and the next mark
                # then runs on cold caches, timing the machine's wake-up more than the mark);
                # torch releases the GIL, so the buddy's thread receives meanwhile.
                torch.mm(busy, busy)
            rounds.append((took / steps * 1e6, sent / steps * 1e6, cpu / steps * 1e6))
        enc = timeit.timeit(lambda: encode(1, others), number=steps) / steps * 1e6
        b = rescue.boundary
        copy = timeit.timeit(b._copy_buffers, number=steps) / steps * 1e6 if b._live else 0.0
        dist.barrier()
        for _ in run.steps(0):
            pass
    mark_us, send_us, cpu_us = sorted(rounds)[len(rounds) // 2]
    print(json.dumps({"rank": rank, "mark_us": mark_us, "send_us": send_us, "cpu_us": cpu_us,
                      "encode_us": enc,
                      "copy_us": copy, "buffers": len(b._live)}), flush=True)
    dist.destroy_process_group()


def per_step(steps: int, sharded: bool = False) -> None:
    kinds = (("demo", "demo state (MLP, Adam, StepLR, data)", 2),
             ("bn", "100 BatchNorm layers (300 buffers)", 2))
    if sharded:
        kinds += (("hsdp1", "HSDP 2 x 1 (2 ranks), demo state", 2),
                  ("hsdp", "HSDP 2 x 2, demo state (fully_shard MLP, Adam, StepLR, data)", 4),
                 ("hsdp-bn", "HSDP 2 x 2, 100 fully_shard Linear + BatchNorm (300 buffers)", 4))
    for kind, what, world in kinds:
        with tempfile.TemporaryDirectory() as d:
            res = _spawn(["--worker-mark", kind, str(steps), d], world=world)
        rows = [json.loads(r.stdout.strip().splitlines()[-1]) for r in res if r.returncode == 0]
        if len(rows) != len(res):
            print(f"{what}: failed\n" + "\n".join(r.stderr[-2000:] for r in res))
            continue
        mark = max(r["mark_us"] for r in rows)
        cpu = max(r["cpu_us"] for r in rows)
        print(f"{what}: mark {mark:.1f} us/step ({mark / 50_000 * 100:.3f} % of a 50 ms step, "
              f"of which the send {max(r['send_us'] for r in rows):.1f} us; its CPU time "
              f"{cpu:.1f} us, {cpu / 50_000 * 100:.3f} %; "
              f"alone: snapshot encode {max(r['encode_us'] for r in rows):.1f} us, copy of "
              f"{rows[0]['buffers']} buffers {max(r['copy_us'] for r in rows):.1f} us)")


# ---------------------------------------------------------------------------- 2. rescue time

def _worker_rescue(nbytes: int, ckpt: str, killfile: str, node_kill: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import kempner_resilience as kr
    from kempner_resilience.slurm import setup_torch_env

    setup_torch_env()                            # under srun (--nodes 2): rank, master address
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    n = nbytes // 3 // 4 // 4096 * 4096         # parameters + Adam's two moments, fp32
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(n // 4096, 4096))
    optim = torch.optim.Adam(model.parameters())
    model.w.grad = torch.zeros_like(model.w)
    optim.step()                                 # Adam's state exists
    cfg = kr.load_config(None, [f"checkpoint.dir={ckpt}", "rescue.budget_s=600",
                                "watchdog.hang_timeout_s=600", "watchdog.exit_mode=exit",
                                "requeue.enabled=false"])
    with kr.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
        for step in run.steps(10):
            if rank == 1 and step == 3:
                if node_kill:                    # the bench kills this node meanwhile
                    Path(killfile).write_text(os.uname().nodename)
                    time.sleep(600)
                Path(killfile).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))       # the step's collective: fails once rank 1 died
            time.sleep(0.05)


def _nbytes(size: str) -> int:
    mult = {"M": 10**6, "G": 10**9}
    return int(float(size[:-1]) * mult[size[-1].upper()])


def rescue_time(size: str) -> None:
    nbytes = _nbytes(size)
    with tempfile.TemporaryDirectory() as d:
        killfile = os.path.join(d, "killed_at")
        res = _spawn(["--worker-rescue", str(nbytes), os.path.join(d, "ckpt"), killfile])
        man = Path(d, "ckpt", "step_000000003", "MANIFEST.json")
        if res[0].returncode != 81 or not man.exists():
            print(f"{size}: no rescue (rank 0 exit {res[0].returncode})\n{res[0].stderr[-3000:]}")
            return
        m = json.loads(man.read_text())
        killed = float(Path(killfile).read_text())
    _print_rescue(f"{size} of state", m, killed)


def _print_rescue(what: str, m: dict, killed: float) -> None:
    r = m["rescue"]
    print(f"{what} ({m['nbytes'] / 2**20:.0f} MiB written): kill -> committed "
          f"{m['committed_at'] - killed:.2f} s; detection -> committed "
          f"{r['detected_to_write_s'] + m['save_seconds']:.2f} s "
          f"(waiting for per-rank state {r['waited_for_state_s']:.3f} s, write+commit "
          f"{m['save_seconds']:.2f} s, {m['nbytes'] / 2**20 / m['save_seconds']:.0f} MiB/s)")


def rescue_time_on_nodes(size: str) -> None:
    nbytes = _nbytes(size)
    script = REPO / "tests" / "cluster" / "multinode_cluster.sh"
    subprocess.run(["bash", str(script), "start"], check=True, capture_output=True, text=True)
    conf = subprocess.run(["bash", str(script), "env"], check=True, capture_output=True,
                          text=True).stdout.split("SLURM_CONF=", 1)[1].split()[0].strip("'\"")
    env = dict(os.environ, SLURM_CONF=conf, PYTHONPATH=str(REPO))
    env.pop("KEMPNER_RESILIENCE_CONFIG", None)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        killfile, ckpt = os.path.join(d, "node"), os.path.join(d, "ckpt")
        job = Path(d, "job.sbatch")
        job.write_text("#!/bin/bash\n#SBATCH -N 2 --ntasks-per-node 1 -p mn --time 10\n"
                       f"#SBATCH -o {d}/job.out\n"
                       f"srun --kill-on-bad-exit=1 {sys.executable} {__file__} --worker-rescue "
                       f"{nbytes} {ckpt} {killfile} node\n")
        job_id = subprocess.run(["sbatch", "--parsable", str(job)], env=env, check=True,
                                capture_output=True, text=True).stdout.strip().split(";")[0]
        node = ""
        try:
            end = time.monotonic() + 600
            while not node and time.monotonic() < end:
                time.sleep(0.05)
                node = Path(killfile).read_text().strip() if os.path.exists(killfile) else ""
            if not node:
                print(f"{size} on 2 nodes: rank 1 never reached step 3\n"
                      + Path(d, "job.out").read_text()[-3000:])
                return
            killed = time.time()
            subprocess.run(["bash", str(script), "kill-node", node.removeprefix("krnode")],
                           check=True, capture_output=True, text=True)
            man = Path(ckpt, "step_000000003", "MANIFEST.json")
            while not man.exists() and time.monotonic() < end:
                time.sleep(0.05)
            if not man.exists():
                print(f"{size} on 2 nodes: no rescue\n" + Path(d, "job.out").read_text()[-3000:])
                return
            m = json.loads(man.read_text())
        finally:
            subprocess.run(["scancel", job_id], env=env, capture_output=True)
            if node:
                subprocess.run(["bash", str(script), "restart-node", node.removeprefix("krnode")],
                               capture_output=True)
    _print_rescue(f"{size} on 2 nodes (node {node} killed)", m, killed)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker-mark":
        return _worker_mark(int(sys.argv[3]), sys.argv[2], sys.argv[4])
    if len(sys.argv) > 1 and sys.argv[1] == "--worker-rescue":
        return _worker_rescue(int(sys.argv[2]), sys.argv[3], sys.argv[4],
                              node_kill=sys.argv[5:] == ["node"])
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sizes", default="200M,2G")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: the rescue time on 2 nodes of the namespace SLURM cluster (root)")
    p.add_argument("--sharded", action="store_true",
                   help="only the per-step mark: DDP (2 ranks) and sharded state (HSDP, 4 "
                        "ranks) side by side")
    args = p.parse_args()
    if args.sharded:
        per_step(args.steps, sharded=True)
        return
    if args.nodes == 2:
        for size in args.sizes.split(","):
            rescue_time_on_nodes(size)
        return
    per_step(args.steps)
    for size in args.sizes.split(","):
        rescue_time(size)


if __name__ == "__main__":
    main()
