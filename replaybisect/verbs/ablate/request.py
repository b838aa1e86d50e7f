"""What `replay ablate` and `replaybisect.ablate` are asked: checked when built (replaybisect/request.py), before
any run is read. The arms and options are checked here (`check_options`), which the engine runs again for its
direct callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union, get_args

from replaybisect import request as checks
from replaybisect.errors import ReplayError
from replaybisect.request import MAX_STEPS, MAX_WORKERS, Bound
from replaybisect.core.jobs import JobSettings, settings_from
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import ArmSpec

Executor = Literal["local", "submitit"]  # local processes | SLURM (or submitit's local/debug executors)
Sweep = Literal["lr", "clip"]  # the interventions whose value --sweep searches
EXECUTORS: tuple[str, ...] = get_args(Executor)
SWEEPS: tuple[str, ...] = get_args(Sweep)
DEFAULT_HORIZON = 200

HORIZON = Bound("ablate", ("--horizon",), high=MAX_STEPS)  # below 1: check_options says what the horizon is
WORKERS = Bound("ablate", ("--workers",), high=MAX_WORKERS)  # below 1: check_options says "or leave it out: auto"
TIME_MIN = Bound("ablate", ("--time",), low=1)
GPUS = Bound("ablate", ("--gpus",), low=0)
CPUS = Bound("ablate", ("--cpus",), low=1)
MEM_GB = Bound("ablate", ("--mem-gb",), low=0.001)


@dataclass(frozen=True)
class AblateRequest:
    """The failed run; the arms (`"lr,clip=265"` or a list; None: every intervention, none with `patch`); where they
    start (`from_step`) and how far past the failure they replay (`horizon`); how they run (`workers`, `executor`,
    and submitit's job options); a changed module to replay (`patch`) or a value to search (`sweep`)."""

    run_id: Optional[str]
    arms: Union[str, Sequence[str], None] = None
    from_step: Optional[int] = None
    horizon: int = DEFAULT_HORIZON
    workers: Optional[int] = None
    executor: Executor = "local"
    cluster: Optional[str] = None  # submitit: slurm | local | debug (None: slurm when sbatch exists, else local)
    partition: Optional[str] = None
    time_min: int = 60
    gpus: int = 0
    cpus: Optional[int] = None
    mem_gb: Optional[float] = None
    account: Optional[str] = None
    slurm: Union[Sequence[str], dict] = ()  # extra SLURM parameters: "qos=high", ... (or {"qos": "high"})
    executor_folder: Union[str, Path] = ".replaybisect/submitit"
    sweep: Optional[Sweep] = None
    patch: Union[str, Path, None] = None
    tracking_uri: Optional[str] = None
    code_dirs: Sequence[str] = ()
    trust: Sequence[str] = ()
    allow_unsigned: Optional[str] = None  # this run's id: replayed without a signature that verifies
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
            executor=checks.text(self.executor, "executor"), cluster=checks.text(self.cluster, "cluster", optional=True),
            partition=checks.text(self.partition, "partition", optional=True),
            time_min=checks.integer(self.time_min, "time_min", TIME_MIN), gpus=checks.integer(self.gpus, "gpus", GPUS),
            cpus=checks.integer(self.cpus, "cpus", CPUS, optional=True),
            mem_gb=checks.number(self.mem_gb, "mem_gb", MEM_GB, optional=True),
            account=checks.text(self.account, "account", optional=True),
            slurm=dict(self.slurm) if isinstance(self.slurm, dict) else checks.strings(self.slurm, "slurm", what="KEY=VALUE SLURM parameters"),
            executor_folder=checks.path(self.executor_folder, "executor_folder"),
            sweep=checks.text(self.sweep, "sweep", optional=True), patch=checks.path(self.patch, "patch", optional=True),
            code_dirs=checks.paths(self.code_dirs, "code_dirs"), trust=checks.strings(self.trust, "trust", what="module prefixes"),
            publish=checks.flag(self.publish, "publish"),
        )
        specs = check_options(self.arm_list, horizon=self.horizon, workers=self.workers, executor=self.executor,
                              from_step=self.from_step, patch=self.patch, sweep=self.sweep)
        checks.setattrs(self, specs=specs)  # the arms as checked once: what the engine runs
        if self.executor == "submitit" or self.cluster is not None:
            self.submitit_options()  # checked: one line for a setting that cannot work, before any run is read
        checks.setattrs(self, trusted=checks.trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned))

    @property
    def arm_list(self) -> Union[str, list[str], None]:
        """The arms as engine.ablate takes them."""
        return list(self.arms) if isinstance(self.arms, tuple) else self.arms

    def submitit_options(self) -> JobSettings:
        return settings_from({"cluster": self.cluster, "executor_folder": str(self.executor_folder), "partition": self.partition,
                              "time_min": self.time_min, "gpus": self.gpus, "cpus": self.cpus, "mem_gb": self.mem_gb,
                              "account": self.account, "slurm": dict(self.slurm) if isinstance(self.slurm, dict) else list(self.slurm)})


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


