"""`kempner-resilience ls` and `verify`: what is in a checkpoint directory, and is it intact."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from kempner_resilience.checkpoint import integrity, layout
from kempner_resilience.checkpoint.info import CheckpointCorrupt
from kempner_resilience.cli.common import CliError, Verb
from kempner_resilience.core.runpaths import RunPaths


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_SEARCH_DEPTH = 3


def _target(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CliError(f"{p}: no such directory (give checkpoint.dir, or one step_* directory)")
    if not p.is_dir():
        raise CliError(f"{p}: not a directory")
    return p


def _groups(p: Path) -> tuple[list[tuple[Path, list[layout.Entry]]], str]:
    """What ``p`` names: one step directory, a checkpoint root, or a directory with roots below
    it (found by a bounded search). Returns (root, entries) pairs, and, when nothing is found, a
    sentence saying where we looked."""
    if layout.parse_name(p.name) is not None:
        entry = layout.scan_one(p)
        return ([(p.parent, [entry])] if entry else []), ""
    roots, complete = layout.find_roots(p, _SEARCH_DEPTH)
    if roots:
        # Each root found is a run's directory named from outside the config.
        return [(r, layout.scan(RunPaths(r))) for r in roots], ""
    where = (f"{p}: no checkpoints (no step_* directories in it or up to {_SEARCH_DEPTH} levels "
             "below")
    if not complete:
        where += "; the search stopped early: give checkpoint.dir itself"
    return [], where + ")"


def _quick_check(entry: layout.Entry) -> None:
    """What `ls` checks without --checksums: resume's pre-load checks that read no tensor data
    (manifest, sizes, .metadata checksum)."""
    layout.validate(entry, allow_foreign_owner=True)
    manifest = entry.manifest or {}
    layout.verify_files(entry.path, manifest,
                        integrity.metadata_names(manifest) or [integrity.METADATA_NAME])


def _problem(entry: layout.Entry, full: bool, progress=None) -> str | None:
    """None when intact, else what is wrong (never raises for a problem of this checkpoint)."""
    if entry.damaged:
        return entry.problem
    try:
        if full:
            layout.verify_entry(entry, progress)
        else:
            _quick_check(entry)
    except CheckpointCorrupt as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or entry.path}: {e.strerror}"
    return None


def setup_ls(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="checkpoint directory (checkpoint.dir), one step_* directory, or "
                               f"a directory with checkpoint directories up to {_SEARCH_DEPTH} "
                               "levels below it")
    p.add_argument("--checksums", action="store_true",
                   help="re-read every file and compare checksums (slow for large checkpoints)")


def run_ls(args: argparse.Namespace) -> int:
    given = _target(args.dir)
    groups, nothing = _groups(given)
    if not groups:
        sys.stdout.write(nothing + "\n")
        return 0
    bad = 0
    for i, (root, entries) in enumerate(groups):
        if root != given and layout.parse_name(given.name) is None:
            sys.stdout.write(("\n" if i else "") + f"{root}:\n")
        bad += _ls_table(entries, args.checksums)
    if not args.checksums:
        # "ok" must not read as "intact": a flipped bit keeps every size.
        sys.stdout.write("(sizes ok: manifest, .metadata checksum and file sizes checked; the data "
                         "was not read: `--checksums` or `kempner-resilience verify` check every "
                         "byte)\n")
    if bad:
        sys.stdout.write(f"{bad} checkpoint(s) DAMAGED: resume skips them; run "
                         f"`kempner-resilience verify {given}` for a full check\n")
    return 1 if bad else 0


def _ls_table(entries: list[layout.Entry], checksums: bool) -> int:
    rows = [("step", "time", "size", "reason", "mesh", "committed", "verified", "path")]
    problems = []
    for e in reversed(entries):  # newest first
        m = e.manifest or {}
        when = (datetime.fromtimestamp(m["committed_at"]).strftime("%Y-%m-%d %H:%M:%S")
                if m.get("committed_at") else "-")
        if not e.committed and not e.damaged:
            verdict = "-"
        else:
            problem = _problem(e, checksums)
            verdict = ("checksums ok" if checksums else "sizes ok") if problem is None \
                else "DAMAGED"
            if problem is not None:
                problems.append(f"  {e.path.name}: {problem}")
        # A manifest exists only once committed (atomic rename): a damaged one was committed.
        committed = "yes" if e.committed or e.damaged else "no (partial)"
        rows.append((str(e.step), when, _size(int(m.get("nbytes", 0))) if m else "-",
                     str(m.get("reason", "-")), layout.mesh_text(m) if m else "-", committed,
                     verdict, e.path.name))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    for line in problems:
        sys.stdout.write(line + "\n")
    return len(problems)


def setup_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="one step_* directory, a checkpoint directory (checks every "
                                "committed checkpoint in it), or a directory with checkpoint "
                                f"directories up to {_SEARCH_DEPTH} levels below it")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")


def run_verify(args: argparse.Namespace) -> int:
    given = _target(args.path)
    groups, nothing = _groups(given)
    if not groups:
        raise CliError(nothing)
    tty = sys.stderr.isatty() and not args.quiet
    failed = checked = 0
    for root, entries in groups:
        if root != given and layout.parse_name(given.name) is None:
            sys.stdout.write(f"{root}:\n")
        todo = [e for e in entries if e.committed or e.damaged]
        partial = len(entries) - len(todo)
        if not todo:
            if layout.parse_name(given.name) is not None or len(groups) == 1:
                raise CliError(f"{given}: no committed checkpoint here (a step directory without "
                               f"{layout.MANIFEST_NAME} was never committed and is never resumed "
                               "from)")
        for e in todo:
            def progress(done: int, total: int, took: float, name=e.path.name) -> None:
                if tty:
                    rate = done / took / 2**30 if took > 0 else 0.0
                    sys.stderr.write(f"\r{name}: {100 * done / max(total, 1):5.1f}% of "
                                     f"{_size(total)} ({rate:.2f} GiB/s)")
                    sys.stderr.flush()
            problem = _problem(e, True, progress)
            if tty:
                sys.stderr.write("\r\033[K")
            checked += 1
            if problem is None:
                man = e.manifest or {}
                sys.stdout.write(f"OK       {e.path} (step {e.step}, mesh {layout.mesh_text(man)}, "
                                 f"{len(man['files'])} files, "
                                 f"{_size(int(man.get('nbytes', 0)))})\n")
            else:
                failed += 1
                sys.stdout.write(f"DAMAGED  {e.path}: {problem}\n")
        if partial:
            sys.stdout.write(f"         ({partial} partial step director"
                             f"{'y' if partial == 1 else 'ies'} in {root} not checked: never "
                             "committed, never resumed from)\n")
    if failed:
        sys.stdout.write(f"{failed} of {checked} checkpoint(s) DAMAGED; resume skips them and "
                         "falls back to the newest intact one\n")
    return 1 if failed else 0


VERBS = [
    Verb("ls", "list the checkpoints in a directory: step, time, size, reason, mesh, "
         "committed, verified", setup_ls, run_ls),
    Verb("verify", "re-read checkpoints and check the manifest, .metadata and every record and "
         "file against their checksums; exit 1 when anything is damaged", setup_verify,
         run_verify),
]
