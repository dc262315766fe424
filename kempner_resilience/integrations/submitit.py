"""Moved to ``kempner_resilience.supervise.submitit.jobs``; this path keeps working."""

from kempner_resilience.supervise.submitit.jobs import (LOCAL_REQUEUE_CODE, MAX_PICKLE_BYTES,
                                                        ResilientJob, check_small, interrupt,
                                                        make_executor, preempt_signal,
                                                        resolve_callable, submit, submit_array,
                                                        wait)

__all__ = ["ResilientJob", "submit", "submit_array", "make_executor", "wait", "interrupt",
           "preempt_signal", "check_small", "resolve_callable", "MAX_PICKLE_BYTES",
           "LOCAL_REQUEUE_CODE"]
