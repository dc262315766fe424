"""The rescue job (``rescue_job.py``) as a function a submitit job runs: ``main(*argv)`` with
rescue_job's command-line arguments; returns its exit status (0). Imported in the job by its
path ``submitit_rescue:main`` (the test puts this directory on ``PYTHONPATH``)."""

from __future__ import annotations

import sys


def main(*argv: str) -> int:
    import rescue_job

    sys.argv = ["rescue_job", *argv]
    return rescue_job.main()
