"""Detectors of a run that failed: an exception, a NaN (at the start or after k steps), a divergence,
spikes."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np

from replaybisect.core.tags import step_tag
from replaybisect.core.growth import divergence as divergence_growth
from replaybisect.verbs.diagnose.ranks import RANK_METRIC
from replaybisect.core.thresholds import (SPIKE_BASELINE_SAMPLES, SPIKE_FACTOR,
    LAYER_GRAD_GROWTH_EXPLODING as EXPLODING_RATIO, DIVERGENCE_RISE)
from replaybisect.verbs.diagnose.curves import Curves
from replaybisect.verbs.diagnose.detect_learning import loss_growth
from replaybisect.verbs.diagnose.findings import (Finding, Skip, command_for, edge_count, initial_loss, loss_levels,
    rounded, detector, noise_sigma, rolling_median)


# ---- the detectors (symptoms -> causes; each cites its public source) ------------------------------------------------
@detector("exception")
def detect_exception(curves: Curves) -> list[Finding]:
    """A step that raised (the recorder's tags failure=exception, failing_step, error_type, error, error_frame): the
    run stopped there, the state before it and its batch kept; `replay nan` reproduces it."""
    tags = curves.tags
    if tags.get("failure") != "exception":
        return []
    step = step_tag(tags, "failing_step", curves.run_id)
    raised = f"{tags.get('error_type') or 'an exception'}" + (f": {tags['error']}" if tags.get("error") else "")
    frame = tags.get("error_frame")
    where = f" at {os.path.basename(frame.split(' in ', 1)[0])}" if frame else ""
    evidence = {"failing_step": step, "error_type": tags.get("error_type"), "error": tags.get("error"), "frame": frame,
                "finite_steps_before": int(np.sum(curves.get("loss").steps < step)) if step is not None else None}
    if tags.get("failure_kind") == "out_of_memory":  # where the memory went and what fits: replay memory's answer
        return [Finding("exception", f"step {step} ran out of memory{where}: the run crashed there (the state before the "
                        "step and its batch are kept)", evidence, command_for("memory", curves), step=step,
                        source="the recorder keeps a step that ran out of memory with the cap it had; replay memory "
                               "replays it under the memory profiler and proves a batch size that fits")]
    return [Finding("exception", f"step {step} raised {raised}{where}: the run crashed there (the state before the step "
                    "and its batch are kept)", evidence, command_for("nan", curves), step=step,
                    source="the recorder keeps a step that raised as it keeps a non-finite one; replay nan reproduces it")]


@detector("nan")
def detect_nan(curves: Curves) -> list[Finding]:
    """NaN at step 1 (data, weights, init) or NaN after K steps (LR, explosion, overflow, log(0), 0/0)."""
    failing = curves.failing_step
    if failing is None:
        return []
    what = curves.tags.get("nonfinite_what") or _nonfinite_what(curves, failing)
    loss = curves.get("loss").finite()
    first_step = int(min([failing] + ([int(loss.steps[0])] if len(loss) else [])))
    evidence: dict[str, Any] = {"failing_step": failing, "nonfinite": what, "finite_steps_before": int(np.sum(curves.get("loss").steps < failing))}
    first_ranks = _ranks_nonfinite_at(curves, failing)
    if first_ranks:  # a distributed run: the ranks whose own loss went non-finite (the others' gradients followed)
        evidence["ranks_nonfinite_loss"] = first_ranks
        what = f"loss on rank {', '.join(map(str, first_ranks))}"
    precision = curves.params.get("train.precision")
    if precision:
        evidence["precision"] = precision
    if failing <= first_step:
        return [
            Finding(
                "nan-at-start",
                f"non-finite {what} at the first step (step {failing}): NaN/Inf in the data or the weights, or a bad initialisation",
                evidence,
                command_for("nan", curves),
                step=failing,
                source="Karpathy, \"A Recipe for Training Neural Networks\" (2019): verify the data and the loss at init; Megatron-Core rerun state machine: NaN/Inf checks",
            )
        ]
    grads = curves.get("grad_norm").before(failing).finite()
    lr = curves.get("lr").before(failing)
    if len(lr):
        evidence["lr_before"] = rounded(float(lr.values[-1]))
    before = loss.before(failing)
    if len(before):
        evidence["loss_before"] = rounded(float(before.values[-1]))
        evidence["loss_min"] = rounded(float(before.values.min()))
    growth = loss_growth(grads)
    evidence.update(growth)
    climb = divergence_growth(list(zip(before.steps.tolist(), before.values.tolist())),
                              list(zip(grads.steps.tolist(), grads.values.tolist())))
    arms = "lr,clip,precision"
    if climb is not None:  # the words `replay nan` uses for the same failure
        cause = f"a divergence ({climb.sentence()}): learning rate, clipping or init"
        evidence["divergence"] = {"metric": climb.metric, "onset_step": climb.onset_step, "factor": rounded(climb.factor)}
        arms = "lr,clip"
    elif growth.get("grad_norm_growth", 1.0) >= EXPLODING_RATIO:
        cause = "exploding gradients"
    elif "grad_norm_growth" in growth and growth["grad_norm_growth"] < 2 and "grad_norm_growth_per_step" not in growth:
        cause = "a sudden failure with no growth before it: a bad batch, or one op overflowing"
    else:
        cause = "LR too high, overflow, log(0) or 0/0"
    return [
        Finding(
            "nan-after-k",
            f"non-finite {what} at step {failing} after {failing} finite steps; likely {cause}"
            + (f" (grad norm x{growth['grad_norm_growth']:.3g} over the run" if "grad_norm_growth" in growth else "")
            + (f", growing exponentially x{growth['grad_norm_growth_per_step']:.3g} a step)" if "grad_norm_growth_per_step" in growth else ")" if "grad_norm_growth" in growth else ""),
            evidence,
            command_for("nan", curves) + f"   # then: {command_for('ablate ' + arms, curves)}",
            step=failing,
            source="Pascanu et al. 2013 (exploding gradients); Micikevicius et al. 2018, Mixed Precision Training (fp16 overflow); Megatron-Core rerun state machine",
        )
    ]


def _ranks_nonfinite_at(curves: Curves, step: int) -> list[int]:
    """A distributed run's ranks whose own loss is non-finite at `step` (rank 0's is `loss`); [] for one process."""
    keys = [key for key in curves.metrics if RANK_METRIC.match(key) and key.startswith("loss/")]
    if not keys:
        return []
    by_rank = {0: curves.get("loss"), **{int(key.rsplit("rank", 1)[1]): curves.get(key) for key in keys}}
    return sorted(rank for rank, series in by_rank.items()
                  if step in series.steps and not np.isfinite(series.values[series.steps == step]).all())


def _nonfinite_what(curves: Curves, step: int) -> str:
    """Which logged value went non-finite at `step` (a run recorded with on_nonfinite=continue)."""
    for key in ("loss", "grad_norm"):
        series = curves.get(key)
        at_step = series.values[series.steps == step]
        if len(at_step) and not np.isfinite(at_step).all():
            return key
    return "loss"


@detector("divergence")
def detect_divergence(curves: Curves) -> list[Finding]:
    """The loss climbs far above its untrained level (LR too high), or climbs exponentially into the NaN."""
    loss = curves.healthy_loss
    if len(loss) < 10:
        raise Skip(f"{len(loss)} finite loss values (needs 10)")
    climb = _climb_to_failure(curves)
    if climb is not None:
        return [climb]
    if len(loss) < 20:
        return []
    # the untrained level: the first logged loss (an LR typo can make step 1 jump already), or the first 5's median
    initial = min(initial_loss(loss), float(loss.values[0]))
    _, end = loss_levels(loss)
    sigma = noise_sigma(loss.values)
    noise = 4 * 1.25 * sigma / math.sqrt(edge_count(len(loss)))  # 4 standard errors of the end level's median
    if not (initial > 0 and end > DIVERGENCE_RISE * initial and end - initial > noise):
        return []
    smooth = rolling_median(loss.values, max(5, len(loss) // 20) | 1)
    lowest = int(np.argmin(smooth))
    start_step = int(loss.steps[lowest])
    return [
        Finding(
            "divergence",
            f"the loss diverged: from {initial:.4g} at the start it rose to {end:.4g} at the end (x{end / initial:.3g}), rising from "
            f"step {start_step}: learning rate too high (a typo in lr?)",
            {"loss_start": rounded(initial), "loss_end": rounded(end), "rise": rounded(end / initial), "rising_from_step": start_step,
             "lr": rounded(float(curves.get("lr").values[0])) if len(curves.get("lr")) else None},
            command_for("ablate lr,warmup", curves) + "   # or an LR range test: " + command_for("check", curves),
            step=start_step,
            source="Smith 2017, \"Cyclical Learning Rates\" (LR range test: the loss diverges above the largest usable LR)",
        )
    ]


def _climb_to_failure(curves: Curves) -> Optional[Finding]:
    """An exponential climb of the loss or the grad norm that ends in the failing step: one divergence."""
    failing = curves.failing_step
    if failing is None:
        return None
    climbs = [finding for key in ("grad_norm", "loss") if (finding := _climb_of(curves, key, failing)) is not None]
    # the metric whose climb started first tells the whole divergence (a noisy grad norm can hide its early climb)
    return min(climbs, key=lambda finding: finding.evidence["from_step"], default=None)


def _climb_of(curves: Curves, key: str, failing: int) -> Optional[Finding]:
    """The exponential climb of one metric into the failing step, or None."""
    series = curves.get(key).before(failing).finite()
    if len(series) < 10 or np.any(series.values <= 0):
        return None
    start = _climb_start(series.values, len(series) - _rising_streak(series.values))
    streak = len(series) - start
    if streak < 5:
        return None
    first, last = float(series.values[start]), float(series.values[-1])
    if last < SPIKE_FACTOR * first:
        return None
    per_step = math.exp(math.log(last / first) / max(1, streak - 1))
    return Finding(
        "divergence",
        f"{key} climbed exponentially from step {int(series.steps[start])} ({first:.3g}) to {last:.3g} at step "
        f"{int(series.steps[-1])} (x{per_step:.3g} a step), then went non-finite at step {failing}: a divergence (learning rate, "
        "clipping or init), not a run of spikes",
        {"metric": key, "from_step": int(series.steps[start]), "to_step": int(series.steps[-1]), "from_value": rounded(first),
         "to_value": rounded(last), "growth_per_step": rounded(per_step), "failing_step": failing},
        command_for("ablate lr,clip", curves),
        step=int(series.steps[start]),
        source="Megatron-Core rerun machine: >= 10x the early level; Smith 2017 (the loss diverges above the usable LR)",
    )


def _climb_start(values: np.ndarray, start: int) -> int:
    """The streak's start moved past a flat head (a plateau within a tenth is part of the streak, not the climb):
    the climb begins with its first rise of more than a tenth."""
    while start < len(values) - 1 and values[start + 1] <= 1.1 * values[start]:
        start += 1
    return start


def _rising_streak(values: np.ndarray) -> int:
    """How many of the last values rise (allowing a dip of a tenth), counted back from the end."""
    count = 1
    peak = values[-1]
    for value in values[-2::-1]:
        if value > peak * 1.1 or value <= 0:
            break
        peak = min(peak, value)
        count += 1
    return count


@detector("spikes")
def detect_spikes(curves: Curves) -> list[Finding]:
    """Loss or gradient-norm values >= 10x the max |value| of the first 100 samples (Megatron-Core); spikes inside
    those samples count only when one recurs after them (a bad batch each epoch), not as the early transient."""
    failing = curves.failing_step
    found: dict[str, dict[str, Any]] = {}
    for key in ("loss", "grad_norm"):
        series = curves.get(key).before(failing).finite()
        if len(series) < 20:
            continue
        baseline_count = min(SPIKE_BASELINE_SAMPLES, len(series) // 2)
        magnitude = np.abs(series.values)
        early = magnitude[:baseline_count]
        # Megatron takes the max of the first 100 samples; a bad batch that recurs every epoch is already
        # among them, so early values that are themselves isolated spikes (>= 10x the rolling median of
        # their 9 neighbours) are left out of the max. A fast early decrease is not isolated: it stays.
        local = rolling_median(magnitude, 9)[:baseline_count]
        typical = early[early < SPIKE_FACTOR * local]
        baseline = float(typical.max()) if len(typical) else float(np.median(early))
        if baseline <= 0:
            continue
        hits = np.nonzero(magnitude >= SPIKE_FACTOR * baseline)[0]
        if len(hits) and hits[-1] < baseline_count:
            # every hit is inside the early window and none recurs after it: the first steps of training
            # (word_language_model's pre-clip gradient norms at steps 5 and 9), which Megatron's max takes in
            hits = hits[:0]
        if len(hits):
            found[key] = {
                "baseline_max": rounded(baseline),
                "baseline_samples": baseline_count,
                "spike_steps": [int(series.steps[i]) for i in hits[:20]],
                "spike_values": [rounded(float(series.values[i])) for i in hits[:20]],
                "count": int(len(hits)),
                "largest_factor": rounded(float(np.abs(series.values[hits]).max() / baseline)),
            }
    if not found:
        return []
    steps = sorted({s for info in found.values() for s in info["spike_steps"]})
    what = " and ".join(f"{key} ({info['count']}x, up to {info['largest_factor']:.3g}x the early max {info['baseline_max']:.3g})" for key, info in found.items())
    return [
        Finding(
            "spikes",
            f"spikes in {what} at step{'s' if len(steps) > 1 else ''} {_list_steps(steps)}: bad batches or an LR near instability",
            found,
            command_for("ablate clip,skip-batch", curves, f"--from-step {steps[0]}"),
            step=steps[0],
            steps=steps,
            source=f"Megatron-Core rerun machine: >= {SPIKE_FACTOR:g}x the max |value| of the first {SPIKE_BASELINE_SAMPLES} samples"
            " (isolated early spikes left out of that max)",
        )
    ]


def _list_steps(steps: list[int], limit: int = 6) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" (+{len(steps) - limit} more)" if len(steps) > limit else "")
