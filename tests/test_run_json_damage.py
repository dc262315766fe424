"""A damaged ``run.json`` never hands ``checkpoint.dir`` to another lineage.

The step directories record their run ids, so a ``run.json`` cut short, replaced by random
bytes, a symbolic link (dangling or not) or a FIFO is rebuilt from them: the run goes on as the
newest lineage, from its newest checkpoint, under one id in every attempt, and the lineages
left behind stay left behind. A ``run.json`` that cannot be put right by a rename (a directory)
or that the ledger contradicts is refused (exit 78), and a refused start writes nothing.

In-process runs with real DCP checkpoints on disk (``exit_mode="raise"``). Every step adds 1 to
the weights, so a resume from the wrong lineage or step shows in the tensors. The property test
at the end reuses directories written by real runs, copied, and applies the start's own
decisions (``identity.plan`` / ``record``, ``loader.lineage_candidates``, retention) to every
damage at every byte offset.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import kempner_resilience as kr
from kempner_resilience.checkpoint import identity, layout, loader, retention
from kempner_resilience.checkpoint.identity import RUN_ID_ENV, OtherRunError, RunFileError
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.startup import StartupError


def trained_weight(steps: int) -> torch.Tensor:
    """The weights of an uninterrupted run of ``steps`` steps (bitwise: the same additions)."""
    torch.manual_seed(0)
    weight = nn.Linear(4, 2).weight.detach().clone()
    for _ in range(steps):
        weight.add_(1.0)
    return weight


def train(ck: Path, total: int, *, every: int = 10, resume: bool = True,
          run_id: str | None = None, stop_at: int | None = None):
    """One attempt: resume (or not) from ``ck``, train to ``total`` (or leave the loop at
    ``stop_at``: no completed mark) saving every ``every`` steps; the run and its weights."""
    cfg = kr.load_config(overrides=(f"checkpoint.dir={ck}", f"checkpoint.every_steps={every}",
                                    "checkpoint.keep_last=3",
                                    f"checkpoint.resume={str(resume).lower()}"))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with kr.ResilientRun(cfg, state={"model": model}, exit_mode="raise", run_id=run_id) as run:
        for step in run.steps(total):
            if step == stop_at:
                break
            with torch.no_grad():
                model.weight.add_(1.0)
    return run, model.weight.detach().clone()


def by_run(ck: Path) -> dict[int, str]:
    return {e.step: e.manifest["run_id"] for e in layout.scan(RunPaths(ck)) if e.committed}


def listing(ck: Path) -> dict[str, object]:
    """Every entry of the directory with what identifies its state (a refused start must
    leave it as it was)."""
    out: dict[str, object] = {}
    for p in sorted(ck.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(ck))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(autouse=True)
def _no_run_id_from_env(monkeypatch):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


@pytest.fixture
def two_lineages(tmp_path):
    """Lineage 1 (steps 10, 20, 30), then a fresh lineage 2 (steps 4, 8): (dir, ids)."""
    ck = tmp_path / "ck"
    first, _ = train(ck, 30)
    second, _ = train(ck, 8, every=4, resume=False)
    assert by_run(ck) == {4: second.run_id, 8: second.run_id, 10: first.run_id,
                          20: first.run_id, 30: first.run_id}
    return ck, first.run_id, second.run_id


def cut(ck: Path, n: int = 20) -> None:
    (ck / "run.json").write_bytes((ck / "run.json").read_bytes()[:n])


def test_a_truncated_run_json_after_a_fresh_start_resumes_the_fresh_lineage(two_lineages):
    ck, old, fresh = two_lineages
    cut(ck)
    run, weight = train(ck, 12, every=4)
    assert run.run_id == fresh and run.start_step == 8
    assert torch.equal(weight, trained_weight(12))
    recorded = json.loads((ck / "run.json").read_text())
    assert recorded["run_id"] == fresh and recorded["earlier_runs"] == [old]
    assert by_run(ck) == {4: fresh, 8: fresh, 12: fresh, 10: old, 20: old, 30: old}


def test_a_run_json_made_a_directory_is_refused_naming_the_file_and_its_content(two_lineages):
    ck, old, fresh = two_lineages
    (ck / "run.json").unlink()
    (ck / "run.json").mkdir()
    before = listing(ck)
    for _ in range(2):                  # every attempt alike, and none takes a new id
        with pytest.raises(RunFileError) as err:
            train(ck, 40)
        assert isinstance(err.value, StartupError), "a script exits with 78 CONFIG"
        msg = str(err.value)
        assert str(ck / "run.json") in msg and "a directory" in msg
        assert f'"run_id": "{fresh}"' in msg and f'"earlier_runs": ["{old}"]' in msg
        assert listing(ck) == before, "a refused start writes nothing"


def test_a_dangling_run_json_symlink_is_replaced_by_the_newest_lineage(two_lineages):
    ck, old, fresh = two_lineages
    (ck / "run.json").unlink()
    (ck / "run.json").symlink_to(ck / "gone" / "run.json")
    first, weight = train(ck, 12, every=4)
    again, _ = train(ck, 14, every=4)
    assert first.run_id == again.run_id == fresh
    assert (first.start_step, again.start_step) == (8, 12)
    assert torch.equal(weight, trained_weight(12))
    assert (ck / "run.json").is_file() and not (ck / "run.json").is_symlink()
    assert json.loads((ck / "run.json").read_text())["earlier_runs"] == [old]


def test_a_run_json_symlink_to_another_runs_file_is_not_followed(two_lineages, tmp_path):
    ck, _, fresh = two_lineages
    other, _ = train(tmp_path / "other", 3, every=1)
    (ck / "run.json").unlink()
    (ck / "run.json").symlink_to(tmp_path / "other" / "run.json")
    run, _ = train(ck, 12, every=4)
    assert run.run_id == fresh and run.start_step == 8
    assert json.loads((tmp_path / "other" / "run.json").read_text())["run_id"] == other.run_id


def test_a_refused_start_with_a_truncated_run_json_writes_nothing(two_lineages):
    ck, _, fresh = two_lineages
    cut(ck)
    before = listing(ck)
    with pytest.raises(OtherRunError) as err:
        train(ck, 40, run_id="someone-else")
    assert fresh in str(err.value) and "someone-else" in str(err.value)
    assert listing(ck) == before, "run.json, the lease, the ledger: all as they were"


def test_a_fresh_lineage_that_never_saved_is_not_taken_for_the_one_it_left(tmp_path):
    ck = tmp_path / "ck"
    old, _ = train(ck, 30)
    fresh, _ = train(ck, 3, resume=False)          # ended before its first save
    assert set(by_run(ck).values()) == {old.run_id}
    cut(ck)
    before = listing(ck)
    with pytest.raises(RunFileError) as err:
        train(ck, 40)
    msg = str(err.value)
    assert old.run_id in msg and fresh.run_id in msg and "checkpoint.resume: false" in msg
    assert listing(ck) == before
    run, _ = train(ck, 40, run_id=old.run_id)      # the user says which: it goes on
    assert run.run_id == old.run_id and run.start_step == 30


# ------------------------------------------------------------------ the property

SEED = 20240611


def _damages(raw: bytes, rng: random.Random) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("truncate", n) for n in range(len(raw))]
    out += [("random", bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))
            for _ in range(8)]
    out += [("directory", None), ("dangling symlink", None), ("symlink to another run", None),
            ("fifo", None), ("symlink to /dev/zero", None)]
    return out


def _damage(run_file: Path, kind: str, arg: object, other: Path) -> None:
    run_file.unlink()
    if kind == "truncate":
        run_file.write_bytes(RAW[run_file][: int(arg)])  # type: ignore[call-overload]
    elif kind == "random":
        run_file.write_bytes(arg)                       # type: ignore[arg-type]
    elif kind == "directory":
        run_file.mkdir()
    elif kind == "dangling symlink":
        run_file.symlink_to(run_file.parent / "nowhere")
    elif kind == "symlink to another run":
        run_file.symlink_to(other)
    elif kind == "symlink to /dev/zero":
        run_file.symlink_to("/dev/zero")
    else:
        os.mkfifo(run_file)


def _restore(run_file: Path) -> None:
    if run_file.is_dir() and not run_file.is_symlink():
        run_file.rmdir()
    else:
        run_file.unlink()
    run_file.write_bytes(RAW[run_file])


RAW: dict[Path, bytes] = {}


@pytest.fixture(scope="module")
def histories(tmp_path_factory):
    """Six directories written by real runs: one, two and three lineages, the newest one's
    loop finished (``completed_step`` in run.json) or left early. Each: (dir, lineage ids,
    the newest lineage's newest committed step). On /dev/shm when there is one: the property
    writes run.json some thousand times, each fsynced."""
    build = tmp_path_factory.mktemp("histories")
    where = Path(tempfile.mkdtemp(prefix="kr-runjson-", dir="/dev/shm")) \
        if os.access("/dev/shm", os.W_OK) else build / "shm"
    plans = [(30, 10, True, 30), (10, 5, False, 10), (4, 2, False, 4)]
    out = []
    for done in (True, False):
        ck = build / f"chain-{done}"
        ids: list[str] = []
        for n, (total, every, resume, last) in enumerate(plans):
            run, _ = train(ck, total + (0 if done else 10), every=every, resume=resume,
                           stop_at=None if done else total)
            ids.append(run.run_id)
            dest = where / f"h{len(out)}"
            shutil.copytree(ck, dest, symlinks=True)
            out.append((dest, list(ids), last))
            RAW[dest / "run.json"] = (dest / "run.json").read_bytes()
            assert ("completed_step" in RAW[dest / "run.json"].decode()) == done
    yield out
    shutil.rmtree(where, ignore_errors=True)


def _start(ck: Path) -> identity.Plan:
    """What a resuming start decides and writes under its lease (``run/begin.py``)."""
    paths = RunPaths(ck)
    entries = layout.scan(paths)
    planned = identity.plan(paths, entries, None, resume=True)
    identity.check_same_run(paths, planned.run_id, entries, planned.recorded, planned.earlier)
    identity.record(paths, planned)
    return planned


def test_no_damage_to_run_json_resumes_another_lineage_loses_one_or_adds_a_run_id(histories):
    rng = random.Random(SEED)
    t0 = time.monotonic()
    cases = 0
    other = histories[0][0] / "run.json"
    for ck, ids, last in histories:
        run_file = ck / "run.json"
        entries = layout.scan(RunPaths(ck))
        newest_of = {rid: max(e.step for e in entries if e.committed and
                              e.manifest["run_id"] == rid) for rid in ids}
        for kind, arg in _damages(RAW[run_file], rng):
            where = f"{ck.name} ({len(ids)} lineage(s)), run.json {kind} {arg!r:.40}"
            _damage(run_file, kind, arg, other if ck != histories[0][0]
                    else histories[1][0] / "run.json")
            cases += 1
            if kind == "directory":
                before = listing(ck)
                for _ in range(2):
                    with pytest.raises(RunFileError, match="a directory"):
                        _start(ck)
                    assert listing(ck) == before, f"{where}: a refused start wrote"
                _restore(run_file)
                continue
            first = _start(ck)
            second = _start(ck)
            assert first.run_id == second.run_id == ids[-1], f"{where}: {first}, {second}"
            assert second.write is None, f"{where}: the second start rewrote run.json"
            assert set(first.earlier) == set(ids[:-1]), where
            scan = layout.scan(RunPaths(ck))
            tried = loader.lineage_candidates(scan, first.earlier)
            assert tried and tried[0].manifest["run_id"] == ids[-1] \
                and tried[0].step == last, f"{where}: resume tries {tried[:1]}"
            doomed = retention.select_for_deletion(scan, 1, 0, run_id=first.run_id,
                                                   earlier=first.earlier)
            for e in doomed:
                rid = e.manifest["run_id"]
                assert rid == ids[-1], f"{where}: retention deletes {e.path.name} of {rid}"
                assert e.step != newest_of[rid], f"{where}: deletes {rid}'s last checkpoint"
            _restore(run_file)
    assert cases > 600
    assert time.monotonic() - t0 < 30, f"{cases} cases took {time.monotonic() - t0:.1f} s"


def test_real_starts_after_seeded_damage_resume_the_newest_lineage_twice_alike(histories,
                                                                               tmp_path):
    rng = random.Random(SEED + 1)
    for n, (src, ids, last) in enumerate(histories):
        ck = tmp_path / f"h{n}"
        shutil.copytree(src, ck, symlinks=True)
        RAW[ck / "run.json"] = RAW[src / "run.json"]
        kind, arg = rng.choice([d for d in _damages(RAW[ck / "run.json"], rng)
                                if d[0] != "directory"])
        _damage(ck / "run.json", kind, arg, tmp_path / "nowhere")
        first, weight = train(ck, last + 2, every=100)
        again, _ = train(ck, last + 3, every=100)
        assert first.run_id == again.run_id == ids[-1], f"{ck.name}: {kind} {arg!r:.40}"
        assert first.start_step == last and torch.equal(weight, trained_weight(last + 2))
