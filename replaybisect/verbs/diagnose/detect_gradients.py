"""Detectors of the layers' gradients and updates: exploding, vanishing, dead ReLUs, an update/weight
ratio out of range."""

from __future__ import annotations

import numpy as np

from replaybisect.core.thresholds import (DEAD_LAYER_ZERO_FRACTION as DEAD_ZERO_FRACTION,
    LAYER_GRAD_GROWTH_EXPLODING as EXPLODING_RATIO, LAYER_GRAD_NORM_EXPLODING_MIN as EXPLODING_MIN_NORM,
    LAYER_GRAD_NORM_VANISHING as VANISHING_ABSOLUTE, LAYER_GRAD_NORM_VANISHING_WITH_RATIO as VANISHING_NORM,
    LAYER_TO_LARGEST_GRAD_RATIO_VANISHING as VANISHING_RATIO, UPDATE_RATIO_FAIL as UPDATE_RATIO_RANGE)
from replaybisect.verbs.diagnose.curves import Curves
from replaybisect.verbs.diagnose.findings import Finding, Skip, command_for, rounded, detector


@detector("exploding-gradients")
def detect_exploding(curves: Curves) -> list[Finding]:
    """A layer's grad norm grows > 70x its early level (AUTOTRAINER) to >= 1 (a tiny start growing to a small value
    is not an explosion), or turns non-finite."""
    layers = curves.layers("grad_norm/")
    if not layers:
        raise Skip("no grad_norm/<module> metrics (snapshot.layer_stats_every=0?)")
    nonfinite = {}
    growth = {}
    total = curves.get("grad_norm").finite()
    for module, series in layers.items():
        bad = ~np.isfinite(series.values)
        if bad.any():
            nonfinite[module] = int(series.steps[bad][0])
        finite = series.finite()
        if len(finite) < 4:
            continue
        early = float(np.median(finite.values[:3]))
        late = float(np.median(finite.values[-2:]))  # two samples: one noisy sample is not a trend
        total_early = total.values[np.isin(total.steps, finite.steps[:3])]
        if len(total_early) and early < 1e-3 * float(np.median(total_early)):
            continue  # the layer started with (almost) no gradient, e.g. behind a zero-initialised one: growing from ~0 is not exploding
        if early > 0 and late / early > EXPLODING_RATIO and late >= EXPLODING_MIN_NORM:
            growth[module] = (late / early, early, late, int(finite.steps[-1]))
    if not nonfinite and not growth:
        return []
    findings = []
    if nonfinite:
        first = min(nonfinite.values())
        modules = sorted((m for m, s in nonfinite.items() if s == first))
        findings.append(
            Finding(
                "exploding-gradients",
                f"non-finite gradient in {', '.join(modules)} at step {first}",
                {"first_nonfinite_step": first, "modules": {m: nonfinite[m] for m in sorted(nonfinite)}},
                command_for("nan", curves),
                step=first,
                layer=modules[0],
                source="AUTOTRAINER: exploding = any NaN/Inf gradient",
            )
        )
    if growth:
        ranked = sorted(growth.items(), key=lambda item: -item[1][0])
        module, (ratio, early, late, at) = ranked[0]
        findings.append(
            Finding(
                "exploding-gradients",
                f"exploding gradients in {module}: grad norm x{ratio:.3g} ({early:.3g} -> {late:.3g} by step {at})"
                + (f"; also {', '.join(m for m, _ in ranked[1:4])}" if len(ranked) > 1 else ""),
                {"layers": {m: {"growth": rounded(r), "early": rounded(e), "late": rounded(l), "step": s} for m, (r, e, l, s) in ranked}},
                command_for("nan", curves) if curves.failing_step is not None else command_for("ablate clip,lr", curves),
                step=at,
                layer=module,
                source=f"AUTOTRAINER: exploding gradient ratio > {EXPLODING_RATIO:g}; and at least {EXPLODING_MIN_NORM:g}, the usual clip_grad_norm (nanoGPT, Megatron-LM)",
            )
        )
    return findings


@detector("vanishing-gradients")
def detect_vanishing(curves: Curves) -> list[Finding]:
    """A layer whose gradient is < 1e-3 of the largest layer's and < 1e-4 (AUTOTRAINER), or < 1e-7 (SageMaker)."""
    layers = {m: s.before(curves.failing_step).finite() for m, s in curves.layers("grad_norm/").items()}
    layers = {m: s for m, s in layers.items() if len(s)}
    if len(layers) < 2:
        raise Skip("fewer than two grad_norm/<module> metrics")
    steps = sorted(set.intersection(*(set(s.steps.tolist()) for s in layers.values())))
    if not steps:
        return []
    table = np.array([[dict(zip(s.steps.tolist(), s.values.tolist()))[step] for step in steps] for s in layers.values()])
    names = list(layers)
    largest = table.max(axis=0)
    if np.median(largest) <= 1e-12:
        return []  # nothing gets a gradient at all: that is flat-from-start, not vanishing
    ratio = table / np.maximum(largest, 1e-30)
    median_norm = np.median(table, axis=1)
    median_ratio = np.median(ratio, axis=1)
    flagged = [
        i for i in range(len(names))
        if (median_ratio[i] < VANISHING_RATIO and median_norm[i] < VANISHING_NORM) or median_norm[i] < VANISHING_ABSOLUTE
    ]
    if not flagged:
        return []
    flagged.sort(key=lambda i: median_norm[i])
    top = int(np.argmax(np.median(table, axis=1)))
    evidence = {
        "largest_layer": names[top],
        "largest_median_norm": rounded(float(median_norm[top])),
        "stats_steps": len(steps),
        "layers": {names[i]: {"median_norm": rounded(float(median_norm[i])), "ratio_to_largest": rounded(float(median_ratio[i]))} for i in flagged},
    }
    saturated = {m[len("act_sat_frac/"):]: rounded(float(np.median(s.values))) for m, s in curves.metrics.items() if m.startswith("act_sat_frac/") and len(s)}
    if saturated:
        evidence["saturated_fraction"] = saturated
    first = names[flagged[0]]
    return [
        Finding(
            "vanishing-gradients",
            f"vanishing gradients in {first}: grad norm {median_norm[flagged[0]]:.2g}, {median_ratio[flagged[0]]:.2g} of {names[top]}'s"
            + (f"; {len(flagged) - 1} more layer{'s' if len(flagged) > 2 else ''}" if len(flagged) > 1 else ""),
            evidence,
            command_for("check", curves) + "   # gradient flow and saturation per layer",
            step=steps[0],
            layer=first,
            source="AUTOTRAINER: ratio < 1e-3 with norm < 1e-4; SageMaker Debugger: < 1e-7",
        )
    ]


@detector("dead-relu")
def detect_dead_relu(curves: Curves) -> list[Finding]:
    """A ReLU layer whose output is zero >= 99% of the time (SageMaker: active < 1% of the time = dead)."""
    layers = {m: s.before(curves.failing_step).finite() for m, s in curves.layers("act_zero_frac/").items()}
    layers = {m: s for m, s in layers.items() if len(s)}
    if not layers:
        raise Skip("no act_zero_frac/<module> metrics (no ReLU, or no layer statistics)")
    findings = []
    for module, series in sorted(layers.items()):
        half = series.values[len(series) // 2:]  # the state the run ended in, robust to one odd batch
        if np.median(half) < DEAD_ZERO_FRACTION:
            continue
        dead = series.values >= DEAD_ZERO_FRACTION
        # the step from which it stays dead (to the end)
        alive_after = np.nonzero(~dead)[0]
        since_index = int(alive_after[-1]) + 1 if len(alive_after) else 0
        since_index = min(since_index, len(series) - 1)
        since = int(series.steps[since_index])
        findings.append(
            Finding(
                "dead-relu",
                f"dead ReLU {module}: {100 * float(np.median(half)):.1f}% of its outputs are zero"
                + (" from the first step" if since_index == 0 else f" since step {since}"),
                {"zero_fraction_median": rounded(float(np.median(half))), "dead_since_step": since, "samples": int(len(series))},
                command_for("check", curves) + "   # activations and initialisation per layer",
                step=since,
                layer=module,
                source="SageMaker Debugger: a unit active < 1% of the time is dead",
            )
        )
    return findings


@detector("update-ratio")
def detect_update_ratio(curves: Curves) -> list[Finding]:
    """‖Δθ‖/‖θ‖ outside [1e-8, 10] (SageMaker Debugger); about 1e-3 is healthy."""
    series = curves.get("update_ratio").before(curves.failing_step).finite()
    if len(series) < 3:
        raise Skip("fewer than 3 update_ratio values (snapshot.layer_stats_every)")
    median = float(np.median(series.values))
    low, high = UPDATE_RATIO_RANGE
    grads = curves.get("grad_norm").finite()
    if median < low and len(grads) and float(np.median(grads.values)) <= 1e-12:
        return []  # no gradient at all: flat-from-start names the cause, a zero update is its consequence
    if low <= median <= high:
        return []
    lr = curves.get("lr").finite()
    evidence = {
        "update_ratio_median": rounded(median),
        "update_ratio_min": rounded(float(series.values.min())),
        "update_ratio_max": rounded(float(series.values.max())),
        "healthy_range": [low, high],
        "samples": int(len(series)),
    }
    if len(lr):
        evidence["lr_median"] = rounded(float(np.median(lr.values)))
    if median < low:
        summary = f"updates too small: update/weight ratio {median:.2g} (median of {len(series)}), below {low:g}: the LR is too small or the updates are masked"
        next_command = command_for("check", curves) + "   # LR range test"
    else:
        summary = f"updates too large: update/weight ratio {median:.2g} (median of {len(series)}), above {high:g}: the LR is far too high"
        next_command = command_for("ablate lr,warmup", curves)
    return [Finding("update-ratio", summary, evidence, next_command, step=int(series.steps[0]), source="SageMaker Debugger: update/weight ratio outside [1e-8, 10]; ~1e-3 healthy")]
