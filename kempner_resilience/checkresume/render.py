"""check-resume's report, as the user reads it: the verdict first, then what differs and why."""

from __future__ import annotations

import textwrap
from collections import defaultdict

from kempner_resilience.checkresume.check import RESCUE_NOT_COVERED, Outcome, Verdict
from kempner_resilience.checkresume.compare import EntryDiff

__all__ = ["render"]

_SHOW = 3          # entries listed by name per group; the rest are counted


def _group(key: str) -> str:
    """``model.0.weight`` -> ``model``; ``rank0:objects.sched.last_epoch`` -> ``rank0:objects.
    sched``; ``rank0:rng.torch`` -> ``rank0:rng``."""
    rank, sep, rest = key.partition(":")
    if not sep:
        return key.split(".", 1)[0]
    parts = rest.split(".")
    return f"{rank}:{'.'.join(parts[:2] if parts[0] == 'objects' else parts[:1])}"


def _entries(diffs: tuple[EntryDiff, ...]) -> list[str]:
    groups: dict[str, list[EntryDiff]] = defaultdict(list)
    for d in diffs:
        groups[_group(d.key)].append(d)
    lines = []
    for name, items in groups.items():
        worst = [d.max_abs for d in items if d.max_abs is not None]
        size = f", max abs diff {max(worst):.3g}" if worst else ""
        lines.append(f"  {name} ({items[0].kind.value}): {len(items)} "
                     f"entr{'y' if len(items) == 1 else 'ies'} differ{'s' if len(items) == 1 else ''}{size}")
        for d in items[:_SHOW]:
            lines.append(f"    {d.key}: {d.what}")
        if len(items) > _SHOW:
            lines.append(f"    ... and {len(items) - _SHOW} more")
    return lines


def _wrap(text: str, indent: str = "  ") -> str:
    return textwrap.fill(text, 96, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False)


def render(v: Verdict) -> str:
    """The report of ``v`` (several lines, no trailing newline), with the disk the runs used."""
    text = _report(v)
    if v.disk_bytes is None:
        return text
    return text + f"\n  disk used: {v.disk_bytes / 1e6:.1f} MB (checkpoints and logs of the runs)"


def _report(v: Verdict) -> str:
    if v.outcome is Outcome.UNCHECKED:
        return f"check-resume: UNCHECKED: {v.problem}\n  work directory: {v.workdir}"
    note = ""
    if v.unseeded:
        note = "\n" + _wrap(f"(not compared: {', '.join(v.unseeded)}: RNG streams the "
                             "training loop never draws from, left unseeded by the script)",
                             "  ")
    if v.layouts:
        note += "\n" + _wrap(f"(not compared bitwise: {', '.join(v.layouts[:4])}: DDP's "
                             "gradient-bucket layout, which a resumed process records later; "
                             "what it determines, the gradients' sum, is in the model and "
                             "optimizer, compared)", "  ")
    for n in v.notes:
        note += "\n" + _wrap(f"({n})", "  ")
    if v.outcome is Outcome.NONDETERMINISTIC:
        lines = [f"check-resume: NOT DETERMINISTIC (unchecked). The run {v.how} differs from "
                 "the uninterrupted run, but so does a second uninterrupted run: the two "
                 f"straight runs already differ at step {v.first_step}:"]
        lines += _entries(v.first_diffs)
        lines.append("Cause:")
        lines += [_wrap(f"- {c}") for c in v.causes]
        lines.append(f"  checkpoints and rank logs of the runs: {v.workdir}")
        return "\n".join(lines) + note
    if v.outcome in (Outcome.EXACT, Outcome.NOT_COVERED):
        also = f", and the run {v.also}," if v.also else ""
        exact = (f"The run {v.how} and resumed each time{also} equals the uninterrupted run at "
                 f"every step compared, bitwise ({len(v.compared)} checkpoints, steps "
                 f"{v.compared[0]}..{v.compared[-1]}).")
        if v.crossed:
            exact += "\n" + _wrap(f"Its stops crossed {', '.join(v.crossed)}.", "  ")
        if v.outcome is Outcome.EXACT:
            return f"check-resume: exact. {exact}{note}"
        lines = [f"check-resume: NOT COVERED: exact for steps {v.compared[0]}-{v.compared[-1]}; "
                 f"not covered: {'; '.join(e.split(':', 1)[0] for e in v.not_covered)}.", exact,
                 "Not covered:"]
        lines += [_wrap(f"- {e}") for e in v.not_covered]
        if any(not e.startswith(RESCUE_NOT_COVERED) for e in v.not_covered):
            lines.append(_wrap("A resume across it may still differ (a value changed there "
                               "and carried outside state, an eval loader's workers): raise "
                               "--max-steps and --timeout to cross it, or shorten the script's "
                               "epochs for the check.", "  "))
        return "\n".join(lines) + note
    lines = [f"check-resume: INEXACT. The run {v.how} and resumed differs "
             f"from the uninterrupted run from step {v.first_step} on"
             + (f" ({v.first_step - v.after_stop} step(s) after the stop at step "
                f"{v.after_stop})." if v.after_stop is not None else "."),
             f"At step {v.first_step}, the first that differs:"]
    lines += _entries(v.first_diffs)
    if v.final_step is not None and v.final_step != v.first_step:
        lines.append(f"At step {v.final_step}, the last compared:")
        lines += _entries(v.final_diffs)
    lines.append("Likely cause:")
    lines += [_wrap(f"- {c}") for c in v.causes]
    lines.append(f"  checkpoints and rank logs of both runs: {v.workdir}")
    return "\n".join(lines) + note
