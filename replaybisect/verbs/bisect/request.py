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
from replaybisect.request import MAX_STEPS, MAX_WORKERS, Bound

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

    good: str
    bad: str
    repo: Union[str, Path] = "."
    overrides: Sequence[str] = ()
    config_dir: str = "conf"
    config_name: str = "config"
    steps: Optional[int] = None
    metric: str = "loss"
    threshold: Optional[float] = None
    seeds: int = 3
    max_seeds: Optional[int] = None
    workers: int = 1
    cmd: Optional[str] = None
    tracking_uri: Optional[str] = None
    use_cache: bool = True
    publish: bool = True
    executor: str = "local"  # local | submitit: where the trials run (core/jobs.py)
    jobs: Any = None  # submitit's JobSettings (the Python API's `submitit={...}`, the command's job options)

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
        from replaybisect.core.jobs import EXECUTORS, JobSettings

        if self.executor not in EXECUTORS:
            raise ReplayError(f"--executor {str(self.executor)[:80]!r} is not one of {', '.join(EXECUTORS)}")
        if self.jobs is not None and not isinstance(self.jobs, JobSettings):
            raise ReplayError(f"jobs={self.jobs!r:.60} is not a JobSettings; pass the options as submitit={{...}}")
        if self.executor == "submitit":
            checks.setattrs(self, jobs=(self.jobs or JobSettings()).checked())
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ReplayError(f"--threshold {self.threshold} must be a finite number (or leave it out: judged from the endpoints)")

    def arguments(self) -> dict:
        """engine.bisect's arguments (but `on_event`)."""
        return dict(good=self.good, bad=self.bad, repo=self.repo, config_dir=self.config_dir, config_name=self.config_name,
                    overrides=list(self.overrides), steps=self.steps, metric=self.metric, threshold=self.threshold,
                    seeds=self.seeds, max_seeds=self.max_seeds, workers=self.workers, cmd=self.cmd,
                    tracking_uri=self.tracking_uri, use_cache=self.use_cache, executor=self.executor, jobs=self.jobs)
