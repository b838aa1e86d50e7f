"""`replay verify`'s verdict from what its replays found (verbs/verify/engine.py): a loop recorded as written whose
replayed iteration made another number of training calls than recorded ran another step, whichever step of the
differing interval it was, compared or not; that is no verdict on the machine."""

from __future__ import annotations

from replaybisect.verbs.verify.engine import Difference, VerifyReport, _verdict


def report(calls_differ: dict[int, list[int]]) -> VerifyReport:
    """Steps 3..9 compared from snapshots 0 and 5 on the machine that recorded them; step 7's loss differs."""
    return VerifyReport(run_id="r", start=3, end=10, steps_compared=7,
                        segments=[{"snapshot": 0, "start": 3, "end": 5, "differences": 0},
                                  {"snapshot": 5, "start": 5, "end": 10, "differences": 1}],
                        differences=[Difference(7, "loss", 0.5, 0.25, 0.5)], recorded_on="vm", replayed_on="vm",
                        second_replay="same", calls_differ=calls_differ)


def test_another_number_of_training_calls_at_or_before_the_difference_is_the_loop_verdict():
    verdict, sentence = _verdict(report({7: [13, 19]}))
    assert verdict == "loop" and "made 13 training calls of the model in its replay where the recording made 19" in sentence
    verdict, sentence = _verdict(report({5: [4, 6], 7: [13, 19]}))  # step 5: its interval's first, before the difference
    assert verdict == "loop" and "in its replay of step 5, before it, where the recording made 6" in sentence


def test_calls_that_differ_outside_the_differing_interval_leave_the_machines_verdict():
    assert _verdict(report({}))[0] == "transient"
    assert _verdict(report({4: [2, 3]}))[0] == "transient"  # another interval's (snapshot 0's) step
    assert _verdict(report({8: [2, 3]}))[0] == "transient"  # after the first difference: the state had gone on from it


def test_a_report_round_trips_through_json_with_its_steps_as_numbers():
    import json

    again = VerifyReport.from_json(json.loads(json.dumps(report({7: [13, 19]}).to_json())))
    assert again.calls_differ == {7: [13, 19]} and _verdict(again)[0] == "loop"


def test_a_replayed_step_differs_by_its_calls_and_a_stopped_one_by_those_before_its_stop():
    """core/inline_step.calls_differing: what RemoteStep keeps as a step whose iteration decided otherwise."""
    from replaybisect.core.inline_step import calls_differing

    assert calls_differing(19, 19, None) is None
    assert calls_differing(13, 19, None) == (13, 19) and calls_differing(25, 19, None) == (25, 19)
    # the run's failing step, recorded up to its NaN at call 4 of 8: a replay halting there runs the other 4 idle
    assert calls_differing(8, 4, stopped=4) is None
    assert calls_differing(8, 4, stopped=3) is None  # (stopped earlier: an arm changed the step, not the loop)
    assert calls_differing(30, 19, stopped=25) == (25, 19)  # more calls before its stop than were ever recorded
