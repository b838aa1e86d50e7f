"""What the checks read from a model: a forward pass's per-layer activity (ForwardProbe) and a few steps'
gradients and updates (GradProbe), each on a copy of the state, through the one step code path."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from replaybisect.core import loop
from replaybisect.core.inline_step import LoopEnded
from replaybisect.core.guard import scaler_enabled
from replaybisect.core.layer_stats import SATURATING, ZEROING, norm_of, parameter_owners
from replaybisect.core.thresholds import SATURATION_PREACT, SIGMOID_EXTREME, TANH_EXTREME
from replaybisect.verbs.check.batches import batch_size_of


# ---- probes: what the checks read --------------------------------------------------------------------
class RecordingLoss:
    """Wraps the loss function to keep what the step function feeds it (the first call per batch)."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, *args, **kwargs):
        if len(self.calls) < 64:
            self.calls.append(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[:2]))
        return self.loss_fn(*args, **kwargs)


def _unit_activity(output: torch.Tensor, channel_first: bool) -> tuple[torch.Tensor, int]:
    """Per-unit count of active (> 0) entries and the number of entries per unit."""
    active = output.detach() > 0
    if active.dim() <= 1:
        return active.reshape(1, -1).sum(1), active.numel()
    if channel_first and active.dim() >= 3:
        active = active.transpose(1, -1)
    flat = active.reshape(-1, active.shape[-1])
    return flat.sum(0), flat.shape[0]


@dataclass
class LayerActivity:
    kind: str  # relu | tanh | sigmoid | hardtanh
    zeros: int = 0
    values: int = 0
    unit_active: Optional[torch.Tensor] = None
    unit_entries: int = 0
    saturated: int = 0  # beyond +-5 (or outside Hardtanh's range)
    extreme: int = 0  # beyond SageMaker's bounds
    max_abs_preact: float = 0.0


@dataclass
class ForwardProbe:
    """Statistics of a few forward passes of a model copy on the run's first batches (no update)."""

    layers: dict[str, LayerActivity] = field(default_factory=dict)
    leaf_order: list[str] = field(default_factory=list)  # leaf modules in execution order (first pass)
    leaf_types: dict[str, str] = field(default_factory=dict)
    loss_calls: list[tuple[Any, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    batches: int = 0
    samples: int = 0


def forward_probe(state: loop.TrainState, batches: list) -> ForwardProbe:
    model = state.model
    probe = ForwardProbe()
    handles = []
    last_param_module: list[Optional[nn.Module]] = [None]
    first_pass = [True]

    def leaf_hook(name):
        def hook(module, inputs, output):
            if first_pass[0] and name not in probe.leaf_types:
                probe.leaf_order.append(name)
                probe.leaf_types[name] = type(module).__name__
            if any(True for _ in module.parameters(recurse=False)):
                last_param_module[0] = module

        return hook

    def zero_hook(name):
        def hook(module, inputs, output):
            if not isinstance(output, torch.Tensor):
                return
            layer = probe.layers.setdefault(name, LayerActivity("relu"))
            channel_first = isinstance(last_param_module[0], (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.GroupNorm))
            active, entries = _unit_activity(output, channel_first or output.dim() >= 4)
            if layer.unit_active is None or layer.unit_active.shape != active.shape:
                layer.unit_active, layer.unit_entries = active.clone(), entries
            else:
                layer.unit_active += active
                layer.unit_entries += entries
            layer.zeros += int((output.detach() == 0).sum())
            layer.values += output.numel()

        return hook

    def saturation_hook(name):
        def hook(module, inputs, output):
            pre = inputs[0].detach().float() if inputs and isinstance(inputs[0], torch.Tensor) else None
            if pre is None:
                return
            kind = "tanh" if isinstance(module, nn.Tanh) else "sigmoid" if isinstance(module, nn.Sigmoid) else "hardtanh"
            layer = probe.layers.setdefault(name, LayerActivity(kind))
            if kind == "hardtanh":
                saturated = (pre < module.min_val) | (pre > module.max_val)
                extreme = saturated
            else:
                saturated = pre.abs() > SATURATION_PREACT
                extreme = pre.abs() > TANH_EXTREME if kind == "tanh" else (pre < SIGMOID_EXTREME[0]) | (pre > SIGMOID_EXTREME[1])
            layer.saturated += int(saturated.sum())
            layer.extreme += int(extreme.sum())
            layer.values += pre.numel()
            finite = pre[torch.isfinite(pre)]
            if finite.numel():
                layer.max_abs_preact = max(layer.max_abs_preact, float(finite.abs().max()))

        return hook

    for name, module in model.named_modules():
        if not any(True for _ in module.children()):
            handles.append(module.register_forward_hook(leaf_hook(name or "model")))
        if isinstance(module, ZEROING):
            handles.append(module.register_forward_hook(zero_hook(name)))
        elif isinstance(module, SATURATING):
            handles.append(module.register_forward_hook(saturation_hook(name)))
    if state.user_loop:  # the user's own step (backward and update inside): each batch on a fresh copy
        try:
            _user_step_passes(state, batches, probe, first_pass)
        finally:
            for handle in handles:
                handle.remove()
        return probe
    recording = RecordingLoss(state.loss_fn)
    try:
        model.train()
        with torch.no_grad():
            for batch in batches:
                calls_before = len(recording.calls)
                try:
                    with loop.autocast(state):
                        loss = state.step_fn(model, loop.to_device(batch, state.device), recording)
                    probe.losses.append(float(loss.detach().float().item()))
                except Exception as error:  # the loss may refuse the batch (labels out of range, ...)
                    probe.errors.append(f"{type(error).__name__}: {first_line(error)}")
                if len(recording.calls) > calls_before:
                    probe.loss_calls.append(recording.calls[calls_before])
                probe.batches += 1
                probe.samples += batch_size_of(batch)
                first_pass[0] = False
    finally:
        for handle in handles:
            handle.remove()
    return probe


def _user_step_passes(state: loop.TrainState, batches: list, probe: ForwardProbe, first_pass: list[bool]) -> None:
    """The forward statistics of a run from the user's own loop: their step from the same state for every batch
    (weights, optimizer, scheduler, scaler put back in `state`'s objects, which carry the module hooks), so no batch
    sees another's update."""
    saved, carry = loop.copy_state(state), state.carry
    for batch in batches:
        loop.load_state(state, saved)
        state.carry = None  # each batch's step starts with an empty carry, not the one the last batch left
        try:
            outcome = loop.run_step(state, 0, loop.to_device(batch, state.device), halt_on_nonfinite=False)
            probe.losses.append(outcome.loss)
        except LoopEnded:
            raise
        except Exception as error:
            probe.errors.append(f"{type(error).__name__}: {first_line(error)}")
        probe.batches += 1
        probe.samples += batch_size_of(batch)
        first_pass[0] = False
    loop.load_state(state, saved)
    state.carry = carry


@dataclass
class GradProbe:
    """A few real steps (`loop.run_step`) of a model copy: which parameters got gradients, per-layer norms,
    the update/weight ratio."""

    steps_run: int = 0
    module_order: list[str] = field(default_factory=list)  # modules owning parameters, forward order
    module_grad_norm: dict[str, list[float]] = field(default_factory=dict)
    module_grad_mean_abs: dict[str, list[float]] = field(default_factory=dict)
    module_update_ratio: dict[str, list[float]] = field(default_factory=dict)
    update_ratio: list[float] = field(default_factory=list)
    got_grad: dict[str, bool] = field(default_factory=dict)  # parameter name -> any grad tensor seen
    nonzero_grad: dict[str, bool] = field(default_factory=dict)  # ... and any non-zero entry
    frozen: list[str] = field(default_factory=list)  # requires_grad=False
    not_in_optimizer: list[str] = field(default_factory=list)
    nonfinite: Optional[str] = None  # what stopped the probe: "non-finite loss at probe step 0"
    nonfinite_step: Optional[int] = None
    nonfinite_loss: Optional[float] = None
    nonfinite_grads: dict[str, str] = field(default_factory=dict)  # parameter -> "inf" | "nan" (first step it was seen)
    backward_steps: int = 0  # steps whose gradients were computed (a non-finite loss stops a step before its backward)
    error: Optional[str] = None
    final_params: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # after the probe steps


class _GradObserver:
    def __init__(self, probe: GradProbe, model: nn.Module):
        self.probe = probe
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.owners = parameter_owners(model)
        self.before: dict[str, list[torch.Tensor]] = {}

    def after_backward(self, state) -> None:
        self.probe.backward_steps += 1
        routine_overflow = scaler_enabled(state.scaler)  # an enabled GradScaler skips an overflowing step: no fault
        for name, param in self.named:
            grad = param.grad
            if grad is not None:
                self.probe.got_grad[name] = True
                if bool((grad != 0).any()):
                    self.probe.nonzero_grad[name] = True
                if routine_overflow or name in self.probe.nonfinite_grads:
                    continue
                if not bool(torch.isfinite(grad).all()):
                    self.probe.nonfinite_grads[name] = "nan" if bool(torch.isnan(grad).any()) else "inf"
        for name, params in self.owners:
            grads = [p.grad.detach().float() for p in params if p.grad is not None]
            if grads:
                norm = float(norm_of(grads))
                mean_abs = float(sum(g.abs().sum() for g in grads) / sum(g.numel() for g in grads))
                self.probe.module_grad_norm.setdefault(name, []).append(norm)
                self.probe.module_grad_mean_abs.setdefault(name, []).append(mean_abs)
            self.before[name] = [p.detach().float().clone() for p in params]

    def after_update(self, state) -> None:
        total_delta = total_weight = 0.0
        for name, params in self.owners:
            before = self.before.get(name)
            if not before:
                continue
            delta = sum(float(torch.sum((p.detach().float() - b) ** 2)) for p, b in zip(params, before))
            weight = sum(float(torch.sum(b**2)) for b in before)
            total_delta += delta
            total_weight += weight
            if weight > 0:
                self.probe.module_update_ratio.setdefault(name, []).append(math.sqrt(delta / weight))
        if total_weight > 0:
            self.probe.update_ratio.append(math.sqrt(total_delta / total_weight))


def grad_probe(state: loop.TrainState, batches: list) -> GradProbe:
    probe = GradProbe()
    model = state.model
    in_optimizer = {id(p) for p in state.params}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            probe.frozen.append(name)
        elif id(param) not in in_optimizer:
            probe.not_in_optimizer.append(name)
        else:
            probe.got_grad.setdefault(name, False)
            probe.nonzero_grad.setdefault(name, False)
    seen: set[str] = set()

    def order_hook(name):
        def hook(module, inputs):
            if name not in seen:
                seen.add(name)
                probe.module_order.append(name)

        return hook

    owners = {name for name, _ in parameter_owners(model)}
    handles = [
        module.register_forward_pre_hook(order_hook(name or "model"))
        for name, module in model.named_modules()
        if (name or "model") in owners
    ]
    observer = _GradObserver(probe, model)
    try:
        for index, batch in enumerate(batches):
            outcome = loop.run_step(state, index, loop.to_device(batch, state.device), observer=observer)
            probe.steps_run += 1
            if outcome.nonfinite:
                probe.nonfinite = f"non-finite {outcome.nonfinite.replace('_', ' ')} at probe step {index}"
                probe.nonfinite_step, probe.nonfinite_loss = index, outcome.loss
                break
    except LoopEnded:  # no steps left in a script's loop: the checks reading this probe skip (run_checks)
        raise
    except Exception as error:
        probe.error = f"{type(error).__name__}: {first_line(error)}"
    finally:
        for handle in handles:
            handle.remove()
    probe.final_params = {name: p.detach() for name, p in model.named_parameters()}
    return probe


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
