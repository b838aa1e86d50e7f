"""What `replay verify` and `replaybisect.verify` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from replaybisect import request as checks
from replaybisect.core.jobs import JobSettings, given_settings
from replaybisect.errors import ReplayError
from replaybisect.request import REQUIRED, Bound, ReplayRequest, option, option_group


SAMPLE = Bound("verify", ("--sample",), low=0.001, high=1000)


@dataclass(frozen=True)
class VerifyRequest(ReplayRequest):
    """A recorded run (ReplayRequest) and the recorded steps to verify (`steps`: "A:B", "A:" or ":B"; default: all)."""

    run_id: str = option(REQUIRED, "--run-id", help="The run to verify (see `replay runs`).")
    steps: Optional[str] = option(None, "--steps", metavar="A:B", help="Verify the recorded steps A..B-1 (A: or :B "
                                  "too; default: every step of the run), each replayed from its snapshot.")
    sample: Optional[float] = option(None, "--sample", metavar="PER_1000", bound=SAMPLE,
                                     help="Verify a sample of the run: at least this many recorded steps per thousand "
                                     "(e.g. 5), from snapshot intervals drawn at random (the same for the same run).")
    cross_check: bool = option(False, "--cross-check", help="When this machine computes a step differently from the "
                               "one that recorded it, replay it once more on another machine, as a submitit job (SLURM "
                               "when sbatch exists, else submitit's local executor), to say whose hardware it is.")
    jobs: Optional[JobSettings] = option_group(JobSettings)  # where the cross-check's job runs (the API's `submitit={...}`)
    start: Optional[int] = field(init=False, repr=False, compare=False)  # from `steps`
    end: Optional[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        steps = checks.text(self.steps, "steps", optional=True)
        start, end = _span(steps)
        checks.setattrs(self, steps=steps, start=start, end=end, cross_check=checks.flag(self.cross_check, "cross_check"),
                        sample=checks.number(self.sample, "sample", SAMPLE, optional=True))
        if self.sample is not None and self.sample != self.sample:
            raise ReplayError("--sample nan is not a number of steps per thousand; pass e.g. --sample 5")
        if self.sample is not None and steps is not None:
            raise ReplayError("--sample and --steps both choose the steps to verify; pass one of them")
        given_settings(self.jobs, "verify")
        if self.cross_check:
            checks.setattrs(self, jobs=(self.jobs or JobSettings()).checked("verify"))


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
