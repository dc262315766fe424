"""Property: whatever happens to a checkpoint directory, retention never loses a lineage.

Thousands of seeded random histories of one ``checkpoint.dir``: saves, saves cut short by a
crash, crashes, resumes, fresh starts (``checkpoint.resume: false``), checkpoints damaged in
their data or their manifest, a damaged checkpoint that cannot be renamed aside, an attempt whose
config keeps fewer or more checkpoints than the last. The decisions
are the package's own, pure ones: which checkpoints resume tries and in which order
(``loader.lineage_candidates``), which lineage a fresh start begins and what it leaves behind
(``identity.plan_lineage`` / ``record_lineage`` on a real ``run.json``), and what retention
deletes after each commit (``retention.plan_deletions``, with the protections the saver adds).
The directory itself is simulated with ``layout.Entry`` objects, so a history costs well under a
millisecond.

After every step of every history:
- no lineage that held an intact checkpoint lost its last one, except by damage itself;
- retention deleted only checkpoints of the lineage of the run that ran it;
- a resume continued the newest lineage (``run.json``'s), from its newest intact checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kempner_resilience.checkpoint import identity, layout, loader, retention
from kempner_resilience.core.runpaths import RunPaths

CASES = 3000


@pytest.fixture
def run_dirs(tmp_path):
    """Where the histories' ``run.json`` files live: in memory when /dev/shm exists (each fresh
    start fsyncs its ``run.json``; on a busy disk that alone takes most of a minute)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        where = Path(tempfile.mkdtemp(prefix="kr-retention-", dir="/dev/shm"))
        yield where
        shutil.rmtree(where, ignore_errors=True)
    else:
        yield tmp_path


@dataclass
class Process:
    """One attempt of the run, as far as retention and resume see it."""

    run_id: str
    step: int
    earlier: frozenset[str | None]
    resumed_from: Path | None = None
    unloadable: set[Path] = field(default_factory=set)
    own_commit: bool = False


@dataclass
class Directory:
    """A simulated ``checkpoint.dir``: its step directories (with the run id each marker
    records and whether its bytes are damaged) and a real ``run.json`` in ``root``."""

    root: Path
    entries: dict[Path, layout.Entry] = field(default_factory=dict)
    run_of: dict[Path, str | None] = field(default_factory=dict)
    bad_bytes: set[Path] = field(default_factory=set)
    clock: float = 0.0

    def scan(self) -> list[layout.Entry]:
        return sorted(self.entries.values(), key=layout.Entry.sort_key)

    def intact(self, run_id: str | None) -> list[layout.Entry]:
        return [e for e in self.scan() if e.committed and e.path not in self.bad_bytes
                and self.run_of[e.path] == run_id]

    def add(self, step: int, run_id: str, committed: bool) -> layout.Entry:
        attempt = 0
        while self.root / layout.dir_name(step, attempt) in self.entries:
            attempt += 1
        path = self.root / layout.dir_name(step, attempt)
        self.clock += 1.0
        manifest = {"step": step, "run_id": run_id, "committed_at": self.clock} \
            if committed else None
        entry = layout.Entry(path, step, attempt, manifest)
        self.entries[path] = entry
        self.run_of[path] = run_id
        return entry


class History:
    """One seeded history; ``step`` applies one random event and checks the properties."""

    def __init__(self, seed: int, root: Path) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.keep_last = self.rng.choice([1, 1, 2, 3])
        self.keep_every = self.rng.choice([0, 0, 0, 4])
        self.rename_fails = self.rng.choice([0.0, 0.2, 0.6, 1.0])   # setting aside can fail
        self.d = Directory(root)
        self.proc: Process | None = None
        self.log: list[str] = []

    def fail(self, what: str) -> None:
        raise AssertionError(f"seed {self.seed} (now keep_last={self.keep_last}, keep_every="
                             f"{self.keep_every}): {what}\nhistory: {'; '.join(self.log)}")

    # ---------------------------------------------------------------------------- events

    def start(self, resume: bool) -> None:
        d = self.d
        if self.rng.random() < 0.5:             # the next attempt's config keeps fewer or more
            self.keep_last = self.rng.choice([1, 1, 2, 3])
        if not resume:
            rid, data = identity.plan_lineage(RunPaths(d.root), d.scan(), None)
            identity.record_lineage(RunPaths(d.root), rid, data)
            self.proc = Process(rid, 0, identity.earlier_runs(RunPaths(d.root)))
            return
        rid, _ = identity.load_or_create(RunPaths(d.root))
        earlier = identity.earlier_runs(RunPaths(d.root))
        proc = Process(rid, 0, earlier)
        tried = loader.lineage_candidates(d.scan(), earlier, run_of=lambda e: d.run_of[e.path])
        for e in tried:
            if e.damaged or e.path in d.bad_bytes:
                # Bytes proven damaged are set aside (unless the rename fails); a manifest that
                # does not parse is not proof (a transient read error looks the same).
                if e.committed and self.rng.random() >= self.rename_fails:
                    del d.entries[e.path]          # renamed: its name is free again
                    d.bad_bytes.discard(e.path)
                else:
                    proc.unloadable.add(e.path)
                continue
            proc.step, proc.resumed_from = e.step, e.path
            newer = [x for x in d.intact(rid) if x.sort_key() > e.sort_key()]
            if newer:
                self.fail(f"resumed from {e.path.name}, but {newer[0].path.name} of run {rid} "
                          "is newer and intact")
            break
        else:
            if tried:        # checkpoints, none loads: the start fails (exit 1), nothing runs
                self.proc = None
                return
        self.proc = proc

    def save(self) -> None:
        d, p = self.d, self.proc
        assert p is not None
        p.step += self.rng.randint(0, 4)       # 0: an emergency save at the step just saved
        d.add(p.step, p.run_id, committed=True)
        p.own_commit = True
        protect = set(p.unloadable)
        if p.resumed_from is not None and not p.own_commit:
            protect.add(p.resumed_from)
        victims = retention.plan_deletions(d.scan(), self.keep_last, self.keep_every, protect,
                                           run_id=p.run_id, earlier=p.earlier,
                                           run_of=lambda e: d.run_of[e.path])
        for e in victims:
            if d.run_of[e.path] != p.run_id:
                self.fail(f"run {p.run_id}'s retention deleted {e.path.name} of run "
                          f"{d.run_of[e.path]}")
            del d.entries[e.path]
            d.bad_bytes.discard(e.path)

    def damage(self) -> None:
        d = self.d
        committed = [e for e in d.scan() if e.committed]
        if not committed:
            return
        # The newest is the one that matters most (resume tries it first): hit it half the time.
        e = committed[-1] if self.rng.random() < 0.5 else self.rng.choice(committed)
        if self.rng.random() < 0.7:
            d.bad_bytes.add(e.path)            # a flipped byte, a cut-off shard
        else:                                  # MANIFEST.json unreadable: Entry.damaged
            d.entries[e.path] = layout.Entry(e.path, e.step, e.attempt, None, "unreadable")

    def step(self) -> None:
        lineages = set(self.d.run_of.values())
        before = {r for r in lineages if self.d.intact(r)}
        if self.proc is None:
            event = self.rng.choice(["resume", "resume", "resume", "fresh", "damage", "damage"])
        else:
            event = self.rng.choice(["save"] * 6 + ["partial", "crash", "damage"])
        self.log.append(event)
        if event == "resume":
            self.start(resume=True)
        elif event == "fresh":
            self.start(resume=False)
        elif event == "save":
            self.save()
        elif event == "partial":              # killed while writing: a directory, no manifest
            assert self.proc is not None
            self.d.add(self.proc.step + 1, self.proc.run_id, committed=False)
            self.proc = None
        elif event == "crash":
            self.proc = None
        else:
            self.damage()
            return                              # damage may destroy the last intact one itself
        lost = sorted(r for r in before if not self.d.intact(r))
        if lost:
            self.fail(f"{event} left run(s) {lost} with no intact checkpoint")


def test_no_history_of_saves_crashes_resumes_fresh_starts_and_damage_loses_a_lineage(
        run_dirs):
    t0 = time.monotonic()
    events = 0
    for seed in range(CASES):
        root = run_dirs / f"c{seed}"
        root.mkdir()
        history = History(seed, root)
        for _ in range(history.rng.randint(5, 40)):
            history.step()
            events += 1
    # The point of testing the pure decisions: thousands of histories in seconds.
    assert time.monotonic() - t0 < 60, f"{CASES} histories took {time.monotonic() - t0:.1f} s"
    assert events > CASES * 10


def _failing_histories(where: Path, n: int = 300) -> int:
    failures = 0
    for seed in range(n):
        root = where / f"c{seed}"
        root.mkdir()
        history = History(seed, root)
        try:
            for _ in range(history.rng.randint(5, 40)):
                history.step()
        except AssertionError:
            failures += 1
    return failures


def test_the_property_catches_retention_that_counts_across_lineages(run_dirs, monkeypatch):
    """The check itself catches issue 28 item 2: retention counting every lineage's
    checkpoints by step number."""
    real = retention.plan_deletions

    def by_step_across_lineages(entries, keep_last, keep_every, protect=(), **kw):
        return real(entries, keep_last, keep_every, protect, run_id=None,
                    run_of=lambda e: None)

    monkeypatch.setattr(retention, "plan_deletions", by_step_across_lineages)
    assert _failing_histories(run_dirs) > 0


def test_the_property_catches_retention_that_counts_a_checkpoint_resume_could_not_load(
        run_dirs, monkeypatch):
    """The check itself catches issue 28 item 1: a damaged checkpoint left in place counted as
    the newest, pushing the good ones out (rarer: it takes a damaged newest checkpoint that
    cannot be renamed, an older intact one, and a later attempt keeping fewer)."""
    real = retention.plan_deletions

    def unprotected(entries, keep_last, keep_every, protect=(), **kw):
        return real(entries, keep_last, keep_every, (), **kw)

    monkeypatch.setattr(retention, "plan_deletions", unprotected)
    assert _failing_histories(run_dirs, CASES) > 0
