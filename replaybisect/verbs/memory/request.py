"""What `replay memory` and `replaybisect.memory` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from replaybisect import request as checks
from replaybisect.request import REQUIRED, Bound, ReplayRequest, option

STEP = Bound("memory", ("--step",), low=0)
STEPS = Bound("memory", ("--steps",), low=3, high=100)


@dataclass(frozen=True)
class MemoryRequest(ReplayRequest):
    """A recorded run (ReplayRequest), the snapshot to replay from (at or before `step`; default: the newest with
    `steps` recorded steps after it) and how many steps to watch."""

    run_id: str = option(REQUIRED, "--run-id", help="The run whose memory grew (see `replay diagnose`'s memory-leak) "
                         "or whose step ran out of memory.")
    step: Optional[int] = option(None, bound=STEP, help="Replay from the snapshot at or before this step (default: the "
                                 "newest with --steps recorded steps after it).")
    steps: int = option(4, bound=STEPS, help="How many recorded steps to watch (at least 3: growth is told over steps).")

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.setattrs(self, step=checks.integer(self.step, "step", STEP, optional=True),
                        steps=checks.integer(self.steps, "steps", STEPS))
