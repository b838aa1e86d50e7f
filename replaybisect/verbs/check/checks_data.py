"""The checks of the data: non-finite values, input scale, label range, class balance, batch diversity."""

from __future__ import annotations

from typing import Optional

import torch

from replaybisect.core.thresholds import (CLASS_BALANCE_MAX_CLASSES as BALANCE_MAX_CLASSES,
    CLASS_BALANCE_MIN_EXPECTED as BALANCE_MIN_EXPECTED, CLASS_BALANCE_P as BALANCE_P, DIVERSITY_FAIL, DIVERSITY_WARN,
    IMBALANCE_WARN, INPUT_ABS_WARN, INPUT_STD_WARN)
from replaybisect.verbs.check.batches import batch_fields, batch_inputs, batch_size_of, batch_targets, is_class_labels
from replaybisect.verbs.check.context import Check, CheckContext, names_shown, register_check


# ---- data sanity ------------------------------------------------------------------------------------------
@register_check("data.finite")
def data_finite(ctx: CheckContext) -> Check:
    """NaN or Inf in the batches the run gets, or anywhere in a sample of the dataset."""
    total = 0
    first: Optional[str] = None
    fields_hit: dict[str, int] = {}
    for step, batch in ctx.scanned():
        for name, tensor in batch_fields(batch):
            if not tensor.is_floating_point():
                continue
            bad = ~torch.isfinite(tensor)
            count = int(bad.sum())
            if count:
                total += count
                fields_hit[name] = fields_hit.get(name, 0) + count
                if first is None:
                    row = int(bad.reshape(len(bad), -1).any(1).nonzero()[0]) if bad.dim() else 0
                    first = f"step {step} row {row}"
    indices, chunks = ctx.dataset_sample()
    dataset_bad: list[int] = []
    offset = 0
    for chunk in chunks:
        for name, tensor in batch_fields(chunk):
            if tensor.is_floating_point():
                bad_rows = (~torch.isfinite(tensor)).reshape(len(tensor), -1).any(1) if tensor.dim() else (~torch.isfinite(tensor)).reshape(1)
                for row in bad_rows.nonzero().flatten().tolist():
                    dataset_bad.append(indices[offset + row])
                    fields_hit.setdefault(name, 0)
        offset += batch_size_of(chunk)
    dataset_bad = sorted(set(dataset_bad))
    if not total and not dataset_bad:
        scanned = len(ctx.scanned())
        return Check("data.finite", "pass", 0.0, f"no NaN/Inf in {scanned} batches of the run and {len(indices)} dataset items")
    field_names = names_shown(sorted(fields_hit))
    where = []
    if first:
        where.append(f"first in the run's batches at {first}")
    if dataset_bad:
        where.append(f"dataset items {', '.join(str(i) for i in dataset_bad[:5])}{' ...' if len(dataset_bad) > 5 else ''} ({len(dataset_bad)} of {len(indices)} read)")
    return Check(
        "data.finite", "fail", float(total),
        f"{total} non-finite values in field {field_names}: {'; '.join(where)}; fix the data pipeline (a NaN input makes the loss NaN at once)",
        layer=sorted(fields_hit)[0] if fields_hit else None,
    )


@register_check("data.input_scale")
def data_input_scale(ctx: CheckContext) -> Check:
    values = [batch_inputs(b) for _, b in ctx.scanned()]
    values = [v for v in values if v is not None and v.is_floating_point()]
    if not values:
        return Check("data.input_scale", "skip", None, "inputs are not floating point (token ids or custom batches): scale does not apply")
    x = torch.cat([v.reshape(-1).float() for v in values])
    x = x[torch.isfinite(x)]
    if not x.numel():
        return Check("data.input_scale", "fail", None, "no finite input values", layer="input")
    std, mean, max_abs = float(x.std()) if x.numel() > 1 else 0.0, float(x.mean()), float(x.abs().max())
    detail = f"inputs mean {mean:.3g}, std {std:.3g}, max |x| {max_abs:.3g}"
    if std == 0:
        return Check("data.input_scale", "fail", std, detail + ": every input value is the same; the model sees no signal", layer="input")
    if std > INPUT_STD_WARN[1] or max_abs > INPUT_ABS_WARN:
        return Check("data.input_scale", "warn", std, detail + ": not normalized; scale to about unit variance (e.g. divide by 255, or standardize)", layer="input")
    if std < INPUT_STD_WARN[0]:
        return Check("data.input_scale", "warn", std, detail + ": nearly constant inputs; check the preprocessing", layer="input")
    return Check("data.input_scale", "pass", std, detail)


def _label_values(ctx: CheckContext) -> list[torch.Tensor]:
    """Every class label read: the dataset sample and the run's batches."""
    _, chunks = ctx.dataset_sample()
    targets = [batch_targets(c) for c in chunks] + [batch_targets(b) for _, b in ctx.scanned()]
    return [t.reshape(-1).long() for t in targets if is_class_labels(t)]


@register_check("data.label_range")
def data_label_range(ctx: CheckContext) -> Check:
    """Class labels must lie in [0, C) where C is the size of the class dimension the loss receives."""
    call = ctx.loss_call()
    if call is None or not is_class_labels(call[1] if len(call) > 1 else None):
        return Check("data.label_range", "skip", None, "the loss does not take class-index targets")
    logits = call[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        return Check("data.label_range", "skip", None, "the loss input has no class dimension")
    classes = int(logits.shape[1])
    ignore = getattr(ctx.state.loss_fn, "ignore_index", None)
    values = torch.cat([call[1].reshape(-1).long()] + _label_values(ctx))
    if ignore is not None:
        values = values[values != ignore]
    low, high = int(values.min()), int(values.max())
    head = ctx.output_module()
    head_text = f" (`{head}` is the last layer)" if head else ""
    if high >= classes or low < 0:
        bad = int(((values >= classes) | (values < 0)).sum())
        return Check(
            "data.label_range", "fail", float(high),
            f"labels span {low}..{high} but the loss input has {classes} classes{head_text}: {bad} of {len(values)} labels out of range; "
            "fix the label mapping or the model's output size",
            layer=head,
        )
    return Check("data.label_range", "pass", float(high), f"labels span {low}..{high}, within the {classes} outputs{head_text}")


def _per_sample_labels(ctx: CheckContext) -> tuple[Optional[torch.Tensor], str]:
    """Per-sample class labels of the dataset sample, or why there are none: one label per input row (a language
    model's targets are per token, however they are shaped), integers, not too many classes."""
    indices, chunks = ctx.dataset_sample()
    batches = chunks if chunks else [b for _, b in ctx.scanned()]
    pairs = [(batch_inputs(b), batch_targets(b)) for b in batches]
    pairs = [(x, t) for x, t in pairs if t is not None]
    if not pairs:
        return None, "no targets in the batches"
    if not all(is_class_labels(t) for _, t in pairs):
        return None, "targets are not class labels (regression or soft targets)"
    for inputs, targets in pairs:
        rows = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) and inputs.dim() else None
        if targets.dim() != 1 or rows != len(targets):
            shape = "x".join(str(n) for n in targets.shape)
            return None, f"targets are per token or per pixel ({shape} targets for {rows if rows is not None else '?'} input rows), not one class per sample"
    labels = torch.cat([t for _, t in pairs]).long()
    classes = max(int(labels.unique().numel()), _loss_classes(ctx) or 0)
    if classes > BALANCE_MAX_CLASSES:
        return None, f"{classes} classes: a vocabulary or a fine-grained label set, not a few classes to balance"
    return labels, ""


def _loss_classes(ctx: CheckContext) -> Optional[int]:
    """The size of the class dimension the loss receives, when the run's loss was seen."""
    call = ctx.loss_call()
    logits = call[0] if call else None
    return int(logits.shape[1]) if isinstance(logits, torch.Tensor) and logits.dim() >= 2 else None


@register_check("data.class_balance")
def data_class_balance(ctx: CheckContext) -> Check:
    labels, why = _per_sample_labels(ctx)
    if labels is None:
        return Check("data.class_balance", "skip", None, why)
    from scipy.stats import chisquare

    values, counts = labels.unique(return_counts=True)
    ratio = float(counts.max()) / float(counts.min())
    common, rare = int(values[counts.argmax()]), int(values[counts.argmin()])
    detail = f"{len(values)} classes in {len(labels)} samples; most common {common} ({int(counts.max())}) vs rarest {rare} ({int(counts.min())}): ratio {ratio:.3g}"
    if len(values) == 1:
        return Check("data.class_balance", "fail", ratio, f"every sample has label {common}: nothing to learn", layer="target")
    expected = len(labels) / len(values)
    if expected < BALANCE_MIN_EXPECTED:  # a few samples per class: the counts are noise
        return Check("data.class_balance", "skip", ratio, detail + f"; {expected:.2g} samples per class are too few to judge balance")
    p_value = float(chisquare(counts.double().numpy()).pvalue)
    detail += f", chi-square p={p_value:.2g}"
    if ratio > IMBALANCE_WARN and p_value < BALANCE_P:
        return Check("data.class_balance", "warn", ratio, detail + "; imbalanced: consider class weights or resampling, and watch per-class metrics", layer="target")
    return Check("data.class_balance", "pass", ratio, detail)


def _diversity(batches: list[torch.Tensor], labels: torch.Tensor, classes: torch.Tensor) -> tuple[float, float, float, int, float]:
    """(distinct classes per batch / expected for a shuffled batch, mean distinct, expected, batch size,
    chi-square homogeneity p) for batches of per-sample class labels, against the dataset's class shares."""
    from scipy.stats import chi2_contingency

    p = torch.stack([(labels == c).float().mean() for c in classes])
    p = p / p.sum() if float(p.sum()) > 0 else torch.full_like(p, 1 / len(classes))
    size = len(batches[0])
    expected = float((1 - (1 - p) ** size).sum())  # distinct classes in a random batch of this size
    mean_distinct = sum(len(t.unique()) for t in batches) / len(batches)
    table = torch.stack([torch.stack([(t == c).sum() for c in classes]) for t in batches]).numpy()
    table = table[:, table.sum(0) > 0]
    p_value = float(chi2_contingency(table)[1]) if len(batches) > 1 and table.shape[1] > 1 else 1.0
    return mean_distinct / expected, mean_distinct, expected, size, p_value


@register_check("data.batch_diversity")
def data_batch_diversity(ctx: CheckContext) -> Check:
    """Do the batches the run actually trains on mix the classes like a shuffled batch would?

    Data order here is a pure function of (seed, step), but a dataset that ignores the index it is
    given (reads sequentially, caches, sorts) still hands the run class-sorted batches, and a custom
    step function can swap the batch for its own. So both are read: the run's batches, and the targets
    the loss actually receives on the probe batches."""
    labels, why = _per_sample_labels(ctx)
    per_sample = lambda t: isinstance(t, torch.Tensor) and is_class_labels(t) and t.dim() == 1  # noqa: E731
    batches = [batch_targets(b) for _, b in ctx.scanned()]
    batches = [t.long() for t in batches if per_sample(t)]
    at_loss = [call[1].long() for call in ctx.probe().loss_calls if len(call) > 1 and per_sample(call[1])]
    if labels is None or not batches:
        return Check("data.batch_diversity", "skip", None, why or "no per-sample class labels in the run's batches")
    classes = torch.cat([labels] + batches + at_loss).unique()
    if len(classes) < 2:
        return Check("data.batch_diversity", "skip", None, "a single class: nothing to mix")
    ratio, distinct, expected, size, p_value = _diversity(batches, labels, classes)
    detail = (
        f"{distinct:.3g} distinct classes per batch vs {expected:.3g} expected for shuffled batches of {size} "
        f"({len(batches)} batches from step {ctx.first_step}; chi-square homogeneity p={p_value:.2g})"
    )
    advice = "the dataset must return the item of the index it is given (order comes from the seed)"
    if at_loss and ratio >= DIVERSITY_WARN:  # the batches are mixed: does the loss get them?
        loss_ratio, loss_distinct, loss_expected, loss_size, _ = _diversity(at_loss, labels, classes)
        if loss_ratio < DIVERSITY_WARN:
            ratio = loss_ratio
            detail = (
                f"the loss receives {loss_distinct:.3g} distinct classes per batch vs {loss_expected:.3g} expected for shuffled batches of "
                f"{loss_size} ({len(at_loss)} probe batches), though the run's batches hold {distinct:.3g}"
            )
            advice = "the step function trains on other data than the batch it is given; use the batch"
    if ratio < DIVERSITY_FAIL:
        return Check("data.batch_diversity", "fail", ratio, detail + f": batches are sorted or grouped by class; {advice}", layer="target")
    if ratio < DIVERSITY_WARN:
        return Check("data.batch_diversity", "warn", ratio, detail + ": batches mix fewer classes than shuffled data would", layer="target")
    return Check("data.batch_diversity", "pass", ratio, detail)
