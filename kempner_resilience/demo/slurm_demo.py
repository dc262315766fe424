"""The SLURM side of the demo: a demo training job rendered from the shipped sbatch template,
submitted, signalled and watched on a real cluster.

``kempner-resilience demo --slurm`` (``cli/demo_slurm.py``) tells the demo's story with these:
an uninterrupted reference run, then the same trainer as a batch job whose every step is
SLURM's own: ``scancel --signal`` delivers the signal to the srun tasks, rank 0 calls
``scontrol requeue``, SLURM reruns the batch script with ``SLURM_RESTART_COUNT`` incremented.
The end-to-end tests and ``bench/slurm_latency_bench.py`` drive the cluster with them too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = ["DemoJob", "ClusterError", "check_cluster", "write_job", "submit", "job_info",
           "wait_until", "run_reference", "TERMINAL"]

# A task's shell names its launch ("<SLURM's restart count>.<relaunch>") as its channel says.
_LAUNCH_NAME = "from kempner_resilience.supervise.channel import launch_name; print(launch_name())"
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class ClusterError(RuntimeError):
    """No usable SLURM cluster (sinfo missing or failing, sbatch refusing)."""


def _run(args: list[str], timeout: float = 30.0, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


def check_cluster(timeout: float = 15.0) -> str:
    """``sinfo`` output when a cluster answers; raises ClusterError naming the problem."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        raise ClusterError("no SLURM cluster: `sinfo`/`sbatch` are not on PATH (on this "
                           "project's test machines: bash tests/cluster/slurm_cluster.sh start)")
    try:
        res = _run(["sinfo", "-h", "-o", "%P %a %D %t"], timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"no SLURM cluster: `sinfo` did not answer within {timeout:.0f} s"
                           ) from None
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise ClusterError("no SLURM cluster: `sinfo` failed: " + (msg[-1] if msg else
                                                                   f"exit {res.returncode}"))
    return res.stdout


def submit(script: Path | str, *args: str, cwd: Path | str | None = None,
           env: dict[str, str] | None = None) -> str:
    """``sbatch --parsable [args] script`` -> job id. ``env``: sbatch's environment (the job
    inherits it; ``SLURM_CONF`` there picks the cluster)."""
    res = subprocess.run(["sbatch", "--parsable", *args, str(script)], capture_output=True,
                         text=True, timeout=30, cwd=cwd, stdin=subprocess.DEVNULL, env=env)
    job_id = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not re.fullmatch(r"\d+", job_id):
        raise ClusterError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
    return job_id


def job_info(job_id: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``scontrol show -o job`` as a dict; {} when slurmctld does not know the job (any more)."""
    from kempner_resilience.slurm.scontrol import parse_show_job

    try:
        res = _run(["scontrol", "show", "-o", "job", str(job_id)], 15, env)
    except subprocess.TimeoutExpired:
        return {}
    if res.returncode != 0:
        return {}
    jobs = parse_show_job(res.stdout)
    return jobs[0] if jobs else {}


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               poll: float = 0.1) -> Any:
    """Poll ``predicate()`` until it is truthy; returns it. TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(poll)


def _demo_env() -> dict[str, str]:
    # One intra-op thread: results independent of how many cores srun hands a task, and the
    # 2-core test machines stay usable.
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class DemoJob:
    """A demo training job rendered from the sbatch template into ``workdir``.

    ``env``: the environment of every SLURM command run for the job (None: this process's);
    ``SLURM_CONF`` in it picks the cluster.
    """

    workdir: Path
    script: Path
    ranks: int
    steps: int
    job_id: str | None = None
    env: dict[str, str] | None = None
    nodes: int = 1
    #: ``kempner-resilience`` arguments that render the same batch script (``sbatch ...``).
    sbatch_args: list[str] = field(default_factory=list)
    signals_sent: list[tuple[str, float, int | None]] = field(default_factory=list)
    #: where ``sbatch`` runs (the job's SLURM_SUBMIT_DIR); None: ``workdir``.
    submit_dir: Path | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "job.out"

    @property
    def weights(self) -> Path:
        return self.workdir / "weights.pt"

    @property
    def checkpoints(self) -> Path:
        return self.workdir / "checkpoints"

    @property
    def progress(self) -> Path:
        return self.workdir / "progress.txt"

    def worker_ranks(self) -> dict[int, int]:
        """The torchrun workers' pids and ranks, as each wrote them at its start ({pid: rank},
        every launch's): a warm worker's ``/proc`` shows its zygote's command and environment,
        so neither names the rank."""
        found: dict[int, int] = {}
        for f in self.workdir.glob("worker.*"):
            try:
                found[int(f.read_text().strip())] = int(f.name.rsplit(".", 1)[1])
            except (OSError, ValueError):
                continue
        return found

    def submit(self, *args: str) -> str:
        self.job_id = submit(self.script, *args, cwd=self.submit_dir or self.workdir,
                             env=self.env)
        return self.job_id

    def info(self) -> dict[str, str]:
        assert self.job_id is not None
        return job_info(self.job_id, self.env)

    def hosts(self) -> list[str]:
        """The host names of the job's current (or last) allocation; empty while pending."""
        from kempner_resilience.slurm.env import expand_hostlist

        return expand_hostlist(self.info().get("NodeList", ""))

    def last_step(self) -> int | None:
        """The newest step rank 0 finished (over all runs of the job), from the progress file."""
        try:
            text = self.progress.read_text()
        except FileNotFoundError:
            return None
        steps = re.findall(r"^rank 0 step (\d+)$", text, re.M)
        return int(steps[-1]) if steps else None

    def steps_done_in_run(self, restart: int | str) -> int | None:
        """Rank 0's newest step in the run with SLURM_RESTART_COUNT ``restart``."""
        marker = f"# run {restart}\n"
        try:
            text = self.progress.read_text()
        except FileNotFoundError:
            return None
        if marker not in text:
            return None
        steps = re.findall(r"^rank 0 step (\d+)$", text.split(marker, 1)[1].split("# run ")[0],
                           re.M)
        return int(steps[-1]) if steps else None

    def report(self, restart: int | str) -> dict[str, Any] | None:
        """Rank 0's KEMPNER_RESILIENCE_REPORT for run ``restart`` (0 = first run)."""
        try:
            return json.loads((self.workdir / f"report.{restart}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def rank_exit(self, restart: int | str, rank: int) -> int | None:
        """Rank ``rank``'s exit status in run ``restart`` (``rank_files`` jobs); None when the
        rank has not exited, or died with its node."""
        try:
            return int((self.workdir / f"rank.{restart}.{rank}.exit").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def rank_stderr(self, restart: int | str, rank: int) -> str:
        """Rank ``rank``'s stderr in run ``restart`` (``rank_files`` jobs)."""
        try:
            return (self.workdir / f"rank.{restart}.{rank}.err").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def signal(self, sig: str = "USR1") -> float:
        """``scancel --signal=SIG`` to every srun task; returns the wall time it was sent."""
        assert self.job_id is not None
        t = time.time()
        res = _run(["scancel", f"--signal={sig}", self.job_id], 30, self.env)
        if res.returncode != 0:
            raise ClusterError(f"scancel --signal={sig} {self.job_id}: {res.stderr.strip()}")
        self.signals_sent.append((sig, t, self.last_step()))
        return t

    def wait_state(self, states: Iterable[str] = TERMINAL, timeout: float = 120.0,
                   restarts: int | None = None, poll: float = 0.2) -> dict[str, str]:
        """Wait for JobState in ``states`` (and Restarts == ``restarts`` when given)."""
        want = set(states)

        def ok() -> dict[str, str] | None:
            info = self.info()
            if info.get("JobState") in want and (
                    restarts is None or info.get("Restarts") == str(restarts)):
                return info
            return None
        try:
            return wait_until(ok, timeout, f"job {self.job_id} in {sorted(want)}"
                              + (f" with Restarts={restarts}" if restarts is not None else ""),
                              poll)
        except TimeoutError as e:
            info = self.info()
            raise TimeoutError(f"{e}; last JobState={info.get('JobState')} "
                               f"Restarts={info.get('Restarts')} Reason={info.get('Reason')}"
                               f"\n--- log tail ---\n{self.log_text()[-3000:]}") from None

    def wait_step(self, step: int, timeout: float = 120.0) -> int:
        def reached() -> int | None:
            s = self.last_step()
            return s if s is not None and s >= step else None
        try:
            return wait_until(reached, timeout, f"job {self.job_id} reaching step {step}", 0.05)
        except TimeoutError as e:
            info = self.info()
            raise TimeoutError(f"{e}; JobState={info.get('JobState')} "
                               f"Reason={info.get('Reason')}\n--- log tail ---\n"
                               f"{self.log_text()[-3000:]}") from None

    def cancel(self) -> None:
        if self.job_id is not None:
            _run(["scancel", self.job_id], 30, self.env)


def write_job(workdir: Path | str, *, ranks: int = 1, steps: int = 60, step_time: float = 0.1,
              every_steps: int = 5, sets: Iterable[str] = (), time_limit: str = "00:10:00",
              lead_time_s: float | None = None, partition: str | None = None,
              job_name: str = "kr-demo", python: str = sys.executable,
              extra: dict[str, object | None] | None = None,
              train_args: Iterable[str] = (), nodes: int = 1, rank_files: bool = False,
              env: dict[str, str] | None = None, torchrun: bool = False,
              spares: int = 0, config_in_script: bool = False,
              submit_dir: Path | None = None) -> DemoJob:
    """Render ``single_node`` (``multi_node`` when ``nodes > 1``) for the demo trainer into
    ``workdir/job.sbatch``: ``ranks`` srun tasks in all, ``ranks / nodes`` on each node.
    ``torchrun``: ``multi_node_torchrun`` instead, one ``kempner-resilience torchrun`` agent per
    node starting ``ranks / nodes`` workers (``kempner-resilience`` must be on the job's PATH).

    Checkpoints go to ``workdir/checkpoints``, final weights to ``workdir/weights.pt``, rank 0's
    report of run k (``SLURM_RESTART_COUNT``, 0 first) to ``workdir/report.k.json``, completed
    steps to ``workdir/progress.txt`` (``# run k`` before each run's lines), the job's log to
    ``workdir/job.out``. ``sets`` are extra ``--set KEY=VALUE`` config overrides, ``train_args``
    extra trainer arguments (``--hang-at``, ``--no-ddp``). ``rank_files``: each rank's stderr goes
    to ``workdir/rank.k.R.err`` and its exit status to ``workdir/rank.k.R.exit`` instead (what a
    rank on a surviving node saw when another node died). ``env``: see ``DemoJob``.
    ``spares``: that many spare nodes; a run then is ``k.i`` (SLURM's restart count, then
    the relaunch in place: ``report.0.1.json``). ``multi_node``: ``kempner-resilience srun``
    runs the steps (it must be on the job's PATH) and counts the relaunches; with
    ``torchrun``: the rendezvous rounds of torch's worker-group restarts in the job.
    ``config_in_script``: the config reaches the trainer only (it sets ``checkpoint.dir`` in
    code, as the README shows), never ``kempner-resilience sbatch``/``srun``. ``submit_dir``:
    where ``sbatch`` runs (default ``workdir``).
    """
    from kempner_resilience.config import load_config
    from kempner_resilience.slurm.templates import render_sbatch

    if nodes < 1 or ranks % nodes:
        raise ValueError(f"ranks={ranks} cannot be spread evenly over nodes={nodes}")
    work = Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = [f"checkpoint.dir={work / 'checkpoints'}", f"checkpoint.every_steps={every_steps}",
                 *sets]
    cfg = load_config(None, overrides)
    train = [python, "-u", "-m", "kempner_resilience.demo.train", "--steps", str(steps),
             "--step-time", str(step_time), "--out", str(work / "weights.pt"),
             "--progress", str(work / "progress.txt")]
    for o in overrides:
        train += ["--set", o]
    train += [str(a) for a in train_args]
    run, named = "${SLURM_RESTART_COUNT:-0}", ""
    if spares:   # a relaunch in place keeps SLURM's count; the glue counts its relaunches
        # (torchrun: the rendezvous round, the same on every node, where a standby's
        # TORCHELASTIC_RESTART_COUNT is 0), said in the task's supervisor channel.
        named = f"run=$({shlex.quote(python)} -c {shlex.quote(_LAUNCH_NAME)}); "
        run = "$run"
    # One srun line (the template's). Each task's bash names the report after the restart count,
    # marks where a run starts in the progress file (rank 0 only: torchrun's RANK, else srun's
    # SLURM_PROCID) and execs the trainer, so the signals reach Python directly. Everything that
    # needs a shell is inside that `bash -c`: the command is a plain argument list, which
    # `kempner-resilience sbatch -- ...` renders the same way.
    mark = (f'{named}export KEMPNER_RESILIENCE_REPORT={shlex.quote(str(work))}/report.{run}.json; '
            f'[ "${{RANK:-$SLURM_PROCID}}" = 0 ] && echo "# run {run}" >> '
            f'{shlex.quote(str(work / "progress.txt"))}; ')
    if rank_files:
        # This shell stays, to write the trainer's exit status. SLURM signals only the task
        # itself (slurmstepd's children), so it forwards the signals to the trainer; `wait`
        # returns early (> 128) on each of them while the trainer still runs. bash 5.2 can
        # lose the status of a child that exited during a trap (its second `wait` gave -1):
        # then the signal's code stays.
        rank = f'{shlex.quote(str(work))}/rank.{run}.${{RANK:-$SLURM_PROCID}}'
        fwd = " ".join(f"trap 'kill -{s} $p 2>/dev/null' {s};" for s in
                       ("USR1", "USR2", "TERM", "INT"))
        mark += (f'"$@" 2>> {rank}.err & p=$!; {fwd} '
                 'while :; do wait $p; rc=$?; kill -0 $p 2>/dev/null || break; done; '
                 'if [ $rc -gt 128 ]; then wait $p; r=$?; [ $r = 127 ] || [ $r -lt 0 ] || rc=$r; fi; '
                 f'echo $rc > {rank}.exit; exit $rc')
    else:
        mark += 'exec "$@"'
    command = ["bash", "-c", mark, "_", "env",
               *(f"{k}={v}" for k, v in _demo_env().items()), *train]
    all_extra: dict[str, object | None] = {"cpus-per-task": 1}
    if (torchrun or spares) and not rank_files:
        # The worker is the trainer itself, so each torchrun agent, or each node's standby
        # under `kempner-resilience srun`, can fork it warm: the trainer does the shell line's
        # bookkeeping. torchrun gives each worker one thread; srun's tasks get it exported.
        command = [*train, "--run-files", str(work), *(["--named-launches"] if spares else [])]
        if not torchrun:
            all_extra["export"] = "ALL," + ",".join(f"{k}={v}" for k, v in _demo_env().items())
    if partition:
        all_extra["partition"] = partition
    all_extra.update(extra or {})
    template = "multi_node_torchrun" if torchrun else "multi_node" if nodes > 1 \
        else "single_node"
    text = render_sbatch(cfg, template=template, job_name=job_name, command=command,
                         time=time_limit, nodes=nodes, ntasks_per_node=ranks // nodes,
                         output=str(work / "job.out"), lead_time_s=lead_time_s, extra=all_extra,
                         spares=spares,
                         overrides=overrides if spares and not config_in_script else ())
    script = work / "job.sbatch"
    script.write_text(text)
    cli = ["sbatch", "--template", template, "--job-name", job_name, "--time", time_limit,
           "--nodes", str(nodes), "--ntasks-per-node", str(ranks // nodes),
           "--log", str(work / "job.out")]
    if lead_time_s is not None:
        cli += ["--lead-time", str(lead_time_s)]
    if spares:
        cli += ["--spares", str(spares)]
    for o in () if config_in_script else overrides:
        cli += ["--set", o]
    for key, val in all_extra.items():
        cli += ["--extra", key if val is None else f"{key}={val}"]
    cli += ["--", *command]
    return DemoJob(work, script, ranks, steps, env=env, nodes=nodes, sbatch_args=cli,
                   submit_dir=submit_dir)


def run_reference(workdir: Path | str, *, ranks: int, steps: int, python: str = sys.executable,
                  timeout: float = 300.0, train_args: Iterable[str] = ()) -> Path:
    """The uninterrupted run: the same trainer, ``ranks`` plain processes (RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT, no SLURM, no torchrun, no checkpoints). Returns the weights path.
    ``train_args``: extra trainer arguments (``--no-ddp``)."""
    work = Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "weights.pt"
    from kempner_resilience.demo.launcher import free_port
    from kempner_resilience.supervise.local.launcher import start_rank
    from kempner_resilience.supervise.local.standby import standby_or_zygote
    from kempner_resilience.supervise.local.warm import warm_command

    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.pop("KEMPNER_RESILIENCE_REPORT", None)
    base.pop("KEMPNER_RESILIENCE_CONFIG", None)
    base.update(_demo_env())
    cmd = [python, "-m", "kempner_resilience.demo.train", "--steps", str(steps), "--quiet",
           "--out", str(out), "--set", f"checkpoint.dir={work / 'checkpoints'}",
           "--set", "checkpoint.every_steps=0", "--set", "checkpoint.resume=false",
           *(str(a) for a in train_args)]
    # With warm starts on, the ranks fork from one process that imported torch once: a cold
    # rank pays 3 s of CPU for its imports. One rank alone would pay them in that process.
    own = standby_or_zygote(base) if ranks > 1 and warm_command(cmd) else None
    parent, procs = own, []
    try:
        for rank in range(ranks):
            env = dict(base, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            log = str(work / f"rank{rank}.log")
            proc, parent = start_rank(parent, cmd, env, str(work), log, log)
            procs.append(proc)
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if own is not None:
            own.close()
    if any(codes) or not out.exists():
        raise RuntimeError(f"reference run failed with exit codes {codes}; see {work}/rank*.log")
    return out
