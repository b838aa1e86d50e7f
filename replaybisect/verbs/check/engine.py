"""`replay check`: the five-minute checklist, before a long run or against a recorded one.

A registry of small checks. Each reads a `CheckContext` (the training state, the batches the run
actually gets, a sample of the dataset) and returns one `Check`: pass | warn | fail (skip when it does
not apply) with the number behind it and a one-line detail naming the layer or field.

Side computations never touch the user's objects: every check that runs a model works on a fresh copy
of the state (model, optimizer, scheduler, scaler), inside `isolated_rng()`, and is seeded on its own so
results do not depend on which checks ran before it. Steps go through `loop.run_step`, the one code path.

Thresholds come from core/thresholds.py (the public source named beside each); where no public number exists the
comment says "our choice" and why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from replaybisect.core import loop, reentry, user_step
from replaybisect.core.config import needs_closure
from replaybisect.core.jsonutil import from_jsonable
from replaybisect.core.inline_step import ARGS, KWARGS, OUTSIDE, LoopEnded, RemoteStep
from replaybisect.core.guard import scaler_enabled
from replaybisect.core.layer_stats import SATURATING, ZEROING, norm_of, parameter_owners
from replaybisect.core.snapshot import like
from replaybisect.errors import ConfigError, ReplayError
from replaybisect.core.rng import isolated_rng, seed_everything
from replaybisect.verbs.check import lr_finder

__all__ = ["Check", "CheckContext", "CheckOptions", "CheckReport", "REGISTRY", "check", "register_check", "run_checks"]

SEVERITY = {"skip": 0, "pass": 0, "warn": 1, "fail": 2}

# ---- thresholds ------------------------------------------------------------------------------------
from replaybisect.core.thresholds import (  # noqa: E402  (sources cited there)
    CLASS_BALANCE_MAX_CLASSES as BALANCE_MAX_CLASSES, CLASS_BALANCE_MIN_EXPECTED as BALANCE_MIN_EXPECTED,
    CLASS_BALANCE_P as BALANCE_P, DEAD_LAYER_FAIL, DEAD_LAYER_WARN, DEAD_UNIT_ACTIVE, DIVERSITY_FAIL, DIVERSITY_WARN,
    IMBALANCE_WARN,
    INIT_LOSS_WARN, INPUT_ABS_WARN, INPUT_STD_WARN, PROB_ROW_TOL, RELU_ZERO_FAIL, RELU_ZERO_WARN,
    SATURATION_FAIL, SATURATION_PREACT, SATURATION_WARN, SIGMOID_EXTREME, TANH_EXTREME,
    LR_DIVERGENCE_MARGIN, LR_SUGGESTION_BAND as LR_BAND, UPDATE_RATIO_FAIL, UPDATE_RATIO_WARN,
    FIRST_LAST_GRAD_RATIO_EXPLODING as EXPLODING_RATIO,
    FIRST_LAST_GRAD_RATIO_VANISHING as VANISHING_RATIO,
    FIRST_LAYER_GRAD_NORM_VANISHING as VANISHING_FIRST_NORM,
    GRAD_MEAN_ABS_VANISHING as VANISHING_MEAN_ABS,
    GRAD_NORM_SPAN_WARN_DECADES as SPAN_WARN_DECADES,
    OVERFIT_ONE_BATCH_LEARNS as OVERFIT_LEARNS,
    OVERFIT_ONE_BATCH_PASS as OVERFIT_PASS,
    OVERFIT_ONE_BATCH_WARN as OVERFIT_WARN,
)
DATASET_SAMPLE = 4096  # dataset items read for label statistics (all of a small dataset)



# ---- results ---------------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail | skip
    value: Optional[float]
    detail: str
    layer: Optional[str] = None  # the module, parameter or data field the finding is about
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # curves for plots (not in JSON)

    def to_json(self) -> dict[str, Any]:
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        return {"name": self.name, "status": self.status, "value": value, "detail": self.detail, "layer": self.layer}

    def to_full_json(self) -> dict[str, Any]:
        """With the curves behind it (`extra`): how a check made in a re-entered script comes back."""
        from replaybisect.core.jsonutil import to_jsonable

        return {**self.to_json(), "extra": to_jsonable(self.extra)}

    @classmethod
    def from_full_json(cls, data: dict[str, Any]) -> "Check":
        extra = from_jsonable(dict(data.get("extra") or {}))
        if extra.get("lr_range") is not None:
            extra["lr_range"] = lr_finder.LRRangeResult(**extra["lr_range"])
        return cls(data["name"], data["status"], from_jsonable(data["value"]), data["detail"], data.get("layer"), extra)


@dataclass
class CheckOptions:
    overfit_steps: int = 300  # "a few hundred steps" (issue 6; Karpathy's recipe)
    overfit_samples: int = 16  # 2..32 samples
    lr_steps: int = lr_finder.STEPS
    lr_min: float = lr_finder.LR_MIN
    lr_max: float = lr_finder.LR_MAX
    scan_batches: int = 32  # the run's own batches read for data checks (at most one epoch)
    probe_batches: int = 4  # batches forwarded for activation / dead-unit statistics
    grad_steps: int = 3  # steps whose gradients the gradient-flow checks read
    only: Optional[list[str]] = None  # check names or groups (data, loss, init, act, grad, overfit, lr)


def worst(statuses) -> str:
    statuses = list(statuses)
    if not statuses:
        return "pass"
    top = max(SEVERITY[s] for s in statuses)
    return {0: "pass", 1: "warn", 2: "fail"}[top]


# ---- batch structure ---------------------------------------------------------------------------------
def merged_micro_batches(batch):
    """A user loop's list of micro-batches (tuples or dicts of tensors, one structure) as one batch: every field
    concatenated along dim 0. Anything else is returned as it is."""
    batch = user_step.data_of(batch)
    if isinstance(batch, list) and batch and all(isinstance(b, dict) and ARGS in b for b in batch):
        # a loop recorded as written: each training call's inputs, then the targets its loss met outside the model
        batch = [(*b[ARGS], *b[KWARGS].values(), *(b.get(OUTSIDE) or [])) for b in batch]
    if not isinstance(batch, (list, tuple)) or not batch or not all(isinstance(b, (list, tuple, dict)) for b in batch):
        return batch
    first = batch[0]
    try:
        if isinstance(first, dict):
            return {key: torch.cat([b[key] for b in batch]) for key in first if isinstance(first[key], torch.Tensor)}
        return tuple(torch.cat([b[i] for b in batch]) for i in range(len(first)) if isinstance(first[i], torch.Tensor))
    except (KeyError, IndexError, TypeError, RuntimeError):  # micro-batches of different structures or shapes
        return batch


def batch_fields(batch) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of a batch: (inputs, targets) tuples become `input`/`target`, dicts keep their keys."""
    batch = merged_micro_batches(batch)
    if isinstance(batch, torch.Tensor):
        return [("input", batch)]
    if isinstance(batch, dict):
        return [(str(k), v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    if isinstance(batch, (list, tuple)):
        names = ["input", "target"] + [f"field {i}" for i in range(2, len(batch))]
        return [(names[i], v) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)]
    return []


def batch_inputs(batch) -> Optional[torch.Tensor]:
    batch = merged_micro_batches(batch)
    if isinstance(batch, dict):
        return batch.get("input")
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def batch_targets(batch) -> Optional[torch.Tensor]:
    batch = merged_micro_batches(batch)
    if isinstance(batch, dict):
        return batch.get("target")
    if isinstance(batch, (list, tuple)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    return None


def leading_sizes(batch) -> set[int]:
    """The first-dimension sizes of every tensor in a batch (scalars have none)."""
    if isinstance(batch, torch.Tensor):
        return {int(batch.shape[0])} if batch.dim() else set()
    if isinstance(batch, dict):
        return set().union(*(leading_sizes(v) for v in batch.values()))
    if isinstance(batch, (list, tuple)):
        return set().union(*(leading_sizes(v) for v in batch))
    return set()


def samples_of(batch, count: int) -> Optional[Any]:
    """The first `count` samples of a batch when every tensor in it has the same first dimension, else None: then no
    slice is a set of samples (a sequence-first language model gets (T, B) tokens and T*B flattened targets; slicing
    both by 16 feeds its loss 16 targets for T*B outputs). A stored step is sliced as its step reads it: its batch
    (each rank's, for a distributed step), not the RNG states stored beside it."""
    return user_step.map_batch(batch, lambda data: slice_batch(data, count) if len(leading_sizes(data)) == 1 else None)


def slice_batch(batch, count: int):
    """The first `count` samples of a batch (every tensor sliced along dim 0)."""
    if isinstance(batch, torch.Tensor):
        return batch[:count]
    if isinstance(batch, dict):
        return {k: slice_batch(v, count) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return like(batch, [slice_batch(v, count) for v in batch])
    return batch


def batch_size_of(batch) -> int:
    fields = batch_fields(batch)
    return int(fields[0][1].shape[0]) if fields and fields[0][1].dim() else 0


def is_class_labels(targets: Optional[torch.Tensor]) -> bool:
    return targets is not None and not targets.is_floating_point() and not targets.is_complex() and targets.dtype != torch.bool


@dataclass(frozen=True)
class TrainingLr:
    """The learning rate the checks train at (the first param group's; others keep their ratio to it), and why."""

    lr: float
    source: str

    def text(self) -> str:
        return f"lr {self.lr:.3g} ({self.source})"


def training_lr(state: loop.TrainState) -> TrainingLr:
    """A config's (or a run's, when it logged none) lr: the scheduler's base lr, else the optimizer's lr. A
    snapshot's current lr is where the schedule stood (the end of a cosine is near 0), not what the run trains at."""
    group = state.optimizer.param_groups[0]
    if "initial_lr" in group:
        return TrainingLr(float(group["initial_lr"]), "the scheduler's base lr")
    return TrainingLr(float(group["lr"]), "the optimizer's lr")


def freeze_schedule(state: loop.TrainState, lr: Optional[float] = None) -> None:
    """Switch the scheduler off and put the groups at their base lr (warmups start near 0), or with `lr` the first
    group at `lr` and the others at the same ratio to it as their base lrs."""
    state.scheduler = None
    groups = state.optimizer.param_groups
    bases = [float(group.get("initial_lr", group["lr"])) for group in groups]
    factor = lr / bases[0] if lr is not None and bases[0] > 0 else 1.0
    for group, base in zip(groups, bases):
        group["lr"] = base * factor


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
                    probe.errors.append(f"{type(error).__name__}: {_first_line(error)}")
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
            probe.errors.append(f"{type(error).__name__}: {_first_line(error)}")
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
        probe.error = f"{type(error).__name__}: {_first_line(error)}"
    finally:
        for handle in handles:
            handle.remove()
    probe.final_params = {name: p.detach() for name, p in model.named_parameters()}
    return probe


# ---- the context the checks read ---------------------------------------------------------------------------
class CheckContext:
    """The user's state (read through copies only), the run's batches and a sample of its dataset."""

    def __init__(
        self,
        state: loop.TrainState,
        batch_of: Callable[[int], Any],
        *,
        first_step: int = 0,
        dataset=None,
        steps_per_epoch: Optional[int] = None,
        options: Optional[CheckOptions] = None,
        at_init: bool = True,
        seed: int = 0,
        lr: Optional[TrainingLr] = None,
        initial: Optional[Callable[[], loop.TrainState]] = None,
    ):
        self.state = state
        self._batch_of = batch_of
        self.first_step = first_step
        self.dataset = dataset
        self.steps_per_epoch = steps_per_epoch
        self.options = options or CheckOptions()
        self.at_init = at_init
        self.seed = seed
        self.lr = lr or training_lr(state)
        # a recorded run's state at initialization (its config, its seed), for the LR range test; None: `state` is it
        self._initial = initial
        self._batches: dict[int, Any] = {}
        self._initial_batches: dict[int, Any] = {}
        self._probe: Optional[ForwardProbe] = None
        self._grad: Optional[GradProbe] = None
        self._lr_range: Optional[lr_finder.LRRangeResult] = None
        self._sample: Optional[tuple[list[int], list]] = None
        self.batch_errors: list[str] = []
        # a re-entered script's own objects (state.live) cannot be copied: each copy is those objects, put back first
        self._live_saved = loop.copy_state(state) if state.live else None

    # the run's batches, in the run's order ------------------------------------------------------------
    def batch(self, offset: int):
        """The batch of step first_step + offset, on CPU. When the data source cannot make it (a recorded
        run whose stored batches end), the batches already read are reused in order."""
        return self._cached_batch(self._batches, self.first_step + offset, offset)

    def initial_batch(self, step: int):
        """The batch of step `step` from the run's start (the LR range test from initialization)."""
        return self._cached_batch(self._initial_batches, step, step) if self._initial else self.batch(step)

    def _cached_batch(self, cache: dict[int, Any], step: int, offset: int):
        if offset not in cache:
            try:
                cache[offset] = self._batch_of(step)
            except ReplayError as error:
                if not cache:
                    raise
                self.batch_errors.append(str(error))
                known = sorted(cache)
                return cache[known[offset % len(known)]]
        return cache[offset]

    def scanned(self) -> list[tuple[int, Any]]:
        count = self.options.scan_batches
        if self.steps_per_epoch:
            count = min(count, self.steps_per_epoch)
        out = []
        for offset in range(max(1, count)):
            try:
                out.append((self.first_step + offset, self.batch(offset)))
            except ReplayError:
                break
        return out

    def dataset_sample(self) -> tuple[list[int], list]:
        """Collated chunks of up to DATASET_SAMPLE dataset items (all of a small dataset), with their indices."""
        if self._sample is None:
            indices: list[int] = []
            chunks: list = []
            if self.dataset is not None:
                size = len(self.dataset)
                if size <= DATASET_SAMPLE:
                    indices = list(range(size))
                else:
                    indices = torch.linspace(0, size - 1, DATASET_SAMPLE).round().long().unique().tolist()
                from torch.utils.data import default_collate

                for start in range(0, len(indices), 512):
                    chunks.append(default_collate([self.dataset[i] for i in indices[start : start + 512]]))
            self._sample = (indices, chunks)
        return self._sample

    def copy(self) -> loop.TrainState:
        """A state to train freely: a clone, or for a script's own objects those objects, with the state the checks
        began from loaded back (the copies are used one at a time)."""
        if self._live_saved is None:
            return loop.clone_state(self.state)
        loop.load_state(self.state, self._live_saved)
        self.state.optimizer.zero_grad(set_to_none=True)
        return loop.under_settings(self.state, self.state.cfg)

    def probe(self) -> ForwardProbe:
        if self._probe is None:
            count = max(1, self.options.probe_batches)
            self._probe = forward_probe(self.copy(), [batch for _, batch in self.scanned()[:count]])
        return self._probe

    def grads(self) -> GradProbe:
        if self._grad is None:
            count = max(1, self.options.grad_steps)
            state = self.copy()
            freeze_schedule(state, self.lr.lr)
            self._grad = grad_probe(state, [self.batch(i) for i in range(count)])
        return self._grad

    def lr_range(self) -> lr_finder.LRRangeResult:
        """The LR range test, from initialization (Smith's recipe sweeps an untrained model: at a trained snapshot
        the loss has no room left to fall, and the steepest descent lands anywhere)."""
        if self._lr_range is None:
            opts = self.options
            state = self._initial() if self._initial else self.copy()
            batch_of = lambda i: loop.to_device(self.initial_batch(i), state.device)  # noqa: E731
            result = lr_finder.lr_range_test(state, batch_of, lr_min=opts.lr_min, lr_max=opts.lr_max, steps=opts.lr_steps)
            if result.stop_reason == "nonfinite" and len(result.lrs) > lr_finder.SKIP_BEGIN:
                control = self._initial() if self._initial else self.copy()
                seed_everything(self.seed)  # the sweep's random draws again (dropout), so only the lr differs
                if lr_finder.nonfinite_at_lowest_lr(control, batch_of, result):
                    result.stop_reason, result.suggested_lr, result.suggested_index = "fault", None, None
            if lr_finder.still_falling(result):  # no turn in the curve: its steepest descent is no suggestion
                result.suggested_lr = result.suggested_index = None
            self._lr_range = result
        return self._lr_range

    def lr_judgement(self) -> Optional[str]:
        """"high" or "low" when the LR range test says the training lr is off, "ok" when its sweep trained well at
        that lr, None when it cannot tell (no suggestion, or an lr past a sweep that never blew up)."""
        result = self.lr_range()
        lr = self.lr.lr
        if result.stop_reason == "fault":  # non-finite whatever the lr: the sweep says nothing about it
            return None
        if lr_finder.still_falling(result):  # the loss fell to the sweep's end: fine inside it, unknown past it
            return "ok" if lr <= result.lrs[-1] else None
        stopped = result.diverged_lr is not None and result.stop_reason != "completed"
        if stopped and lr * LR_DIVERGENCE_MARGIN > result.diverged_lr:
            return "high"
        if result.suggested_lr is None:
            return None
        if lr < result.suggested_lr / LR_BAND[0]:
            return "low"
        if lr <= result.suggested_lr * LR_BAND[1]:
            return "ok"
        # above the steepest descent: too high only where the sweep found the loss blowing up (word_language_model's
        # SGD at lr 20 with clip 0.25 trains, and a sweep to 10 never blows up)
        if stopped:
            return "high"
        return "ok" if result.lrs and lr <= result.lrs[-1] else None

    def loss_call(self) -> Optional[tuple[Any, Any]]:
        calls = self.probe().loss_calls
        return calls[0] if calls else None

    def output_module(self) -> Optional[str]:
        """The last leaf module the forward pass ran: the one whose output the loss most likely reads."""
        order = self.probe().leaf_order
        skip = (nn.Dropout, nn.Identity)
        types = {name: type(m) for name, m in self.state.model.named_modules()}
        for name in reversed(order):
            if not issubclass(types.get(name, nn.Module), skip):
                return name
        return None

    def where(self) -> str:
        return "at init" if self.at_init else f"at step {self.first_step}"


# ---- the registry ------------------------------------------------------------------------------------------
CheckFn = Callable[[CheckContext], Check]
REGISTRY: dict[str, CheckFn] = {}


def register_check(name: str):
    """Register a check; adding a check is adding one function."""

    def register(function: CheckFn) -> CheckFn:
        REGISTRY[name] = function
        return function

    return register


def group_of(name: str) -> str:
    return name.split(".", 1)[0]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _fmt(value: float) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e4):
        return f"{value:.4g}"
    return f"{value:.3g}"


def _names(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{i}`" for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


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
    field_names = _names(sorted(fields_hit))
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
            f"non-finite gradient ({kinds}) in {len(names)} of {len(probe.got_grad)} parameters: {_names(names)}, "
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
        problems.append(f"no gradient (detached or unused in the forward pass): {_names(no_grad)}")
    if zero_grad:
        problems.append(f"all-zero gradient (behind a dead or constant path): {_names(zero_grad)}")
    if probe.not_in_optimizer:
        problems.append(f"not in the optimizer, never updated: {_names(probe.not_in_optimizer)}")
    steps = f"{probe.steps_run} steps"
    if problems:
        bad = no_grad + zero_grad + probe.not_in_optimizer
        frozen = f"; frozen (requires_grad=False): {_names(probe.frozen)}" if probe.frozen else ""
        return Check("grad.missing", "fail", float(len(bad)), f"{len(bad)} of {total} parameters over {steps}: " + "; ".join(problems) + frozen, layer=bad[0])
    if probe.frozen:
        return Check(
            "grad.missing", "warn", float(len(probe.frozen)),
            f"{len(probe.frozen)} of {total} parameters are frozen (requires_grad=False): {_names(probe.frozen)}; fine if you meant to train only part of the model",
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


# ---- running the checklist ----------------------------------------------------------------------------------------
ORDER = [
    "overfit.one_batch",
    "data.finite", "data.input_scale", "data.label_range", "data.class_balance", "data.batch_diversity",
    "loss.output_mismatch",
    "init.symmetry", "init.dead_units", "init.loss",
    "act.relu_zero", "act.saturation",
    "grad.nonfinite", "grad.missing", "grad.vanishing", "grad.update_ratio",
    "lr.range_test",
]
GROUPS = sorted({group_of(n) for n in ORDER})


def select(only: Optional[list[str]]) -> list[str]:
    names = [n for n in ORDER if n in REGISTRY] + [n for n in REGISTRY if n not in ORDER]
    if not only:
        return names
    unknown = [o for o in only if o not in REGISTRY and o not in GROUPS]
    if unknown:
        raise ReplayError(f"unknown check {', '.join(unknown)}; choose from the groups {', '.join(GROUPS)} or the checks {', '.join(names)}")
    return [n for n in names if n in only or group_of(n) in only]


MANY_STEPS = ("overfit.one_batch", "lr.range_test")  # hundreds of steps each (a script's loop may end first)


def run_checks(ctx: CheckContext, progress: Optional[Callable[[str], None]] = None) -> list[Check]:
    """Run the selected checks. Nothing here changes the user's model, optimizer or RNG streams: every
    check runs under `isolated_rng()`, seeded on its own, against copies."""
    results = []
    names = select(ctx.options.only)
    if isinstance(ctx.state.step_fn, RemoteStep):  # a script's own loop runs each step: the checks of few steps first
        names = sorted(names, key=lambda name: name in MANY_STEPS)
    with isolated_rng():
        for name in names:
            if progress:
                progress(name)
            seed_everything(ctx.seed)
            try:
                result = REGISTRY[name](ctx)
            except LoopEnded:  # a loop recorded as written ran its last iteration: the checks needing more steps skip
                result = Check(name, "skip", None, "the script's own loop ended before this check's steps (a re-entered "
                               "script runs as many iterations as its command line asks for)")
            except ReplayError:
                raise
            except Exception as error:  # the user's code raised inside a check: that is a finding
                result = Check(name, "fail", None, f"could not run: {type(error).__name__}: {_first_line(error)}")
            results.append(result)
    order = select(ctx.options.only)
    return sorted(results, key=lambda check: order.index(check.name))  # (as selected, whatever order they ran in)


# ---- the command: a config or a recorded run, checked into a CheckReport (report.publish records it) ---------
@dataclass
class CheckReport:
    run_id: Optional[str]  # the check run (kind=check), once report.publish has recorded it
    checked_run_id: Optional[str]  # the recorded run checked (--run-id), else None
    source: str  # config | run
    snapshot_step: Optional[int]
    checks: list[Check]
    options: CheckOptions
    configured_lr: Optional[float] = None  # the lr the checks trained at ...
    lr_source: str = ""  # ... and where it comes from ("the run's peak lr, step 30")
    snapshot_reason: str = ""  # why this snapshot of a recorded run ("the last snapshot before the growth ...")
    warnings: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)  # set by report.publish, like run_id and tracking_uri
    tracking_uri: str = ""
    seconds: float = 0.0  # the checks, and the publishing once done

    @property
    def status(self) -> str:
        return worst(c.status for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for c in self.checks if c.status == s) for s in ("pass", "warn", "fail", "skip")}

    def find(self, name: str) -> Optional[Check]:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def lr_range(self) -> Optional[lr_finder.LRRangeResult]:
        found = self.find("lr.range_test")
        return found.extra.get("lr_range") if found else None

    def to_full_json(self) -> dict[str, Any]:
        """Every field, the checks' curves too: how a report made in a re-entered script comes back."""
        from dataclasses import fields

        from replaybisect.core.jsonutil import to_jsonable

        data = {f.name: to_jsonable(getattr(self, f.name)) for f in fields(self) if f.name not in ("checks", "options")}
        return {**data, "checks": [check.to_full_json() for check in self.checks], "options": to_jsonable(self.options)}

    @classmethod
    def from_full_json(cls, data: dict[str, Any]) -> "CheckReport":
        values = dict(data)
        values["checks"] = [Check.from_full_json(check) for check in data["checks"]]
        values["options"] = CheckOptions(**data["options"])
        values["configured_lr"] = from_jsonable(values.get("configured_lr"))
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        lr = self.lr_range
        overfit = self.find("overfit.one_batch")
        return {
            "run_id": self.run_id,
            "checked_run_id": self.checked_run_id,
            "source": self.source,
            "snapshot_step": self.snapshot_step,
            "snapshot_reason": self.snapshot_reason or None,
            "lr": {"value": self.configured_lr, "source": self.lr_source},
            "status": self.status,
            "summary": self.counts(),
            "checks": [c.to_json() for c in self.checks],
            "lr_range": ({**lr.to_json(), "configured_lr": self.configured_lr, "judgement": self.find("lr.range_test").extra.get("lr_judgement")}
                         if lr else None),
            "overfit": (
                {"final_loss": overfit.value, "floor": overfit.extra.get("floor"), "steps": len(overfit.extra.get("losses", []))}
                if overfit and overfit.extra
                else None
            ),
            "warnings": self.warnings,
            "artifacts": self.artifacts,
            "seconds": round(self.seconds, 3),
            "tracking_uri": self.tracking_uri,
        }


def _build_from_config(cfg):
    state = loop.build_state(cfg)
    batch_source, _ = loop.build_data(cfg)
    return state, batch_source


def check(
    store=None,
    *,
    cfg=None,
    run_id: Optional[str] = None,
    step: Optional[int] = None,
    options: Optional[CheckOptions] = None,
    progress: Optional[Callable[[str], None]] = None,
    trust=None,
) -> CheckReport:
    """Run the checklist on a config (at initialization) or on a recorded run (its config, at a healthy snapshot:
    `recorded.choose_snapshot`; `step` picks the snapshot at or before it). Nothing is written: the store is only
    read, for --run-id (without one, a cfg needs no store); check/report.py `publish` records the report."""
    started = time.perf_counter()
    options = options or CheckOptions()
    select(options.only)  # an unknown check name is bad input before anything is built
    if step is not None and not run_id:
        raise ReplayError("--step picks a snapshot of a recorded run: pass it with --run-id")

    # 1. build everything first: bad input never creates a run
    if run_id:
        cfg_of_run = _recorded_config(store, run_id, trust)
        if cfg_of_run.train.get("script") is not None and not reentry.replaying():  # checked inside the script, run again
            from dataclasses import asdict

            from replaybisect.script_replay import run_in_script

            arguments = {"step": step, "options": asdict(options)}
            report = CheckReport.from_full_json(run_in_script("check", store, run_id, cfg_of_run, trust, arguments,
                                                              progress or (lambda line: None)))
            report.seconds = time.perf_counter() - started  # (the script's start and its hand-over too)
            return report
        ctx, snapshot_step, reason, warnings = _recorded_context(store, run_id, step, options, cfg_of_run)
    else:
        if cfg is None:
            raise ReplayError("pass a config (--config-dir/--config-name, overrides) or --run-id")
        state, source = _build_from_config(cfg)
        ctx = CheckContext(state, source.batch, dataset=source.dataset, steps_per_epoch=source.steps_per_epoch,
                           options=options, seed=int(cfg.seed))
        snapshot_step, reason, warnings = None, "", []

    # 2. the checklist
    checks = run_checks(ctx, progress=progress)
    warnings += sorted(set(ctx.batch_errors))[:3]

    return CheckReport(
        run_id=None, checked_run_id=run_id, source="run" if run_id else "config", snapshot_step=snapshot_step,
        checks=checks, options=options, configured_lr=ctx.lr.lr, lr_source=ctx.lr.source, snapshot_reason=reason,
        warnings=warnings, seconds=time.perf_counter() - started,
    )


def _recorded_config(store, run_id: str, trust):
    """The config of a run the checks can read (refused in one line otherwise), admitted as `trust` says."""
    from replaybisect import restore as restore_mod

    if store is None:
        raise ReplayError(f"checking run {run_id} needs the store it was recorded in")
    tags = store.tags(run_id)  # RunNotFound: one line, exit 2
    if tags.get("kind") == "check":
        parent = store.get_run(run_id).data.tags.get("mlflow.parentRunId")
        raise ReplayError(f"run {run_id} is a check run; pass the run it checked{f' ({parent})' if parent else ''} or a config")
    artifacts = {Path(info.path).name for info in store.list_artifacts(run_id)}
    if "config.yaml" not in artifacts:
        has_metrics = bool(store.get_run(run_id).data.metrics)
        what = "no config.yaml" + ("" if has_metrics else " and no metrics")
        raise ReplayError(
            f"run {run_id} has {what}: it was not recorded by `replay train`; "
            "check a config instead: replay check --config-dir DIR --config-name NAME"
        )
    return restore_mod.run_config(store, run_id, trust)  # trust: --code-dir/--trust (replaybisect.core.trust.Trust)


def _recorded_context(store, run_id: str, step: Optional[int], options: CheckOptions, cfg):
    """A recorded run rebuilt for the checklist: (context, snapshot step or None, why that snapshot, warnings)."""
    from replaybisect import restore as restore_mod
    from replaybisect.core import ranks
    from replaybisect.verbs.check import recorded

    choice = recorded.choose_snapshot(store, run_id, step)  # a bad --step: one line, before anything is built

    if ranks.recorded_sharded(cfg):  # its probes read whole parameters; a sharded replay holds DTensors
        raise ConfigError(f"run {run_id}'s model was sharded with fully_shard: replay check does not check a sharded run's "
                          "state yet; check its config on one process (replay check with its overrides), or replay nan / ablate the run")
    peak = recorded.peak_lr(store, run_id)
    warnings: list[str] = []
    if choice.step is None:
        warnings.append(f"run {run_id}: {choice.reason}")
        state, source = _build_from_config(cfg)
        ctx = CheckContext(state, source.batch, dataset=source.dataset, steps_per_epoch=source.steps_per_epoch, options=options,
                           seed=int(cfg.seed), lr=_run_lr(state, peak))
        return ctx, None, choice.reason, warnings
    restored = restore_mod.restore(store, run_id, choice.step, cfg=cfg)
    warnings += restored.warnings
    reason = choice.reason
    if restored.step != choice.step:  # the chosen snapshot did not verify: restore took an earlier one
        reason += f"; snapshot {choice.step} did not verify, so the one at step {restored.step}"
    batch_of = restored.batch
    if cfg.train.loop == "user":  # the stored batch without the RNG state recorded with it
        batch_of = lambda at: user_step.unpack(restored.batch(at))[0]  # noqa: E731
    dataset, steps_per_epoch = None, None
    with isolated_rng():
        try:
            source, _ = loop.build_data(cfg)
            dataset, steps_per_epoch = source.dataset, source.steps_per_epoch
        except ReplayError as error:
            warnings.append(f"the run's dataset cannot be built here ({error}); data checks read its stored batches only")

    def initial() -> loop.TrainState:  # the run at initialization, for the LR range test: its step-0 snapshot
        with isolated_rng():
            if 0 in restore_mod.snapshot_steps(store, run_id):
                return restore_mod.restore(store, run_id, 0, cfg=cfg).state
            return loop.build_state(cfg)  # (no snapshot at step 0: the run's config built afresh)

    ctx = CheckContext(
        restored.state, batch_of, first_step=restored.step, dataset=dataset, steps_per_epoch=steps_per_epoch,
        options=options, at_init=restored.step == 0, seed=int(cfg.seed), lr=_run_lr(restored.state, peak),
        initial=None if restored.step == 0 else initial,
    )
    return ctx, restored.step, reason, warnings


def _run_lr(state: loop.TrainState, peak) -> TrainingLr:
    """A recorded run trains at its peak lr (the top of its warmup or schedule), else its base lr."""
    return TrainingLr(peak.lr, peak.source) if peak is not None else training_lr(state)
