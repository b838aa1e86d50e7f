"""What a check is and what it reads: `Check` (pass | warn | fail | skip, the number behind it), the options,
the registry checks join with @register_check, and `CheckContext`: the training state, the batches the run
actually gets, a sample of the dataset, and the probes, each computed once and shared by the checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from replaybisect.core import loop
from replaybisect.core.jsonutil import from_jsonable
from replaybisect.errors import ReplayError
from replaybisect.core.rng import seed_everything
from replaybisect.verbs.check import lr_finder
from replaybisect.core.thresholds import LR_DIVERGENCE_MARGIN, LR_SUGGESTION_BAND as LR_BAND
from replaybisect.verbs.check.probes import ForwardProbe, GradProbe, forward_probe, grad_probe

SEVERITY = {"skip": 0, "pass": 0, "warn": 1, "fail": 2}

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


def fmt(value: float) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e4):
        return f"{value:.4g}"
    return f"{value:.3g}"


def names_shown(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{i}`" for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
