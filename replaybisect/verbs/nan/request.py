"""What `replay nan` and `replaybisect.find_nan` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from replaybisect import request as checks
from replaybisect.core.config import MAX_PROCESSES
from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.request import REQUIRED, Bound, option

STEP = Bound("nan", ("--step",), low=0)
NPROC = Bound("nan", ("--nproc",), low=1, high=MAX_PROCESSES)


@dataclass(frozen=True)
class NanRequest:
    """The failed run, the step to examine (default: its first non-finite step), the device to replay on (default:
    the run's train.device), where the store is, and which of the stored config's `_target_`s may be built."""

    run_id: str = option(REQUIRED, "--run-id", help="The run that went non-finite.")
    step: Optional[int] = option(None, bound=STEP, help="Examine this step instead of the run's first non-finite step.")
    device: Optional[str] = option(None, "--device", help="Replay on this device (default: the run's train.device).")
    nproc: Optional[int] = option(None, bound=NPROC, help="A distributed run: replay it over the real collective, one "
                                  "process per recorded rank on this machine (gloo), for what one process cannot reproduce.")
    publish: bool = option(True, "--no-child-run", negated=True, help="Do not record the report as a child run.")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    code_dirs: Sequence[str] = checks.code_dirs_option()
    trust: Sequence[str] = checks.trust_option()
    allow_unsigned: Optional[str] = checks.allow_unsigned_option()  # this run's id: replayed without a signature that verifies
    # built from the fields above when the request is: the trust decision, the device (a torch.device, or None)
    trusted: Any = field(init=False, repr=False, compare=False)
    torch_device: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks.setattrs(
            self, tracking_uri=checks.tracking_uri(self.tracking_uri), run_id=checks.run_id(self.run_id),
            step=checks.integer(self.step, "step", STEP, optional=True),
            nproc=checks.integer(self.nproc, "nproc", NPROC, optional=True),
            device=checks.text(self.device, "device", optional=True),
            code_dirs=checks.paths(self.code_dirs, "code_dirs"), trust=checks.strings(self.trust, "trust", what="module prefixes"),
            publish=checks.flag(self.publish, "publish"),
        )
        torch_device = None
        if self.device:  # a device this machine lacks is bad input before the store is opened (imports torch)
            from replaybisect.core.device import resolve_device

            torch_device = resolve_device(self.device, "--device")
        checks.setattrs(self, torch_device=torch_device, trusted=checks.trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned))


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
