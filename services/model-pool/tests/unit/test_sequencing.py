"""The sequencer's decisions: who runs, who waits, who yields to a priority-0 stream."""

from __future__ import annotations

from loadmaster.model_pool.sequencing import Action, ActionKind, Sequencer

START, RESUME, PREEMPT = ActionKind.START, ActionKind.RESUME, ActionKind.PREEMPT


def running(sequencer: Sequencer, *ids: str, tokens: int = 10) -> None:
    for request_id in ids:
        sequencer.submitted(request_id)
        sequencer.progressed(request_id, tokens)


def test_streams_start_up_to_the_capacity_then_wait_in_priority_then_arrival_order() -> None:
    sequencer = Sequencer(capacity=2)
    assert sequencer.arrive("a", 2) == [Action(START, "a")]
    assert sequencer.arrive("b", 2) == [Action(START, "b")]
    assert sequencer.arrive("c", 3) == []
    assert sequencer.arrive("d", 1) == []
    assert sequencer.arrive("e", 1) == []
    assert (sequencer.running, sequencer.waiting) == (2, 3)
    assert sequencer.finished("a") == [Action(START, "d")]
    assert sequencer.finished("b") == [Action(START, "e")]
    assert sequencer.finished("d") == [Action(START, "c")]


def test_a_priority_0_stream_preempts_the_lowest_priority_newest_sequence_which_resumes_first() -> None:
    sequencer = Sequencer(capacity=2)
    sequencer.arrive("old", 2)
    sequencer.arrive("new", 2)
    running(sequencer, "old", "new")
    sequencer.arrive("later", 2)
    assert sequencer.arrive("urgent", 0) == [Action(PREEMPT, "new"), Action(START, "urgent")]
    assert sequencer.preemptions == 1
    assert sequencer.finished("urgent") == [Action(RESUME, "new")]  # its arrival is older than "later"
    assert sequencer.resumptions == 1


def test_no_preemption_while_a_priority_0_sequence_runs_or_below_priority_0() -> None:
    sequencer = Sequencer(capacity=1)
    sequencer.arrive("p1", 1)
    running(sequencer, "p1")
    assert sequencer.arrive("also-p1", 1) == []  # only priority 0 preempts
    sequencer = Sequencer(capacity=1)
    sequencer.arrive("zero", 0)
    running(sequencer, "zero")
    assert sequencer.arrive("another-zero", 0) == []


def test_a_sequence_is_not_preempted_before_it_made_progress_then_is() -> None:
    sequencer = Sequencer(capacity=1, min_tokens_between=4)
    sequencer.arrive("low", 2)
    assert sequencer.arrive("urgent", 0) == []  # still being submitted
    assert sequencer.submitted("low") == []
    assert sequencer.progressed("low", 3) == []
    assert sequencer.progressed("low", 1) == [Action(PREEMPT, "low"), Action(START, "urgent")]


def test_a_stream_cancelled_while_waiting_is_skipped() -> None:
    sequencer = Sequencer(capacity=1)
    sequencer.arrive("a", 1)
    sequencer.arrive("b", 1)
    assert sequencer.is_waiting("b")
    assert sequencer.finished("b") == []
    assert sequencer.finished("a") == []
    assert (sequencer.running, sequencer.waiting) == (0, 0)
