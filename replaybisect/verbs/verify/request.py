"""What `replay verify` and `replaybisect.verify` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from replaybisect import request as checks
from replaybisect.errors import ReplayError
from replaybisect.request import REQUIRED, option


@dataclass(frozen=True)
class VerifyRequest:
    """The run, the recorded steps to verify (`steps`: "A:B", "A:" or ":B"; default: all), the device to replay on,
    where the store is, and which of the stored config's `_target_`s may be built."""

    run_id: str = option(REQUIRED, "--run-id", help="The run to verify (see `replay runs`).")
    steps: Optional[str] = option(None, "--steps", metavar="A:B", help="Verify the recorded steps A..B-1 (A: or :B "
                                  "too; default: every step of the run), each replayed from its snapshot.")
    device: Optional[str] = option(None, "--device", help="Replay on this device (default: the run's train.device).")
    publish: bool = option(True, "--no-child-run", negated=True, help="Do not record the report as a child run.")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    code_dirs: Sequence[str] = checks.code_dirs_option()
    trust: Sequence[str] = checks.trust_option()
    allow_unsigned: Optional[str] = checks.allow_unsigned_option()  # this run's id: replayed without a signature that verifies
    trusted: Any = field(init=False, repr=False, compare=False)
    torch_device: Any = field(init=False, repr=False, compare=False)
    start: Optional[int] = field(init=False, repr=False, compare=False)  # from `steps`
    end: Optional[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks.setattrs(
            self, tracking_uri=checks.tracking_uri(self.tracking_uri), run_id=checks.run_id(self.run_id),
            steps=checks.text(self.steps, "steps", optional=True),
            device=checks.text(self.device, "device", optional=True), publish=checks.flag(self.publish, "publish"),
            code_dirs=checks.paths(self.code_dirs, "code_dirs"), trust=checks.strings(self.trust, "trust", what="module prefixes"),
        )
        torch_device = None
        if self.device:  # a device this machine lacks is bad input before the store is opened (imports torch)
            from replaybisect.core.device import resolve_device

            torch_device = resolve_device(self.device, "--device")
        start, end = _span(self.steps)
        checks.setattrs(self, start=start, end=end)
        checks.setattrs(self, torch_device=torch_device, trusted=checks.trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned))


def _span(steps: Optional[str]) -> tuple[Optional[int], Optional[int]]:
    """--steps "A:B" (either side may be left out) as (A, B)."""
    if steps is None:
        return None, None
    first, colon, last = steps.partition(":")
    try:
        start = int(first) if first.strip() else None
        end = int(last) if last.strip() else None
    except ValueError:
        start = end = -1
    if not colon or start == -1 or (start is not None and start < 0) or (end is not None and end < 1) or \
            (start is not None and end is not None and start >= end):
        raise ReplayError(f"--steps {steps[:40]!r} is not a range of steps A:B with 0 <= A < B (A: or :B too); pass e.g. --steps 100:200")
    return start, end
