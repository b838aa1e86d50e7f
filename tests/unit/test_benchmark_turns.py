"""benchmarks/overhead.py's Turns: the trainers' plain and recorded fits take turns a step at a time, in ABBA order,
never running at once, each turn timed on its own side, and a fit that fails or ends early ends the measurement
with an error instead of leaving the other waiting."""

import importlib.util
import threading
import types
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("overhead", Path(__file__).parents[2] / "benchmarks" / "overhead.py")
overhead = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(overhead)

STEP = {"plain": 1.0, "recorded": 2.0}  # seconds a fake step takes on the fake clock
DRAIN = 10.0  # and the recorded side's wait for the writer
WARM_UP = 3  # the warm-up pair's steps take this many times as long


@pytest.fixture
def clock(monkeypatch):
    """A clock only the fake fits move: each turn's time is exactly what its own side did."""
    now = [0.0]
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(overhead, "WAITED", [0.0])
    return now


def fake_fit(turns, name: str, clock: list, ran: list, running: list, steps: int = 0, fail_at: int = -1):
    """A fit of turns.steps() steps (or `steps`) that calls step_ended at each step's end, as the benchmark's
    callbacks do; the recorded side drains its writes, adding to WAITED as overhead.writes_done does."""
    def drain() -> None:
        clock[0] += DRAIN
        overhead.WAITED[0] += DRAIN

    def run() -> None:
        for step in range(steps or turns.steps()):
            running.append(name)
            try:
                assert running == [name], f"{running} ran at once"
                ran.append((name, step))
                clock[0] += STEP[name] * (WARM_UP if step == 1 else 1)  # step 1: the first turn, the warm-up pair's
                if step == fail_at:
                    raise RuntimeError("the fit failed")
            finally:
                running.remove(name)
            turns.step_ended(name, drain if name == "recorded" else lambda: None)
    return run


def measured(turns, fits: dict, timeout: float = 30):
    """turns.run(fits) in a daemon thread: (its pairs, or the error it raised); a hang fails the test."""
    result = []

    def run() -> None:
        try:
            result.append(turns.run(fits))
        except Exception as error:
            result.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert result, "the fits were left waiting"
    return result[0]


@pytest.mark.parametrize("swapped", [False, True])
def test_the_fits_take_turns_step_by_step_in_abba_order_one_at_a_time(clock, swapped):
    turns = overhead.Turns(pairs=5, swapped=swapped)
    ran, running = [], []
    pairs = measured(turns, {name: fake_fit(turns, name, clock, ran, running) for name in ("plain", "recorded")})

    assert pairs == [(STEP["plain"], STEP["recorded"] + DRAIN)] * 5  # the warm-up pair left out; each side's own time
    assert turns.waited == 5 * DRAIN  # the warm-up pair's waiting left out too
    assert ran[0] == ("recorded" if swapped else "plain", 0)  # swapped: the recorded fit starts first
    timed = [name for name, step in ran if 1 <= step <= turns.steps() - 2]  # a fit's first and last step: no turn
    assert timed == turns.order == ["plain", "recorded", "recorded", "plain"] * 3
    assert [step for name, step in ran if name == "plain"] == list(range(turns.steps()))
    assert turns.objects("built", "twin") == ({"plain": "built", "recorded": "twin"} if swapped
                                              else {"plain": "twin", "recorded": "built"})


@pytest.mark.parametrize("ending, message", [({"fail_at": 3}, "the fit failed"),
                                             ({"steps": 3}, "ended before its turns did")])
def test_a_fit_that_fails_or_ends_early_stops_the_other_and_the_measurement_raises(clock, ending, message):
    turns = overhead.Turns(pairs=50)
    ran, running = [], []
    fits = {"plain": fake_fit(turns, "plain", clock, ran, running),
            "recorded": fake_fit(turns, "recorded", clock, ran, running, **ending)}

    error = measured(turns, fits)

    assert isinstance(error, RuntimeError) and message in str(error)
    if "fail_at" in ending:  # the other fit stopped at its next step's end, not run out
        assert max(step for name, step in ran if name == "plain") <= 4
