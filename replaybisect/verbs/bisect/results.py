"""What a bisect finds: each trial's seed runs, the endpoints' baseline, the tried commits and the result."""

from __future__ import annotations

from typing import Optional

from dataclasses import dataclass, field

from replaybisect.errors import ReplayError
from replaybisect.verbs.bisect.gitops import CommitInfo
from replaybisect.core.thresholds import REPLAY_RELATIVE_TOLERANCE as REPRODUCE_RTOL

ALPHA = 0.01  # Chromium Pinpoint calls two samples different at p <= 0.01


class BisectAborted(ReplayError):
    """The `--cmd` asked to abort (exit status >= 128), as `git bisect run` does."""


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class SeedRun:
    """One training run (or one `--cmd` run) of one commit with one seed."""

    seed: int
    outcome: str  # ok | nonfinite | skip (training); good | bad | skip (--cmd)
    metric: float | None = None
    run_id: str | None = None
    cached: bool = False
    detail: str = ""  # one line: why a skip, where non-finite, the exit status
    seconds: float = 0.0


@dataclass
class Trial:
    """What was learnt about one commit."""

    sha: str
    position: int  # in BAD's first-parent history; GOOD is 0, BAD is len(history) - 1
    subject: str
    verdict: str  # good | bad | skip
    runs: list[SeedRun] = field(default_factory=list)
    round: int = 0  # 0 = the endpoints
    z: float | None = None
    p: float | None = None
    note: str = ""

    @property
    def metrics(self) -> list[float]:
        return [run.metric for run in self.runs if run.metric is not None]

    @property
    def metric(self) -> float | None:
        values = self.metrics
        return sum(values) / len(values) if values else None

    @property
    def seeds(self) -> list[int]:
        return [run.seed for run in self.runs]

    @property
    def cached(self) -> bool:
        return bool(self.runs) and all(run.cached for run in self.runs)


@dataclass
class Baseline:
    """What the endpoints measured, and the test every other commit is judged with."""

    mode: str  # paired | threshold | nonfinite | cmd
    metric_name: str
    good: dict[int, float] = field(default_factory=dict)  # seed -> metric
    bad: dict[int, float] = field(default_factory=dict)
    bad_nonfinite_seeds: list[int] = field(default_factory=list)
    threshold: float | None = None
    sigma: float = 0.0  # noise of one u_s (see the module docstring)
    p_endpoints: float | None = None
    seeds: list[int] = field(default_factory=list)  # seeds both endpoints were measured with

    def describe(self) -> str:
        if self.mode == "cmd":
            return "--cmd exit status: 0 good, 125 skip, 1-127 bad, >=128 abort (git bisect run)"
        if self.mode == "nonfinite":
            extra = f", and {self.metric_name} <= {self.threshold:g}" if self.threshold is not None else ""
            return f"BAD diverges (non-finite at seeds {self.bad_nonfinite_seeds}): a commit is bad if it is non-finite at those seeds{extra}"
        if self.mode == "threshold":
            return (f"{self.metric_name} against --threshold {self.threshold:g}: z-test of the seed mean, sigma {self.sigma:.3g} "
                    f"(endpoints' pooled seed spread), decided at p <= {ALPHA}")
        return (f"per seed: reproduces GOOD or BAD (within {REPRODUCE_RTOL:g} relative), else a z-test against the midpoint "
                f"of GOOD and BAD at the same seed, sigma {self.sigma:.3g} from the endpoints' paired differences; "
                f"decided at p <= {ALPHA}, else one more seed")


@dataclass
class BisectResult:
    good: str
    bad: str
    first_bad: str | None  # None when skipped commits leave more than one candidate
    candidates: list[str]  # the commits the first bad one could be (one when found)
    commit: CommitInfo | None  # subject, author, date and diffstat of first_bad
    trials: list[Trial]  # in history order
    history_length: int  # commits in GOOD..BAD on the first-parent chain, GOOD included
    n_rounds: int
    workers: int
    mode: str  # train | cmd
    metric_name: str
    baseline: Baseline
    n_runs: int  # runs executed by this bisect
    n_cached: int  # runs reused from earlier bisects
    seconds: float
    run_id: str | None = None  # the kind=bisect MLflow run
    repo: str = ""
    tracking_uri: str = ""  # the store holding run_id and the trials (where report.publish writes)
    # the first op of the first step whose outputs the commit changed (core/op_trace.first_difference), with both
    # sides: {index, good: {op, out, at}, bad: {...}, same_op, ops, commits, rows: the two steps' ops aligned around
    # it (core/op_trace.aligned), rendered as ops.html}; {"error": ...} when no trace could be made;
    # None when the ops' outputs are the same (or the bisect ran --cmd)
    numerics: Optional[dict] = None

    @property
    def n_trials(self) -> int:
        return len(self.trials)

    @property
    def subject(self) -> str | None:
        return self.commit.subject if self.commit else None

    def to_dict(self) -> dict:
        """The JSON of DESIGN §5: {first_bad, subject, n_trials, trials:[{sha, verdict, metric, seeds, run_id}]} and more."""
        return {
            "first_bad": self.first_bad,
            "subject": self.subject,
            "author": self.commit.author if self.commit else None,
            "date": self.commit.date if self.commit else None,
            "diffstat": self.commit.diffstat if self.commit else None,
            "candidates": self.candidates,
            "n_trials": self.n_trials,
            "trials": [
                {
                    "sha": trial.sha,
                    "position": trial.position,
                    "subject": trial.subject,
                    "verdict": trial.verdict,
                    "metric": trial.metric,
                    "seeds": trial.seeds,
                    "metrics": [run.metric for run in trial.runs],
                    "outcomes": [run.outcome for run in trial.runs],
                    "run_id": trial.runs[0].run_id if trial.runs else None,
                    "run_ids": [run.run_id for run in trial.runs],
                    "cached": trial.cached,
                    "round": trial.round,
                    "z": trial.z,
                    "p": trial.p,
                    "note": trial.note,
                }
                for trial in self.trials
            ],
            "good": self.good,
            "bad": self.bad,
            "history_length": self.history_length,
            "n_rounds": self.n_rounds,
            "workers": self.workers,
            "mode": self.mode,
            "metric_name": self.metric_name,
            "test": self.baseline.describe(),
            "endpoints": {
                "good": self.baseline.good,
                "bad": self.baseline.bad,
                "bad_nonfinite_seeds": self.baseline.bad_nonfinite_seeds,
                "p": self.baseline.p_endpoints,
                "sigma": self.baseline.sigma,
                "threshold": self.baseline.threshold,
            },
            "n_runs": self.n_runs,
            "n_cached": self.n_cached,
            "numerics": self.numerics,
            "seconds": round(self.seconds, 3),
            "run_id": self.run_id,
            "repo": self.repo,
        }
