"""The gradient norm (used by `replay nan`)'s trend before the failing step: a least-squares fit of log(grad_norm) over the last
finite steps, its growth per step and how sure it is."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from replaybisect.core.thresholds import GRAD_NORM_TREND_EXPLODING_FACTOR as EXPLODING_FACTOR
from replaybisect.core.thresholds import GRAD_NORM_TREND_P as EXPLODING_P

HISTORY_WINDOW = 50  # fit log(grad_norm) over the last <= 50 finite steps before t
HISTORY_MIN_POINTS = 8


@dataclass
class HistoryFit:
    """The loss / grad-norm curves before the failing step, and an exponential fit of the grad norm."""

    steps: int  # points in the fit
    first_step: Optional[int]
    last_step: Optional[int]
    growth_per_step: Optional[float]  # exp(slope) - 1 of log(grad_norm) vs step
    growth_over_window: Optional[float]  # fitted grad_norm(last) / grad_norm(first)
    r_squared: Optional[float]
    p_value: Optional[float]
    exploding: bool
    last_grad_norm: Optional[float]
    last_loss: Optional[float]
    summary: str


# ---- history -----------------------------------------------------------------------------------------------------
def history_fit(losses: list[tuple[int, float]], grad_norms: list[tuple[int, float]]) -> HistoryFit:
    """Fit log(grad_norm) vs step over the last <= 50 finite steps: exponential growth shows as a straight line."""
    points = [(s, g) for s, g in grad_norms if math.isfinite(g) and g > 0][-HISTORY_WINDOW:]
    last_loss = next((v for _, v in reversed(losses) if math.isfinite(v)), None)
    last_grad = points[-1][1] if points else None
    if len(points) < HISTORY_MIN_POINTS:
        return HistoryFit(len(points), points[0][0] if points else None, points[-1][0] if points else None, None, None, None, None,
                          False, last_grad, last_loss, f"too few grad-norm points before the failure ({len(points)}) to fit a trend")
    steps = [s for s, _ in points]
    logs = [math.log(g) for _, g in points]
    if max(logs) - min(logs) < 1e-12:
        fit_slope, r_value, p_value = 0.0, 0.0, 1.0
    else:
        fit_slope, r_value, p_value = linear_fit(steps, logs)
    growth = math.exp(fit_slope) - 1
    over = math.exp(fit_slope * (steps[-1] - steps[0]))
    exploding = fit_slope > 0 and p_value <= EXPLODING_P and over >= EXPLODING_FACTOR
    if exploding:
        summary = (f"exploding gradients: the grad norm grew exponentially, x{over:.3g} over steps {steps[0]}..{steps[-1]} "
                   f"({growth * 100:+.3g}% per step, r^2={r_value ** 2:.2f})")
    elif fit_slope > 0 and p_value <= EXPLODING_P:
        summary = f"grad norm rising {growth * 100:+.3g}% per step (x{over:.3g} over {len(points)} steps), below the x{EXPLODING_FACTOR:g} of exploding gradients"
    else:
        summary = f"no exponential growth of the grad norm before the failure ({growth * 100:+.3g}% per step, p={p_value:.2g}; last {fmt(last_grad)})"
    return HistoryFit(len(points), steps[0], steps[-1], growth, over, r_value ** 2, p_value, exploding, last_grad, last_loss, summary)


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(slope, r, two-sided p of a zero slope) of a least-squares line through points with distinct xs and ys not all
    equal (history_fit's), as scipy.stats.linregress computes them, with the Student t from scipy.special:
    scipy.stats takes half a second to import, a tenth of a `replay nan`."""
    import numpy as np
    from scipy.special import stdtr

    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    ssxm, ssxym, _, ssym = (float(value) for value in np.cov(x, y, bias=True).flat)
    r = min(max(ssxym / math.sqrt(ssxm * ssym), -1.0), 1.0)
    slope = ssxym / ssxm
    df = len(x) - 2
    t = r * math.sqrt(df / ((1.0 - r + 1e-20) * (1.0 + r + 1e-20)))
    return slope, r, float(2 * stdtr(df, -abs(t)))


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if math.isfinite(value) else str(value)
