"""The checks of the model and its loss: overfit one batch, loss/output mismatch, initialization,
activations. Each reads a CheckContext and returns one Check."""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
from torch import nn

from replaybisect.core import loop
from replaybisect.core.thresholds import (DEAD_LAYER_FAIL, DEAD_LAYER_WARN, DEAD_UNIT_ACTIVE, INIT_LOSS_WARN,
    PROB_ROW_TOL, RELU_ZERO_FAIL, RELU_ZERO_WARN, SATURATION_FAIL, SATURATION_PREACT, SATURATION_WARN,
    OVERFIT_ONE_BATCH_LEARNS as OVERFIT_LEARNS, OVERFIT_ONE_BATCH_PASS as OVERFIT_PASS,
    OVERFIT_ONE_BATCH_WARN as OVERFIT_WARN)
from replaybisect.verbs.check.batches import batch_inputs, batch_size_of, samples_of
from replaybisect.verbs.check.context import Check, CheckContext, freeze_schedule, register_check
from replaybisect.verbs.check.probes import LayerActivity, RecordingLoss


# ---- overfit one batch ------------------------------------------------------------------------------------
def loss_floor(loss_fn, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor], classes: Optional[int]) -> tuple[Optional[float], str]:
    """The lowest loss a model could reach on this batch, and how it was derived.

    Cross-entropy with hard labels: 0, unless identical inputs carry different labels (then their label
    entropy) or label smoothing is on (then the entropy of the smoothed target). Soft targets: their
    entropy. Regression losses: 0. Unknown losses: assumed 0, said so."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and targets is not None:
        if targets.is_floating_point():  # probabilities as targets
            p = targets.float().clamp_min(1e-12)
            return float((-(p * p.log()).sum(1)).mean()), "entropy of the soft targets"
        smoothing = float(getattr(loss_fn, "label_smoothing", 0.0) or 0.0)
        if smoothing > 0 and classes:
            top = 1 - smoothing + smoothing / classes
            rest = smoothing / classes
            return float(-(top * math.log(top)) - (classes - 1) * rest * math.log(rest)), f"label smoothing {smoothing}"
        if inputs is not None and targets.dim() == 1 and len(inputs) == len(targets):
            return _conflict_entropy(inputs, targets)
        return 0.0, "hard labels"
    if isinstance(loss_fn, (nn.BCEWithLogitsLoss, nn.BCELoss)) and targets is not None:
        p = targets.float().clamp(1e-12, 1 - 1e-12)
        entropy = -(p * p.log() + (1 - p) * (1 - p).log())
        return float(entropy.mean()), "binary entropy of the targets"
    if isinstance(loss_fn, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.KLDivLoss)):
        return 0.0, type(loss_fn).__name__
    return 0.0, f"assumed 0 for {type(loss_fn).__name__}"


def _conflict_entropy(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, str]:
    flat = inputs.reshape(len(inputs), -1)
    _, group = torch.unique(flat, dim=0, return_inverse=True)
    total = 0.0
    for g in group.unique():
        labels = targets[group == g]
        counts = torch.bincount(labels - labels.min()).float()
        p = counts[counts > 0] / counts.sum()
        total += float(-(p * p.log()).sum()) * len(labels)
    floor = total / len(targets)
    return floor, ("hard labels" if floor == 0 else "identical inputs with different labels")


@register_check("overfit.one_batch")
def overfit_one_batch(ctx: CheckContext) -> Check:
    """Can the model drive the loss on a handful of samples to its floor? If not, nothing else matters."""
    opts = ctx.options
    full = ctx.batch(0)
    count = max(2, min(32, opts.overfit_samples, batch_size_of(full) or 2))
    batch = samples_of(full, count)
    if batch is not None:
        count = batch_size_of(batch)  # each rank's `count` rows, for a distributed step
    samples = f"{count} samples"
    if batch is None:
        batch, count = full, batch_size_of(full)
        samples = "the whole first batch (its tensors differ in their first dimension: no slice of it is a set of samples)"
    state = ctx.copy()
    freeze_schedule(state, ctx.lr.lr)
    device_batch = loop.to_device(batch, state.device)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(opts.overfit_steps):
        outcome = loop.run_step(state, step, device_batch)
        losses.append(outcome.loss)
        if outcome.nonfinite:
            return _overfit_nonfinite(ctx, outcome, losses, samples)
    if state.user_loop:  # the loss is computed inside the user's step: no eval pass, floor assumed 0
        eval_loss, (floor, how) = math.nan, (0.0, "assumed 0: the loss is computed in your own step")
    else:
        recording = RecordingLoss(state.loss_fn)
        state.model.eval()
        with torch.no_grad(), loop.autocast(state):
            eval_loss = float(state.step_fn(state.model, device_batch, recording).float().item())
        state.model.train()
        logits, targets = recording.calls[0] if recording.calls else (None, None)
        classes = int(logits.shape[1]) if isinstance(logits, torch.Tensor) and logits.dim() >= 2 else None
        floor, how = loss_floor(state.loss_fn, batch_inputs(batch), targets, classes)
    final = min(eval_loss, losses[-1]) if math.isfinite(eval_loss) else losses[-1]
    initial = losses[0]
    extra = {"losses": losses, "floor": floor, "eval_loss": eval_loss, "samples": count, "seconds": time.perf_counter() - started}
    where = f"{samples}, {opts.overfit_steps} steps at {ctx.lr.text()}, scheduler off"
    if floor is None or min(losses) < floor - 1e-6:
        return Check("overfit.one_batch", "warn", final, f"loss {initial:.4g} -> {final:.4g} ({where}); its floor is unknown ({how}): judge the curve", extra=extra)
    gap = initial - floor
    if gap <= 1e-6:
        return Check("overfit.one_batch", "pass", final, f"loss already at its floor {floor:.4g} ({how}) on {samples}", extra=extra)
    remaining = (final - floor) / gap
    extra["remaining"] = remaining
    detail = f"loss {initial:.4g} -> {final:.4g}, floor {floor:.4g} ({how}): {100 * (1 - remaining):.0f}% of the way ({where})"
    if remaining <= OVERFIT_PASS:
        return Check("overfit.one_batch", "pass", final, detail, extra=extra)
    if remaining <= OVERFIT_LEARNS:
        return Check("overfit.one_batch", "pass", final, detail + "; most of the way down: the model and loss learn", extra=extra)
    if remaining <= OVERFIT_WARN:
        return Check("overfit.one_batch", "warn", final, detail + "; still falling: more --overfit-steps or a higher lr", extra=extra)
    return Check(
        "overfit.one_batch", "fail", final,
        detail + "; the model cannot fit a handful of samples: look for detached outputs, frozen layers, a wrong loss or a far too small lr",
        extra=extra,
    )


def _overfit_nonfinite(ctx: CheckContext, outcome, losses: list[float], samples: str) -> Check:
    """The overfit probe met a non-finite loss or gradient: a climb by orders of magnitude first is a divergence
    (the lr), a sudden one a fault to find."""
    from replaybisect.core.growth import measure

    what = f"non-finite {outcome.nonfinite.replace('_', ' ')} at overfit step {outcome.step} on {samples} ({ctx.lr.text()})"
    climb = measure(list(enumerate(losses[:-1])), "loss")
    extra = {"losses": losses, "nonfinite": True}
    if climb is not None and climb.is_divergence:
        return Check("overfit.one_batch", "fail", outcome.loss,
                     f"{what} after the {climb.sentence()}: a divergence; the lr is too high for this model (see lr.range_test)",
                     extra={**extra, "diverged": True})
    return Check("overfit.one_batch", "fail", outcome.loss, f"{what}; run the data and loss checks, then `replay nan`", extra=extra)


# ---- loss / output mismatch --------------------------------------------------------------------------------
def _rows_are_probabilities(x: torch.Tensor, dim: int = 1) -> float:
    x = x.float()
    in_range = bool(((x >= 0) & (x <= 1)).all())
    if not in_range:
        return 0.0
    sums = x.sum(dim)
    return float(((sums - 1).abs() <= PROB_ROW_TOL).float().mean())


@register_check("loss.output_mismatch")
def loss_output_mismatch(ctx: CheckContext) -> Check:
    call = ctx.loss_call()
    loss_fn = ctx.state.loss_fn
    name = type(loss_fn).__name__
    if call is None:
        return Check("loss.output_mismatch", "skip", None, "no configured loss function was called: the loss is computed in your own code (or by the model)")
    x, target = call[0], call[1] if len(call) > 1 else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return Check("loss.output_mismatch", "skip", None, f"the {name} input is not a float tensor")
    head = ctx.output_module()
    head_type = ctx.probe().leaf_types.get(head or "", "")
    at = f"`{head}` ({head_type})" if head else "the model's output"
    # no Softmax module to point at: the normalization happens inside forward()
    suspect = at if head_type in ("Softmax", "LogSoftmax", "Sigmoid") or not head else f"the model's output (after `{head}` ({head_type}); a softmax in forward()?)"
    finite = x[torch.isfinite(x)]
    if isinstance(loss_fn, nn.CrossEntropyLoss) and x.dim() >= 2:
        share = _rows_are_probabilities(x)
        if share >= 0.99:
            return Check(
                "loss.output_mismatch", "fail", share,
                f"CrossEntropyLoss is fed probabilities: {share:.0%} of rows lie in [0, 1] and sum to 1, from {suspect}; "
                "CrossEntropyLoss applies log_softmax itself, so gradients shrink: feed it raw logits (remove the softmax)",
                layer=head,
            )
        return Check("loss.output_mismatch", "pass", share, f"CrossEntropyLoss gets unnormalized logits from {at} ({share:.0%} of rows look like probabilities)")
    if isinstance(loss_fn, nn.NLLLoss) and x.dim() >= 2:
        if _rows_are_probabilities(x) >= 0.99:
            return Check("loss.output_mismatch", "fail", 1.0, f"NLLLoss is fed probabilities from {suspect}; it expects log-probabilities: use log_softmax (or CrossEntropyLoss on logits)", layer=head)
        log_norm = torch.logsumexp(x.float(), dim=1)
        share = float((log_norm.abs() <= PROB_ROW_TOL).float().mean())
        if share < 0.99:
            return Check("loss.output_mismatch", "fail", share, f"NLLLoss is fed values that are not log-probabilities (logsumexp != 0) from {at}; add log_softmax or use CrossEntropyLoss", layer=head)
        return Check("loss.output_mismatch", "pass", share, f"NLLLoss gets log-probabilities from {at}")
    if isinstance(loss_fn, nn.BCEWithLogitsLoss):
        in_unit = bool(((finite >= 0) & (finite <= 1)).all()) if finite.numel() else False
        if in_unit and head_type == "Sigmoid":
            return Check("loss.output_mismatch", "fail", 1.0, f"BCEWithLogitsLoss is fed sigmoid outputs from {at}; it applies the sigmoid itself: remove it", layer=head)
        return Check("loss.output_mismatch", "pass", 0.0, f"BCEWithLogitsLoss gets logits from {at}")
    if isinstance(loss_fn, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)) and isinstance(target, torch.Tensor):
        if tuple(x.shape) != tuple(target.shape):
            return Check(
                "loss.output_mismatch", "fail", None,
                f"{name} input shape {tuple(x.shape)} differs from the target shape {tuple(target.shape)}: they broadcast into a wrong loss; reshape one",
                layer=head,
            )
        return Check("loss.output_mismatch", "pass", None, f"{name} input and target shapes match {tuple(x.shape)}")
    return Check("loss.output_mismatch", "pass", None, f"no known mismatch for {name} (input shape {tuple(x.shape)})")


# ---- initialization ------------------------------------------------------------------------------------------
@register_check("init.symmetry")
def init_symmetry(ctx: CheckContext) -> Check:
    """Identical rows in a weight matrix are identical units. If the updates give them identical gradients
    (every layer initialized alike) they never differ: the layer is one unit wide for good. The grad
    probe's few real steps tell the two cases apart."""
    flagged = []  # (share, name, identical rows, rows, still identical after the probe steps, all zero)
    checked = 0
    probe = None
    for name, param in ctx.state.model.named_parameters():
        if param.dim() < 2 or param.shape[0] < 2:
            continue
        checked += 1
        rows = param.detach().reshape(param.shape[0], -1)
        _, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
        if int(counts.max()) < 2:
            continue
        duplicated = counts[inverse] > 1  # rows that have a twin
        probe = probe or ctx.grads()
        after = probe.final_params.get(name)
        still = None
        if after is not None and probe.steps_run and not probe.error:
            later = after.reshape(after.shape[0], -1)[duplicated]
            still = bool(torch.unique(later, dim=0).shape[0] < int(duplicated.sum()))
        zero = bool((rows[duplicated] == 0).all())
        flagged.append((float(duplicated.float().mean()), name, int(duplicated.sum()), rows.shape[0], still, zero))
    if not flagged:
        return Check("init.symmetry", "pass", 0.0, f"no identical rows in {checked} weight matrices ({ctx.where()})")
    flagged.sort(key=lambda f: (f[4] is True, f[0]), reverse=True)
    share, name, count, rows, still, zero = flagged[0]
    layer = name.rsplit(".", 1)[0] if "." in name else name
    steps = probe.steps_run if probe else 0
    listed = "; ".join(f"`{n}`: {k} of {r} rows identical" for _, n, k, r, _, _ in flagged[:3])
    if still:
        return Check(
            "init.symmetry", "fail", share,
            f"{listed} ({ctx.where()}), still identical after {steps} updates: these units get identical gradients and never differ "
            "(symmetry); initialize weights randomly (the default, or kaiming_uniform_)",
            layer=layer,
        )
    if still is False and zero:
        return Check("init.symmetry", "pass", share, f"{listed} ({ctx.where()}) are zero-initialized and the updates separate them (a deliberate zero init, e.g. LoRA or ReZero)")
    after = f", the updates separate them within {steps} steps" if still is False else ""
    return Check("init.symmetry", "warn", share, f"{listed} ({ctx.where()}){after}: the layer starts with fewer distinct units than it has; initialize randomly", layer=layer)


def _relu_layers(ctx: CheckContext) -> dict[str, LayerActivity]:
    return {n: a for n, a in ctx.probe().layers.items() if a.kind == "relu" and a.values}


def _producer(ctx: CheckContext, name: str) -> Optional[str]:
    """The parameterized module whose output feeds `name` (the last one executed before it)."""
    order = ctx.probe().leaf_order
    owners = {n for n, m in ctx.state.model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    if name not in order:
        return None
    for earlier in reversed(order[: order.index(name)]):
        if earlier in owners:
            return earlier
    return None


@register_check("init.dead_units")
def init_dead_units(ctx: CheckContext) -> Check:
    layers = _relu_layers(ctx)
    if not layers:
        return Check("init.dead_units", "skip", None, "no ReLU modules (functional activations are not hooked)")
    probe = ctx.probe()
    results = []
    for name, act in layers.items():
        share_active = act.unit_active.float() / max(act.unit_entries, 1)
        dead = float((share_active < DEAD_UNIT_ACTIVE).float().mean())
        results.append((dead, name, int((share_active < DEAD_UNIT_ACTIVE).sum()), len(share_active)))
    results.sort(reverse=True)
    dead, name, count, units = results[0]
    producer = _producer(ctx, name)
    fed = f" (fed by `{producer}`)" if producer else ""
    detail = f"`{name}`{fed}: {count} of {units} units never active on {probe.samples} samples ({ctx.where()})"
    if dead > DEAD_LAYER_FAIL:
        return Check("init.dead_units", "fail", dead, detail + "; dead units pass no gradient: check that layer's bias and init, the input scale, or lower the lr", layer=name)
    if dead > DEAD_LAYER_WARN:
        return Check("init.dead_units", "warn", dead, detail, layer=name)
    return Check("init.dead_units", "pass", dead, f"most dead: {detail}")


@register_check("init.loss")
def init_loss(ctx: CheckContext) -> Check:
    """Cross-entropy at init should be about ln(C): the model starts undecided (Karpathy's recipe)."""
    call = ctx.loss_call()
    if not ctx.at_init:
        return Check("init.loss", "skip", None, f"the state is at step {ctx.first_step}, not at initialization")
    if not isinstance(ctx.state.loss_fn, nn.CrossEntropyLoss) or call is None or not isinstance(call[0], torch.Tensor) or call[0].dim() < 2:
        return Check("init.loss", "skip", None, "only for cross-entropy over classes")
    losses = [l for l in ctx.probe().losses if math.isfinite(l)]
    if not losses:
        return Check("init.loss", "skip", None, "no finite loss on the probe batches")
    classes = int(call[0].shape[1])
    expected = math.log(classes)
    loss = sum(losses) / len(losses)
    detail = f"loss at init {loss:.4g} vs ln({classes}) = {expected:.4g}"
    if loss > INIT_LOSS_WARN * expected:
        head = ctx.output_module()
        return Check("init.loss", "warn", loss, detail + f": the initial logits are large and confidently wrong; scale down the init of `{head}`", layer=head)
    return Check("init.loss", "pass", loss, detail)


# ---- activations -------------------------------------------------------------------------------------------------
@register_check("act.relu_zero")
def act_relu_zero(ctx: CheckContext) -> Check:
    layers = _relu_layers(ctx)
    if not layers:
        return Check("act.relu_zero", "skip", None, "no ReLU modules (functional activations are not hooked)")
    fractions = sorted(((a.zeros / a.values, n) for n, a in layers.items()), reverse=True)
    share, name = fractions[0]
    listing = ", ".join(f"`{n}` {f:.0%}" for f, n in fractions[:4])
    detail = f"zero fraction per ReLU: {listing} ({ctx.where()})"
    if share >= RELU_ZERO_FAIL:
        producer = _producer(ctx, name)
        source = f"the bias of `{producer}`" if producer else "the bias of the layer before it"
        return Check("act.relu_zero", "fail", share, detail + f"; `{name}` is dead: raise {source}, fix the input scale or the lr", layer=name)
    if share >= RELU_ZERO_WARN:
        return Check("act.relu_zero", "warn", share, detail + f"; `{name}` is mostly off", layer=name)
    return Check("act.relu_zero", "pass", share, detail)


@register_check("act.saturation")
def act_saturation(ctx: CheckContext) -> Check:
    layers = {n: a for n, a in ctx.probe().layers.items() if a.kind != "relu" and a.values}
    if not layers:
        return Check("act.saturation", "skip", None, "no tanh/sigmoid/hardtanh modules")
    fractions = sorted(((a.saturated / a.values, n, a) for n, a in layers.items()), key=lambda t: t[0], reverse=True)
    share, name, act = fractions[0]
    bound = "its range" if act.kind == "hardtanh" else f"+-{SATURATION_PREACT:g}"
    detail = (
        f"`{name}` ({act.kind}): {share:.0%} of pre-activations beyond {bound} "
        f"({act.extreme / act.values:.0%} beyond SageMaker's extreme bound; max |x| {act.max_abs_preact:.3g}; {ctx.where()})"
    )
    if share > SATURATION_FAIL:
        producer = _producer(ctx, name)
        source = f"the init of `{producer}`" if producer else "the init of the layer before it"
        return Check("act.saturation", "fail", share, detail + f"; saturated units pass almost no gradient: shrink {source} or normalize its input", layer=name)
    if share > SATURATION_WARN:
        return Check("act.saturation", "warn", share, detail, layer=name)
    return Check("act.saturation", "pass", share, detail)
