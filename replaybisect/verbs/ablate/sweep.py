"""`replay ablate --sweep lr|clip`: how far the learning rate must come down (how tight the clipping must be) for the
failure to go away, found by bisection on the value's logarithm and proven by the arms that ran.

Both knobs are safer small: a smaller lr factor, a smaller clip threshold. The search keeps a bracket
(the largest value known stable, the smallest known to fail; the range's ends until then) and replaces it each round
by `workers` values spread evenly (in log) inside it, run in parallel; it stops when the bracket is narrower than
PRECISION (a ratio), so it takes about log2(log(range) / log(PRECISION)) rounds with one worker, fewer with more. Stable means the arm's
verdict is `fixes`: finite through the horizon and the loss not blown up. Every value in the answer is an arm that ran.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from replaybisect.errors import ReplayError
from replaybisect.verbs.ablate.interventions import ArmSpec, get

LR_FACTOR_RANGE = (1e-3, 1.0)  # lr x0.001 .. x1 (x1 is the baseline, which failed)
CLIP_BELOW_HEALTHY = 4.0  # the clip search starts at the smallest healthy norm / 4: clipping every step
CLIP_ABOVE_HEALTHY = 100.0  # and ends at 100x the largest healthy norm (or the largest recorded): clipping only the climb
PRECISION = 1.25  # stop when the smallest failing value is within 25% of the largest stable one
MAX_ROUNDS = 12


@dataclass
class _Search:
    knob: str
    safe: float  # the range's safe end (tested first)
    risky: float  # the range's risky end
    risky_known_to_fail: bool  # lr x1 is the baseline
    tested: dict[float, Any] = field(default_factory=dict)  # value -> ArmOutcome
    rounds: list[list[str]] = field(default_factory=list)

    def stable(self, value: float) -> bool:
        return self.tested[value].verdict == "fixes"

    def bracket(self) -> tuple[Optional[float], Optional[float]]:
        """(the largest stable value below the smallest failing one, the smallest failing value) as tested so far."""
        failing = [v for v in self.tested if not self.stable(v)] + ([self.risky] if self.risky_known_to_fail else [])
        high = min(failing) if failing else None
        stable = [v for v in self.tested if self.stable(v) and (high is None or v < high)]
        return (max(stable) if stable else None), high

    def next_values(self, count: int) -> list[float]:
        """The values the next round runs (empty: the search is over). The range's ends count as the bracket until
        an arm has run there: the safe end is run only when everything above it failed, so every answer is proven."""
        low, high = self.bracket()
        if (low is None and self.safe in self.tested) or (high is None and self.risky in self.tested):
            return []  # even the safe end fails, or even the risky end is stable: the range holds no boundary
        lower = low if low is not None else self.safe
        upper = high if high is not None else self.risky
        if upper / lower <= PRECISION:  # narrow enough: prove an untested end of the bracket, or stop
            return [self.safe] if low is None else [self.risky] if high is None else []
        if len(self.rounds) >= MAX_ROUNDS:
            return []
        return _new(self, _spread(lower, upper, count))


def _round3(value: float) -> float:
    """3 significant digits: the value an arm's name shows is the value it runs."""
    return float(f"{value:.3g}")


def _spread(low: float, high: float, count: int) -> list[float]:
    """`count` values strictly inside (low, high), evenly spaced in log."""
    if count <= 0:
        return []
    ratio = math.log(high / low)
    return [_round3(low * math.exp(ratio * i / (count + 1))) for i in range(1, count + 1)]


def _new(search: _Search, values: list[float]) -> list[float]:
    return sorted({value for value in values if value not in search.tested})


def _search(knob: str, plan, runner) -> _Search:
    if knob == "lr":
        return _Search(knob, LR_FACTOR_RANGE[0], LR_FACTOR_RANGE[1], risky_known_to_fail=True)
    healthy = [v for v in plan.grad_norms if math.isfinite(v) and v > 0]
    recorded = [v for step, v in runner.store.metric_history(runner.run_id, "grad_norm")
                if math.isfinite(v) and v > 0 and (plan.failing_step is None or step < plan.failing_step)]
    if not healthy or not recorded:
        raise ReplayError(f"run {runner.run_id} recorded no finite gradient norm before the failure: nothing to sweep "
                          "clip thresholds over; try `replay ablate clip=1.0`")
    safe, risky = _round3(min(healthy) / CLIP_BELOW_HEALTHY), _round3(min(max(recorded), CLIP_ABOVE_HEALTHY * max(healthy)))
    if risky <= safe * PRECISION:
        risky = _round3(safe * PRECISION * PRECISION)
    clipped = plan.cfg.train.clip_grad_norm
    if clipped is not None and clipped < risky:  # the run clips already: at and above its threshold is the baseline
        return _Search(knob, min(safe, clipped / CLIP_BELOW_HEALTHY), clipped, risky_known_to_fail=True)
    # The risky end is run, not assumed to fail: a threshold far above the healthy norms may still stop the climb.
    return _Search(knob, safe, risky, risky_known_to_fail=False)


def run_sweep(knob: str, plan, runner) -> tuple[list, dict[str, Any]]:
    """(the sweep's arms, sorted by value; what it found: the stable range, the arms proving it, its cost)."""
    if plan.failing_step is None:
        raise ReplayError(f"run {runner.run_id} never failed: --sweep {knob} searches the values that make a failure go away")
    started = time.perf_counter()
    search = _search(knob, plan, runner)
    while True:
        values = search.next_values(max(1, runner.workers))
        if not values:
            break
        specs = [ArmSpec(knob, value) for value in values]
        runner.add(specs)
        outcomes = runner.run(specs)
        search.rounds.append([spec.name for spec in specs])
        for value, outcome in zip(values, outcomes):
            search.tested[value] = outcome
        if runner.inconclusive:
            break
    arms = [search.tested[value] for value in sorted(search.tested)]
    return arms, _summary(search, runner, time.perf_counter() - started)


def _summary(search: _Search, runner, seconds: float) -> dict[str, Any]:
    low, high = search.bracket()
    stable_arm = search.tested.get(low) if low is not None else None
    failing_arm = search.tested.get(high) if high is not None else None
    non_monotone = sorted(v for v in search.tested if search.stable(v) and high is not None and v > high)
    replays = 1 + len(search.tested)
    data = {
        "knob": search.knob,
        "range": [search.safe, search.risky],
        "precision": PRECISION,
        "stable_max": low,
        "fails_min": high,
        "stable_arm": stable_arm.name if stable_arm else None,
        "stable_run_id": None,  # set when the arms are recorded (report.publish)
        "fails_arm": failing_arm.name if failing_arm else ("baseline" if high is not None else None),
        "rounds": search.rounds,
        "replays": replays,
        "seconds": round(seconds, 2),
        "non_monotone": non_monotone,
    }
    data["conclusion"] = _conclusion(search, low, high, stable_arm, failing_arm, runner, replays, seconds, non_monotone)
    return data


def _shown(knob: str, value: float) -> str:
    return f"{knob}={get(knob).show(value)}"


def _conclusion(search: _Search, low, high, stable_arm, failing_arm, runner, replays: int, seconds: float,
                non_monotone: list[float]) -> str:
    cost = f"{replays} replays (baseline + {replays - 1} arms) in {len(search.rounds)} rounds, {seconds:.1f}s of replays"
    if runner.inconclusive:
        return f"inconclusive: {runner.inconclusive}; {cost}"
    what = "lr factor" if search.knob == "lr" else "clip threshold"
    end = runner.plan.end - 1
    if low is None:
        return (f"no {what} in {_shown(search.knob, search.safe)}..{_shown(search.knob, search.risky)} fixes the failure: even "
                f"{_shown(search.knob, search.safe)} is {search.tested[search.safe].verdict} ({search.tested[search.safe].reason}); {cost}")
    if high is None:
        return (f"every {what} tried up to {_shown(search.knob, search.risky)} stays finite through step {end}: "
                f"{stable_arm.name} fixes ({stable_arm.change}); {cost}")
    failing = (f"{failing_arm.name} {failing_arm.verdict} ({failing_arm.reason})" if failing_arm is not None
               else f"the baseline ({_shown(search.knob, high)}, the run as recorded) fails at step {runner.plan.failing_step}")
    text = (f"the largest {what} that fixes it: {get(search.knob).show(low)} ({stable_arm.name} fixes: {stable_arm.change}; "
            f"{stable_arm.reason}); {failing}; stable where tested from {get(search.knob).show(min(search.tested))} up to "
            f"{get(search.knob).show(low)}; {cost}")
    if non_monotone:
        text += f"; not monotone: {', '.join(_shown(search.knob, v) for v in non_monotone)} also fix"
    return text
