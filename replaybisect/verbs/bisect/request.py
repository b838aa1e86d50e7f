"""What `replay bisect` and `replaybisect.bisect` are asked: checked when built (replaybisect/request.py). What needs
the repository (the commits, the config at each endpoint) or the metric's name is the engine's to check, as soon as
it starts and before anything is written."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from replaybisect import request as checks
from replaybisect.errors import ReplayError
from replaybisect.request import MAX_STEPS, MAX_WORKERS, Bound, argument, option, option_group
from replaybisect.core.jobs import JobSettings

MAX_SEEDS = 100  # seeds per endpoint; each is a training run per tried commit
STEPS = Bound("bisect", ("--steps",), low=1, high=MAX_STEPS)
SEEDS = Bound("bisect", ("--seeds",), low=1, high=MAX_SEEDS)
MOST_SEEDS = Bound("bisect", ("--max-seeds",), low=1, high=3 * MAX_SEEDS)
WORKERS = Bound("bisect", ("--workers", "-w"), low=1, high=MAX_WORKERS)


@dataclass(frozen=True)
class BisectRequest:
    """GOOD and BAD (SHAs, branches, tags) in `repo`; how each tried commit is judged: trained (`config_dir` and
    `config_name` relative to the repository root, `overrides`, `steps`, `metric` against `threshold`, `seeds`) or a
    shell command (`cmd`); `workers` commits at once; `use_cache`: reuse trial results of earlier bisects."""

    good: str = argument(help="A commit that trains well (SHA, branch, tag).")
    bad: str = argument(help="A later commit that does not.")
    repo: Union[str, Path] = option(".", "--repo", help="The git repository (never modified: trials run in a private clone).")
    overrides: Sequence[str] = checks.hydra_overrides()
    config_dir: str = option("conf", "--config-dir", help="Hydra config folder, relative to the repository root at each commit.")
    config_name: str = option("config", "--config-name", help="Primary config in --config-dir.")
    steps: Optional[int] = option(None, bound=STEPS, help="Training steps per trial (default: the config's train.steps).")
    metric: str = option("loss", "--metric", help="Metric judged (lower is better): its mean over the last 10% of logged steps.")
    threshold: Optional[float] = option(None, "--threshold", help="Metric above this is bad (default: judged against the "
                                        "endpoints' measured spread).")
    seeds: int = option(3, bound=SEEDS, help="Seeds the endpoints are measured with (a commit gets more when unclear); "
                        "training only.")
    max_seeds: Optional[int] = option(None, bound=MOST_SEEDS, help="Most seeds for one commit (default 3x --seeds).")
    workers: int = option(1, bound=WORKERS, help="Commits tested in parallel per round.")
    cmd: Optional[str] = option(None, "--cmd", help="Run this shell command instead of training; exit 0 good, 125 skip, "
                                "1-127 bad, >=128 abort.")
    use_cache: bool = option(True, "--no-cache", negated=True, help="Do not reuse trial results of earlier bisects.")
    executor: str = checks.executor_option()  # local | submitit: where the trials run (core/jobs.py)
    jobs: Any = option_group(JobSettings)  # submitit's JobSettings (the Python API's `submitit={...}`, the command's job options)
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    publish: bool = True

    def __post_init__(self) -> None:
        checks.setattrs(
            self, tracking_uri=checks.tracking_uri(self.tracking_uri), good=checks.text(self.good, "good"),
            bad=checks.text(self.bad, "bad"), repo=Path(checks.path(self.repo, "repo")),
            overrides=checks.strings(self.overrides, "overrides", what="Hydra overrides"),
            config_dir=checks.path(self.config_dir, "config_dir"), config_name=checks.text(self.config_name, "config_name"),
            steps=checks.integer(self.steps, "steps", STEPS, optional=True), metric=checks.text(self.metric, "metric"),
            threshold=checks.number(self.threshold, "threshold", optional=True),
            seeds=checks.integer(self.seeds, "seeds", SEEDS),
            max_seeds=checks.integer(self.max_seeds, "max_seeds", MOST_SEEDS, optional=True),
            workers=checks.integer(self.workers, "workers", WORKERS), cmd=checks.text(self.cmd, "cmd", optional=True),
            use_cache=checks.flag(self.use_cache, "use_cache"), publish=checks.flag(self.publish, "publish"),
        )
        from replaybisect.core.jobs import EXECUTORS

        if self.executor not in EXECUTORS:
            raise ReplayError(f"--executor {str(self.executor)[:80]!r} is not one of {', '.join(EXECUTORS)}")
        if self.jobs is not None and not isinstance(self.jobs, JobSettings):
            raise ReplayError(f"jobs={self.jobs!r:.60} is not a JobSettings; pass the options as submitit={{...}}")
        if self.jobs is not None:
            self.jobs.in_range("bisect")
        if self.executor == "submitit":
            checks.setattrs(self, jobs=(self.jobs or JobSettings()).checked("bisect"))
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ReplayError(f"--threshold {self.threshold} must be a finite number (or leave it out: judged from the endpoints)")

    def arguments(self) -> dict:
        """engine.bisect's arguments (but `on_event`)."""
        return dict(good=self.good, bad=self.bad, repo=self.repo, config_dir=self.config_dir, config_name=self.config_name,
                    overrides=list(self.overrides), steps=self.steps, metric=self.metric, threshold=self.threshold,
                    seeds=self.seeds, max_seeds=self.max_seeds, workers=self.workers, cmd=self.cmd,
                    tracking_uri=self.tracking_uri, use_cache=self.use_cache, executor=self.executor, jobs=self.jobs)
