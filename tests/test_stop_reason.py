"""Why the ranks stop is a type: a signal, the allocation's end, or a lost lease.

The time-limit stop is no signal: it is agreed, logged and recorded as ``time-limit``; only the
shutdown decides, in one place, that it acts as the first signal whose action is ``requeue``
(docs/config.md, ``requeue.time_limit_stop``).
"""

from __future__ import annotations

import signal

import pytest

import kempner_resilience as kr
from kempner_resilience.config import Action
from kempner_resilience.shutdown.stages import stop_action
from kempner_resilience.stop.agreement import StopAgreement
from kempner_resilience.stop.reason import StopKind, StopReason

USR1, TERM = StopReason.signal(signal.SIGUSR1), StopReason.signal(signal.SIGTERM)


def test_each_reason_has_the_word_the_ledger_and_the_log_use():
    assert USR1.word == "SIGUSR1" and TERM.word == "SIGTERM"
    assert StopReason.TIME_LIMIT.word == "time-limit"
    assert StopReason.LEASE_LOST.word == "lease-lost"


def test_a_reason_crosses_the_store_as_text_and_comes_back_equal():
    for reason in (USR1, TERM, StopReason.TIME_LIMIT, StopReason.LEASE_LOST):
        assert StopReason.decode(reason.encode()) == reason


def test_in_should_stops_reduce_any_signal_wins_over_the_time_limit_and_both_over_nothing():
    orders = [USR1.order, TERM.order, StopReason.TIME_LIMIT.order]
    assert max(orders) == TERM.order and min(orders) == StopReason.TIME_LIMIT.order > 0
    for reason in (USR1, TERM, StopReason.TIME_LIMIT):
        assert StopReason.from_order(reason.order) == reason
    assert StopReason.from_order(0) is None


def test_only_a_signal_reason_carries_a_signal_number():
    with pytest.raises(ValueError):
        StopReason(StopKind.SIGNAL)
    with pytest.raises(ValueError):
        StopReason(StopKind.TIME_LIMIT, int(signal.SIGUSR1))


def test_a_single_process_agreement_decides_on_the_reason_it_was_given():
    agreement = StopAgreement()
    assert agreement.poll(3, None) is None
    decision = agreement.poll(4, StopReason.TIME_LIMIT)
    assert decision.step == 4 and decision.reason is StopReason.TIME_LIMIT
    assert not decision.lease_lost and agreement.agreed_reason() is StopReason.TIME_LIMIT
    lost = StopAgreement().poll(5, USR1, lease_lost=True)
    assert lost.lease_lost and lost.reason.kind is StopKind.LEASE_LOST


def test_the_time_limit_acts_as_the_first_requeue_signal_and_a_signal_as_itself():
    cfg = kr.load_config(None)
    assert stop_action(cfg, StopReason.TIME_LIMIT) == (Action.REQUEUE, signal.SIGUSR1)
    assert stop_action(cfg, TERM) == (cfg.signals.actions["SIGTERM"], signal.SIGTERM)
    term_requeues = kr.load_config({"signals": {"actions": {
        "SIGUSR1": "stop", "SIGUSR2": "stop", "SIGTERM": "requeue"}}})
    assert stop_action(term_requeues, StopReason.TIME_LIMIT) == (Action.REQUEUE,
                                                                 signal.SIGTERM)
    none_requeues = kr.load_config({"signals": {"actions": {"SIGUSR1": "stop",
                                                            "SIGUSR2": "stop"}}})
    assert stop_action(none_requeues, StopReason.TIME_LIMIT) == (Action.STOP, signal.SIGUSR1)
