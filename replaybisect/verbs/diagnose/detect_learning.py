"""Detectors of how the loss learns: flat from the start, no gradient, slow, a plateau, oscillation,
overfitting, a train/validation mismatch."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from replaybisect.core.thresholds import (OVERFIT_GAP, OVERFIT_PATIENCE, OVERFIT_RISE, OVERFIT_TREND_P,
    PLATEAU_MIN_LEVEL, PLATEAU_MIN_SHARE, PLATEAU_TREND_P, PLATEAU_TREND_SE, SLOW_FALL_MAX, SLOW_GRAD_NORM_MAX)
from replaybisect.verbs.diagnose.curves import Curves, Series
from replaybisect.verbs.diagnose.findings import (Finding, Skip, command_for, edge_count, initial_loss, loss_levels,
    rounded, block_medians, detector, noise_sigma, rolling_median)


def loss_growth(grads: Series) -> dict[str, Any]:
    """How the total grad norm moved before a failure: early level, last level, and the growth rate."""
    if len(grads) < 5:
        return {}
    edge = min(edge_count(len(grads)), 20)
    early = float(np.median(grads.values[:edge]))
    last = float(np.median(grads.values[-3:]))
    out: dict[str, Any] = {"grad_norm_early": rounded(early), "grad_norm_last": rounded(last)}
    if early > 0:
        out["grad_norm_growth"] = rounded(last / early)
    tail = grads.values[-min(len(grads), 30):]
    if len(tail) >= 5 and np.all(tail > 0):
        slope, _ = np.polyfit(np.arange(len(tail)), np.log(tail), 1)
        if slope > 0 and tail[-1] > 2 * tail[0]:
            out["grad_norm_growth_per_step"] = rounded(float(math.exp(slope)))
    return out


@detector("flat-from-start")
def detect_flat(curves: Curves) -> list[Finding]:
    """The loss never moves: zero gradient (no backward, detached graph, frozen or unconnected params)."""
    loss = curves.healthy_loss
    if len(loss) < 20:
        raise Skip(f"{len(loss)} finite loss values (needs 20)")
    values = loss.values
    start, end = loss_levels(loss)
    initial = initial_loss(loss)
    blocks = block_medians(values, 10)
    block_size = len(values) / 10
    sigma = noise_sigma(values)
    # How far a median can wander by noise alone: 4 standard errors (~1.25 sigma / sqrt(samples)), or 2%.
    tolerance = max(0.02 * abs(start), 4 * 1.25 * sigma / math.sqrt(block_size))
    initial_tolerance = max(0.02 * abs(initial), 4 * 1.25 * sigma / math.sqrt(5))
    lowest = float(blocks.min())
    if start - lowest > tolerance or initial - lowest > initial_tolerance:
        return []  # it decreased at some point (perhaps within the first tenth): not flat from the start
    # Under heavy noise the medians are loose: a clear downward trend (Mann-Kendall p < 0.01) is progress.
    from scipy.stats import kendalltau

    thinned = values[:: len(values) // 2000 + 1]
    tau, p_value = kendalltau(np.arange(len(thinned)), thinned)
    if tau < 0 and p_value < 0.01 and start - end > 0.02 * abs(start):
        return []
    grads = curves.get("grad_norm").before(curves.failing_step).finite()
    evidence: dict[str, Any] = {
        "steps": [int(loss.steps[0]), int(loss.steps[-1])],
        "loss_start": rounded(start),
        "loss_end": rounded(end),
        "largest_decrease": rounded(start - lowest),
        "tolerance": rounded(tolerance),
    }
    zero_grad = False
    if len(grads):
        median_grad = float(np.median(grads.values))
        evidence["grad_norm_median"] = rounded(median_grad)
        zero_grad = median_grad <= 1e-12
    updates = curves.get("update_ratio").finite()
    if len(updates):
        evidence["update_ratio_median"] = rounded(float(np.median(updates.values)))
    if zero_grad:
        summary = f"flat from step {int(loss.steps[0])}: the loss stays at {start:.4g}; no parameter gets a gradient (grad norm 0): no backward, a detached graph, or frozen / unconnected parameters"
    else:
        summary = f"flat from step {int(loss.steps[0])}: the loss stays at {start:.4g} (never {tolerance:.2g} lower) although gradients are non-zero: the updates do not reach the loss"
    return [
        Finding(
            "flat-from-start",
            summary,
            evidence,
            command_for("check", curves) + "   # gradient flow: parameters with no or zero gradient",
            step=int(loss.steps[0]),
            source="AUTOTRAINER (Zhang et al., ICSE 2021): not converging; Karpathy's recipe: use backprop to chart dependencies",
        )
    ]


@detector("no-gradient")
def detect_no_gradient(curves: Curves) -> list[Finding]:
    """Modules whose parameters never get a gradient: the recorder logs weight_norm/<module> for every module with
    parameters and grad_norm/<module> only for those with a gradient, so a module with weights and no (or only
    zero) gradient norm at every recorded step sits on a detached branch or is frozen."""
    weights = {k[len("weight_norm/"):] for k in curves.metric_keys if k.startswith("weight_norm/")}
    grads = {m: s.before(curves.failing_step).finite() for m, s in curves.layers("grad_norm/").items()}
    if not weights or not grads:
        raise Skip("no weight_norm/<module> or grad_norm/<module> metrics (snapshot.layer_stats_every=0?)")
    recorded = max(len(s) for s in grads.values())
    if recorded < 3:
        raise Skip(f"{recorded} recorded layer statistics (needs 3)")
    learning = {m for m, s in grads.items() if len(s) and float(np.max(np.abs(s.values))) > 0}
    silent = sorted(weights - learning)
    if not silent or not learning:
        return []  # nothing learns at all: flat-from-start says so
    total_weights = len(weights)
    return [
        Finding(
            "no-gradient",
            f"{len(silent)} of {total_weights} modules never get a gradient ({', '.join(silent[:4])}{', ...' if len(silent) > 4 else ''}): "
            "a detached branch (.detach(), .data, torch.no_grad in forward) or frozen parameters (requires_grad=False); "
            "if the freeze is intended, ignore this",
            {"modules": silent, "modules_with_gradient": sorted(learning), "stats_steps": recorded},
            command_for("check", curves) + "   # gradient flow: parameters with no gradient",
            step=int(min(s.steps[0] for s in grads.values() if len(s))),
            layer=silent[0],
            source="Karpathy, \"A Recipe for Training Neural Networks\" (2019): use backprop to chart dependencies; "
            "AUTOTRAINER / DeepDiagnosis: parameters without gradient do not learn",
        )
    ]


@detector("slow-learning")
def detect_slow_learning(curves: Curves) -> list[Finding]:
    """The loss falls, but very slowly, and the gradients are small and shrinking: the signature of softmax fed
    into cross-entropy (probabilities in [0, 1] as logits cap the loss at log(e + C - 1) - 1 for C classes)."""
    loss = curves.healthy_loss
    if len(loss) < 50:
        raise Skip(f"{len(loss)} finite loss values (needs 50)")
    grads = curves.get("grad_norm").before(curves.failing_step).finite()
    if len(grads) < 20:
        raise Skip(f"{len(grads)} finite grad_norm values (needs 20)")
    initial = initial_loss(loss)
    _, end = loss_levels(loss)
    if initial <= 0:
        return []
    fall = (initial - end) / initial
    from scipy.stats import kendalltau

    thinned = loss.values[:: len(loss) // 2000 + 1]
    tau, p_value = kendalltau(np.arange(len(thinned)), thinned)
    edge = edge_count(len(grads))
    grad_median = float(np.median(grads.values))
    grad_early, grad_late = float(np.median(grads.values[:edge])), float(np.median(grads.values[-edge:]))
    if not (0 < fall < SLOW_FALL_MAX and tau < 0 and p_value < 0.01 and grad_median < SLOW_GRAD_NORM_MAX and grad_late <= grad_early):
        return []
    classes = math.exp(initial)
    floor = math.log(math.e + classes - 1) - 1  # the lowest cross-entropy of probabilities over C = e^initial classes
    return [
        Finding(
            "slow-learning",
            f"the loss falls very slowly ({initial:.4g} -> {end:.4g}, {100 * fall:.1f}% in {int(loss.steps[-1] - loss.steps[0]) + 1} steps) "
            f"with small, shrinking gradients (median grad norm {grad_median:.3g}, {grad_early:.3g} -> {grad_late:.3g}): "
            f"likely softmax fed into cross-entropy (probabilities as logits: the loss cannot go below {floor:.3g} for "
            f"~{classes:.0f} classes); feed the loss raw logits",
            {
                "loss_start": rounded(initial), "loss_end": rounded(end), "fall": rounded(fall),
                "grad_norm_median": rounded(grad_median), "grad_norm_early": rounded(grad_early), "grad_norm_late": rounded(grad_late),
                "trend_tau": rounded(float(tau)), "probability_ce_floor": rounded(floor),
            },
            command_for("check", curves) + "   # loss/head mismatch: do the loss input rows sum to 1?",
            step=int(loss.steps[0]),
            source="Karpathy, \"A Recipe for Training Neural Networks\" (2019); PyTorch CrossEntropyLoss docs "
            "(the input is expected to contain unnormalized logits)",
        )
    ]


@detector("plateau")
def detect_plateau(curves: Curves) -> list[Finding]:
    """The loss decreased, then stopped improving far above where it started from (LR too small, capacity)."""
    loss = curves.healthy_loss
    n = len(loss)
    if n < 50:
        raise Skip(f"{n} finite loss values (needs 50)")
    _, end = loss_levels(loss)
    start = initial_loss(loss)
    if start <= 0 or (start - end) < 0.05 * start:
        return []  # never decreased by 5%: flat-from-start's business, not a plateau
    if end < PLATEAU_MIN_LEVEL * start:
        return []  # it got most of the way down: converged, not stuck (healthy built-in runs end at <= 0.34x)
    window = max(5, n // 20) | 1
    smooth = rolling_median(loss.values, window)
    # The band the smoothed curve must stay in: 2% of the level, or 4 standard errors of a rolling median
    # (~1.25 sigma / sqrt(window)) so ordinary SGD noise never ends a plateau.
    band = max(0.02 * end, 4 * 1.25 * noise_sigma(loss.values) / math.sqrt(window))
    outside = np.nonzero(np.abs(smooth - end) > band)[0]
    start_index = int(outside[-1]) + 1 if len(outside) else 0
    if n - start_index < max(20, PLATEAU_MIN_SHARE * n):
        return []  # stuck only lately: a healthy run converging looks the same, so it is not called a plateau
    # Still improving, only slowly (a healthy run converging to a high floor)? Compare the first and last
    # quarter of the candidate plateau: a decrease beyond 1% of the level or 1 standard error of the
    # difference of two medians (1.25 sigma / sqrt(samples) each) is progress, not a plateau.
    segment = loss.values[start_index:]
    quarter = max(5, len(segment) // 4)
    decline = float(np.median(segment[:quarter]) - np.median(segment[-quarter:]))
    standard_error = math.sqrt(2) * 1.25 * noise_sigma(segment) / math.sqrt(quarter)
    if decline > max(0.01 * end, PLATEAU_TREND_SE * standard_error):
        return []
    # ... nor a monotone trend down across it (Mann-Kendall: Kendall's tau against the step, p < 0.2),
    # which sees a slow, steady creep that two quarter medians miss under heavy noise.
    from scipy.stats import kendalltau

    thinned = segment[:: len(segment) // 2000 + 1]
    tau, p_value = kendalltau(np.arange(len(thinned)), thinned)
    if tau < 0 and p_value < PLATEAU_TREND_P and decline > 0.01 * end:
        return []
    plateau_step = int(loss.steps[start_index])
    evidence: dict[str, Any] = {
        "plateau_start_step": plateau_step,
        "plateau_level": rounded(end),
        "loss_start": rounded(start),
        "decrease_before": rounded(start - end),
        "plateau_steps": int(loss.steps[-1] - plateau_step),
        "band": rounded(band),
        "decline_across_plateau": rounded(decline),
    }
    lr = curves.get("lr")
    if len(lr):
        evidence["lr_at_plateau"] = rounded(float(np.median(lr.values[lr.steps >= plateau_step]))) if np.any(lr.steps >= plateau_step) else None
        evidence["lr_start"] = rounded(float(lr.values[0]))
    updates = curves.get("update_ratio").finite()
    if len(updates) and np.any(updates.steps >= plateau_step):
        evidence["update_ratio_at_plateau"] = rounded(float(np.median(updates.values[updates.steps >= plateau_step])))
    return [
        Finding(
            "plateau",
            f"plateau from step {plateau_step}: the loss fell from {start:.4g} to {end:.4g} ({100 * end / start:.0f}% of its start) and has not improved for {evidence['plateau_steps']} steps: LR too small or too little capacity",
            evidence,
            command_for("check", curves) + "   # LR range test",
            step=plateau_step,
            source="Smith 2017, \"Cyclical Learning Rates\" (LR range test); Karpathy's recipe: overfit, then regularize",
        )
    ]


@detector("oscillation")
def detect_oscillation(curves: Curves) -> list[Finding]:
    """The smoothed loss keeps going up and down by a large fraction of its level (LR too high, not diverging)."""
    loss = curves.healthy_loss
    n = len(loss)
    if n < 60:
        raise Skip(f"{n} finite loss values (needs 60)")
    start, end = loss_levels(loss)
    half = loss.values[n // 2:]
    window = max(5, len(half) // 10) | 1
    smooth = rolling_median(half, window)
    level = float(np.median(half))
    if level <= 0:
        return []
    rises = np.diff(smooth)
    total_rise = float(rises[rises > 0].sum())
    net_change = float(smooth[0] - smooth[-1])
    swing = float(np.percentile(smooth, 90) - np.percentile(smooth, 10))
    # Oscillating: the smoothed second half climbs back by more than its own level in total, spans at
    # least half its level and a tenth of the untrained loss (near-zero losses are noisy in relative terms
    # only), and ends no lower than where it was half-way (no progress). Healthy built-in runs: net
    # decrease >= 1.06x the swing.
    initial = initial_loss(loss)
    if not (total_rise > level and swing > 0.5 * level and net_change < 0.25 * swing and swing > 0.1 * initial):
        return []
    turning = int(np.sum(np.diff(np.sign(rises[np.abs(rises) > 1e-12 * level])) != 0))
    first_step = int(loss.steps[n // 2])
    return [
        Finding(
            "oscillation",
            f"oscillating loss from step {first_step}: the smoothed loss swings by {swing:.3g} around {level:.3g} ({100 * swing / level:.0f}%) with no net progress: LR too high without diverging",
            {
                "from_step": first_step,
                "level": rounded(level),
                "swing_p10_p90": rounded(swing),
                "total_rise": rounded(total_rise),
                "net_decrease": rounded(net_change),
                "turning_points": turning,
                "loss_start": rounded(start),
            },
            command_for("ablate lr,warmup", curves),
            step=first_step,
            source="Smith 2017 (above the usable LR the loss oscillates or diverges); AUTOTRAINER: oscillating loss",
        )
    ]


def _train_at(loss: Series, steps: np.ndarray) -> np.ndarray:
    """The training loss around each evaluation step: median of the interval since the previous one."""
    out = []
    previous = -1
    for step in steps:
        window = loss.values[(loss.steps > previous) & (loss.steps <= step)]
        if not len(window):
            window = loss.values[loss.steps <= step][-5:]
        out.append(float(np.median(window)) if len(window) else math.nan)
        previous = step
    return np.array(out)


def _val_and_train(curves: Curves) -> tuple[Series, np.ndarray, Series]:
    val = curves.get("val_loss").before(curves.failing_step).finite()
    loss = curves.healthy_loss
    if len(val) < 4 or len(loss) < 20:
        raise Skip(f"{len(val)} validation losses (needs 4; set val_data and train.val_every)")
    return val, _train_at(loss, val.steps), loss


@detector("overfitting")
def detect_overfitting(curves: Curves) -> list[Finding]:
    """Train down, validation up after K, gap (val - train)/train > 0.1 with patience (SageMaker)."""
    val, train, loss = _val_and_train(curves)
    values = val.values
    best = int(np.argmin(values))
    if best == 0 or values[best] > 0.95 * values[0]:
        return []  # validation never improved: a mismatch, not overfitting (see distribution-mismatch)
    after = values[best + 1:]
    if len(after) < OVERFIT_PATIENCE:
        return []
    tail_val = values[-OVERFIT_PATIENCE:]
    tail_train = train[-OVERFIT_PATIENCE:]
    gap = (tail_val - tail_train) / np.maximum(np.abs(tail_train), 1e-12)
    rose = np.all(tail_val > values[best] * (1 + OVERFIT_RISE))
    train_kept_falling = np.median(tail_train) <= train[best] * 1.05
    if not (rose and np.all(gap > OVERFIT_GAP) and train_kept_falling):
        return []
    # A rise is a trend, not the noise of a converged run around its best (Mann-Kendall on val from the best).
    from scipy.stats import kendalltau

    tau, p_value = kendalltau(np.arange(len(values) - best), values[best:])
    if not (tau > 0 and p_value < OVERFIT_TREND_P):
        return []
    k = int(val.steps[best])
    return [
        Finding(
            "overfitting",
            f"overfitting from step {k}: val_loss rose from {values[best]:.4g} (step {k}) to {values[-1]:.4g} (step {int(val.steps[-1])}) while the train loss fell from {train[best]:.4g} to {train[-1]:.4g}; gap (val-train)/train {gap[-1]:.3g}",
            {
                "best_val_step": k,
                "best_val_loss": rounded(float(values[best])),
                "last_val_loss": rounded(float(values[-1])),
                "val_rise": rounded(float(values[-1] / values[best] - 1)),
                "train_at_best": rounded(float(train[best])),
                "train_last": rounded(float(train[-1])),
                "gap_last": [rounded(float(g)) for g in gap],
                "patience": OVERFIT_PATIENCE,
                "trend_tau": rounded(float(tau)),
                "trend_p": rounded(float(p_value)),
                "evaluations": int(len(values)),
            },
            f"replay train <your config> train.steps={k + 1}   # stop at the best validation step, or add data / regularisation (weight decay, dropout)",
            step=k,
            source="SageMaker Debugger overfit rule: (val-train)/train > 0.1 with patience",
        )
    ]


@detector("distribution-mismatch")
def detect_mismatch(curves: Curves) -> list[Finding]:
    """Train falls, validation stays flat from the start: the validation data is not what the model trains on."""
    val, train, loss = _val_and_train(curves)
    _, end = loss_levels(loss)
    start = initial_loss(loss)
    if start <= 0:
        return []
    train_gain = 1 - end / start
    val_gain = 1 - float(val.values.min()) / start
    # Train lost more than half of its starting loss while validation never got 20% below it.
    if not (train_gain > 0.5 and val_gain < 0.2):
        return []
    gap = (val.values[-1] - train[-1]) / max(abs(train[-1]), 1e-12)
    return [
        Finding(
            "distribution-mismatch",
            f"train/validation mismatch: the train loss fell from {start:.4g} to {end:.4g} while val_loss never went below {val.values.min():.4g} "
            f"(first {val.values[0]:.4g} at step {int(val.steps[0])}, last {val.values[-1]:.4g}): the validation data differs from the training data",
            {
                "loss_start": rounded(start),
                "train_end": rounded(end),
                "val_first": rounded(float(val.values[0])),
                "val_min": rounded(float(val.values.min())),
                "val_last": rounded(float(val.values[-1])),
                "train_gain": rounded(train_gain),
                "val_gain": rounded(val_gain),
                "gap_last": rounded(float(gap)),
                "evaluations": int(len(val)),
            },
            command_for("check", curves) + "   # data sanity: compare train and validation preprocessing",
            step=int(val.steps[0]),
            source="Zinkevich, \"Rules of Machine Learning\" #37 (training-serving skew); Karpathy's recipe: become one with the data",
        )
    ]
