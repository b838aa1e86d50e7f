"""benchmarks/overhead.py's Alternation: a trainer's one fit alternates plain and recorded steps in ABBA order, the
recorder records only its own steps, each step is timed from the previous step's end on its own side, the warm-up
pair is left out, and a fit that ends early is an error, not a shorter measurement."""

import importlib.util
import types
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("overhead", Path(__file__).parents[2] / "benchmarks" / "overhead.py")
overhead = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(overhead)

STEP = {"plain": 1.0, "recorded": 2.0}  # seconds a fake step takes on the fake clock
DRAIN = 10.0  # and a recorded step's wait for the writer
WARM_UP = 3  # the warm-up pair's steps take this many times as long


@pytest.fixture
def clock(monkeypatch):
    """A clock only the fake fit moves: each step's time is exactly what its own kind did."""
    now = [0.0]
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(overhead, "WAITED", [0.0])
    return now


def fake_fit(alternation, clock: list, steps: int = 0) -> list[str]:
    """A fit of alternation.steps() steps (or `steps`) whose recorder works only on the steps it is given, and a
    callback after it that ends each step, draining the writer as overhead.writes_done does. Returns who ran each step."""
    ran = []

    def drain() -> None:
        clock[0] += DRAIN
        overhead.WAITED[0] += DRAIN

    for step in range(steps or alternation.steps()):
        kind = "recorded" if alternation.records(step) else "plain"
        ran.append(kind)
        clock[0] += STEP[kind] * (WARM_UP if step < 2 else 1)
        alternation.step_ended(step, drain)
    return ran


def test_the_steps_alternate_in_abba_order_and_each_is_timed_on_its_own_side(clock):
    alternation = overhead.Alternation(pairs=5)

    ran = fake_fit(alternation, clock)

    assert ran == ["plain", "recorded"] + ["recorded", "plain", "plain", "recorded"] * 2 + ["recorded", "plain"]
    assert alternation.pairs() == [(STEP["plain"], STEP["recorded"] + DRAIN)] * 5  # the warm-up pair left out
    assert alternation.waited == 5 * DRAIN  # its waiting too
    assert not alternation.records(alternation.steps())  # past the schedule: nothing recorded


def test_a_fit_that_ends_before_its_steps_do_is_an_error(clock):
    alternation = overhead.Alternation(pairs=5)
    fake_fit(alternation, clock, steps=7)

    with pytest.raises(RuntimeError, match="ended before its steps did"):
        alternation.pairs()


def test_a_recorder_gated_on_another_step_than_the_clock_counts_is_an_error(clock):
    alternation = overhead.Alternation(pairs=5)
    alternation.step_ended(0, recorded=0)  # plain: the recorder took none
    alternation.step_ended(1, recorded=1)  # recorded: it took this one

    with pytest.raises(RuntimeError, match="took 1 steps by the end of step 2, the schedule gave it 2"):
        alternation.step_ended(2, recorded=1)  # recorded, but the recorder did not take it (a step off)
