"""The statistics and the search: a commit judged good or bad against the endpoints' baseline (Pinpoint's
bar), the endpoints verified, and the next commits to test (W at a time, skips as git bisect does)."""

from __future__ import annotations

import math
from typing import Sequence

from replaybisect.core.thresholds import REPLAY_RELATIVE_TOLERANCE as REPRODUCE_RTOL
from replaybisect.verbs.bisect.results import ALPHA, Baseline, SeedRun
Z_DECIDE = 2.5758293035489  # two-sided normal quantile for ALPHA (scipy.stats.norm.isf(0.005))
UNCLEAR_P = 0.2  # endpoints with ALPHA < p <= this get more seeds before BAD is called passing
MIN_NOISE_FRACTION = 0.05  # sigma floor as a fraction of the endpoint gap (deterministic CPU runs have 0 spread)
MIN_EFFECT_OF_SPREAD = 0.1  # a BAD less than a tenth of GOOD's seed spread worse is "equal within noise"


# ---------------------------------------------------------------------------------------------
# the search (pure: positions and verdicts only)
# ---------------------------------------------------------------------------------------------
class Search:
    """Bisection over positions 0..n of BAD's first-parent history: 0 is GOOD, n is BAD."""

    def __init__(self, n: int):
        self.n = n
        self.verdicts: dict[int, str] = {0: "good", n: "bad"}
        self.rounds = 0

    @property
    def hi(self) -> int:
        """The first known bad position."""
        return min(position for position, verdict in self.verdicts.items() if verdict == "bad")

    @property
    def lo(self) -> int:
        """The last known good position before `hi` (a noisy oracle may call a later commit good: ignored)."""
        hi = self.hi
        return max(position for position, verdict in self.verdicts.items() if verdict == "good" and position < hi)

    def untested(self) -> list[int]:
        return [position for position in range(self.lo + 1, self.hi) if position not in self.verdicts]

    def next_round(self, width: int) -> list[int]:
        """Up to `width` positions splitting the unknown range into width+1 equal parts; a skipped or
        already chosen position gives way to the nearest untested one (as `git bisect skip` does)."""
        available = self.untested()
        lo, hi = self.lo, self.hi
        chosen: list[int] = []
        for k in range(1, width + 1):
            free = [position for position in available if position not in chosen]
            if not free:
                break
            ideal = lo + (hi - lo) * k / (width + 1)
            chosen.append(min(free, key=lambda position: (abs(position - ideal), position)))
        if chosen:
            self.rounds += 1
        return sorted(chosen)

    def record(self, position: int, verdict: str) -> None:
        self.verdicts[position] = verdict

    @property
    def done(self) -> bool:
        return not self.untested()

    def candidates(self) -> list[int]:
        """Where the first bad commit can be: `hi`, preceded by the skipped commits right before it."""
        lo, hi = self.lo, self.hi
        return [position for position in range(lo + 1, hi) if self.verdicts.get(position) == "skip"] + [hi]


# ---------------------------------------------------------------------------------------------
# the verdict (pure: numbers in, verdict out)
# ---------------------------------------------------------------------------------------------
def judge(baseline: Baseline, runs: Sequence[SeedRun], max_seeds: int) -> tuple[str | None, float | None, float | None, str]:
    """(verdict or None for "needs another seed", z, p, note) for one commit's runs so far."""
    for run in runs:
        if run.outcome == "skip":
            return "skip", None, None, run.detail
        if run.outcome == "nonfinite":
            return "bad", None, None, f"non-finite at seed {run.seed}" + (f": {run.detail}" if run.detail else "")
    if baseline.mode == "cmd":
        return (runs[0].outcome, None, None, runs[0].detail) if runs else (None, None, None, "")
    if baseline.mode == "nonfinite":
        tested = {run.seed for run in runs}
        if not set(baseline.bad_nonfinite_seeds) <= tested:
            return None, None, None, ""
        if baseline.threshold is not None:
            mean = sum(run.metric for run in runs) / len(runs)
            if mean > baseline.threshold:
                return "bad", None, None, f"finite, but {baseline.metric_name} {mean:.4g} > threshold {baseline.threshold:g}"
        return "good", None, None, f"finite at seeds {sorted(tested)} where BAD diverges"

    if baseline.mode == "paired":
        same = {_reproduces(run.metric, baseline.good[run.seed], baseline.bad[run.seed]) for run in runs}
        if len(same) == 1 and None not in same:
            side = same.pop()
            endpoint = "GOOD" if side == "good" else "BAD"
            return side, None, None, f"reproduces {endpoint} at seed{'s' * (len(runs) > 1)} {', '.join(str(run.seed) for run in runs)}"
        deltas = [run.metric - (baseline.good[run.seed] + baseline.bad[run.seed]) / 2 for run in runs]
    else:  # threshold
        deltas = [run.metric - baseline.threshold for run in runs]
    if not deltas:
        return None, None, None, ""
    n = len(deltas)
    mean = sum(deltas) / n
    z = mean / (baseline.sigma / math.sqrt(n))
    p = math.erfc(abs(z) / math.sqrt(2))  # two-sided normal p-value
    side = "bad" if mean > 0 else "good"
    if abs(z) >= Z_DECIDE:
        return side, z, p, f"z={z:+.2f} over {n} seed{'s' * (n > 1)}"
    if n >= max_seeds:
        return side, z, p, f"undecided after {n} seeds (z={z:+.2f}, p={p:.2g}): nearer {side.upper()}"
    return None, z, p, ""


def _reproduces(value: float, good: float, bad: float) -> str | None:
    """"good"/"bad" when `value` equals that endpoint's metric at the same seed (within REPRODUCE_RTOL)."""
    for side, ref, other in (("good", good, bad), ("bad", bad, good)):
        tolerance = REPRODUCE_RTOL * max(abs(ref), 1e-12)
        if abs(value - ref) <= tolerance and abs(value - other) > 10 * tolerance:
            return side
    return None


def endpoint_baseline(metric_name: str, good: list[SeedRun], bad: list[SeedRun], threshold: float | None,
                      good_sha: str, bad_sha: str) -> tuple[Baseline | None, str | None]:
    """The baseline from the endpoint runs, or (None, error) when GOOD fails / BAD passes; (None, None) = more seeds."""
    import statistics

    short_good, short_bad = good_sha[:10], bad_sha[:10]
    for run in good:
        if run.outcome == "skip":
            return None, f"GOOD {short_good} cannot be trained (seed {run.seed}: {run.detail}); pick a GOOD commit that trains"
        if run.outcome == "nonfinite":
            return None, f"GOOD {short_good} fails: non-finite at seed {run.seed} ({run.detail}); pick an earlier GOOD commit"
    for run in bad:
        if run.outcome == "skip":
            return None, f"BAD {short_bad} cannot be trained (seed {run.seed}: {run.detail}); pick a BAD commit that trains and fails"
    good_metrics = {run.seed: run.metric for run in good}
    seeds = sorted(good_metrics)
    good_values = [good_metrics[s] for s in seeds]
    good_spread = statistics.stdev(good_values) if len(good_values) > 1 else 0.0
    summary_good = f"GOOD {short_good} {metric_name} {_mean(good_values):.5g} ± {good_spread:.2g}"
    nonfinite = [run.seed for run in bad if run.outcome == "nonfinite"]
    if nonfinite:
        if threshold is not None and _mean(good_values) > threshold:
            return None, f"GOOD {short_good} fails: {summary_good} over seeds {seeds} is above --threshold {threshold:g}; pick an earlier GOOD or raise --threshold"
        return Baseline("nonfinite", metric_name, good=good_metrics, bad_nonfinite_seeds=nonfinite,
                        threshold=threshold, p_endpoints=0.0, seeds=seeds), None

    bad_metrics = {run.seed: run.metric for run in bad}
    bad_values = [bad_metrics[s] for s in seeds]
    bad_spread = statistics.stdev(bad_values) if len(bad_values) > 1 else 0.0
    summary = f"{summary_good}, BAD {short_bad} {_mean(bad_values):.5g} ± {bad_spread:.2g} over seeds {seeds}"

    if threshold is not None:
        if _mean(good_values) > threshold:
            return None, f"GOOD {short_good} fails: {summary}, threshold {threshold:g}; pick an earlier GOOD or raise --threshold"
        if _mean(bad_values) <= threshold:
            return None, f"BAD {short_bad} passes: {summary}, threshold {threshold:g}; pick a later BAD or lower --threshold"
        pooled = math.sqrt((good_spread**2 + bad_spread**2) / 2)
        sigma = max(pooled, MIN_NOISE_FRACTION * (threshold - _mean(good_values)), 1e-12)
        return Baseline("threshold", metric_name, good=good_metrics, bad=bad_metrics, threshold=threshold,
                        sigma=sigma, p_endpoints=None, seeds=seeds), None

    diffs = [bad_metrics[s] - good_metrics[s] for s in seeds]
    gap = _mean(diffs)
    diff_spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    min_effect = max(MIN_EFFECT_OF_SPREAD * good_spread, 1e-9 * abs(_mean(good_values)), 1e-12)
    if gap <= min_effect:
        p = 1.0
    elif len(diffs) < 2 or diff_spread <= 1e-9 * gap:
        p = 0.0  # one seed (no spread to test against) or a constant shift at every seed
    else:
        from scipy import stats

        p = float(stats.ttest_rel(bad_values, good_values, alternative="greater").pvalue)
    if p > ALPHA:
        if p <= UNCLEAR_P:
            return None, None  # unclear: measure both endpoints on more seeds
        return None, (f"BAD {short_bad} does not fail: {summary} (paired difference {gap:+.3g}, one-sided paired "
                      f"t-test p={p:.2g} > {ALPHA}); pick a BAD commit that fails, pass more --seeds, or set --threshold")
    sigma = max(math.sqrt(0.75) * diff_spread, MIN_NOISE_FRACTION * gap)
    return Baseline("paired", metric_name, good=good_metrics, bad=bad_metrics, sigma=sigma, p_endpoints=p, seeds=seeds), None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
