"""What `replay ablate` and `replaybisect.ablate` are asked: checked when built (replaybisect/request.py), before
any run is read. The arms and options are checked here (`check_options`), which the engine runs again for its
direct callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union, get_args

from replaybisect import request as checks
from replaybisect.errors import ReplayError
from replaybisect.request import MAX_STEPS, MAX_WORKERS, Bound, argument, option, option_group
from replaybisect.core.jobs import JobSettings, given_settings
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import ArmSpec

Executor = Literal["local", "submitit"]  # local processes | SLURM (or submitit's local/debug executors)
Sweep = Literal["lr", "clip"]  # the interventions whose value --sweep searches
EXECUTORS: tuple[str, ...] = get_args(Executor)
SWEEPS: tuple[str, ...] = get_args(Sweep)
DEFAULT_HORIZON = 200

HORIZON = Bound("ablate", ("--horizon",), high=MAX_STEPS)  # below 1: check_options says what the horizon is
WORKERS = Bound("ablate", ("--workers",), high=MAX_WORKERS)  # below 1: check_options says "or leave it out: auto"


@dataclass(frozen=True)
class AblateRequest:
    """The failed run; the arms (`"lr,clip=265"` or a list; None: every intervention, none with `patch`); where they
    start (`from_step`) and how far past the failure they replay (`horizon`); how they run (`workers`, `executor`,
    and submitit's job options); a changed module to replay (`patch`) or a value to search (`sweep`)."""

    arms: Union[str, Sequence[str], None] = argument(None, kind=Optional[str], help="Comma-separated arms, bare or with "
                                                     "a value: lr,clip,precision or lr=x0.3,clip=265 (default: all, none "
                                                     "with --patch; see --list).")
    run_id: Optional[str] = option(None, "--run-id", help="The failed run to ablate.")
    from_step: Optional[int] = option(None, "--from-step", help="Apply the changes from this step (default: the snapshot "
                                      "before the failure).")
    horizon: int = option(DEFAULT_HORIZON, bound=HORIZON, help="Replay this many steps past the failing step.")
    workers: Optional[int] = option(None, bound=WORKERS, help="Arms run in parallel: local processes, or SLURM array "
                                    "parallelism with submitit (default: auto: one per arm up to the cores, in-process "
                                    "when the replays are short).")
    executor: Executor = checks.executor_option()
    jobs: Optional[JobSettings] = option_group(JobSettings)  # submitit's settings (the API's `submitit={...}`)
    sweep: Optional[Sweep] = option(None, "--sweep", help="lr | clip: find the largest lr factor (clip threshold) that "
                                    "fixes the failure, by bisection; instead of arms.")
    patch: Union[str, Path, None] = option(None, "--patch", help="Your changed module (fix.py) or a folder of them: replay "
                                           "the failure with it in place of the recorded code.")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    code_dirs: Sequence[str] = checks.code_dirs_option()
    trust: Sequence[str] = checks.trust_option()
    allow_unsigned: Optional[str] = checks.allow_unsigned_option()  # this run's id: replayed without a signature that verifies
    publish: bool = True
    trusted: Any = field(init=False, repr=False, compare=False)  # the trust decision, built when the request is
    specs: Any = field(init=False, repr=False, compare=False)  # the arms as checked (ArmSpecs): what the engine runs

    def __post_init__(self) -> None:
        checks.setattrs(self, tracking_uri=checks.tracking_uri(self.tracking_uri))
        if self.run_id is None or self.run_id == "":
            raise ReplayError("pass --run-id ID of the failed run (find it with `replay runs --status nonfinite`)")
        arms = self.arms if self.arms is None or isinstance(self.arms, str) else checks.strings(self.arms, "arms", what="arms")
        checks.setattrs(
            self, run_id=checks.run_id(self.run_id), arms=arms,
            from_step=checks.integer(self.from_step, "from_step", optional=True),
            horizon=checks.integer(self.horizon, "horizon", HORIZON),
            workers=checks.integer(self.workers, "workers", WORKERS, optional=True),
            executor=checks.text(self.executor, "executor"),
            sweep=checks.text(self.sweep, "sweep", optional=True), patch=checks.path(self.patch, "patch", optional=True),
            code_dirs=checks.paths(self.code_dirs, "code_dirs"), trust=checks.strings(self.trust, "trust", what="module prefixes"),
            publish=checks.flag(self.publish, "publish"),
        )
        specs = check_options(self.arm_list, horizon=self.horizon, workers=self.workers, executor=self.executor,
                              from_step=self.from_step, patch=self.patch, sweep=self.sweep)
        checks.setattrs(self, specs=specs)  # the arms as checked once: what the engine runs
        given_settings(self.jobs, "ablate")
        if self.executor == "submitit" or self.jobs is not None and self.jobs.cluster is not None:
            # checked: one line for a setting that cannot work, before any run is read
            checks.setattrs(self, jobs=(self.jobs or JobSettings()).checked("ablate"))
        checks.setattrs(self, trusted=checks.trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned))

    @property
    def arm_list(self) -> Union[str, list[str], None]:
        """The arms as engine.ablate takes them."""
        return list(self.arms) if isinstance(self.arms, tuple) else self.arms

def parse_arms(arms: Optional[str | list[str]], default_all: bool = True) -> list[ArmSpec]:
    """'lr,clip=265' -> [ArmSpec('lr'), ArmSpec('clip', 265.0)]; None/empty -> every registered intervention that
    runs bare (or none when not `default_all`). Unknown arms and bad values are one-line errors, before anything runs."""
    if arms is None or (isinstance(arms, str) and not arms.strip()):
        return [ArmSpec(name) for name in interventions.names() if interventions.get(name).by_default] if default_all else []
    items = arms.split(",") if isinstance(arms, str) else [a for part in arms for a in part.split(",")]
    specs: list[ArmSpec] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        spec = interventions.parse_arm(item)
        if spec.label not in {s.label for s in specs}:  # `lr` and `lr=x0.1` are one arm
            specs.append(spec)
    if not specs:
        raise ReplayError(f"no arms given; valid arms: {', '.join(interventions.names())}")
    return specs


def check_options(arms, *, horizon: int, workers: Optional[int], executor: str, from_step: Optional[int],
                  patch: Optional[str] = None, sweep: Optional[str] = None) -> list[ArmSpec]:
    """Everything about the options that is wrong before any run is read (light: no torch, no MLflow)."""
    if sweep is not None and sweep not in SWEEPS:
        as_arm = f", or try {sweep} as an arm: replay ablate {sweep}" if sweep in interventions.names() else ""
        raise ReplayError(f"--sweep {sweep[:80]!r} cannot be swept; --sweep takes {' or '.join(SWEEPS)} (a number to search)"
                          + as_arm)
    if sweep is not None and (patch is not None or (arms and str(arms).strip())):
        raise ReplayError(f"--sweep {sweep} runs its own arms; leave out the arms{' and --patch' if patch else ''} (run them in another `replay ablate`)")
    names = parse_arms(arms, default_all=patch is None) if sweep is None else []
    if patch is not None:
        from replaybisect.verbs.ablate.patch import check_path

        check_path(patch)
    if horizon <= 0:
        raise ReplayError(f"--horizon {horizon} must be a positive number of steps past the failing step (e.g. --horizon {DEFAULT_HORIZON})")
    if workers is not None and workers < 1:
        raise ReplayError(f"--workers {workers} must be at least 1 (or leave it out: auto)")
    if executor not in EXECUTORS:
        raise ReplayError(f"unknown executor {executor!r}; use one of {', '.join(EXECUTORS)}")
    if from_step is not None and from_step < 0:
        raise ReplayError(f"--from-step {from_step} must be a step >= 0")
    return names


def checked_failing_step(store, run_id: str, from_step: Optional[int]) -> Optional[int]:
    """The run's first non-finite step; a run that never failed needs --from-step, which must not be after it. Light:
    the command asks it before torch is imported."""
    from replaybisect.core.tags import failing_step as first_failing

    failing_step = first_failing(store, run_id)
    if failing_step is None and from_step is None:
        raise ReplayError(
            f"run {run_id} never failed (no non-finite loss or gradient norm recorded); "
            "pass --from-step S to ablate it from step S anyway"
        )
    if failing_step is not None and from_step is not None and from_step > failing_step:
        raise ReplayError(f"--from-step {from_step} is after the failing step {failing_step}; pass a step <= {failing_step}")
    return failing_step
