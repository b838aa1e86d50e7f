"""LR range test (Smith 2015; the fastai / PyTorch Lightning / torch-lr-finder recipe).

The learning rate grows exponentially from `lr_min` to `lr_max`, one optimizer step per batch, on a
copy of the training state. The loss is smoothed, the sweep stops once it diverges, and the suggestion
is the point of steepest descent of the smoothed curve. Defaults from Smith 2017 ("Cyclical Learning Rates") as Lightning, fastai and torch-lr-finder implement it:
exponential from 1e-7 to 10 over ~100 steps, stop at loss > 4x best, smoothing 0.05, suggest the
steepest-descent point skipping the first 10 and last 5 points (Lightning, fastai, torch-lr-finder).

Every step is `loop.run_step`, the one code path training uses. The caller passes a state it owns
(a copy): the sweep changes its parameters and learning rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from replaybisect.core.thresholds import (  # noqa: E402  (Lightning, fastai, torch-lr-finder; cited there)
    LR_FINDER_DIVERGE_FACTOR as DIVERGE_FACTOR, LR_FINDER_MAX as LR_MAX, LR_FINDER_MIN as LR_MIN,
    LR_FINDER_SKIP_BEGIN as SKIP_BEGIN, LR_FINDER_SKIP_END as SKIP_END, LR_FINDER_SMOOTHING as SMOOTHING,
    LR_FINDER_STEPS as STEPS,
)


@dataclass
class LRRangeResult:
    lrs: list[float] = field(default_factory=list)  # the lr each step used
    losses: list[float] = field(default_factory=list)  # raw loss of each step (before its update)
    smoothed: list[float] = field(default_factory=list)
    suggested_lr: Optional[float] = None  # steepest descent of the smoothed curve
    suggested_index: Optional[int] = None
    best_lr: Optional[float] = None  # lr at the lowest smoothed loss
    diverged_lr: Optional[float] = None  # lr at which the sweep stopped: loss > 4x best or non-finite
    stop_reason: str = "completed"  # completed | diverged | nonfinite | fault (non-finite at the lowest lr too)
    planned_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "suggested_lr": self.suggested_lr,
            "best_lr": self.best_lr,
            "diverged_lr": self.diverged_lr,
            "stop_reason": self.stop_reason,
            "steps_run": len(self.lrs),
            "planned_steps": self.planned_steps,
        }


def still_falling(result: LRRangeResult) -> bool:
    """The sweep ran to its end with the smoothed loss lowest in its last points: the curve never turned, so its
    steepest descent places no learning rate (a suggestion below the best lr would be read as one)."""
    if result.stop_reason != "completed" or len(result.smoothed) <= SKIP_BEGIN + SKIP_END:
        return False
    lowest = min(range(len(result.smoothed)), key=result.smoothed.__getitem__)
    return lowest >= len(result.smoothed) - 1 - SKIP_END


def lr_schedule(lr_min: float, lr_max: float, steps: int) -> list[float]:
    """Exponentially spaced learning rates from lr_min to lr_max inclusive."""
    if steps == 1:
        return [lr_min]
    ratio = lr_max / lr_min
    return [lr_min * ratio ** (i / (steps - 1)) for i in range(steps)]


def suggest(lrs: list[float], smoothed: list[float], skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END) -> Optional[int]:
    """Index of the steepest descent of the smoothed loss (Lightning's `suggestion`), None when too few points."""
    import numpy as np

    end = len(smoothed) - skip_end
    if end - skip_begin < 2:
        return None
    # Ours, beyond Lightning/fastai: look only on the way down to the lowest point. After a spike the
    # smoothed curve recovers steeply too, and that "descent" can sit at a learning rate 50x too high.
    lowest = int(np.nanargmin(np.asarray(smoothed, dtype=float))) + 1
    if lowest - skip_begin >= 2:
        end = min(end, lowest)
    window = np.asarray(smoothed[skip_begin:end], dtype=float)
    if not np.all(np.isfinite(window)):
        return None
    # Evenly spaced in log(lr), so the gradient over the index is the gradient over log(lr).
    return skip_begin + int(np.argmin(np.gradient(window)))


def lr_range_test(
    state,
    batch_of: Callable[[int], Any],
    *,
    lr_min: float = LR_MIN,
    lr_max: float = LR_MAX,
    steps: int = STEPS,
    smoothing: float = SMOOTHING,
    diverge_factor: float = DIVERGE_FACTOR,
    skip_begin: int = SKIP_BEGIN,
    skip_end: int = SKIP_END,
) -> LRRangeResult:
    """Sweep the learning rate on `state` (a copy the caller owns). `batch_of(i)` is the i-th batch on
    the state's device. The scheduler is switched off: the sweep sets every group's lr itself."""

    if not 0 < lr_min < lr_max:
        raise ValueError(f"LR range test needs 0 < lr_min < lr_max, got {lr_min} and {lr_max}")
    state.scheduler = None
    result = LRRangeResult(planned_steps=steps)
    best = math.inf
    for index, lr in enumerate(lr_schedule(lr_min, lr_max, steps)):
        outcome, nonfinite = _step_at(state, lr, index, batch_of)
        result.lrs.append(lr)
        result.losses.append(outcome.loss)
        if nonfinite:
            result.smoothed.append(math.nan)
            result.diverged_lr, result.stop_reason = lr, "nonfinite"
            break
        smooth = outcome.loss if index == 0 else smoothing * outcome.loss + (1 - smoothing) * result.smoothed[-1]
        result.smoothed.append(smooth)
        if smooth < best:
            best, result.best_lr = smooth, lr
        if best > 0 and smooth > diverge_factor * best:
            result.diverged_lr, result.stop_reason = lr, "diverged"
            break
    finite = [s for s in result.smoothed if math.isfinite(s)]
    index = suggest(result.lrs[: len(finite)], finite, skip_begin, skip_end)
    if index is not None:
        result.suggested_index = index
        result.suggested_lr = result.lrs[index]
    return result


def nonfinite_at_lowest_lr(state, batch_of: Callable[[int], Any], result: LRRangeResult) -> bool:
    """The sweep's steps again on `state` (a fresh copy the caller owns) with the lr held at the sweep's lowest: True
    when the loss turns non-finite there too, by the step the sweep stopped at. Then the fault is the data's or the
    model's (a planted overflow fires whatever the lr), not the learning rate's, and the sweep suggests nothing."""
    state.scheduler = None
    return any(_step_at(state, result.lrs[0], index, batch_of)[1] for index in range(len(result.lrs)))


def _step_at(state, lr: float, index: int, batch_of: Callable[[int], Any]):
    """One step of the sweep at `lr` (every group's), the one code path training uses: (its outcome, non-finite?)."""
    from replaybisect.core import loop

    for group in state.optimizer.param_groups:
        group["lr"] = lr
    outcome = loop.run_step(state, index, batch_of(index))
    return outcome, outcome.nonfinite or not math.isfinite(outcome.loss)

