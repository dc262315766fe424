"""Stop agreement: every rank leaves run.steps() at the same step, whoever got the signal."""

import os
import signal


from helpers import free_port, start, wait_for_file, write_script
from kempner_resilience.exitcodes import ExitCode

TWO_RANKS = """
import os, sys, time
import torch, torch.distributed as dist
import kempner_resilience as kr

rank, port, progress, eval_every = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
leave_loop = len(sys.argv) > 5
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank))
# "cuda:gloo" makes a default group with no CPU backend, as a GPU job's NCCL group is: the
# package must never run its own collectives on it. The step's collective then uses a group
# the script makes, as a GPU job's would run on CUDA tensors over NCCL.
dist.init_process_group(os.environ.get("DEFAULT_BACKEND", "gloo"), rank=rank, world_size=2)
train = None if os.environ.get("DEFAULT_BACKEND", "gloo") == "gloo" else dist.new_group(
    backend="gloo")
log = open(progress + f".{rank}", "a", buffering=1)
cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=60"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(10_000):
        log.write(f"step {step}\\n")
        dist.all_reduce(torch.ones(8), group=train)        # the step's collective
        time.sleep(0.02 if rank == 0 else 0.03)
        if eval_every and step % eval_every == eval_every - 1:
            for batch in range(100_000):
                log.write(f"eval {step} {batch}\\n")
                dist.all_reduce(torch.ones(8), group=train)
                time.sleep(0.01)
                if run.should_stop():
                    log.write(f"eval interrupted {step} {batch}\\n")
                    break
            if leave_loop and run.should_stop():
                break   # leave training too: the with-block finishes the shutdown
log.write("after the run\\n")
"""


def last(path, prefix: str) -> str:
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith(prefix)]
    return lines[-1] if lines else ""


def run_two_ranks(tmp_path, eval_every: int, wait_for: str, *extra: str,
                  default_backend: str = "gloo"):
    script = write_script(tmp_path, TWO_RANKS)
    port, progress = str(free_port()), tmp_path / "progress"
    procs = [start(script, str(r), port, str(progress), str(eval_every), *extra,
                   DEFAULT_BACKEND=default_backend) for r in (0, 1)]
    try:
        wait_for_file(tmp_path / "progress.1", timeout=120, contains=wait_for)
        os.kill(procs[1].pid, signal.SIGUSR1)          # only rank 1 is signalled
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return procs, errs, [tmp_path / f"progress.{r}" for r in (0, 1)]


def test_signal_to_one_rank_stops_both_at_the_same_step_with_the_same_code(tmp_path):
    procs, errs, logs = run_two_ranks(tmp_path, eval_every=0, wait_for="step 5\n")
    assert [p.returncode for p in procs] == [ExitCode.REQUEUE] * 2, errs
    assert last(logs[0], "step") == last(logs[1], "step")
    assert "all ranks stop at step" in errs[1]


def test_signal_during_eval_stops_both_ranks_in_the_same_eval_batch(tmp_path):
    procs, errs, logs = run_two_ranks(tmp_path, eval_every=3, wait_for="eval 2 5\n")
    assert [p.returncode for p in procs] == [ExitCode.REQUEUE] * 2, errs
    assert last(logs[0], "eval interrupted") == last(logs[1], "eval interrupted") != ""
    assert last(logs[0], "step") == last(logs[1], "step")
    # the run stopped at the boundary right after the interrupted eval, not later
    assert last(logs[0], "step").split()[1] == last(logs[0], "eval interrupted").split()[2]


def test_should_stop_works_when_the_default_group_cannot_take_cpu_tensors(tmp_path):
    procs, errs, logs = run_two_ranks(tmp_path, eval_every=3, wait_for="eval 2 5\n",
                                      default_backend="cuda:gloo")
    assert [p.returncode for p in procs] == [ExitCode.REQUEUE] * 2, errs
    assert last(logs[0], "eval interrupted") == last(logs[1], "eval interrupted") != ""


def test_leaving_the_loop_after_should_stop_shuts_down_every_rank_alike(tmp_path):
    procs, errs, logs = run_two_ranks(tmp_path, 3, "eval 2 5\n", "leave-loop")
    assert [p.returncode for p in procs] == [ExitCode.REQUEUE] * 2, errs
    assert last(logs[0], "step") == last(logs[1], "step")
    # the SystemExit left the with-block: code after it did not run on either rank
    assert all("after the run" not in log.read_text() for log in logs)


def test_single_process_stop_needs_no_distributed_setup(tmp_path):
    script = write_script(tmp_path, """
        import os, signal
        import kempner_resilience as kr
        with kr.ResilientRun(kr.load_config(overrides=["watchdog.hang_timeout_s=0"])) as run:
            assert run.world_size == 1 and run.rank == 0
            for step in run.steps(100):
                if step == 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
                print("step", step, flush=True)
    """)
    proc = start(script)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.REQUEUE, err
    assert out.split()[-1] == "1"


LAST_WORD = """
import datetime, os, sys, time
from torch.distributed import TCPStore
from kempner_resilience.stop.agreement import StopAgreement

rank, port, readers_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
store = TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
agreement = StopAgreement(store, rank=rank, world_size=3)
if rank == 2:
    time.sleep(2.0)      # a slow rank: still finishing its part of the save
text = agreement.share_text("verdict", "requeued" if rank == 0 else None, 30.0,
                            readers_s=readers_s)
print(text, flush=True)
os._exit(0)              # rank 0, the store's host, leaves at once, as the shutdown does
"""


def test_rank_0_stays_until_a_slow_rank_has_read_the_last_shared_value(tmp_path):
    # The requeue verdict is the last thing the ranks share before they exit; a rank that reads
    # it after rank 0 (the store's host) has exited would report a failed requeue instead.
    script = write_script(tmp_path, LAST_WORD)
    port = str(free_port())
    procs = [start(script, str(r), port, "10") for r in (0, 1, 2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-500:] for o in outs]
    assert [o[0].strip() for o in outs] == ["requeued"] * 3


def _two_agreements(**kw):
    import datetime
    from torch.distributed import TCPStore
    from kempner_resilience.stop.agreement import StopAgreement

    server = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30),
                      wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 2, False,
                      timeout=datetime.timedelta(seconds=30))
    return [StopAgreement(store, rank=r, world_size=2, **kw)
            for r, store in enumerate((server, client))]


def test_with_1_ms_steps_and_the_check_off_the_step_every_rank_stops_at_the_agreed_step():
    # Each rank in a thread, a barrier as the step's collective (it blocks the CPU, as gloo's
    # do): the check issued at one boundary and read at the next still stops both ranks at the
    # step the signalled rank published, whichever rank is signalled and at whichever step.
    import threading
    import time
    from kempner_resilience.stop.reason import StopReason

    for signalled, at in [(1, 3), (0, 17), (1, 40), (0, 41)]:
        agreements = _two_agreements(ahead=True)
        collective = threading.Barrier(2, timeout=30)
        stops: dict[int, int] = {}

        def rank(r: int) -> None:
            for step in range(1000):
                local = StopReason.signal(signal.SIGUSR1) if r == signalled and step >= at \
                    else None
                decision = agreements[r].poll(step, local)
                if decision is not None:
                    stops[r] = decision.step
                    return
                collective.wait()
                time.sleep(0.001 * (r + 1))

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for a in agreements:
            a.release()
        assert stops == {0: at + 2, 1: at + 2}, (signalled, at)


def test_a_released_agreement_leaves_no_check_thread_behind():
    import threading

    agreements = _two_agreements(ahead=True)
    for step in range(3):
        assert all(a.poll(step, None) is None for a in agreements)
    for a in agreements:
        a.release()
    assert not [t for t in threading.enumerate() if t.name == "kempner-stop-check"]
