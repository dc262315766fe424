"""`kempner-resilience report DIR`: a run's attempts and its goodput, from ``ledger.jsonl``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from datetime import datetime
from pathlib import Path

from kempner_resilience.cli.common import CliError, Verb
from kempner_resilience.goodput import PARTS, Goodput, analyze
from kempner_resilience.ledger import LEDGER_NAME, read_ledger

_LABELS = {"startup": "start-up", "load": "checkpoint load",
           "save_blocking": "periodic-save blocking", "kept": "steps kept (goodput)",
           "lost": "steps lost (redone)", "shutdown": "emergency save + shutdown",
           "queue": "between attempts (queue)"}


def _hms(s: float) -> str:
    s = max(s, 0.0)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def render(g: Goodput) -> str:
    rows = [("#", "job", "started", "wall", "steps", "kept", "saves", "stop", "exit")]
    for a in g.attempts:
        stop = "-" if a.stop_signal is None else f"{a.stop_signal}@{a.stop_step}"
        code = "killed?" if a.crashed else f"{a.exit_code} {a.ending or ''}".strip()
        rows.append((str(a.restart_count if a.restart_count is not None else a.index),
                     str(a.job_id or "-"),
                     datetime.fromtimestamp(a.t0).strftime("%Y-%m-%d %H:%M:%S"),
                     _hms(a.wall_s), f"{a.start_step}-{a.last_step}", str(a.kept_steps),
                     str(a.saves), stop, code))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [f"run {g.run_id or '?'}: {len(g.attempts)} attempt(s)", ""]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out += ["", f"goodput {100 * g.goodput:.1f}% of {_hms(g.allocated_s)} allocated "
                f"({100 * g.wall_goodput:.1f}% of {_hms(g.wall_s)} wall, queue included)"]
    for p in (*PARTS, "queue"):
        v = g.parts[p]
        share = 100 * v / g.wall_s if g.wall_s > 0 else 0.0
        out.append(f"  {_LABELS[p]:<27} {_hms(v):>10}  {share:5.1f}%")
    return "\n".join(out) + "\n"


def setup_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help=f"checkpoint directory (checkpoint.dir, holding {LEDGER_NAME}) "
                               "or the ledger file")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the timeline of the attempts into FILE.png (needs matplotlib:"
                        " pip install 'kempner_resilience[plot]'; exit 2 without it)")


def run_report(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    ledger = target / LEDGER_NAME if target.is_dir() else target
    if not ledger.exists():
        raise CliError(f"{ledger}: no run ledger here (ResilientRun writes {LEDGER_NAME} into "
                       "checkpoint.dir when the run has checkpoint state)")
    if args.plot:
        try:   # before any output: a missing extra is said alone, not after the report
            importlib.import_module("matplotlib")
        except ImportError:
            from kempner_resilience.cli.plot import MISSING_MATPLOTLIB

            raise CliError(MISSING_MATPLOTLIB, 2) from None
    events = read_ledger(ledger)
    g = analyze(events)
    if not g.attempts:
        raise CliError(f"{ledger}: no events in the ledger")
    if args.json:
        sys.stdout.write(json.dumps(g.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(render(g))
    if args.plot:
        from kempner_resilience.cli.plot import plot_timeline

        try:
            plot_timeline(g, events, args.plot)
        except OSError as e:
            raise CliError(f"cannot write the plot {args.plot}: {e.strerror or e}") from None
        sys.stderr.write(f"wrote the timeline to {args.plot}\n")
    return 0


VERBS = [Verb("report", "a run's attempts across requeues and its goodput (share of the "
              "allocated time spent on steps that were kept), from checkpoint.dir/ledger.jsonl",
              setup_report, run_report)]
