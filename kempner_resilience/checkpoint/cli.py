"""`kempner-resilience ls` and `verify`: what is in a checkpoint directory, and is it intact."""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from datetime import datetime
from pathlib import Path

from kempner_resilience.checkpoint import layout
from kempner_resilience.checkpoint.info import CheckpointCorrupt
from kempner_resilience.cli import CliError, register

_CHUNK = 16 << 20


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _root(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CliError(f"{p}: no such directory (give checkpoint.dir, or one step_* directory)")
    if not p.is_dir():
        raise CliError(f"{p}: not a directory")
    return p


def _entries(p: Path) -> list[layout.Entry]:
    """``p`` is a checkpoint root, or one step directory."""
    if layout.parse_name(p.name) is not None:
        return [e for e in layout.scan(p.parent) if e.path.name == p.name]
    return layout.scan(p)


def _check(entry: layout.Entry, checksums: bool, progress=None) -> str | None:
    """None when intact, else what is wrong."""
    try:
        layout.validate(entry, allow_foreign_owner=True)
        if checksums:
            _verify_crcs(entry, progress)
    except CheckpointCorrupt as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or entry.path}: {e.strerror}"
    return None


def _verify_crcs(entry: layout.Entry, progress=None) -> None:
    files = entry.manifest["files"]  # type: ignore[index]
    total = sum(int(m.get("size", 0)) for m in files.values())
    done, t0 = 0, time.monotonic()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for name, meta in sorted(files.items()):
        crc = 0
        with open(entry.path / name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
                done += n
                if progress:
                    progress(done, total, time.monotonic() - t0)
        if crc != meta["crc32"]:
            raise CheckpointCorrupt(f"{entry.path / name}: checksum mismatch (file damaged)")


def setup_ls(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="checkpoint directory (checkpoint.dir)")
    p.add_argument("--checksums", action="store_true",
                   help="re-read every file and compare checksums (slow for large checkpoints)")


def run_ls(args: argparse.Namespace) -> int:
    root = _root(args.dir)
    entries = _entries(root)
    if not entries:
        sys.stdout.write(f"{root}: no checkpoints\n")
        return 0
    rows = [("step", "time", "size", "reason", "committed", "verified", "path")]
    bad = 0
    for e in reversed(entries):  # newest first
        m = e.manifest or {}
        when = (datetime.fromtimestamp(m["committed_at"]).strftime("%Y-%m-%d %H:%M:%S")
                if m.get("committed_at") else "-")
        if not e.committed:
            verdict = "-"
        else:
            problem = _check(e, args.checksums)
            verdict = ("checksums ok" if args.checksums else "sizes ok") if problem is None \
                else "BAD"
            bad += problem is not None
        rows.append((str(e.step), when, _size(int(m.get("nbytes", 0))) if m else "-",
                     str(m.get("reason", "-")), "yes" if e.committed else "no (partial)",
                     verdict, e.path.name))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    if bad:
        sys.stdout.write(f"{bad} committed checkpoint(s) failed verification: run "
                         f"`kempner-resilience verify {root}` for details\n")
    return 1 if bad else 0


def setup_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="one step_* directory, or a checkpoint directory (checks every "
                                "committed checkpoint in it)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")


def run_verify(args: argparse.Namespace) -> int:
    root = _root(args.path)
    entries = [e for e in _entries(root) if e.committed]
    if not entries:
        raise CliError(f"{root}: no committed checkpoint here (a step directory without "
                       f"{layout.MANIFEST_NAME} was never committed and is never resumed from)")
    tty = sys.stderr.isatty() and not args.quiet
    failed = 0
    for e in entries:
        def progress(done: int, total: int, took: float, name=e.path.name) -> None:
            if tty:
                rate = done / took / 2**30 if took > 0 else 0.0
                sys.stderr.write(f"\r{name}: {100 * done / max(total, 1):5.1f}% of "
                                 f"{_size(total)} ({rate:.2f} GiB/s)")
                sys.stderr.flush()
        problem = _check(e, True, progress)
        if tty:
            sys.stderr.write("\r\033[K")
        if problem is None:
            sys.stdout.write(f"OK   {e.path} (step {e.step}, {len(e.manifest['files'])} files, "
                             f"{_size(int(e.manifest.get('nbytes', 0)))})\n")
        else:
            failed += 1
            sys.stdout.write(f"BAD  {e.path}: {problem}\n")
    if failed:
        sys.stdout.write(f"{failed} of {len(entries)} checkpoint(s) damaged; resume skips them "
                         "and falls back to the newest intact one\n")
    return 1 if failed else 0


register("ls", "list the checkpoints in a directory: step, time, size, reason, committed, "
         "verified", setup_ls, run_ls)
register("verify", "re-read a checkpoint and check every file against its checksums; non-zero "
         "exit when anything is wrong", setup_verify, run_verify)
