"""What `replay nan` and `replaybisect.find_nan` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from replaybisect import request as checks
from replaybisect.core.config import MAX_PROCESSES
from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.request import REQUIRED, Bound, ReplayRequest, option

STEP = Bound("nan", ("--step",), low=0)
NPROC = Bound("nan", ("--nproc",), low=1, high=MAX_PROCESSES)


@dataclass(frozen=True)
class NanRequest(ReplayRequest):
    """A failed run (ReplayRequest), the step to examine (default: its first non-finite step), and for a distributed
    run the processes to replay it over."""

    run_id: str = option(REQUIRED, "--run-id", help="The run that went non-finite.")
    step: Optional[int] = option(None, bound=STEP, help="Examine this step instead of the run's first non-finite step.")
    nproc: Optional[int] = option(None, bound=NPROC, help="A distributed run: replay it over the real collective, one "
                                  "process per recorded rank on this machine (gloo), for what one process cannot reproduce.")

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.setattrs(self, step=checks.integer(self.step, "step", STEP, optional=True),
                        nproc=checks.integer(self.nproc, "nproc", NPROC, optional=True))


def target_step(run_id: str, step: int | None, recorded: int | None, tags: dict, losses: dict, grad_norms: dict) -> int:
    """The step `replay nan` examines: `step`, else the run's first non-finite step (`recorded`); a run that never
    failed, or a step that was finite, is one line. Light: the command asks it before torch is imported."""
    if step is None:
        if recorded is None:
            if tags.get("status") == "nonfinite":
                raise SnapshotError(
                    f"run {run_id} stopped on a non-finite value but recorded no metrics or snapshots (recorder off); "
                    "retrain with snapshot.enabled=true and snapshot.every > 0 to make it replayable"
                )
            raise ReplayError(
                f"run {run_id} never went non-finite (every logged loss and grad_norm is finite); "
                f"to read its curves run `replay diagnose --run-id {run_id}`"
            )
        return recorded
    if step < 0:
        raise ReplayError(f"--step {step} is negative; pass a step of run {run_id} (its first non-finite step is {recorded})")
    logged = [v for v in (losses.get(step), grad_norms.get(step)) if v is not None]
    last = max(list(losses) + list(grad_norms) + ([recorded] if recorded is not None else []), default=-1)
    if step > last:
        raise ReplayError(f"--step {step} is past the run's last step ({last}); pass a step the run reached")
    if step != recorded and logged and all(math.isfinite(v) for v in logged):
        where = f"its first non-finite step is {recorded}" if recorded is not None else "the run never went non-finite"
        raise ReplayError(f"step {step} of run {run_id} was finite (loss {losses.get(step)}); nothing to diagnose there; {where}")
    return step
