"""What `replay profile` and `replaybisect.profile` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from replaybisect import request as checks
from replaybisect.request import REQUIRED, Bound, ReplayRequest, option

STEP = Bound("profile", ("--step",), low=0)
STEPS = Bound("profile", ("--steps",), low=1, high=100)


@dataclass(frozen=True)
class ProfileRequest(ReplayRequest):
    """A recorded run (ReplayRequest), the step to profile (default: its slowest recorded step) and how many steps
    from there."""

    run_id: str = option(REQUIRED, "--run-id", help="The run to profile (see `replay runs`).")
    publish: bool = option(True, "--no-child-run", negated=True, help="Do not record the report and the trace as a child run.")
    step: Optional[int] = option(None, bound=STEP, help="Profile from this step (default: the run's slowest recorded "
                                 "step, by its logged step_time).")
    steps: int = option(3, bound=STEPS, help="How many recorded steps to profile, from --step.")

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.setattrs(self, step=checks.integer(self.step, "step", STEP, optional=True),
                        steps=checks.integer(self.steps, "steps", STEPS))
