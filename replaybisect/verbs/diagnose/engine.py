"""`replay diagnose`: read a run's recorded curves and name the pathology they show.

Reads the metrics only (no replay, no torch). The symptom -> cause table of public debugging guides (below) is a registry of small
detectors: each takes the run's curves and returns findings with evidence (steps, numbers) and the next
command to run. A healthy run gets a clean bill, never a list of guesses, so every threshold is a
published one (cited beside it) applied to robust statistics (medians, medians of blocks, rolling
medians) that ordinary SGD noise does not trip.

Steps are the recorded, 0-based step numbers: "the first step" is step 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replaybisect.errors import ReplayError
from replaybisect.store import Store
from replaybisect.verbs.diagnose.curves import Curves, Series, load_curves
from replaybisect.verbs.diagnose.findings import (DETECTORS, Diagnosis, Finding, Skip, initial_loss, loss_levels,
    rounded, detector)
from replaybisect.verbs.diagnose import detect_failures, detect_gradients, detect_learning, detect_loop  # noqa: F401  (each registers its detectors)

__all__ = ["Finding", "Diagnosis", "Curves", "Series", "DETECTORS", "detector", "diagnose", "load_curves", "analyse"]


# ---- the analysis ----------------------------------------------------------------------------------------
ORDER = [
    "exception", "gradients-not-zeroed", "model-in-eval", "not-optimized", "memory-leak", "nan-at-start", "nan-after-k", "divergence", "dead-relu", "flat-from-start", "no-gradient", "exploding-gradients",
    "vanishing-gradients", "update-ratio", "spikes", "oscillation", "slow-learning", "plateau", "overfitting",
    "distribution-mismatch", "input-pipeline-bound", "replicas-drifted", "rank-loss-scale",
]


# the detectors in the order they run (the report's "not checked" list keeps it), each family's module registering its own
RUN_ORDER = [
    "exception", "memory-leak", "not-optimized", "model-in-eval", "gradients-not-zeroed", "nan", "flat-from-start",
    "no-gradient", "slow-learning", "divergence", "spikes", "exploding-gradients", "vanishing-gradients", "dead-relu",
    "update-ratio", "plateau", "oscillation", "overfitting", "distribution-mismatch", "input-pipeline-bound",
    "replicas-drifted", "rank-loss-scale",
]


def _explain(findings: list[Finding]) -> list[Finding]:
    """Tie findings to what explains them: a layer that gets exactly no gradient because the ReLU after it
    is dead is a blocked path, not a vanishing one (dropped); a flat loss names its cause when one is found."""
    dead = [f.layer for f in findings if f.pattern == "dead-relu"]
    climbs = [f.evidence["from_step"] for f in findings if f.pattern == "divergence" and "from_step" in f.evidence]
    kept = []
    for finding in findings:
        if climbs and finding.pattern == "spikes" and all(step >= min(climbs) for step in finding.steps):
            continue  # the climb into the NaN, not bad batches: the divergence finding says so
        if finding.pattern in ("flat-from-start", "oscillation") and any(f.pattern == "divergence" for f in findings):
            continue  # a loss that rose far above its start is neither flat nor oscillating: the divergence says what happened
        if finding.pattern == "plateau" and any(f.pattern == "slow-learning" for f in findings):
            continue  # the slow fall explains the flat stretch: slow-learning names the cause
        if dead and finding.pattern == "vanishing-gradients":
            layers = finding.evidence.get("layers", {})
            if layers and all((info.get("median_norm") or 0.0) <= 1e-12 for info in layers.values()):
                continue
        kept.append(finding)
    causes = [
        f"{f.pattern} ({f.layer})" if f.layer else f.pattern
        for f in kept
        if f.pattern in ("dead-relu", "vanishing-gradients", "update-ratio")
    ]
    for finding in kept:
        if finding.pattern == "flat-from-start" and causes:
            finding.summary += f"; explained by {', '.join(causes)}"
            finding.evidence["explained_by"] = causes
    return kept


def summarise(curves: Curves) -> dict[str, Any]:
    """The numbers a clean bill rests on."""
    loss = curves.get("loss")
    finite = loss.finite()
    summary: dict[str, Any] = {"steps_logged": int(len(loss))}
    if len(finite):
        start = initial_loss(finite)
        # loss_end is the last finite loss logged (for a healthy run, the final loss `replay train` prints);
        # the detectors read robust levels (medians), given as loss_end_median
        end_median = loss_levels(finite)[1] if len(finite) >= 10 else float(finite.values[-1])
        summary.update(first_step=int(finite.steps[0]), last_step=int(finite.steps[-1]), loss_start=rounded(start),
                       loss_end=float(finite.values[-1]), loss_end_median=rounded(end_median))
    val = curves.get("val_loss").finite()
    if len(val):
        best = int(np.argmin(val.values))
        summary.update(val_best=rounded(float(val.values[best])), val_best_step=int(val.steps[best]), val_last=rounded(float(val.values[-1])))
    grads = curves.get("grad_norm").finite()
    if len(grads):
        summary["grad_norm_median"] = rounded(float(np.median(grads.values)))
    updates = curves.get("update_ratio").finite()
    if len(updates):
        summary["update_ratio_median"] = rounded(float(np.median(updates.values)))
    data, compute = curves.get("data_time").finite(), curves.get("step_time").finite()
    if len(data) and len(compute):
        d, c = float(np.median(data.values)), float(np.median(compute.values))
        summary["data_share"] = rounded(d / max(d + c, 1e-12))
        summary["step_time_median_s"] = rounded(c)
    layers = curves.layers("grad_norm/")
    if layers:
        summary["layers"] = len(layers)
    return summary


def analyse(curves: Curves) -> Diagnosis:
    """Run every detector on the curves; a detector without its metrics is listed as skipped, with why."""
    if not any(len(s) for s in curves.metrics.values()) and curves.failing_step is None:
        raise ReplayError(f"run {curves.run_id} has no metrics to diagnose; was it recorded by `replay train`? (check `replay runs`)")
    findings: list[Finding] = []
    checked: list[str] = []
    skipped: dict[str, str] = {}
    for pattern, function in sorted(DETECTORS, key=lambda entry: RUN_ORDER.index(entry[0])):
        try:
            findings += function(curves)
            checked.append(pattern)
        except Skip as why:
            skipped[pattern] = str(why)
    findings = _explain(findings)
    if any(f.pattern.startswith("nan") for f in findings):
        # The non-finite exploding-gradient finding repeats what the NaN finding says.
        findings = [f for f in findings if not (f.pattern == "exploding-gradients" and f.evidence.get("first_nonfinite_step") is not None)]
    findings.sort(key=lambda f: (ORDER.index(f.pattern) if f.pattern in ORDER else len(ORDER), f.step if f.step is not None else -1))
    return Diagnosis(
        run_id=curves.run_id,
        run_name=curves.run_name,
        status=curves.tags.get("status", "unknown"),
        findings=findings,
        summary=summarise(curves),
        checked=checked,
        skipped=skipped,
    )


def diagnose(store: Store, run_id: str) -> Diagnosis:
    """Read the run's curves and name the pathologies; reads the store, writes nothing
    (`replaybisect.verbs.diagnose.report.publish` attaches diagnosis.md and the annotated loss curve)."""
    return analyse(load_curves(store, run_id))
