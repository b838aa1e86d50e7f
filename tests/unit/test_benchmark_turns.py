"""benchmarks/overhead.py's Turns: the trainers' plain and recorded fits take turns a step at a time, in ABBA order,
never running at once, and a fit that fails ends the measurement instead of leaving the other waiting."""

import importlib.util
import threading
import time
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("overhead", Path(__file__).parents[2] / "benchmarks" / "overhead.py")
overhead = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(overhead)


def fake_fit(turns, name: str, ran: list, running: list, fail_at: int = -1):
    """A fit of turns.steps() steps that calls step_ended at each step's end, as the benchmark's callbacks do."""
    def run() -> None:
        for step in range(turns.steps()):
            running.append(name)
            assert len(set(running)) == 1, f"{running} ran at once"
            ran.append((name, step))
            time.sleep(0.001 if name == "plain" else 0.002)
            if step == fail_at:
                raise RuntimeError("the fit failed")
            running.remove(name)
            turns.step_ended(name)
    return run


@pytest.mark.parametrize("swapped", [False, True])
def test_the_fits_take_turns_step_by_step_in_abba_order_one_at_a_time(swapped):
    turns = overhead.Turns(pairs=5, swapped=swapped)
    ran, running = [], []
    pairs = turns.run({name: fake_fit(turns, name, ran, running) for name in ("plain", "recorded")})

    assert ran[0] == ("recorded" if swapped else "plain", 0)  # swapped: the recorded fit starts first
    assert turns.objects("built", "twin") == ({"plain": "built", "recorded": "twin"} if swapped
                                              else {"plain": "twin", "recorded": "built"})

    assert len(pairs) == 5  # the warm-up pair left out
    assert all(recorded > plain > 0 for plain, recorded in pairs)  # each side's own step, timed
    timed = [name for name, step in ran if 1 <= step <= turns.steps() - 2]  # a fit's first and last step: no turn
    assert timed == turns.order == ["plain", "recorded", "recorded", "plain"] * 3
    assert [step for name, step in ran if name == "plain"] == list(range(turns.steps()))


def test_a_fit_that_fails_ends_the_measurement_with_its_error():
    turns = overhead.Turns(pairs=5)
    ran, running = [], []
    fits = {"plain": fake_fit(turns, "plain", ran, running), "recorded": fake_fit(turns, "recorded", ran, running, fail_at=3)}
    finished = []
    worker = threading.Thread(target=lambda: finished.append(pytest.raises(RuntimeError, turns.run, fits)))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and finished, "the other fit was left waiting"
    assert "the fit failed" in str(finished[0].value)
