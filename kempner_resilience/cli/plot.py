"""`kempner-resilience report DIR --plot FILE.png`: a run's timeline as a picture.

One row per attempt, on one time axis from the first attempt's start: start-up, checkpoint
load, the training loop (split into steps kept and steps lost, in proportion to their step
counts, as the report does), the periodic saves that blocked training (ticks where they
happened), emergency save + shutdown, and the time between attempts; an in-job restart's row
starts with its detection, rescue and relaunch (drawn back from its start), then its start-up
and load: the recovery from the failure to its first step. The legend carries each
part's total, the title the goodput.

matplotlib is an optional extra (``pip install 'kempner_resilience[plot]'``); it is imported
only here, with the non-interactive Agg backend, so this works on a node without a display.
"""

from __future__ import annotations

import os
from typing import Any

from kempner_resilience.core.goodput import Goodput, split_attempts

__all__ = ["MISSING_MATPLOTLIB", "plot_timeline", "supported_formats"]

MISSING_MATPLOTLIB = ("report --plot needs matplotlib, which is not installed: pip install "
                      "'kempner_resilience[plot]' (in a checkout: pip install -e '.[plot]'), or "
                      "pip install matplotlib")

# Part -> (label, colour). Colour-blind-safe (Tableau 10), kept green and lost red as in a report.
STYLE = {
    "startup": ("start-up", "#bab0ac"),
    "load": ("checkpoint load", "#4e79a7"),
    "kept": ("steps kept (goodput)", "#59a14f"),
    "lost": ("steps lost (redone)", "#e15759"),
    "save_blocking": ("periodic-save blocking", "#1b1b1b"),
    "shutdown": ("emergency save + shutdown", "#f28e2b"),
    "queue": ("between attempts (queue)", "#e8e8e8"),
    # An in-job restart's recovery before its start-up and load (the allocation held).
    "detection": ("detection", "#b07aa1"),
    "rescue": ("rescue", "#edc948"),
    "relaunch": ("relaunch", "#76b7b2"),
}


def _unit(span_s: float) -> tuple[float, str]:
    if span_s > 3 * 3600:
        return 3600.0, "hours"
    if span_s > 600:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _short(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def supported_formats() -> set[str]:
    """The file suffixes (without the dot) matplotlib can write; needs matplotlib."""
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def plot_timeline(g: Goodput, events: list[dict[str, Any]],
                  path: str | os.PathLike[str]) -> None:
    """Draw ``g`` (with the ledger ``events`` it came from, for the saves' times) into
    ``path`` (PNG, or any format matplotlib knows by the suffix). Raises ImportError with
    ``MISSING_MATPLOTLIB`` when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(MISSING_MATPLOTLIB) from e

    origin = g.attempts[0].t0
    scale, unit = _unit(g.wall_s)

    def x(t: float) -> float:
        return (t - origin) / scale

    # Save events by attempt, split as goodput.analyze splits them: a new one at each start.
    if g.other_runs:                # the run analysed only, as goodput.analyze filters them
        events = [e for e in events if e.get("run_id") in (g.run_id, None)]
    saves = {k: [e for e in group if e.get("ev") == "save" and e.get("t") is not None]
             for k, group in enumerate(split_attempts(events))}

    n = len(g.attempts)
    fig, ax = plt.subplots(figsize=(9.0, 1.2 + 0.42 * n), dpi=100)
    height = 0.6
    for a in g.attempts:
        y = a.index
        p = a.parts
        t_loop = a.t0 + p["startup"] + p["load"]
        loop_end = a.end - p["shutdown"]
        ran = p["kept"] + p["lost"]
        kept_end = t_loop + (loop_end - t_loop) * (p["kept"] / ran if ran > 0 else 1.0)
        spans = [("startup", a.t0, a.t0 + p["startup"]), ("load", a.t0 + p["startup"], t_loop),
                 ("kept", t_loop, kept_end), ("lost", kept_end, loop_end),
                 ("shutdown", loop_end, a.end)]
        for part, lo, hi in spans:
            if hi > lo:
                ax.broken_barh([(x(lo), x(hi) - x(lo))], (y - height / 2, height),
                               facecolors=STYLE[part][1])
        # Each save event is written when the save returns: it blocked training just before.
        ticks = [(x(float(e["t"]) - float(e.get("blocking_s") or 0.0)),
                  max(float(e.get("blocking_s") or 0.0) / scale, g.wall_s / scale / 400))
                 for e in saves.get(a.index, [])]
        if ticks:
            ax.broken_barh(ticks, (y - height / 2, height),
                           facecolors=STYLE["save_blocking"][1])
        rec, hi = a.recovery, a.t0
        for part in ("relaunch", "rescue", "detection"):    # back from the start, in the gap
            lo = hi - rec.get(part, 0.0)
            if hi > lo:
                ax.broken_barh([(x(lo), x(hi) - x(lo))], (y - height / 2, height),
                               facecolors=STYLE[part][1])
            hi = lo
        if a.queue_after_s and a.queue_after_s > 0:
            ax.broken_barh([(x(a.end), a.queue_after_s / scale)], (y - height / 2, height),
                           facecolors=STYLE["queue"][1], edgecolor="#9a9a9a", hatch="//",
                           linewidth=0.5)
        stop = "" if a.stop_signal is None else f"{a.stop_signal}@{a.stop_step} → "
        code = "killed?" if a.crashed else f"exit {a.exit_code}"
        ax.text(x(a.end) + g.wall_s / scale / 150, y,
                f"{stop}{code}  (steps {a.start_step}-{a.last_step})", va="center",
                fontsize=8)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"attempt {a.restart_count if a.restart_count is not None else a.index}"
                        + (f"+{a.relaunch} in-job" if a.relaunch else "")
                        + (f"\njob {a.job_id}" if a.job_id else "") for a in g.attempts],
                       fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)          # the first attempt on top
    ax.set_xlim(0, g.wall_s / scale * 1.28)    # room for the labels after the last attempt
    ax.set_xlabel(f"{unit} since the first attempt started")
    ax.set_title(f"run {g.run_id or '?'}: goodput {100 * g.goodput:.1f}% of "
                 f"{_short(g.allocated_s)} allocated ({100 * g.wall_goodput:.1f}% of "
                 f"{_short(g.wall_s)} wall)", fontsize=10)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    handles = [Patch(facecolor=STYLE[p][1], edgecolor="#9a9a9a" if p == "queue" else None,
                     hatch="//" if p == "queue" else None,
                     label=f"{STYLE[p][0]} {_short(g.parts[p])}")
               for p in ("startup", "load", "kept", "lost", "save_blocking", "shutdown",
                         "queue")]
    relaunched = [a for a in g.attempts if a.restart is not None]
    handles += [Patch(facecolor=STYLE[p][1], label=f"{STYLE[p][0]} "
                      f"{_short(sum(a.recovery[p] for a in relaunched))}")
                for p in ("detection", "rescue", "relaunch") if relaunched]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (n + 1) - 0.12),
              ncol=4, fontsize=8, frameon=False)
    try:
        fig.savefig(path, bbox_inches="tight")    # the legend below the axes included
    finally:
        plt.close(fig)
