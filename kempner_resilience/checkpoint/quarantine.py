"""Setting a damaged checkpoint aside: renamed, kept for inspection, never counted again.

A committed checkpoint whose bytes prove it damaged at resume (``CheckpointDamaged``: a checksum
that does not match, a truncated or missing file) would otherwise stay the "newest committed"
one: every later resume tries it first, and retention keeps it as the newest and deletes the good
ones below it (``keep_last`` counts it). Rank 0 renames it to
``.damaged-step_000000030-<why>``: the name no longer matches the step pattern, so neither
``scan`` (so ``ls``), resume, retention nor ``clean_trash`` ever sees it again, and it is left on
disk for the user to inspect and delete. A ``DAMAGED.txt`` in it says why.

A run whose every checkpoint was set aside does not start fresh at step 0 on its own: resume
refuses (``refusal``, exit 78), and so does every later launch while set-aside checkpoints of
its lineage are here (``entries``). ``checkpoint.resume: false`` starts a new lineage on
purpose; the set-aside ones then belong to an earlier lineage, and stay on disk.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from kempner_resilience.checkpoint import layout
from kempner_resilience.checkpoint.info import CheckpointCorrupt, LineageDamagedError
from kempner_resilience.core.fileio import fsync_dir
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["NOTE_NAME", "entries", "refusal", "set_aside", "what_is_wrong", "why_word"]

log = get_logger(__name__)

NOTE_NAME = "DAMAGED.txt"

# The first pattern found in the failure names the directory: short, and enough to tell a flipped
# byte from a cut-off file at a glance (the full text is in DAMAGED.txt and the log).
_WORDS = (("checksum mismatch", "checksum"), ("truncated", "truncated"),
          ("ends early", "truncated"), ("manifest says", "size"), ("longer than", "size"),
          ("missing", "missing-file"))


def why_word(why: str) -> str:
    """One word for the directory name: what the failure says is wrong."""
    for pattern, word in _WORDS:
        if pattern in why:
            return word
    return "damaged"


def what_is_wrong(why: str) -> str:
    """What a failure's text says is wrong with a checkpoint, in the user's words."""
    if why_word(why) == "missing-file":
        return "a file it was committed with is gone"
    return "its shards no longer match their checksums"


def _changed_after_commit(path: Path) -> str:
    """A clause naming the files modified after the commit, when the manifest lists any (a
    plain ``dcp.save`` into the step directory: torch's FileSystemWriter overwrites in place
    by default); "" when none was, or it cannot be told. The manifest is written last, so its
    mtime is the commit's on the filesystem's own clock: no two hosts' clocks are compared."""
    try:
        man = layout.read_manifest(path)
        committed = os.stat(path / layout.MANIFEST_NAME).st_mtime_ns
        changed = []
        for name in man["files"]:
            with contextlib.suppress(OSError):
                if os.stat(path / name).st_mtime_ns > committed:
                    changed.append(name)
    except Exception:  # noqa: BLE001 - only a hint: a manifest that cannot be read gives none
        return ""
    if not changed:
        return ""
    return (f"; {', '.join(sorted(changed)[:3])}{' ...' if len(changed) > 3 else ''} "
            "modified after its commit: something wrote into the committed step directory (a "
            "plain dcp.save with torch's FileSystemWriter overwrites it in place)")


def set_aside(path: Path, why: str) -> Path | None:
    """Rename the damaged checkpoint ``path`` aside (rank 0) and log it in one line: which
    step, what is wrong, where it went. Its new path, or None when it could not be renamed
    (then it stays where it is: resume already skips it, and the run protects it from its own
    retention)."""
    changed = _changed_after_commit(path)
    parsed = RunPaths.parse_step_name(path.name)
    step = f"step {parsed[0]}" if parsed else path.name
    word, n = why_word(why), 0
    target = path.parent / RunPaths.damaged_name(path.name, word)
    while os.path.lexists(target):          # the same step damaged twice: keep both
        n += 1
        target = path.parent / RunPaths.damaged_name(path.name, word, n)
    try:
        os.rename(path, target)
        fsync_dir(path.parent)
    except OSError as e:
        log.warning("cannot set the damaged checkpoint %s aside (%s); it stays, and resume "
                    "keeps skipping it", path, e.strerror or e)
        return None
    with contextlib.suppress(OSError):      # a note for whoever looks; its absence is harmless
        (target / NOTE_NAME).write_text(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}: resume found {path.name} damaged and set "
            f"it aside:\n{why}\n")
    log.warning("checkpoint %s (%s) is damaged: %s (%s)%s; set it aside as %s (kept for "
                "inspection, never resumed from or counted by retention again; delete it when "
                "done)", step, path, what_is_wrong(why), why, changed, target)
    return target


def entries(paths: RunPaths) -> list[layout.Entry]:
    """The checkpoints set aside in the run's directory, oldest first, each as the Entry of
    the step it was: committed (it was, when set aside), its manifest when that still
    parses, so ``identity.recorded_run_id`` tells its lineage (else its ownership marker)."""
    out = []
    for p in paths.set_aside():
        parsed = RunPaths.parse_step_name(RunPaths.parse_damaged_name(p.name) or "")
        if parsed is None or not p.is_dir():
            continue
        try:
            man = layout.read_manifest(p)
        except (CheckpointCorrupt, OSError):    # no manifest now, or one that does not parse
            man = {}                # set aside once committed: still counted as committed
        out.append(layout.Entry(p, parsed[0], parsed[1], man))
    out.sort(key=layout.Entry.sort_key)
    return out


def refusal(paths: RunPaths, now: list[tuple[Path, Path | None, str]], before: list[Path],
            renamed: bool = True) -> LineageDamagedError:
    """The error a resume raises when no checkpoint of the run's lineage is left intact:
    ``now`` the damaged ones this resume found (where each was, where it went or None, why),
    ``before`` those earlier launches set aside. It names them and the ways on. ``renamed``:
    this process set ``now`` aside (rank 0); another rank names them as they were."""
    where = [(t or p) for p, t, _ in now] + list(before)
    items = [(f"{p.name} set aside as {t}" if t is not None else
              f"{p} (could not be set aside)") if renamed else f"{p} (set aside by rank 0)"
             for p, t, _ in now] + [f"{p} (set aside earlier)" for p in before]
    shown = "; ".join(items[:6]) + (f"; and {len(items) - 6} more" if len(items) > 6 else "")
    wrong = sorted({what_is_wrong(why) for _, _, why in now}) or \
        ["its shards no longer match their checksums"]
    return LineageDamagedError(
        f"no checkpoint of this run in {paths} could be loaded: every one was found damaged "
        f"({' or '.join(wrong)}): {shown}. The run does not start again at step 0 on its own, "
        "which would quietly drop the training they held. To start a new lineage on purpose, "
        "launch once with checkpoint.resume: false (--set checkpoint.resume=false); the "
        "set-aside directories stay on disk for inspection (delete them when done)", where)
