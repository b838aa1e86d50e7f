"""How a run's numbers grew before it failed: the onset and size of a growth by orders of magnitude.

A run that diverges (a learning rate too high, no clipping, a bad init) shows it in its curves before any value
overflows: the gradient norm or the loss climbs steadily by orders of magnitude. `measure` finds that climb in one
series of (step, value) points; `growth_onset` is the first step of the climb that ended in the failure, which
`replay nan` reports and `replay check --run-id` examines the state before. Pure Python: no torch, no store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

DIVERGENCE_GROWTH = 100.0  # a climb by this factor or more is "orders of magnitude"
ONSET_BAND = 2.0  # the climb starts after the last step within this factor of the series' low level
LOW_QUANTILE = 0.1  # the series' low level: its 10th percentile (one unusually low point does not move it)
WINDOW = 200  # points before the end that are read


@dataclass(frozen=True)
class Growth:
    """A series' climb from its onset to its last finite value."""

    metric: str  # what grew: "grad norm", "loss", a layer's "grad norm of fc1"
    onset_step: int  # the last step still within ONSET_BAND of the low level
    last_step: int
    onset_value: float
    last_value: float

    @property
    def factor(self) -> float:
        return self.last_value / self.onset_value

    @property
    def steps(self) -> int:
        return self.last_step - self.onset_step

    @property
    def is_divergence(self) -> bool:
        return self.factor >= DIVERGENCE_GROWTH and self.steps >= 2

    def sentence(self) -> str:
        """e.g. 'grad norm x4.1e+07 over 10 steps (step 5: 0.83 -> step 15: 3.4e+07)'."""
        return (f"{self.metric} x{self.factor:.2g} over {self.steps} steps "
                f"(step {self.onset_step}: {self.onset_value:.3g} -> step {self.last_step}: {self.last_value:.3g})")


def measure(points: Sequence[tuple[int, float]], metric: str) -> Optional[Growth]:
    """The climb at the end of `points` (steps ascending or not); None with fewer than 3 finite positive points."""
    finite = [(int(s), float(v)) for s, v in sorted(points) if v is not None and math.isfinite(v) and v > 0][-WINDOW:]
    if len(finite) < 3:
        return None
    values = sorted(v for _, v in finite)
    low = values[int(LOW_QUANTILE * (len(values) - 1))]
    last_step, last_value = finite[-1]
    onset_step, onset_value = next(((s, v) for s, v in reversed(finite[:-1]) if v <= ONSET_BAND * low), finite[0])
    return Growth(metric, onset_step, last_step, onset_value, last_value)


def divergence(losses: Sequence[tuple[int, float]], grad_norms: Sequence[tuple[int, float]]) -> Optional[Growth]:
    """The climb by orders of magnitude that the gradient norm (else the loss) made before the end, or None."""
    for points, metric in ((grad_norms, "grad norm"), (losses, "loss")):
        growth = measure(points, metric)
        if growth is not None and growth.is_divergence:
            return growth
    return None


def growth_onset(losses: Sequence[tuple[int, float]], grad_norms: Sequence[tuple[int, float]]) -> Optional[int]:
    """The first step of the climb by orders of magnitude that ended the history, or None when there was none."""
    growth = divergence(losses, grad_norms)
    return None if growth is None else growth.onset_step


def earliest_climb(series: dict[str, Sequence[tuple[int, float]]], min_factor: float = 10.0) -> Optional[tuple[str, Growth]]:
    """Of several named series (one per layer), the one whose climb by `min_factor` or more began first
    (ties: the larger climb, then the first name given): the earliest precursor of a divergence."""
    climbs = []
    for order, (name, points) in enumerate(series.items()):
        growth = measure(points, name)
        if growth is not None and growth.factor >= min_factor:
            climbs.append((growth.onset_step, -growth.factor, order, name, growth))
    if not climbs:
        return None
    _, _, _, name, growth = min(climbs)
    return name, growth
