"""What a detector says (`Finding`: the pattern, its evidence, the next command), the diagnosis they make,
the registry detectors join with @detector, and the robust statistics they share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from replaybisect.core.jsonutil import to_jsonable as _jsonable
from replaybisect.verbs.diagnose.curves import Curves, Series


# ---- findings -------------------------------------------------------------------------------------------
@dataclass
class Finding:
    pattern: str  # e.g. "spikes", "overfitting", "dead-relu"
    summary: str  # one line a person reads first
    evidence: dict[str, Any]  # the steps and numbers behind it
    next: str  # the next command to run
    step: Optional[int] = None  # the step it starts at (marked on the plot)
    layer: Optional[str] = None  # the module it names, for per-layer patterns
    steps: list[int] = field(default_factory=list)  # further steps to mark (spikes)
    source: str = ""  # where the threshold comes from

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "summary": self.summary,
            "step": self.step,
            "layer": self.layer,
            "evidence": _jsonable(self.evidence),
            "next": self.next,
            "source": self.source,
        }


@dataclass
class Diagnosis:
    run_id: str
    run_name: str
    status: str
    findings: list[Finding]
    summary: dict[str, Any]
    checked: list[str]  # the patterns that had the metrics they need
    skipped: dict[str, str]  # pattern -> why it could not be checked
    artifacts: list[str] = field(default_factory=list)

    @property
    def judged(self) -> bool:
        """Enough curve to judge: the loss-shape detectors ran (a run stopped at step 0 is judged by its NaN)."""
        return bool(self.findings) or "flat-from-start" in self.checked

    @property
    def healthy(self) -> bool:
        return not self.findings and self.judged

    @property
    def verdict(self) -> str:
        if self.findings:
            return ", ".join(dict.fromkeys(f.pattern for f in self.findings))
        if not self.judged:
            return f"not enough data to judge ({self.skipped.get('flat-from-start', 'too few metrics')})"
        return "no pathology found"

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_name": self.run_name,
            "status": self.status,
            "healthy": self.healthy,
            "verdict": self.verdict,
            "findings": [f.to_json() for f in self.findings],
            "summary": _jsonable(self.summary),
            "checked": self.checked,
            "skipped": self.skipped,
            "artifacts": self.artifacts,
        }


class Skip(Exception):
    """A detector lacks the metrics it needs (the reason is reported, never a guess)."""


Detector = Callable[[Curves], list[Finding]]
DETECTORS: list[tuple[str, Detector]] = []


def detector(pattern: str):
    """Register a detector: adding a pattern is adding one function."""

    def register(function: Detector) -> Detector:
        DETECTORS.append((pattern, function))
        return function

    return register


# ---- robust statistics ------------------------------------------------------------------------------------
def rounded(value: float, digits: int = 4) -> float:
    if value is None or not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")


def edge_count(n: int) -> int:
    """How many samples make a robust 'start' or 'end' level: a tenth of the run, at least 5."""
    return max(5, n // 10)


def rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling median (edges padded with the edge value): smooths SGD noise, keeps the steps.
    scipy's C median filter: a 10,000-step curve with a 500-step window takes about a millisecond."""
    from scipy.ndimage import median_filter

    values = np.asarray(values, dtype=float)
    window = max(1, min(int(window), len(values)))
    if window <= 1:
        return values.copy()
    return median_filter(values, size=window, mode="nearest")


def block_medians(values: np.ndarray, blocks: int) -> np.ndarray:
    return np.array([np.median(chunk) for chunk in np.array_split(values, blocks) if len(chunk)])


def noise_sigma(values: np.ndarray) -> float:
    """Robust per-sample noise: 1.4826 x MAD of the residual around a rolling median."""
    if len(values) < 5:
        return 0.0
    residual = values - rolling_median(values, max(5, len(values) // 20) | 1)
    return float(1.4826 * np.median(np.abs(residual - np.median(residual))))


def loss_levels(loss: Series) -> tuple[float, float]:
    """(start, end): medians of the first and last tenth of the curve."""
    edge = edge_count(len(loss))
    return float(np.median(loss.values[:edge])), float(np.median(loss.values[-edge:]))


def initial_loss(loss: Series) -> float:
    """The untrained level: median of the first 5 values (a fast learner is far lower after a tenth of the run)."""
    return float(np.median(loss.values[:5]))


def command_for(verb: str, curves: Curves, extra: str = "") -> str:
    return f"replay {verb} --run-id {curves.run_id}" + (f" {extra}" if extra else "")
