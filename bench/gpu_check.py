"""The GPU check: what only a machine with a CUDA GPU can show, in one run (not part of CI).

    .venv/bin/python bench/gpu_check.py [--work /tmp/gpu_check] [--sizes-gib 4,12] [--skip-bench]

Prints, each with PASS/FAIL:

1. exact resume of a CUDA model (MLP with dropout, AdamW, deterministic kernels) stopped by
   SIGUSR1 (exit 75) and resumed in a new process, against an uninterrupted run: bitwise;
2. the same for an FSDP2 model (``fully_shard``, NCCL process group of world size 1);
3. four shutdown scenarios on the GPU, each with its exit codes and whether ``nvidia-smi`` still
   lists any of its processes afterwards:
   a. a peer rank SIGKILLed while the survivor's executor threads hold CUDA work (exit 81),
   b. the local launcher and Ctrl+C to its process group, 2 DDP ranks on CUDA (both exit 130),
   c. ``run.should_stop()`` with NCCL as the default group (both ranks exit 75 in the same
      eval batch; the package must run no collective of its own on NCCL),
   d. a hang inside ``torch.cuda.synchronize()`` (a kernel that spins for hours): exit 42;
   e. a warm launch: 2 ranks forked from a process that imported torch init CUDA and NCCL;
4. the save/load figures: ``bench/checkpoint_bench.py --cuda`` (4 and 12 GiB of CUDA state) and
   the CPU emergency save vs ``dd`` (``--emergency-only``), with the issue's targets.

Without a CUDA device it says so and exits 2. Exit 0 when every check passed, else 1.
The scenarios reuse the scripts of tests/test_bounded_exit.py, tests/test_launcher_ctrl_c.py,
tests/test_agreement.py and tests/test_watchdog.py with the work moved onto the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kempner_resilience.demo.launcher import free_port  # noqa: E402  (the tests' ports too)

PEER_LOST, REQUEUE, SIGINT_CODE, HANG = 81, 75, 130, 42

# ------------------------------------------------------------------------------ the scripts

TRAIN = """
import argparse, os, signal, sys
import kempner_resilience as kr                      # before torch (see startup.py)
from kempner_resilience.core.log import configure
import torch, torch.nn as nn
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

ap = argparse.ArgumentParser()
ap.add_argument("--dir"); ap.add_argument("--steps", type=int); ap.add_argument("--out")
ap.add_argument("--signal-at", type=int, default=-1); ap.add_argument("--fsdp", action="store_true")
args = ap.parse_args()
configure()
torch.use_deterministic_algorithms(True)
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
if args.fsdp:
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 1024),
                      nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256)).to(dev)
if args.fsdp:
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(1)                                   # dropout masks: the CUDA RNG stream
cfg = kr.load_config(None, [f"checkpoint.dir={args.dir}", "signals.grace_s=120",
                            "watchdog.hang_timeout_s=300"])
with kr.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
    for step in run.steps(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, 256, generator=g).to(dev)
        y = torch.randn(64, 256, generator=g).to(dev)
        loss = ((model(x) - y) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step == args.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
    msd, osd = get_state_dict(model, optim)
    def host(v):
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            return v.detach().cpu()
        if isinstance(v, dict):
            return {k: host(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(host(x) for x in v)
        return v
    torch.save({"model": host(msd), "optim": host(osd)}, args.out)
    print("finished", flush=True)
"""

# tests/test_bounded_exit.py with the model and the executor's never-ending work on the GPU.
PEER_KILLED = """
import os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import kempner_resilience as kr
import torch, torch.distributed as dist
from torch import nn

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("gloo", rank=rank, world_size=world)
model = nn.Linear(1024, 1024).to(dev)
cfg = kr.load_config(None, ["watchdog.exit_timeout_s=3", "watchdog.cleanup_timeout_s=1",
                            "signals.grace_s=10"])
progress = open(sys.argv[1] + f".{rank}", "a", buffering=1)

def gpu_work():                                    # CUDA work that never finishes
    a = torch.randn(2048, 2048, device=dev)
    while True:
        a = torch.tanh(a @ a)
        torch.cuda.synchronize(dev)

with kr.ResilientRun(cfg) as run:
    pool = run.add_executor(ThreadPoolExecutor(2))
    pool.submit(gpu_work)
    pool.submit(threading.Event().wait)
    for step in run.steps(100_000):
        out = model(torch.randn(4, 1024, device=dev))
        dist.all_reduce(out.detach().cpu())
        time.sleep(0.02)
        progress.write(f"step {step}\\n")
"""

# tests/test_launcher_ctrl_c.py's RANK with DDP on the GPU (gloo carries CUDA tensors).
CTRL_C_RANK = """
import argparse, os, sys, time
import kempner_resilience as kr
import torch, torch.distributed as dist
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--dir"); ap.add_argument("--progress")
args = ap.parse_args()
rank = int(os.environ["RANK"])
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
model = nn.parallel.DistributedDataParallel(nn.Linear(256, 256).to(dev), device_ids=[dev])
optim = torch.optim.SGD(model.parameters(), lr=1e-3)
progress = open(args.progress, "a", buffering=1)
with kr.ResilientRun(kr.load_config(None, [f"checkpoint.dir={args.dir}"]),
                     state={"model": model, "optim": optim}) as run:
    for step in run.steps(100_000):
        optim.zero_grad()
        model(torch.randn(4, 256, device=dev)).sum().backward()
        optim.step()
        time.sleep(0.02)
        progress.write(f"rank {rank} step {step}\\n")
"""

CTRL_C_LAUNCHER = """
import json, sys
from pathlib import Path
from kempner_resilience.demo.launcher import LocalLauncher

rank_script, work = sys.argv[1:3]
cmd = [sys.executable, rank_script, "--dir", str(Path(work) / "ckpt")]
launch = LocalLauncher(cmd, ranks=2, workdir=Path(work), max_launches=1).run()[-1]
print(json.dumps({"exit_codes": launch.exit_codes, "interrupted": launch.interrupted,
                  "killed": launch.killed}))
"""

# A warm launch's ranks are forks of a process that imported torch and never touched CUDA:
# each must still initialise CUDA and NCCL as a cold rank does.
WARM_CUDA_RANK = """
import os
import torch, torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl")
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
assert x.item() == dist.get_world_size(), x
print(f"rank {rank} parent {os.getppid()} all_reduce {x.item():g}", flush=True)
dist.destroy_process_group()
"""

# tests/test_agreement.py's TWO_RANKS with NCCL as the default group and the step's collective
# on a gloo group, as a GPU job has it. With one GPU both ranks share it: NCCL communicators are
# created lazily, so that works as long as nothing runs a collective on the default group.
NCCL_SHOULD_STOP = """
import os, sys, time
import kempner_resilience as kr
import torch, torch.distributed as dist

rank, port, progress = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank))
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("nccl", rank=rank, world_size=2)
train = dist.new_group(backend="gloo")
log = open(progress + f".{rank}", "a", buffering=1)
cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=60"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(10_000):
        log.write(f"step {step}\\n")
        x = torch.ones(8, device=dev) * step
        dist.all_reduce(x.cpu(), group=train)
        time.sleep(0.02 if rank == 0 else 0.03)
        if step % 3 == 2:
            for batch in range(100_000):
                log.write(f"eval {step} {batch}\\n")
                dist.all_reduce(torch.ones(8), group=train)
                time.sleep(0.01)
                if run.should_stop():
                    log.write(f"eval interrupted {step} {batch}\\n")
                    break
log.write("after the run\\n")
"""

# tests/test_watchdog.py's hang, in cuda.synchronize(): a kernel spinning for hours.
CUDA_SYNC_HANG = """
import sys, time
import kempner_resilience as kr
import torch

stamp, timeout = sys.argv[1], sys.argv[2]
torch.cuda.init()
cfg = kr.load_config(overrides=[f"watchdog.hang_timeout_s={timeout}"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(10):
        time.sleep(0.05)
        if step == 3:
            open(stamp, "w").write(repr(time.monotonic()))
            torch.cuda._sleep(int(1e13))              # ~1.5 hours of spinning at 2 GHz
            torch.cuda.synchronize()
"""


# ------------------------------------------------------------------------------ helpers

def script(work: Path, name: str, body: str) -> Path:
    path = work / name
    path.write_text(textwrap.dedent(body))
    return path


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("KEMPNER_RESILIENCE_CONFIG", None)
    e.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        CUBLAS_WORKSPACE_CONFIG=":4096:8")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def start(*args: str, new_session: bool = False, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(**extra),
                            start_new_session=new_session)


def wait_for(path: Path, contains: str, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and contains in path.read_text():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not show {contains!r} within {timeout:.0f} s")


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int | None, str, str]]:
    """Wait (bounded) for every process; kill what is left. (exit code or None, stderr,
    stdout) each."""
    res = []
    end = time.monotonic() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(end - time.monotonic(), 1))
            res.append((p.returncode, err, out))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            res.append((None, err + "\n[gpu_check: killed after the time limit]", out))
    return res


def gpu_pids() -> set[int] | None:
    """PIDs nvidia-smi lists as compute processes (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        return None
    return {int(x) for x in r.stdout.split() if x.strip().isdigit()}


@dataclass(frozen=True)
class GpuResidue:
    """What nvidia-smi lists after a scenario that it did not list before: ``new`` is the set
    of such PIDs, or None when nvidia-smi could not tell (then the scenario cannot pass: "no
    process holds the GPU afterwards" is part of what it must show)."""

    new: frozenset[int] | None

    @property
    def clean(self) -> bool:
        return self.new is not None and not self.new

    def __str__(self) -> str:
        if self.new is None:
            return "nvidia-smi unavailable: cannot tell whether a process is left on the GPU"
        return "no process left on the GPU" if not self.new else \
            f"LEFT ON THE GPU: pids {sorted(self.new)}"


def left_on_gpu(before: set[int] | None) -> GpuResidue:
    """What nvidia-smi lists now that it did not before (waiting up to 15 s for teardown)."""
    if before is None:
        return GpuResidue(None)
    end = time.monotonic() + 15
    while True:
        now = gpu_pids()
        if now is None:
            return GpuResidue(None)
        new = now - before - {os.getpid()}
        if not new or time.monotonic() > end:
            break
        time.sleep(0.5)
    return GpuResidue(frozenset(new))


# --------------------------------------------------------------------------- the verdicts
# Pure functions of what a scenario recorded, so that tests/test_gpu_check.py checks every
# verdict without a GPU (a verdict that could never pass once shipped: it looked for a phrase
# in the success text).

def exact_resume_ok(codes: list[int | None], same: bool) -> bool:
    return codes == [0, REQUEUE, 0] and same


def peer_killed_ok(survivor_code: int | None, residue: GpuResidue) -> bool:
    return survivor_code == PEER_LOST and residue.clean


def ctrl_c_ok(launcher_code: int | None, result: dict, saved: list[str],
              residue: GpuResidue) -> bool:
    return (launcher_code == 0 and result.get("exit_codes") == [SIGINT_CODE] * 2
            and len(saved) == 1 and not result.get("killed") and residue.clean)


def should_stop_ok(codes: list[int | None], same_batch: bool, residue: GpuResidue) -> bool:
    return codes == [REQUEUE, REQUEUE] and same_batch and residue.clean


def sync_hang_ok(code: int | None, stacks: bool, residue: GpuResidue) -> bool:
    return code == HANG and stacks and residue.clean


def emergency_median(lines: list[str]) -> float | None:
    """The median ratio checkpoint_bench --emergency-only prints ("emergency save vs dd ...
    median 1.08x ..."), or None when it printed none."""
    for line in reversed(lines):
        if line.startswith("emergency save vs dd") and "median " in line:
            try:
                return float(line.split("median ", 1)[1].split("x", 1)[0])
            except ValueError:
                return None
    return None


def emergency_ok(lines: list[str], want: float = 0.9) -> bool:
    got = emergency_median(lines)
    return got is not None and got >= want


class Results:
    def __init__(self) -> None:
        self.rows: list[tuple[bool, str]] = []

    def add(self, ok: bool, what: str) -> None:
        self.rows.append((ok, what))
        print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)


def tail(text: str, n: int = 2500) -> str:
    return textwrap.indent(text[-n:], "    | ")


# ---------------------------------------------------------------------------- the checks

def exact_resume(work: Path, res: Results, fsdp: bool) -> None:
    kind = "FSDP2 model (NCCL, world 1)" if fsdp else "CUDA model"
    sub = work / ("fsdp" if fsdp else "cuda")
    sub.mkdir()
    train = script(sub, "train.py", TRAIN)
    flags = ["--fsdp"] if fsdp else []
    dist_env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port())) if fsdp else {}
    steps, stop_at = 30, 11

    def launch(ckpt: str, *extra: str) -> tuple[int | None, str, str]:
        if fsdp:
            dist_env["MASTER_PORT"] = str(free_port())
        p = start(str(train), "--dir", str(sub / ckpt), "--steps", str(steps), *flags, *extra,
                  **dist_env)
        return finish([p], 300)[0]

    codes = []
    straight = launch("straight", "--out", str(sub / "straight.pt"))
    codes.append(straight[0])
    stopped = launch("ckpt", "--signal-at", str(stop_at))
    codes.append(stopped[0])
    resumed = launch("ckpt", "--out", str(sub / "resumed.pt"))
    codes.append(resumed[0])
    ok_codes = exact_resume_ok(codes, True)
    same = False
    detail = ""
    if ok_codes:
        import torch

        a = torch.load(sub / "straight.pt", weights_only=False)
        b = torch.load(sub / "resumed.pt", weights_only=False)
        same, detail = compare(a, b)
    staged = "staging: pinned" in stopped[1] and "staging: pinned" in resumed[1]
    res.add(exact_resume_ok(codes, same),
            f"exact resume of a {kind} after SIGUSR1: exit codes {codes} (want [0, 75, 0]), "
            f"bitwise equal to the uninterrupted run: {same}{detail}; pinned staging logged at "
            f"both starts: {staged}")
    if not (ok_codes and same):
        for name, (_, err, _) in (("straight", straight), ("stopped", stopped),
                                  ("resumed", resumed)):
            print(f"  {name}:\n{tail(err)}")
    else:
        for line in (stopped[1] + resumed[1]).splitlines():
            if "staging:" in line or "committed (emergency)" in line or "resumed from" in line:
                print("   ", line.strip())


def compare(a, b, where: str = "") -> tuple[bool, str]:
    import torch

    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
        return ok, "" if ok else f" (first difference at {where})"
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return False, f" (keys differ at {where})"
        for k in a:
            ok, d = compare(a[k], b[k], f"{where}.{k}")
            if not ok:
                return ok, d
        return True, ""
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return False, f" (lengths differ at {where})"
        for i, (x, y) in enumerate(zip(a, b)):
            ok, d = compare(x, y, f"{where}[{i}]")
            if not ok:
                return ok, d
        return True, ""
    return (a == b), "" if a == b else f" ({where}: {a!r} != {b!r})"


def peer_killed(work: Path, res: Results) -> None:
    sub = work / "peer_killed"
    sub.mkdir()
    path = script(sub, "rank.py", PEER_KILLED)
    before = gpu_pids()
    port = str(free_port())
    procs = [start(str(path), str(sub / "progress"), RANK=str(r), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in (0, 1)]
    try:
        wait_for(sub / "progress.1", "step 5\n")
        procs[0].kill()
        t0 = time.monotonic()
        (code1, err1, _), = finish([procs[1]], 60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        finish(procs, 30)
    gpu = left_on_gpu(before)
    ok = peer_killed_ok(code1, gpu)
    res.add(ok, f"peer SIGKILLed while executors hold CUDA work: survivor exit {code1} (want "
                f"{PEER_LOST}) {took:.1f} s after the kill; {gpu}")
    if not ok:
        print(tail(err1))


def launcher_ctrl_c(work: Path, res: Results) -> None:
    sub = work / "ctrl_c"
    sub.mkdir()
    rank = script(sub, "rank.py", CTRL_C_RANK)
    launcher = script(sub, "launcher.py", CTRL_C_LAUNCHER)
    run_dir = sub / "work"
    run_dir.mkdir()
    before = gpu_pids()
    proc = start(str(launcher), str(rank), str(run_dir), new_session=True)
    try:
        wait_for(run_dir / "progress.0", "rank 0 step 2\n")
        wait_for(run_dir / "progress.0", "rank 1 step 2\n")
        os.killpg(proc.pid, signal.SIGINT)            # a terminal's Ctrl+C
        (code, err, out), = finish([proc], 180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    result = {}
    try:
        lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        pass
    saved = [p.name for p in (run_dir / "ckpt").glob("step_*")
             if '"reason":"emergency"' in (p / "MANIFEST.json").read_text()] \
        if (run_dir / "ckpt").is_dir() else []
    gpu = left_on_gpu(before)
    ok = ctrl_c_ok(code, result, saved, gpu)
    res.add(ok, f"launcher + Ctrl+C to its process group, 2 DDP ranks on CUDA: rank exit codes "
                f"{result.get('exit_codes')} (want [130, 130]), launcher exit {code}, emergency "
                f"checkpoints {saved}; {gpu}")
    if not ok:
        print(tail(err))
        for log in sorted(run_dir.glob("rank*.log")):
            print(f"  {log.name}:\n{tail(log.read_text(), 1500)}")


def warm_cuda_ranks(work: Path, res: Results) -> None:
    sub = work / "warm_cuda"
    sub.mkdir()
    rank = script(sub, "rank.py", WARM_CUDA_RANK)
    proc = subprocess.Popen([sys.executable, "-m", "kempner_resilience.cli", "launch", "--ranks",
                             "2", "--warm", "--", sys.executable, str(rank)], cwd=sub,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True)
    (code, err, out), = finish([proc], 180)
    cold = "cold" in err
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("rank "))
    parents = {ln.split()[3] for ln in lines}
    ok = code == 0 and len(lines) == 2 and not cold and str(proc.pid) not in parents
    res.add(ok, f"warm launch (ranks forked from a process that imported torch), 2 ranks, NCCL "
                f"all_reduce: exit {code}, {lines}, {'started cold' if cold else 'forked'}")
    if not ok:
        print(tail(err))


def nccl_should_stop(work: Path, res: Results) -> None:
    sub = work / "nccl_should_stop"
    sub.mkdir()
    path = script(sub, "rank.py", NCCL_SHOULD_STOP)
    port, progress = str(free_port()), sub / "progress"
    before = gpu_pids()
    procs = [start(str(path), str(r), port, str(progress)) for r in (0, 1)]
    try:
        wait_for(sub / "progress.1", "eval 2 5\n")
        os.kill(procs[1].pid, signal.SIGUSR1)        # only rank 1 is signalled
        outs = finish(procs, 180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    def last(r: int, prefix: str) -> str:
        lines = [ln for ln in (sub / f"progress.{r}").read_text().splitlines()
                 if ln.startswith(prefix)]
        return lines[-1] if lines else ""
    codes = [c for c, _, _ in outs]
    same_batch = last(0, "eval interrupted") == last(1, "eval interrupted") != ""
    gpu = left_on_gpu(before)
    ok = should_stop_ok(codes, same_batch, gpu)
    res.add(ok, f"should_stop() with NCCL as the default group: exit codes {codes} (want "
                f"[75, 75]), same eval batch: {same_batch} ({last(0, 'eval interrupted')!r}); "
                f"{gpu}")
    if not ok:
        for _, err, _ in outs:
            print(tail(err))


def cuda_sync_hang(work: Path, res: Results) -> None:
    sub = work / "sync_hang"
    sub.mkdir()
    path = script(sub, "hang.py", CUDA_SYNC_HANG)
    stamp, timeout = sub / "stamp", 5.0
    before = gpu_pids()
    proc = start(str(path), str(stamp), str(timeout))
    (code, err, _), = finish([proc], 180)
    ended = time.monotonic()
    stuck = ended - float(stamp.read_text()) if stamp.exists() else float("nan")
    gpu = left_on_gpu(before)
    stacks = "synchronize" in err
    ok = sync_hang_ok(code, stacks, gpu)
    res.add(ok, f"hang in torch.cuda.synchronize(): exit {code} (want {HANG}) {stuck:.1f} s after "
                f"the last step (hang_timeout_s={timeout:g}); stacks name synchronize: {stacks}; "
                f"{gpu}")
    if not ok:
        print(tail(err))


def bench(res: Results, sizes: str, work: Path) -> None:
    for what, args in (
            ("checkpoint_bench --cuda", ["--cuda", "--sizes-gib", sizes, "--tensors", "1500",
                                         "--dir", str(work / "ckbench_cuda")]),
            ("checkpoint_bench --emergency-only (CPU state, 1 GiB)",
             ["--emergency-only", "--rounds", "3", "--size-gib", "1",
              "--dir", str(work / "ckbench_cpu")])):
        print(f"\n--- {what}", flush=True)
        proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "checkpoint_bench.py"),
                                 *args], env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if " INFO " not in line:
                print(line, end="", flush=True)
        proc.wait()
        if what.startswith("checkpoint_bench --cuda"):
            res.add(proc.returncode == 0, f"{what}: every target met (exit {proc.returncode})")
        else:
            median = [ln for ln in lines if ln.startswith("emergency save vs dd")]
            ok = emergency_ok(lines)
            res.add(ok, f"{what}: {median[-1].strip() if median else 'no figure'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/gpu_check")
    ap.add_argument("--sizes-gib", default="4,12", help="checkpoint_bench --cuda state sizes")
    ap.add_argument("--skip-bench", action="store_true", help="scenarios only")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, "
              "torch.cuda.is_available() is False). Run it on a machine with an NVIDIA GPU and a "
              "CUDA build of torch.", file=sys.stderr)
        return 2
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    smi = gpu_pids()
    print(f"gpu_check: torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): "
          f"{torch.cuda.get_device_name(0)}; nvidia-smi "
          f"{'lists ' + str(len(smi)) + ' compute process(es) before' if smi is not None else 'unavailable'}"
          f"; work dir {work}", flush=True)
    res = Results()
    print("\n--- exact resume", flush=True)
    exact_resume(work, res, fsdp=False)
    exact_resume(work, res, fsdp=True)
    print("\n--- shutdown scenarios on the GPU", flush=True)
    for check in (peer_killed, launcher_ctrl_c, warm_cuda_ranks, nccl_should_stop,
                  cuda_sync_hang):
        try:
            check(work, res)
        except Exception as e:      # one broken scenario must not hide the others
            res.add(False, f"{check.__name__}: {type(e).__name__}: {e}")
    if not args.skip_bench:
        bench(res, args.sizes_gib, work)
    failed = [w for ok, w in res.rows if not ok]
    print(f"\ngpu_check: {len(res.rows) - len(failed)} of {len(res.rows)} checks passed")
    for w in failed:
        print(f"  FAILED: {w}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
