"""Shared test helpers: run real Python subprocesses and find free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kempner_resilience.demo.launcher import free_port  # noqa: F401  (tests import it from here)
from kempner_resilience.core.runpaths import RunPaths

REPO = Path(__file__).resolve().parents[1]


def write_script(tmp_path: Path, body: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("KEMPNER_RESILIENCE_CONFIG", None)
    e["PYTHONUNBUFFERED"] = "1"
    e.update({k: str(v) for k, v in extra.items()})
    return e


def agent_env(**extra: str) -> dict[str, str]:
    """``env`` for a torchrun agent whose workers must be its own descendants (a test that
    reaps them, or checks the agent's own zygote): without the suite's standby, the agent
    forks them from a zygote of its own, its child."""
    e = env(**extra)
    e.pop("KEMPNER_RESILIENCE_STANDBY", None)
    return e


class Forked:
    """A test's script forked from the suite's standby, as ``subprocess.Popen`` gives it: the
    rank's ``WarmProcess`` (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``returncode``) with ``args``, ``stdout``/``stderr`` (pipes), ``communicate`` and
    ``terminate``."""

    def __init__(self, args, proc, stdout, stderr) -> None:
        self.args, self._proc = args, proc
        self.stdout, self.stderr = stdout, stderr
        self._read: dict[str, object] = {}
        self._readers: list = []

    def __getattr__(self, name):
        return getattr(self._proc, name)

    def terminate(self):
        self._proc.send_signal(signal.SIGTERM)

    def communicate(self, timeout=None):
        import threading

        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    t = threading.Thread(target=lambda n=name, f=stream: self._read.update(
                        {n: f.read()}), daemon=True)
                    t.start()
                    self._readers.append(t)
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if end is None else max(end - time.monotonic(), 0.0))
            if t.is_alive():
                raise StillRunning(self.args, timeout, self._holders())
        self.wait(None if end is None else max(end - time.monotonic(), 0.0))
        return self._read.get("stdout"), self._read.get("stderr")

    def _holders(self) -> str:
        """Why the output has not ended: the script still runs, or which processes still hold
        its pipes open (a child it left behind)."""
        code = self._proc.poll()
        if code is None:
            return f"pid {self.pid} is still running"
        pipes = {f"pipe:[{os.fstat(f.fileno()).st_ino}]"
                 for f in (self.stdout, self.stderr) if f is not None}
        held = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if pipes & {os.readlink(f"/proc/{pid}/fd/{fd}")
                            for fd in os.listdir(f"/proc/{pid}/fd")}:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    held.append(f"{pid} ({cmd.decode(errors='replace')[:200]})")
        return f"pid {self.pid} exited with {code}; its pipes are held by: " + \
            ("; ".join(held) or "nobody (it just closed)")


class StillRunning(subprocess.TimeoutExpired):
    """``communicate`` timed out: the ``TimeoutExpired`` tests expect, saying why."""

    def __init__(self, cmd, timeout, why: str) -> None:
        super().__init__(cmd, timeout)
        self.why = why

    def __str__(self) -> str:
        return f"{super().__str__()}: {self.why}"


def spawn_script(args, *, env=None, cwd=None, stdout=None, stderr=None, text=False,
                 start_new_session=False, cold=False):
    """``subprocess.Popen(args, ...)`` for a test's own Python script: forked from the suite's
    standby when one fits (``supervise/local/standby.py``), so the script does not import
    torch again (about 2 s of CPU each, hundreds of scripts); else started cold. A forked
    script is the process a cold start gives (tests/test_warm.py), in a session of its own.
    ``cold``: always started cold (a test of the cold start itself)."""
    from kempner_resilience.supervise.local.standby import NodeStandby
    from kempner_resilience.supervise.local.warm import warm_command

    # Unbuffered, as the standby's streams are (a script's output order is all it changes).
    env = {"PYTHONUNBUFFERED": "1", **(os.environ if env is None else env)}
    standby = None if cold or not warm_command(list(map(str, args))) \
        else NodeStandby.for_env(env)
    if standby is None:
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session)
    ours, theirs = [], {}
    for name, want in (("stdout", stdout), ("stderr", stderr)):
        if want == subprocess.PIPE:
            r, w = os.pipe()
            ours.append((name, r))
            theirs[name] = w
        elif want == subprocess.DEVNULL:
            theirs[name] = os.open(os.devnull, os.O_WRONLY)
        elif want == subprocess.STDOUT:
            theirs[name] = theirs.get("stdout", 1)
        elif want is not None:
            theirs[name] = want.fileno()
    try:
        proc = standby.spawn(list(map(str, args)), env, None if cwd is None else str(cwd),
                             theirs.get("stdout"), theirs.get("stderr"))
    finally:
        for name, want in (("stdout", stdout), ("stderr", stderr)):
            if want in (subprocess.PIPE, subprocess.DEVNULL):
                os.close(theirs[name])
    streams = {name: os.fdopen(r, "r" if text else "rb") for name, r in ours}
    return Forked(args, proc, streams.get("stdout"), streams.get("stderr"))


def communicate_or_stacks(proc, timeout: float) -> tuple:
    """``proc.communicate(timeout)``; past it, the process's every thread's stack (the
    package's hang signal: faulthandler, then exit) and its output, as the test's failure."""
    from kempner_resilience.exitcodes import ExitCode

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(int(ExitCode.HANG))
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = "(its output did not end either)"
        raise AssertionError(f"{e}; its stacks and output:\n{str(err)[-12000:]}") from None


def run_script(args, *, env=None, cwd=None, timeout=None, capture_output=False, text=False,
               check=False, stdout=None, stderr=None, cold=False) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a test's own Python script, forked as ``spawn_script`` forks it."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = spawn_script(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, cold=cold)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def start(script: Path, *args: str, **extra_env: str):
    return spawn_script([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, env=env(**extra_env))


def start_running(script: Path, stamp: Path, *args: str) -> subprocess.Popen:
    """``script STAMP ARGS...`` started; returns once it wrote STAMP (its loop is running)."""
    proc = start(script, str(stamp), *args)
    try:
        wait_for_file(stamp)
    except BaseException:
        proc.kill()
        raise
    return proc


def wait_for_file(path: Path, timeout: float = 60.0, contains: str | None = None) -> str:
    """Wait until ``path`` exists (and holds ``contains``); returns its text."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            text = path.read_text()
            if contains is None or contains in text:
                return text
        time.sleep(0.01)
    raise TimeoutError(f"{path} did not appear (with {contains!r}) within {timeout} s")


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values are identical, bit for bit."""
    import torch

    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@contextlib.contextmanager
def rank0_with_stuck_peer(script: Path, *args: str):
    """Run ``script`` as ranks 0 and 1 of a gloo job (``script RANK PORT *args``); yields rank
    0's process. The script makes rank 1 the peer that stops joining collectives. Both are
    killed on the way out."""
    port = str(free_port())
    peer = start(script, "1", port, *args)
    proc = start(script, "0", port, *args)
    try:
        yield proc
    finally:
        for p in (peer, proc):
            p.kill()
        peer.communicate()


def require(module: str) -> None:
    """Skip a test that needs ``module`` of an optional extra (wandb, matplotlib) when it is
    not installed; under CI fail it instead, where scripts/setup.sh installs the test extras.
    Looked up, not imported: at a module's top this runs at every pytest process's collection,
    where importing Lightning alone costs a second of CPU."""
    import importlib.util

    import pytest

    from slurm_fixtures import in_ci

    if importlib.util.find_spec(module) is None:
        if in_ci():
            pytest.fail(f"{module} is not installed; scripts/setup.sh installs it for the tests",
                        pytrace=False)
        pytest.skip(f"{module} is not installed", allow_module_level=True)


# The rescue tests' job: tests/checkpoint_helpers/rescue_job.py on N local gloo ranks, relaunched
# once after the codes a lost or hung rank leaves (a SIGKILLed rank included).
RESCUE_JOB = Path(__file__).resolve().parent / "checkpoint_helpers" / "rescue_job.py"


def run_rescue_job(work: Path, *extra: str, steps: int, every: int, ranks: int,
                   sets: tuple[str, ...] = (), on_launch=None):
    """(launches, final weights or None) of the rescue job in ``work``."""
    import signal

    import torch

    from kempner_resilience.demo.launcher import LocalLauncher
    from kempner_resilience.exitcodes import ExitCode

    work.mkdir(parents=True, exist_ok=True)
    out = work / "weights.pt"
    cmd = [sys.executable, str(RESCUE_JOB), "--steps", str(steps), "--out", str(out),
           "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", f"checkpoint.every_steps={every}"]
    for s in sets:
        cmd += ["--set", s]
    relaunch = {int(ExitCode.PEER_LOST), int(ExitCode.HANG), 128 + signal.SIGKILL}
    launches = LocalLauncher([*cmd, *extra], ranks=ranks, workdir=work, max_launches=2,
                             relaunch_codes=relaunch, stop_timeout_s=90,
                             on_launch=on_launch).run()
    return launches, torch.load(out, weights_only=True) if out.exists() else None


def committed_manifests(work: Path) -> dict[int, dict]:
    """Step -> manifest of every committed checkpoint in ``work/ckpt``."""
    from kempner_resilience.checkpoint import layout

    return {e.step: e.manifest for e in layout.scan(RunPaths(work / "ckpt")) if e.committed}


def rank_logs(work: Path, launch: int = 0) -> str:
    return "".join(p.read_text() for p in sorted(work.glob(f"rank*.{launch}.log")))


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (read from /proc), sorted."""
    kids = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(path.parent.name))
    return sorted(kids)


def _stdout_file(pid: int) -> tuple[int, int] | None:
    """The regular file ``pid`` writes its stdout to, as (device, inode); None otherwise."""
    try:
        st = os.stat(f"/proc/{pid}/fd/1")
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def worker_pids(agent: int) -> list[int]:
    """A torchrun agent's live workers, sorted. Started cold they are its children; started
    warm, its zygote's (the agent's child) or the suite standby's, which is no kin of the
    agent: then they are found as the processes besides the agent and its zygote that write
    to the agent's stdout, a file of its own (a warm worker is given the agent's streams)."""
    workers = set()
    for pid in child_pids(agent):
        try:
            zygote = "supervise/local/warm.py" in Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        workers.update(child_pids(pid) if zygote else [pid])
    out = _stdout_file(agent)
    if out is not None:
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            if pid != agent and _parent(pid) != agent and _stdout_file(pid) == out:
                workers.add(pid)
    return sorted(workers)


def node_pids(agent: int) -> list[int]:
    """A torchrun agent's whole "node", workers first, then its zygote, then the agent: killed
    in this order, no worker hears its parent-death signal before its own SIGKILL."""
    workers = worker_pids(agent)
    return [*workers, *(p for p in child_pids(agent) if p not in workers), agent]


def kill_node(agent: int) -> None:
    """SIGKILL a torchrun agent's whole tree (``node_pids``' order), as a node's death would;
    a process already gone is skipped."""
    for pid in node_pids(agent):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def fill_disk(root: Path, leave: int = 8192) -> None:
    """Fill the file system of ``root`` (a small tmpfs) up to ``leave`` bytes: less than one
    save, so the next one fails with a full disk."""
    st = os.statvfs(root)
    (root / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - leave))


def buddy_ring_of_two(woken: list[str]):
    """Ranks 0 and 1's rescue buddy links, connected over real sockets on this host; each
    link's wake reasons go to ``woken``."""
    import threading

    from kempner_resilience.rescue.link import BuddyLink

    a, b = BuddyLink(0, woken.append), BuddyLink(1, woken.append)
    addr_a, addr_b = a.listen("127.0.0.1"), b.listen("127.0.0.1")
    token = b"t" * 16
    t = threading.Thread(target=b.connect, args=(0, 0, addr_a, token, 30.0))
    t.start()
    a.connect(1, 1, addr_b, token, 30.0)
    t.join()
    return a, b


def tagged_processes(needle: str, settle_s: float = 0.0, cwd: Path | None = None) -> list[str]:
    """The processes whose environment holds ``needle`` ("KEY=value": a test's tag, which every
    process a job starts inherits), or that work in ``cwd`` or below it (a process forked from
    the suite's standby shows the standby's environment in /proc, but works where its job
    does), as "pid command", after up to ``settle_s`` for them to go."""
    want = needle.encode()
    inside = None if cwd is None else str(Path(cwd).resolve())
    until = time.monotonic() + settle_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if want in Path(f"/proc/{pid}/environ").read_bytes() or (
                        inside is not None and
                        f"{os.readlink(f'/proc/{pid}/cwd')}/".startswith(f"{inside}/")):
                    found.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:80]!r}")
            except OSError:
                continue
        if not found or time.monotonic() > until:
            return found
        time.sleep(0.2)
