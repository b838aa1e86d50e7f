"""What `replay memory` and `replaybisect.memory` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from replaybisect import request as checks
from replaybisect.request import REQUIRED, Bound, option

STEP = Bound("memory", ("--step",), low=0)
STEPS = Bound("memory", ("--steps",), low=3, high=100)


@dataclass(frozen=True)
class MemoryRequest:
    """The run, the snapshot to replay from (at or before `step`; default: the newest with `steps` recorded steps after
    it) and how many steps to watch, the device, where the store is, and which `_target_`s may be built."""

    run_id: str = option(REQUIRED, "--run-id", help="The run whose memory grew (see `replay diagnose`'s memory-leak).")
    step: Optional[int] = option(None, bound=STEP, help="Replay from the snapshot at or before this step (default: the "
                                 "newest with --steps recorded steps after it).")
    steps: int = option(4, bound=STEPS, help="How many recorded steps to watch (at least 3: growth is told over steps).")
    device: Optional[str] = option(None, "--device", help="Replay on this device (default: the run's train.device).")
    publish: bool = option(True, "--no-child-run", negated=True, help="Do not record the report as a child run.")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    code_dirs: Sequence[str] = checks.code_dirs_option()
    trust: Sequence[str] = checks.trust_option()
    allow_unsigned: Optional[str] = checks.allow_unsigned_option()  # this run's id: replayed without a signature that verifies
    trusted: Any = field(init=False, repr=False, compare=False)
    torch_device: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks.setattrs(
            self, tracking_uri=checks.tracking_uri(self.tracking_uri), run_id=checks.run_id(self.run_id),
            step=checks.integer(self.step, "step", STEP, optional=True), steps=checks.integer(self.steps, "steps", STEPS),
            device=checks.text(self.device, "device", optional=True), publish=checks.flag(self.publish, "publish"),
            code_dirs=checks.paths(self.code_dirs, "code_dirs"), trust=checks.strings(self.trust, "trust", what="module prefixes"),
        )
        torch_device = None
        if self.device:  # a device this machine lacks is bad input before the store is opened (imports torch)
            from replaybisect.core.device import resolve_device

            torch_device = resolve_device(self.device, "--device")
        checks.setattrs(self, torch_device=torch_device, trusted=checks.trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned))
