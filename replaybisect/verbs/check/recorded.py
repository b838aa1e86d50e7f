"""What `replay check --run-id` reads from a recorded run before it builds anything: which snapshot to examine
(a healthy state, and why that one) and the learning rate the run trained with at its peak."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from replaybisect.replay import restore as restore_mod
from replaybisect.core import tags
from replaybisect.core.growth import growth_onset
from replaybisect.errors import ReplayError


@dataclass(frozen=True)
class SnapshotChoice:
    """The snapshot to examine (None: no snapshot holds a healthy state; the config is checked at initialization)."""

    step: Optional[int]
    reason: str  # why this snapshot, in words: shown in the report, check.md and the JSON
    failing_step: Optional[int] = None
    growth_onset: Optional[int] = None


@dataclass(frozen=True)
class PeakLr:
    """The learning rate the checks train at, and where it comes from."""

    lr: float
    source: str  # e.g. "the run's peak lr, step 30"


def last_step(store, run_id: str) -> Optional[int]:
    """The run's last step: its last logged loss, or its failing step when later (a non-finite loss is logged too)."""
    steps = [step for step, _ in store.metric_history(run_id, "loss")]
    failing = tags.failing_step(store, run_id)
    candidates = steps + ([failing] if failing is not None else [])
    return max(candidates) if candidates else None


def choose_snapshot(store, run_id: str, requested: Optional[int]) -> SnapshotChoice:
    """`requested` (--step): the snapshot at or before it, or a one-line ReplayError. Else a healthy state: the last
    snapshot before the growth that ended a failed run began; without such growth, the newest snapshot before the
    failing step (that snapshot holds the state that made the non-finite value); for a run that did not fail, the
    newest snapshot."""
    steps = restore_mod.snapshot_steps(store, run_id)
    if requested is not None:
        return _requested(store, run_id, steps, requested)
    failing = tags.failing_step(store, run_id)
    if not steps:
        return SnapshotChoice(None, "the run has no snapshots: its config at initialization", failing)
    if failing is None:
        return SnapshotChoice(steps[-1], "the newest snapshot (the run did not fail)")
    onset = growth_onset(store.metric_history(run_id, "loss"), store.metric_history(run_id, "grad_norm"))
    before_onset = [s for s in steps if onset is not None and s <= onset]
    if before_onset:
        return SnapshotChoice(
            before_onset[-1],
            f"the last snapshot before the growth that began at step {onset} and ended in the failure at step {failing}",
            failing, onset)
    before_failing = [s for s in steps if s < failing]
    if not before_failing:
        return SnapshotChoice(None, f"every snapshot is at or after the failing step {failing}: the run's config at "
                              "initialization", failing, onset)
    why = (f"no snapshot before the growth that began at step {onset}" if onset is not None
           else "no growth before the failure")
    return SnapshotChoice(before_failing[-1], f"the newest snapshot before the failing step {failing} ({why})", failing, onset)


def _requested(store, run_id: str, steps: list[int], requested: int) -> SnapshotChoice:
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise ReplayError(f"--step must be a step number, not {requested!r}")
    if requested < 0:
        raise ReplayError(f"--step {requested} is negative; pass a step of run {run_id} (0 or more)")
    end = last_step(store, run_id)
    if end is not None and requested > end:
        raise ReplayError(f"--step {requested} is past the end of run {run_id} (its last step is {end}); pass a step up to {end}")
    at_or_before = [s for s in steps if s <= requested]
    if not at_or_before:
        held = f"its snapshots are at steps {_listed(steps)}" if steps else "it has no snapshots (train with snapshot.every > 0)"
        raise ReplayError(f"run {run_id} has no snapshot at or before step {requested}: {held}")
    chosen = at_or_before[-1]
    reason = f"the snapshot at --step {requested}" if chosen == requested else f"the newest snapshot at or before --step {requested}"
    return SnapshotChoice(chosen, reason, tags.failing_step(store, run_id))


def _listed(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:8])
    return shown + (f" ... {steps[-1]}" if len(steps) > 8 else "")


def peak_lr(store, run_id: str) -> Optional[PeakLr]:
    """The highest learning rate the run logged (the top of a warmup or of a cosine schedule), None when it logged none."""
    logged = [(value, step) for step, value in store.metric_history(run_id, "lr") if math.isfinite(value) and value > 0]
    if not logged:
        return None
    value, step = max(logged, key=lambda point: (point[0], -point[1]))
    return PeakLr(value, f"the run's peak lr, step {step}")
