"""What the torchrun agent says at the end: its exit code, and only what rank 0's run report
says about the checkpoint. The code itself is the policy's (``evidence.agent_exit_code``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Mapping

from kempner_resilience.exitcodes import ExitCode, describe
from kempner_resilience.core.ledger import REPORT_ENV

__all__ = ["what_the_workers_did", "RunReport"]


# Codes whose meaning includes "checkpoint committed": from the code alone the agent cannot tell
# (a forced exit, 130/143, committed nothing; a run without state requeues without one).
_COMMIT_CODES = (ExitCode.REQUEUE, ExitCode.STOPPED, ExitCode.REQUEUE_FAILED, ExitCode.SIGINT,
                 ExitCode.SIGTERM)


def what_the_workers_did(code: int, report: Mapping[str, Any] | None) -> str:
    """The agent's account of its workers' exit ``code``: the code, and only what rank 0's run
    ``report`` (None: there is none) says about the checkpoint."""
    if code in _COMMIT_CODES:
        text = f"{ExitCode(code).name} ({code})"
    else:
        text = describe(code)
    if report is None:
        text += ("; no run report from rank 0 (forced out, killed, or started by another "
                 "node's agent), so no checkpoint is claimed here: `kempner-resilience ls` "
                 "shows what is on disk")
    elif report.get("saved_step") is not None:
        text += (f"; newest checkpoint this run committed: step {report['saved_step']} "
                 f"({report.get('saved_path')})")
    else:
        resumed = report.get("resumed_from")
        text += "; this run committed no checkpoint" + (
            f" (it resumed from step {resumed})" if resumed is not None else "")
    if code == ExitCode.REQUEUE:
        text += "; torch's 'failed (exitcode: 75)' report above is this requeue, not an error"
    return text


class RunReport:
    """Rank 0's run report, for the agent's last line: at the user's
    ``$KEMPNER_RESILIENCE_REPORT`` (then only a report written during this run counts), else in
    a directory of the agent's own, set in the environment the workers inherit."""

    def __init__(self) -> None:
        self._saved_env = os.environ.get(REPORT_ENV)
        self._own_dir: str | None = None
        if self._saved_env:
            self.path = self._saved_env
        else:
            self._own_dir = tempfile.mkdtemp(prefix="kempner-agent-")
            self.path = os.path.join(self._own_dir, "report.json")
            os.environ[REPORT_ENV] = self.path
        self._before = self._stamp()

    def _stamp(self) -> int | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def read(self) -> dict[str, Any] | None:
        """The report rank 0 wrote during this run, or None."""
        if self._stamp() in (None, self._before):
            return None
        try:
            with open(self.path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) else None

    def close(self) -> None:
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            if os.environ.get(REPORT_ENV) == self.path:
                del os.environ[REPORT_ENV]
