"""The checks of training itself: gradient flow (non-finite, missing, vanishing, update/weight ratio) and
the LR range test."""

from __future__ import annotations

import math
from typing import Optional

from replaybisect.core.config import needs_closure
from replaybisect.verbs.check import lr_finder
from replaybisect.core.thresholds import (UPDATE_RATIO_FAIL, UPDATE_RATIO_WARN,
    FIRST_LAST_GRAD_RATIO_EXPLODING as EXPLODING_RATIO, FIRST_LAST_GRAD_RATIO_VANISHING as VANISHING_RATIO,
    FIRST_LAYER_GRAD_NORM_VANISHING as VANISHING_FIRST_NORM, GRAD_MEAN_ABS_VANISHING as VANISHING_MEAN_ABS,
    GRAD_NORM_SPAN_WARN_DECADES as SPAN_WARN_DECADES)
from replaybisect.verbs.check.context import Check, CheckContext, names_shown, register_check
from replaybisect.verbs.check.probes import GradProbe


# ---- gradient flow ------------------------------------------------------------------------------------------------
def _grad_error(name: str, probe: GradProbe) -> Optional[Check]:
    if probe.error:
        return Check(name, "fail", None, f"the training step raised {probe.error}")
    if probe.nonfinite and probe.backward_steps == 0:  # a non-finite value is its own finding, not a missing gradient
        return Check(name, "skip", None, f"{probe.nonfinite}, before any gradient was computed: nothing to read (see grad.nonfinite)")
    return None


@register_check("grad.nonfinite")
def grad_nonfinite(ctx: CheckContext) -> Check:
    """A loss or gradient that is inf/NaN in a few real steps from the state checked: the state is already
    diverging or broken (a different finding from a parameter that gets no gradient)."""
    probe = ctx.grads()
    if probe.error:
        return Check("grad.nonfinite", "fail", None, f"the training step raised {probe.error}")
    steps = f"{probe.steps_run} steps {ctx.where()}, {ctx.lr.text()}"
    advice = ("the state checked is already diverging or broken: check an earlier snapshot (--step N), and after a failed run "
              "`replay nan --run-id` says where the first non-finite value came from")
    if probe.nonfinite_grads:
        names = list(probe.nonfinite_grads)
        kinds = "/".join(sorted(set(probe.nonfinite_grads.values())))
        return Check(
            "grad.nonfinite", "fail", float(len(names)),
            f"non-finite gradient ({kinds}) in {len(names)} of {len(probe.got_grad)} parameters: {names_shown(names)}, "
            f"{f'at probe step {probe.nonfinite_step} of ' if probe.nonfinite_step is not None else 'within '}{steps}; {advice}",
            layer=names[0],
        )
    if probe.nonfinite:
        return Check(
            "grad.nonfinite", "fail", probe.nonfinite_loss,
            f"{probe.nonfinite} of {steps} (loss {probe.nonfinite_loss:.3g}): no gradient could be computed; {advice}",
        )
    return Check("grad.nonfinite", "pass", 0.0, f"loss and gradients finite over {steps}")


@register_check("grad.missing")
def grad_missing(ctx: CheckContext) -> Check:
    """Parameters that never get a gradient: frozen, detached from the loss, unused, or left out of the optimizer."""
    probe = ctx.grads()
    error = _grad_error("grad.missing", probe)
    if error:
        return error
    no_grad = [n for n, got in probe.got_grad.items() if not got]
    zero_grad = [n for n, got in probe.got_grad.items() if got and not probe.nonzero_grad.get(n)]
    total = len(probe.got_grad) + len(probe.frozen) + len(probe.not_in_optimizer)
    problems = []
    if no_grad:
        problems.append(f"no gradient (detached or unused in the forward pass): {names_shown(no_grad)}")
    if zero_grad:
        problems.append(f"all-zero gradient (behind a dead or constant path): {names_shown(zero_grad)}")
    if probe.not_in_optimizer:
        problems.append(f"not in the optimizer, never updated: {names_shown(probe.not_in_optimizer)}")
    steps = f"{probe.steps_run} steps"
    if problems:
        bad = no_grad + zero_grad + probe.not_in_optimizer
        frozen = f"; frozen (requires_grad=False): {names_shown(probe.frozen)}" if probe.frozen else ""
        return Check("grad.missing", "fail", float(len(bad)), f"{len(bad)} of {total} parameters over {steps}: " + "; ".join(problems) + frozen, layer=bad[0])
    if probe.frozen:
        return Check(
            "grad.missing", "warn", float(len(probe.frozen)),
            f"{len(probe.frozen)} of {total} parameters are frozen (requires_grad=False): {names_shown(probe.frozen)}; fine if you meant to train only part of the model",
            layer=probe.frozen[0],
        )
    return Check("grad.missing", "pass", 0.0, f"all {total} parameters got non-zero gradients within {steps}")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@register_check("grad.vanishing")
def grad_vanishing(ctx: CheckContext) -> Check:
    """Per-layer gradient norms, input side to output side: vanishing, exploding, or spanning many decades."""
    probe = ctx.grads()
    error = _grad_error("grad.vanishing", probe)
    if error:
        return error
    norms = {n: _median(v) for n, v in probe.module_grad_norm.items() if v}
    mean_abs = {n: _median(v) for n, v in probe.module_grad_mean_abs.items() if v}
    ordered = [n for n in probe.module_order if norms.get(n, 0) > 0 and math.isfinite(norms[n])]
    if len(ordered) < 2:
        return Check("grad.vanishing", "skip", None, "fewer than two layers with non-zero gradients")
    first, last = ordered[0], ordered[-1]
    ratio = norms[first] / norms[last]
    values = [norms[n] for n in ordered]
    decades = math.log10(max(values) / min(values))
    smallest = min(ordered, key=lambda n: norms[n])
    tiny = [n for n in ordered if mean_abs.get(n, 1.0) < VANISHING_MEAN_ABS]
    detail = (
        f"grad norm `{first}` {norms[first]:.3g} (input side) / `{last}` {norms[last]:.3g} (output side) = {ratio:.3g}; "
        f"layers span {decades:.1f} decades (smallest `{smallest}` {norms[smallest]:.3g})"
    )
    if (ratio < VANISHING_RATIO and norms[first] < VANISHING_FIRST_NORM) or tiny:
        name = tiny[0] if tiny else first
        return Check(
            "grad.vanishing", "fail", ratio,
            detail + f": vanishing gradient at `{name}` (mean |g| {mean_abs.get(name, 0):.2g}); use ReLU-family activations, normalization or residual connections",
            layer=name,
        )
    if ratio > EXPLODING_RATIO:
        return Check("grad.vanishing", "warn", ratio, detail + ": the input side's gradient is much larger than the output side's (exploding); consider clipping or normalization", layer=first)
    if decades > SPAN_WARN_DECADES:
        return Check("grad.vanishing", "warn", ratio, detail + f": `{smallest}` learns far slower than the rest", layer=smallest)
    return Check("grad.vanishing", "pass", ratio, detail)


def _quasi_newton(ctx: CheckContext) -> Optional[str]:
    """Why the first-order rules (an update ~1e-3 of the weight, the LR range test's sweep) do not judge this
    optimizer, or None: LBFGS and the like step along a curvature-scaled direction their closure re-evaluates."""
    optimizer = ctx.state.optimizer
    if not needs_closure(optimizer):
        return None
    return (f"{type(optimizer).__name__} takes quasi-Newton steps (its lr scales a curvature-based direction): the "
            "first-order rules of thumb for step size do not apply; overfit.one_batch shows whether it learns")


@register_check("grad.update_ratio")
def grad_update_ratio(ctx: CheckContext) -> Check:
    """‖Δθ‖/‖θ‖ per step: about 1e-3 is healthy (Karpathy, CS231n notes), outside [1e-8, 10] pathological (SageMaker)."""
    if (second_order := _quasi_newton(ctx)) is not None:
        return Check("grad.update_ratio", "skip", None, second_order)
    probe = ctx.grads()
    error = _grad_error("grad.update_ratio", probe)
    if error:
        return error
    if not probe.update_ratio:
        return Check("grad.update_ratio", "skip", None, "no optimizer update was applied in the probe steps")
    ratio = _median(probe.update_ratio)
    per_layer = {n: _median(v) for n, v in probe.module_update_ratio.items() if v}
    top = max(per_layer, key=per_layer.get) if per_layer else None
    low = min(per_layer, key=per_layer.get) if per_layer else None
    detail = f"update/weight ratio {ratio:.3g} at {ctx.lr.text()} (median of {len(probe.update_ratio)} steps)"
    if top:
        detail += f"; largest `{top}` {per_layer[top]:.3g}, smallest `{low}` {per_layer[low]:.3g}"
    if not math.isfinite(ratio) or ratio < UPDATE_RATIO_FAIL[0] or ratio > UPDATE_RATIO_FAIL[1]:
        return Check("grad.update_ratio", "fail", ratio, detail + ": pathological step size; see the LR range test", layer=top if ratio > 1 else low)
    if UPDATE_RATIO_WARN[0] <= ratio <= UPDATE_RATIO_WARN[1]:
        return Check("grad.update_ratio", "pass", ratio, detail)
    # The ratio's healthy band is SGD's; an optimizer's own step size (Adadelta's ~1e-3 per weight at lr 1, Adam's
    # ~lr per weight) can sit outside it at a good lr. The LR range test on this model decides whether the lr is off.
    high = ratio > UPDATE_RATIO_WARN[1]
    judged = ctx.lr_judgement()
    range_test = ctx.lr_range()
    optimizer = type(ctx.state.optimizer).__name__
    if judged == "ok":
        return Check(
            "grad.update_ratio", "pass", ratio,
            detail + f": {'large' if high else 'small'} steps for {optimizer}, but the LR range test finds {ctx.lr.lr:.3g} a good lr "
            f"(suggested {range_test.suggested_lr:.3g})",
        )
    blows_up = f", the loss blows up from {range_test.diverged_lr:.3g}" if range_test.diverged_lr is not None else ""
    agrees = f" (the LR range test agrees: suggested {_fmt_lr(range_test.suggested_lr)}{blows_up})" if judged == ("high" if high else "low") else ""
    if high:
        return Check("grad.update_ratio", "warn", ratio, detail + f": each step rewrites over a tenth of the weights; the lr is probably too high{agrees}", layer=top)
    return Check("grad.update_ratio", "warn", ratio, detail + f": the weights barely move; the lr is probably too low{agrees}", layer=low)


def _fmt_lr(value: Optional[float]) -> str:
    return f"{value:.3g}" if value is not None else "-"


# ---- LR range test ---------------------------------------------------------------------------------------------------
@register_check("lr.range_test")
def lr_range_test(ctx: CheckContext) -> Check:
    if (second_order := _quasi_newton(ctx)) is not None:
        return Check("lr.range_test", "skip", None, second_order)
    opts = ctx.options
    lr = ctx.lr.lr
    result = ctx.lr_range()
    extra = {"lr_range": result, "configured_lr": lr, "lr_judgement": ctx.lr_judgement()}
    sweep = f"{len(result.lrs)} steps {opts.lr_min:.0e}..{result.lrs[-1]:.2g}" + ("" if ctx.at_init else ", from the run's initialization")
    stop = f", stopped at lr {result.diverged_lr:.3g} ({result.stop_reason})" if result.diverged_lr else ""
    if result.stop_reason == "fault" or (result.stop_reason == "nonfinite" and len(result.lrs) <= lr_finder.SKIP_BEGIN):
        why = (f"and by then again with the lr held at {opts.lr_min:.0e}: not the learning rate"
               if result.stop_reason == "fault" else "far too small to blame the learning rate")
        return Check(
            "lr.range_test", "fail", None,
            f"the loss was non-finite at sweep step {len(result.lrs) - 1}, lr {result.diverged_lr:.2g}, {why}; "
            "a NaN/Inf in the data or the model comes first (see data.finite; after a run, `replay nan`)",
            extra=extra,
        )
    if result.diverged_lr is not None and lr >= result.diverged_lr:
        return Check(
            "lr.range_test", "fail", result.suggested_lr,
            f"your lr {lr:.3g} is at or past the point where the loss blows up ({result.diverged_lr:.3g}; {sweep}); "
            f"use about {result.suggested_lr:.2g}" if result.suggested_lr else f"your lr {lr:.3g} is past the divergence point {result.diverged_lr:.3g} ({sweep})",
            extra=extra,
        )
    if result.suggested_lr is not None and extra["lr_judgement"] == "high":
        blows_up = f"; the loss blows up from {result.diverged_lr:.3g}" if result.diverged_lr is not None else ""
        return Check(
            "lr.range_test", "warn", result.suggested_lr,
            f"your {ctx.lr.text()} is above the range test's good range (suggested {result.suggested_lr:.3g}{blows_up}; {sweep}); "
            f"use about {result.suggested_lr:.2g}",
            extra=extra,
        )
    if lr_finder.still_falling(result):  # a curve that never turned: its steepest descent suggests no lr
        where = ("inside it, where the loss fell" if lr <= result.lrs[-1] else
                 f"past its end, where the sweep cannot tell (sweep further: --lr-max {lr * 10:.0g})")
        return Check("lr.range_test", "pass", None,
                     f"the loss still fell at the sweep's largest lr ({sweep}): the range is too short to suggest an lr; "
                     f"your {ctx.lr.text()} is {where}", extra=extra)
    if result.suggested_lr is None:
        return Check(
            "lr.range_test", "warn", None,
            f"no suggestion: {len(result.lrs)} points are too few after skipping the first {lr_finder.SKIP_BEGIN} and last {lr_finder.SKIP_END} ({sweep}{stop}); raise --lr-steps",
            extra=extra,
        )
    ok = result.losses[0] > min(result.smoothed) if result.smoothed else False
    detail = f"suggested lr {result.suggested_lr:.3g} (steepest descent; {sweep}{stop}); your {ctx.lr.text()}"
    if not ok:
        return Check("lr.range_test", "warn", result.suggested_lr, detail + ": the loss never fell during the sweep", extra=extra)
    return Check("lr.range_test", "pass", result.suggested_lr, detail, extra=extra)
