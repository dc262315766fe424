"""The folder layout of the package: move the loose root modules into folders that show the layers
(docs/design.md, ## Architecture) and rewrite every reference to them by one table.

    python scripts/relayout.py            # move what is still at its old place, rewrite, report
    python scripts/relayout.py --check    # only report what would change (exit 1 if anything)

Deterministic and idempotent: a second run changes nothing. It is kept so that code written
against the old paths (another branch's NEW files, merged after the move) can be brought over
by running it again; git's rename detection carries edits to the moved files themselves.

What it rewrites, in every tracked text file (.py, .md, .toml, .yaml, .sh, .sbatch, .ipynb):
  * dotted paths: ``kempner_resilience.signals`` -> ``kempner_resilience.stop.signals``
    (imports, ``mock.patch`` targets, logger names, ``python -m``);
  * ``from kempner_resilience import signals, log as l`` -> one import per new parent;
  * file paths: ``kempner_resilience/signals.py`` -> ``kempner_resilience/stop/signals.py``;
  * in Markdown only, a bare ``signals.py`` (not after a ``/``) -> ``stop/signals.py``.
Public paths kept by a thin re-export at the old place (PUBLIC, empty today) are left as they
are in Markdown (what a user reads) and in the package's own ``__init__.py``.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "kempner_resilience"

# old module (dotted, below the package) -> new module
TABLE: dict[str, str] = {
    # core/: what every layer uses (logging, files, processes, the ledger, start-up guards)
    "log": "core.log",
    "fileio": "core.fileio",
    "procs": "core.procs",
    "faults": "core.faults",
    "ledger": "core.ledger",
    "goodput": "core.goodput",
    "startup": "core.startup",
    "version": "core.version",
    # stop/: the stop primitives the shutdown sequence is made of
    "signals": "stop.signals",
    "agreement": "stop.agreement",
    "watchdog": "stop.watchdog",
    "ctimer": "stop.ctimer",
    "backstop": "stop.backstop",
    "teardown": "stop.teardown",
    # checkpoint/: the run id lives in checkpoint.dir beside the lease
    "identity": "checkpoint.identity",
    # run/: the object a training script uses, and its set-up
    "run": "run.resilient",
    "begin": "run.begin",
    # (the old runstate.py is at home again as the runstate/ folder: no rewrite)
    "aio": "run.aio",
    # integrations/: trackers are another tool the run talks to (integrations.wandb)
    "shutdown.trackers": "integrations.trackers",
}
# Old paths users import (README, docs) that were moved: a re-export module stays at the old
# place. None today: exitcodes.py, public, stays at the package root.
PUBLIC: set[str] = set()
NEW_PACKAGES = {  # folder -> its __init__.py docstring
    "core": "What every layer uses: logging, small files written whole, processes, the run "
            "ledger, the start-up guards.",
    "stop": "The stop primitives the shutdown sequence is made of: signals, the stop agreement, "
            "watchdogs and their GIL-free backstops, bounded teardown.",
    "run": "The run a training script holds: ResilientRun, its set-up sequence, its state.",
}
EXTS = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".sbatch", ".ipynb", ".txt", ".cfg"}


def _path(mod: str) -> str:
    return f"{PKG}/{mod.replace('.', '/')}.py"


def _subs_of(folder: str) -> list[str]:
    """The new modules' last parts in ``folder`` (for an old module named like that folder)."""
    return sorted(n.split(".")[-1] for n in TABLE.values() if n.startswith(folder + "."))


def _dotted_rules(md: bool) -> list[tuple[re.Pattern[str], str]]:
    rules = []
    for old, new in sorted(TABLE.items(), key=lambda kv: -len(kv[0])):
        if md and old in PUBLIC:
            continue
        guard = ""
        if old in {n.split(".")[0] for n in TABLE.values()}:  # 'run' is also a new folder
            subs = "|".join(_subs_of(old))
            guard = rf"(?!\.(?:{subs})\b)(?!\s+import\s+(?:{subs})\b)"
        pat = re.compile(rf"(?<![\w.]){PKG}\.{re.escape(old)}(?!\w){guard}")
        rules.append((pat, f"{PKG}.{new}"))
        rules.append((re.compile(rf"(?<![\w/]){re.escape(_path(old))}"), _path(new)))
    return rules


FROM_PKG = re.compile(rf"^([ \t]*)from {PKG} import ([\w ,]+?)([ \t]*#.*)?$", re.M)


def _split_from_imports(text: str, keep: set[str]) -> str:
    """``from kempner_resilience import a, b as c`` with moved names: one line per parent."""
    def repl(m: re.Match[str]) -> str:
        indent, names, comment = m.group(1), m.group(2), m.group(3) or ""
        groups: dict[str, list[str]] = {}
        for item in (s.strip() for s in names.split(",")):
            name, _, alias = item.partition(" as ")
            name, alias = name.strip(), alias.strip()
            if name in TABLE and name not in keep:
                parent, _, last = f"{PKG}.{TABLE[name]}".rpartition(".")
                groups.setdefault(parent, []).append(
                    f"{last} as {alias or name}" if (alias or name) != last else last)
            else:
                groups.setdefault(PKG, []).append(item)
        if list(groups) == [PKG]:
            return m.group(0)
        return "\n".join(f"{indent}from {parent} import {', '.join(items)}"
                         + (comment if i == 0 else "")
                         for i, (parent, items) in enumerate(groups.items()))
    return FROM_PKG.sub(repl, text)


def _bare_md_rules() -> list[tuple[re.Pattern[str], str]]:
    rules = []
    for old, new in TABLE.items():
        if old in PUBLIC:  # the old file is still there: the public re-export
            continue
        if "." in old:
            rules.append((re.compile(rf"(?<![\w/.]){re.escape(old.replace('.', '/'))}\.py\b"),
                          new.replace(".", "/") + ".py"))
        else:
            rules.append((re.compile(rf"(?<![\w/.-]){re.escape(old)}\.py\b"),
                          new.replace(".", "/") + ".py"))
    return rules


def rewrite(text: str, rel: str) -> str:
    md = rel.endswith(".md") or rel.endswith(".ipynb")
    for pat, new in _dotted_rules(md):
        text = pat.sub(new, text)
    keep = PUBLIC if rel == f"{PKG}/__init__.py" or md else set()
    text = _split_from_imports(text, keep)
    if rel.endswith(".md"):
        for pat, new in _bare_md_rules():
            text = pat.sub(new, text)
    return text


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout


def move(check: bool) -> list[str]:
    done = []
    for folder in NEW_PACKAGES:
        if not (ROOT / PKG / folder / "__init__.py").exists():
            done.append(f"create {PKG}/{folder}/__init__.py")
    for old, new in TABLE.items():
        src, dst = ROOT / _path(old), ROOT / _path(new)
        if src.exists() and not dst.exists():
            done.append(f"git mv {_path(old)} {_path(new)}")
            if not check:
                dst.parent.mkdir(parents=True, exist_ok=True)
                _git("mv", _path(old), _path(new))
    if not check:
        for folder, doc in NEW_PACKAGES.items():
            init = ROOT / PKG / folder / "__init__.py"
            if not init.exists():
                init.write_text('"""' + textwrap.fill(doc, 96, break_on_hyphens=False) + '"""\n')
                _git("add", str(init.relative_to(ROOT)))
        for old in PUBLIC:  # a thin re-export keeps a moved public path importable
            shim = ROOT / _path(old)
            if not shim.exists():
                shim.write_text(f"from {PKG}.{TABLE[old]} import *  # noqa: F401,F403\n")
                _git("add", _path(old))
                done.append(f"create {_path(old)} (re-export of {PKG}.{TABLE[old]})")
    return done


def main(argv: list[str]) -> int:
    check = "--check" in argv
    changes = move(check)
    for line in changes:
        print(line)
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    shims = {_path(p) for p in PUBLIC}
    for rel in sorted(_git("ls-files").splitlines() + _git(
            "ls-files", "--others", "--exclude-standard").splitlines()):
        p = ROOT / rel
        if rel == me or rel in shims or p.suffix not in EXTS or not p.is_file():
            continue
        text = p.read_text()
        new = rewrite(text, rel)
        if new != text:
            n = sum(a != b for a, b in zip(text.splitlines(), new.splitlines())) or 1
            print(f"rewrite {rel} ({n} line{'s' if n > 1 else ''})")
            changes.append(rel)
            if not check:
                p.write_text(new)
    if not changes:
        print("nothing to do: the layout is in place")
    return 1 if check and changes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
