"""``rescue_job.py`` with one rank pausing itself inside a periodic save, in the first launch
only (``KEMPNER_RESTART_COUNT`` 0), as ``scontrol suspend`` of one node or a debugger would:

    --stop-in-save R:S    rank R SIGSTOPs itself inside the DCP write of the save of step S,
                          after its files are planned and before its write results are
                          gathered: the other ranks wait for it in the save's collective. It
                          first creates ``stopped.<R>`` next to ``checkpoint.dir`` (for the test)

Every other argument goes to ``rescue_job.py``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rescue_job  # noqa: E402
from kempner_resilience.checkpoint import layout  # noqa: E402
from kempner_resilience.checkpoint.writer import ChecksummingWriter  # noqa: E402


def _install(at: str) -> None:
    rank, step = (int(x) for x in at.split(":"))
    if int(os.environ["RANK"]) != rank or os.environ.get("KEMPNER_RESTART_COUNT", "0") != "0":
        return
    write_data = ChecksummingWriter.write_data

    def stopping_write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        here = Path(self.path)
        parsed = layout.parse_name(here.name)
        if parsed is not None and parsed[0] == step:
            (here.parent.parent / f"stopped.{rank}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return write_data(self, plan, planner)

    ChecksummingWriter.write_data = stopping_write_data  # type: ignore[method-assign]


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--stop-in-save" in argv:
        i = argv.index("--stop-in-save")
        _install(argv[i + 1])
        del argv[i:i + 2]
    sys.argv[1:] = argv
    code = rescue_job.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
