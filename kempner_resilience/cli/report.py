"""`kempner-resilience report DIR`: a run's attempts and its goodput, from ``ledger.jsonl``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from kempner_resilience.checkpoint import layout
from kempner_resilience.cli.common import CliError, Verb
from kempner_resilience.core.goodput import PARTS, RECOVERY, Attempt, Goodput, analyze
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.core.runpaths import RunPaths

_LEDGER = RunPaths(Path(".")).ledger.name     # the ledger's file name, for help texts

_LABELS = {"startup": "start-up", "load": "checkpoint load",
           "save_blocking": "periodic-save blocking", "kept": "steps kept (goodput)",
           "lost": "steps lost (redone)", "shutdown": "emergency save + shutdown",
           "queue": "between attempts (queue)",
           "in_job": "relaunch gaps (in the job)"}
_RECOVERY_LABELS = {"detection": "detection", "rescue": "rescue", "relaunch": "relaunch",
                    "startup": "start-up", "load": "load"}


def _hms(s: float) -> str:
    s = max(s, 0.0)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _when(t: float) -> str:
    # read_ledger bounds every time (years 1970-5138): strftime of any of them works.
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _exit(a: "Attempt") -> str:
    if not a.crashed:
        return f"{a.exit_code} {a.ending or ''}".strip()
    # No exit event: killed, or its node lost. A survivor's rescue may still have kept a step.
    return "killed?" if a.rescue_step is None else f"killed? rescue@{a.rescue_step} kept"


def render(g: Goodput) -> str:
    rows = [("#", "job", "started", "wall", "steps", "kept", "saves", "stop", "exit")]
    for a in g.attempts:
        stop = "-" if a.stop_signal is None else f"{a.stop_signal}@{a.stop_step}"
        saves = str(a.saves) + (f" ({a.failed_saves} failed)" if a.failed_saves else "")
        rows.append((_name(a),
                     str(a.job_id or "-"), _when(a.t0), _hms(a.wall_s),
                     f"{a.start_step}-{a.last_step}", str(a.kept_steps), saves, stop, _exit(a)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [f"run {g.run_id or '?'}: {len(g.attempts)} attempt(s)"]
    if g.other_runs:
        out.append(f"the ledger mixes {len(g.other_runs) + 1} runs; this is the newest (or the "
                   "one asked for with --run); the others: " + ", ".join(
                       f"{r} ({n} events)" for r, n in g.other_runs.items()))
    out.append("")
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    failed = [(a, f) for a in g.attempts for f in a.failures]
    if failed:
        out += ["", "failed periodic saves (training went on):"]
        out += [f"  attempt {a.restart_count if a.restart_count is not None else a.index}, "
                f"{f[:200]}" for a, f in failed]
    out += _recoveries(g)
    out += ["", f"goodput {100 * g.goodput:.1f}% of {_hms(g.allocated_s)} allocated "
                f"({100 * g.wall_goodput:.1f}% of {_hms(g.wall_s)} wall, queue included)"]
    for p in (*PARTS, "queue", *(("in_job",) if g.parts.get("in_job") else ())):
        v = g.parts[p]
        share = 100 * v / g.wall_s if g.wall_s > 0 else 0.0
        out.append(f"  {_LABELS[p]:<27} {_hms(v):>10}  {share:5.1f}%")
    return "\n".join(out) + "\n"


def _name(a: Attempt) -> str:
    """'2' for the job's third launch, '2+1' for its first in-job restart after that."""
    base = str(a.restart_count if a.restart_count is not None else a.index)
    return f"{base}+{a.relaunch}" if a.relaunch else base


def _recoveries(g: Goodput) -> list[str]:
    """Each in-job restart: what failed, what is kept out, and where its recovery went."""
    out: list[str] = []
    for i, a in enumerate(g.attempts):
        r = a.restart
        if r is None:
            continue
        if not out:
            out += ["", "in-job restarts (same job, no requeue): the failure to the first step"]
        rec = a.recovery
        what = [r.get("reason") or "?"]
        bad = r.get("bad_nodes")
        if bad:
            what.append("kept out: " + (bad if isinstance(bad, str) else ",".join(bad)))
        what.append(f"spare: {r['spare']}" if r.get("spare") else "no spare")
        if r.get("step") is not None:
            # The survivors' rescue or the periodic save: a user weighs the steps redone.
            kept = any(b.rescue_step == r["step"] for b in g.attempts[:i + 1])
            what.append(f"resumed at step {r['step']}" + (" (the survivors' rescue)" if kept
                                                           else ""))
        out.append(f"  {_name(a)}: " + "; ".join(what))
        out.append(f"    {_hms(sum(rec.values()))} = " + " + ".join(
            f"{_RECOVERY_LABELS[k]} {_hms(rec[k])}" for k in RECOVERY))
    return out


def setup_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help=f"checkpoint directory (checkpoint.dir, holding {_LEDGER}), "
                               "the ledger file, or a work directory with the checkpoint "
                               "directory up to 3 levels below it (as for `ls`)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the timeline of the attempts into FILE.png (needs matplotlib:"
                        " pip install 'kempner_resilience[plot]'; exit 2 without it). The "
                        "suffix picks the format (.png, .pdf, .svg, ...); none: .png; a "
                        "directory: DIR/goodput-timeline.png")
    p.add_argument("--run", metavar="RUN_ID", help="a ledger holding several runs: report this "
                   "one (default: the newest)")


def _find_ledger(target: Path) -> Path:
    """The ledger ``target`` names, resolved as ``ls`` resolves its directory: the ledger file
    itself, ``checkpoint.dir``, one of its step directories, or a work directory with one
    checkpoint directory up to 3 levels below it (``layout.find_roots``, ``ls``'s search)."""
    if not target.is_dir():
        return target
    here = RunPaths(target).ledger
    if here.exists():
        return here
    if layout.parse_name(target.name) is not None:        # a step directory: its run's
        return RunPaths(target.parent).ledger
    roots, _ = layout.find_roots(target)
    found = [RunPaths(r).ledger for r in roots if RunPaths(r).ledger.exists()]
    if len(found) > 1:
        raise CliError(f"{target}: {len(found)} runs below it; give one of them: "
                       + ", ".join(str(f.parent) for f in found), 2)
    if not found:
        raise CliError(f"{target}: no run ledger here or in a checkpoint directory below it "
                       f"(ResilientRun writes {_LEDGER} into checkpoint.dir when the run has "
                       "checkpoint state)")
    return found[0]


def run_report(args: argparse.Namespace) -> int:
    ledger = _find_ledger(Path(args.dir))
    if not ledger.exists():
        raise CliError(f"{ledger}: no run ledger here (ResilientRun writes {_LEDGER} into "
                       "checkpoint.dir when the run has checkpoint state)")
    plot = _plot_path(args.plot) if args.plot else None     # before any output
    try:
        events = read_ledger(ledger)
    except OSError as e:
        raise CliError(f"{ledger}: cannot read the run ledger: {e.strerror or e}") from None
    try:
        g = analyze(events, args.run)
    except Exception as e:  # noqa: BLE001 - a ledger never gets a traceback
        raise CliError(f"{ledger}: cannot analyse the run ledger ({type(e).__name__}: {e}); "
                       "please report this with the ledger file") from None
    if not g.attempts:
        raise CliError(f"{ledger}: no events in the ledger" + (
            f" for run {args.run} (runs in it: {', '.join(g.other_runs)})" if args.run else ""))
    try:
        text = json.dumps(g.to_dict(), indent=2) + "\n" if args.json else render(g)
    except Exception as e:  # noqa: BLE001
        raise CliError(f"{ledger}: cannot render the report ({type(e).__name__}: {e}); please "
                       "report this with the ledger file") from None
    sys.stdout.write(text)
    if plot is not None:
        from kempner_resilience.cli.plot import plot_timeline

        try:
            plot_timeline(g, events, plot)
        except OSError as e:
            raise CliError(f"cannot write the plot {plot}: {e.strerror or e}") from None
        except Exception as e:  # noqa: BLE001 - a ledger never gets a traceback
            raise CliError(f"cannot draw the plot {plot} ({type(e).__name__}: {e})") from None
        sys.stderr.write(f"wrote the timeline to {plot}\n")
    return 0


def _plot_path(arg: str) -> Path:
    """The file ``--plot ARG`` writes: a directory gets ``goodput-timeline.png`` inside, a name
    without a suffix ``.png`` (as matplotlib would, silently); an unknown suffix is refused
    (exit 2) before anything is printed. Exit 2 when matplotlib is not installed."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        from kempner_resilience.cli.plot import MISSING_MATPLOTLIB

        raise CliError(MISSING_MATPLOTLIB, 2) from None
    from kempner_resilience.cli.plot import supported_formats

    path = Path(arg)
    if path.is_dir():
        return path / "goodput-timeline.png"
    suffix = path.suffix.lower().lstrip(".")
    if not suffix:
        return path.with_name(path.name + ".png")
    formats = supported_formats()
    if suffix not in formats:
        raise CliError(f"--plot {arg}: matplotlib cannot write .{suffix} files; use one of "
                       f"{', '.join('.' + f for f in sorted(formats))}", 2)
    return path


VERBS = [Verb("report", "a run's attempts across requeues and its goodput (share of the "
              "allocated time spent on steps that were kept), from checkpoint.dir/ledger.jsonl",
              setup_report, run_report)]
