"""Divergence or fault: is the non-finite value the end of an optimization divergence, or an op's numerical fault?

A **divergence** (a learning rate too high, no clipping, a bad init): the gradient norm or the loss climbed by orders of
magnitude over the steps before the failure, every op stayed finite until the values themselves overflowed, and the
growth came from the trained weights (no buffer of the model scaled itself). The answer names the climb, the layer
whose norms began to climb first, and the next step is `replay ablate lr,clip`: an op is not to blame.

A **numerical fault**: an op made a non-finite value from finite, moderate inputs (exp of a large logit, log(0), 0/0,
sqrt of a negative, an fp16 overflow): the op, its line and the fix pattern, whatever the curves did before.

The evidence: the run's recorded history (loss, grad norm, the per-layer norms recorded every
`snapshot.layer_stats_every` steps) and the replay of the steps before the failure, which records every layer's
gradient and weight norms at every step (`LayerHistory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from replaybisect.core.growth import Growth, divergence, earliest_climb, measure

EXTREME_INPUT = 1e6  # an op whose finite inputs reach this magnitude overflowed values that had already run away
BUFFER_SCALED = 10.0  # a buffer that scaled itself by this factor (either way) drove the growth, not the updates
# normalization layers' running statistics follow the activations: their growth is a symptom, not a driver
RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


class LayerHistory:
    """Replay hooks' observer factory: every layer's gradient and weight norms at every replayed step."""

    def __init__(self):
        self.grad_norms: dict[str, dict[int, float]] = {}
        self.weight_norms: dict[str, dict[int, float]] = {}
        self._step: Optional[int] = None

    def observer(self, step: int) -> "LayerHistory":
        self._step = step
        return self

    def after_backward(self, state) -> None:  # an observer moment (core/observer.py): reads only
        from replaybisect.verbs.nan.step_probe import per_module_grad_norms

        for name, value in per_module_grad_norms(state).items():
            self.grad_norms.setdefault(name, {})[self._step] = value
        for name, value in per_module_weight_norms(state.model).items():
            self.weight_norms.setdefault(name, {})[self._step] = value


def per_module_weight_norms(model) -> dict[str, float]:
    import torch

    norms = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            with torch.no_grad():
                norms[name or "(root)"] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.float()) for p in own])))
    return norms


def recorded_layer_series(store, run_id: str, prefix: str) -> dict[str, dict[int, float]]:
    """The per-layer metrics the run recorded (`grad_norm/<layer>`, `weight_norm/<layer>`), keyed like the probes."""
    series = {}
    for key in store.metric_keys(run_id):
        if key.startswith(prefix + "/"):
            name = key[len(prefix) + 1:]
            series["(root)" if name == "model" else name] = dict(store.metric_history(run_id, key))
    return series


def buffer_scaling(model, before: dict[str, Any]) -> Optional[tuple[str, float]]:
    """The float buffer (outside normalization running statistics) that scaled itself most between a snapshot's
    tensors (`before`, keyed `model/<name>`) and the model now, as (name, factor >= 1), or None."""
    import torch

    worst = None
    for name, now in model.named_buffers():
        if name.rsplit(".", 1)[-1] in RUNNING_STATS or not torch.is_floating_point(now):
            continue
        then = before.get(f"model/{name}")
        if then is None or then.shape != now.shape:
            continue
        a, b = float(then.detach().float().abs().max()), float(now.detach().float().abs().max())
        if not (math.isfinite(a) and math.isfinite(b)) or a == 0 or b == 0:
            continue
        factor = max(a / b, b / a)
        if worst is None or factor > worst[1]:
            worst = (name, factor)
    return worst


@dataclass
class Verdict:
    """The evidence and the decision; `divergence` True when the failure is an optimization divergence."""

    divergence: bool
    growth: Optional[Growth]  # the run's climb (grad norm, else loss), None when there was none
    reason: str  # one line: why divergence, or why not
    precursor: Optional[str] = None  # the layer whose norms began to climb first
    precursor_growth: Optional[Growth] = None
    weight_growth: Optional[Growth] = None  # the largest climb of a layer's weight norm
    evidence: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def growth_json(growth):
            return None if growth is None else {
                "metric": growth.metric, "onset_step": growth.onset_step, "last_step": growth.last_step,
                "onset_value": growth.onset_value, "last_value": growth.last_value, "factor": growth.factor,
            }

        return {"divergence": self.divergence, "reason": self.reason, "growth": growth_json(self.growth),
                "precursor": self.precursor, "precursor_growth": growth_json(self.precursor_growth),
                "weight_growth": growth_json(self.weight_growth)}


def moderate_fault(op_inputs: list, op: Optional[str]) -> Optional[str]:
    """Why the named op is a numerical fault (a non-finite value from finite, moderate inputs), or None."""
    if not op or not op_inputs:
        return None
    largest = max((max(abs(s.min), abs(s.max)) for s in op_inputs if s.min is not None), default=None)
    if largest is None or largest >= EXTREME_INPUT:
        return None
    return f"{op} made a non-finite value from finite inputs of magnitude <= {largest:.3g}: a numerical fault of the op, not values that ran away"


def decide(losses, grad_norms, layer_grads: dict[str, dict[int, float]], layer_weights: dict[str, dict[int, float]],
           scaled_buffer: Optional[tuple[str, float]], fault: Optional[str]) -> Verdict:
    """Divergence when the curves climbed by orders of magnitude, the op (if one was named) met runaway values,
    and no buffer scaled itself; else a fault, with the reason."""
    growth = divergence(losses, grad_norms)
    if growth is None:
        climb = measure(grad_norms, "grad norm") or measure(losses, "loss")
        said = f" ({climb.sentence()})" if climb is not None else ""
        return Verdict(False, None, f"no climb by orders of magnitude before the failure{said}")
    if fault is not None:
        return Verdict(False, growth, fault)
    if scaled_buffer is not None and scaled_buffer[1] >= BUFFER_SCALED:
        name, factor = scaled_buffer
        return Verdict(False, growth, f"the buffer {name} scaled itself x{factor:.2g} over the replayed steps: the model's own "
                                      "state drove the growth, not the optimizer's updates")
    precursor = earliest_climb({name: sorted(points.items()) for name, points in layer_grads.items()})
    weights = [measure(sorted(points.items()), f"weight norm of {name}") for name, points in layer_weights.items()]
    weight_growth = max((w for w in weights if w is not None), key=lambda w: w.factor, default=None)
    verdict = Verdict(True, growth, f"{growth.sentence()}; every op stayed finite until the values overflowed",
                      precursor[0] if precursor else None, precursor[1] if precursor else None, weight_growth)
    verdict.evidence.append(f"divergence: {growth.sentence()}, an exponential climb that ended in the overflow")
    if precursor is not None:
        name, climb = precursor
        seen_from = min(min(points) for points in layer_grads.values() if points)
        if climb.onset_step <= seen_from and seen_from > growth.onset_step:  # the layers were not watched when it began
            verdict.evidence.append(
                f"per-layer norms exist from step {seen_from} on, after the climb began: "
                f"of those, {name}'s grad norm climbed first and most (x{climb.factor:.2g} by step {climb.last_step}); record them from the "
                "start (snapshot.layer_stats_every / layer_stats_every=) to see where the climb began")
        else:
            verdict.evidence.append(f"the earliest layer to climb: {name} (its grad norm from step {climb.onset_step}, "
                                    f"x{climb.factor:.2g} by step {climb.last_step})")
    if weight_growth is not None and weight_growth.factor >= 2:
        verdict.evidence.append(f"the weights grew with it: {weight_growth.sentence()}")
    return verdict
