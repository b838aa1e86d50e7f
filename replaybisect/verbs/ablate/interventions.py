"""The intervention registry for `replay ablate`: one small function per single-variable change.

Each intervention is a name, a one-line description and a function `(config, ArmContext) -> Change`.
The Change carries the arm's config (objects are built from it; state comes from the snapshot) and the
adjustments a config cannot express, applied after the snapshot is loaded: `optimizer.load_state_dict`
restores the recorded param-group hyperparameters, so an lr or eps change must be re-applied to the groups.

Adding an intervention is adding one decorated function here. This module imports nothing heavy at
import time (`replay ablate --list` must stay fast).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["ArmContext", "ArmSpec", "Change", "Intervention", "REGISTRY", "BASELINE", "names", "get", "parse_arm",
           "baseline_change", "suggested_clip"]

BASELINE = "baseline"
LR_DIVISOR = 10.0  # the field's first move: drop the LR 10x
CLIP_MAX_NORM = 1.0  # the field's default clip threshold
EPS_FACTOR = 1000.0  # Adam eps x1000 (1e-8 -> 1e-5): bounds the update where the second moment is tiny
CLIP_PERCENTILE = 95.0  # clip threshold from data (Zhang et al. 2020, "Why gradient clipping accelerates training"; AutoClip, Seetharaman et al. 2020) ~ the 95th percentile of unclipped norms


@dataclass
class ArmContext:
    """What an intervention may look at besides the config."""

    failing_step: Optional[int]  # the recorded first non-finite step (None: the run never failed)
    start_step: int  # the arm's changes apply from this step on
    end_step: int  # exclusive: the last step replayed is end_step - 1
    grad_norms: list[float] = field(default_factory=list)  # the run's recorded finite pre-clip norms before the failure
    carried_gradients: bool = False  # the run's loop carried gradients into a step (it did not clear them)


@dataclass
class Change:
    """One arm's change: the config to build from, plus what must be done after the snapshot loads."""

    cfg: Any
    params: dict[str, Any]  # logged as the arm's MLflow params
    summary: str  # one line for the report, e.g. "optim.lr 0.3 -> 0.03"
    lr_factor: Optional[Callable[[int], float]] = None  # step -> multiplier on the scheduled lr at that step's update
    group_scale: dict[str, float] = field(default_factory=dict)  # param-group key -> multiplier after restore
    skip_steps: frozenset = frozenset()  # steps whose batch is dropped (no forward, no update)
    skip_rows: Optional[tuple[int, tuple[int, ...]]] = None  # (step, rows): rows dropped from that step's batch
    reseed: Optional[int] = None  # another data-order and RNG seed from the arm's start on
    clear_grads: bool = False  # every step starts with cleared gradients (a loop that never clears them)
    note: str = ""  # extra advice shown with the arm (e.g. the suggested clip threshold)
    not_applicable: Optional[str] = None  # why this change means nothing for this run (then it is not run)
    optimizer: Optional[str] = None  # of several optimizers (core/several.py): the one the lr change is made on


@dataclass(frozen=True)
class Intervention:
    name: str
    description: str
    apply: Callable[[Any, ArmContext, Any], Change]  # (config, context, the arm's value or None: the default)
    parse: Optional[Callable[[str], Any]] = None  # the text after `name=` -> the value; ValueError says what is expected
    show: Callable[[Any], str] = str  # a value -> its text in an arm's label (`lr=x0.1`)
    default: Any = None  # the bare name's value (None: decided per run, e.g. the warmup's length)
    by_default: bool = True  # one of the arms run when none are named (not skip-rows: bare it means nothing)


@dataclass(frozen=True)
class ArmSpec:
    """One arm as asked for: an intervention and its value (None: the bare name, the intervention's default)."""

    intervention: str
    value: Any = None
    suggested: str = ""  # why the report added this arm (a value it suggests, proven by running it)
    optimizer: Optional[str] = None  # `lr[D]`: of several optimizers, the one changed (None: all)

    @property
    def name(self) -> str:
        """The arm's name in results: the bare name, or `name=value` as the value is shown (`lr[D]=x0.3`)."""
        if self.value is None:
            return self._named
        return f"{self._named}={get(self.intervention).show(self.value)}"

    @property
    def label(self) -> str:
        """The arm with the value it runs at, for names people read (`lr=x0.1`, even for a bare `lr`)."""
        intervention = get(self.intervention)
        value = self.value if self.value is not None else intervention.default
        return self._named if value is None else f"{self._named}={intervention.show(value)}"

    @property
    def _named(self) -> str:
        return self.intervention if self.optimizer is None else f"{self.intervention}[{self.optimizer}]"


REGISTRY: dict[str, Intervention] = {}


def intervention(name: str, description: str, parse: Optional[Callable[[str], Any]] = None,
                 show: Callable[[Any], str] = str, default: Any = None, by_default: bool = True):
    def register(function: Callable[[Any, ArmContext, Any], Change]):
        REGISTRY[name] = Intervention(name, description, function, parse, show, default, by_default)
        return function

    return register


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Intervention:
    return REGISTRY[name]


def parse_arm(text: str) -> ArmSpec:
    """'lr' | 'lr=x0.3' | 'clip=265' -> ArmSpec; a ReplayError (one line) for an unknown arm or a bad value."""
    from replaybisect.errors import ReplayError

    name, has_value, raw = (part.strip() for part in text.partition("="))
    name, optimizer = _optimizer_named(name)
    if name not in REGISTRY:
        raise ReplayError(f"unknown arm {name!r}; valid arms: {', '.join(names())}")
    if optimizer is not None and name not in PER_OPTIMIZER:
        raise ReplayError(f"arm {text.strip()[:80]!r}: only {' and '.join(PER_OPTIMIZER)} change one optimizer of several "
                          f"([name]); pass {name} without [{optimizer}]")
    if not has_value:
        return ArmSpec(name, optimizer=optimizer)
    intervention = get(name)
    if intervention.parse is None:
        raise ReplayError(f"arm {name!r} takes no value (got {text.strip()[:80]!r}); pass it bare: {name}")
    try:
        return ArmSpec(name, intervention.parse(raw), optimizer=optimizer)
    except ValueError as error:
        raise ReplayError(f"arm {text.strip()[:80]!r}: {error}") from None


PER_OPTIMIZER = ("lr", "warmup")  # the arms that may change one optimizer of several: lr[D]=x0.1


def _optimizer_named(name: str) -> tuple[str, Optional[str]]:
    """'lr[D]' -> ('lr', 'D'); 'lr' -> ('lr', None)."""
    import re

    from replaybisect.errors import ReplayError

    if "[" not in name:
        return name, None
    named = re.fullmatch(r"([\w-]+)\[([A-Za-z_]\w*)\]", name)
    if named is None:
        raise ReplayError(f"arm {name[:80]!r}: name one optimizer in brackets, as the run was recorded with it (lr[D]=x0.1)")
    return named.group(1), named.group(2)


# ---- values ------------------------------------------------------------------------------------
def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]!r} is not a finite number")
    return value


def parse_factor(text: str) -> float:
    """'x0.3' (or '0.3x', '/10') -> a positive multiplier."""
    hint = "give a factor such as x0.3 (or /10)"
    if text.startswith(("x", "*")):
        factor = _number(text[1:])
    elif text.endswith("x"):
        factor = _number(text[:-1])
    elif text.startswith("/"):
        divisor = _number(text[1:])
        if divisor <= 0:
            raise ValueError(f"{text!r}: the divisor must be positive; {hint}")
        factor = 1 / divisor
    else:
        raise ValueError(f"{text[:40]!r} is not a factor; {hint}")
    if factor <= 0:
        raise ValueError(f"{text!r}: the factor must be positive; {hint}")
    return factor


def show_factor(factor: float) -> str:
    return f"x{factor:.4g}"


def parse_positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise ValueError(f"{text!r} must be a positive number (e.g. clip=1.0)")
    return value


def parse_steps(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{text[:40]!r} must be a positive number of steps (e.g. warmup=20)")
    return int(text)


def parse_step(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{text[:40]!r} must be a step number >= 0 (e.g. skip-batch=47)")
    return int(text)


def parse_rows(text: str) -> tuple[int, ...]:
    rows = text.split("+")
    if not all(row.strip().isdigit() for row in rows):
        raise ValueError(f"{text[:40]!r} must be row numbers of the failing step's batch joined by + (e.g. skip-rows=3+17)")
    return tuple(sorted({int(row) for row in rows}))


def parse_seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text[:40]!r} must be an integer seed (e.g. seed=1)") from None


def parse_precision(text: str) -> str:
    from replaybisect.core.config import PRECISIONS

    if text not in PRECISIONS:
        raise ValueError(f"{text[:40]!r} is not a precision; use one of {', '.join(PRECISIONS)}")
    return text


def show_number(value: float) -> str:
    return f"{value:.4g}"


# ---- helpers -----------------------------------------------------------------------------------
def _edit(cfg, **changes: Any):
    """A copy of the config with dotted keys set (struct mode allows new keys only inside open_dict)."""
    from omegaconf import OmegaConf, open_dict

    new = copy.deepcopy(cfg)
    with open_dict(new):
        for dotted, value in changes.items():
            OmegaConf.update(new, dotted.replace("__", "."), value, merge=False, force_add=True)
    return new


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _optimizer_default(cfg, key: str) -> tuple[bool, Any]:
    """(has the key, value): from the optim config, else the optimizer class's signature default."""
    import inspect

    from hydra.utils import get_class

    if cfg.get("optim") is None:  # a run of the user's own loop: the optimizer is built by their code
        return False, None
    if key in cfg.optim:
        return True, cfg.optim[key]
    try:
        signature = inspect.signature(get_class(cfg.optim._target_))
    except Exception:
        return False, None
    parameter = signature.parameters.get(key)
    if parameter is None:
        return False, None
    return True, parameter.default


def percentile(values: list[float], q: float) -> Optional[float]:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return None
    import numpy as np

    return float(np.percentile(finite, q))


def baseline_change(cfg) -> Change:
    return Change(cfg=cfg, params={}, summary="none (the recorded run, replayed unchanged)")


# ---- the registry ------------------------------------------------------------------------------
@intervention("lr", "multiply the learning rate (default x0.1) at every update, on top of any scheduler; lr=x0.3 for another factor",
              parse=parse_factor, show=show_factor, default=1 / LR_DIVISOR)
def lower_lr(cfg, ctx: ArmContext, factor: Optional[float]) -> Change:
    factor = 1 / LR_DIVISOR if factor is None else factor
    has_lr, old = _optimizer_default(cfg, "lr")
    new = old * factor if isinstance(old, (int, float)) else None
    summary = f"optim.lr {_fmt(old)} -> {_fmt(new)}" if new is not None else f"learning rate {show_factor(factor)}"
    # The scheduler keeps its own schedule; the multiplier scales what it sets, at the update only,
    # so closed-form and chainable schedulers alike see the recorded values.
    return Change(
        cfg=_edit(cfg, **{"optim.lr": new}) if new is not None and has_lr else cfg,
        params={"optim.lr": new if new is not None else show_factor(factor), "lr_factor": factor},
        summary=summary,
        lr_factor=lambda step: factor,
    )


def suggested_clip(grad_norms: list[float]) -> Optional[float]:
    """A clip threshold from this run's own norms (3 significant digits: the value shown is the value run)."""
    value = percentile(grad_norms, CLIP_PERCENTILE)
    return float(f"{value:.3g}") if value is not None and value > 0 else None


def clip_suggestion_note(grad_norms: list[float]) -> str:
    if len(grad_norms) == 1:
        return "the one gradient norm recorded before the failure"
    return f"the {CLIP_PERCENTILE:.0f}th percentile of the {len(grad_norms)} gradient norms recorded before the failure"


CLIP_IN_YOUR_STEP = ("clipped before your step's own clip_grad_norm_, if it has one (an update by hand: as its "
                     "backward returns)")


@intervention("clip", f"clip the total gradient norm (default at {CLIP_MAX_NORM}; clip=265 for another threshold); "
              f"adds an arm at this run's {CLIP_PERCENTILE:.0f}th-percentile norm",
              parse=parse_positive, show=show_number, default=CLIP_MAX_NORM)
def clip_gradients(cfg, ctx: ArmContext, threshold: Optional[float]) -> Change:
    threshold = CLIP_MAX_NORM if threshold is None else threshold
    old = cfg.train.clip_grad_norm
    if old is not None and old <= threshold:
        return Change(cfg, {}, f"train.clip_grad_norm is already {_fmt(old)}",
                      not_applicable=f"the run already clips at {_fmt(old)} <= {_fmt(threshold)}")
    edited = _edit(cfg, **{"train.clip_grad_norm": threshold})
    if cfg.train.loop == "user" and old is None:  # the user's step may clip too: ours comes first, where it clips
        return Change(cfg=edited, params={"train.clip_grad_norm": threshold},
                      summary=f"clip the gradient norm at {_fmt(threshold)} before each update", note=CLIP_IN_YOUR_STEP)
    return Change(cfg=edited, params={"train.clip_grad_norm": threshold},
                  summary=f"train.clip_grad_norm {_fmt(old) if old is not None else 'off'} -> {_fmt(threshold)}")


@intervention("precision", "train in another precision (default fp32, instead of bf16/fp16 autocast)",
              parse=parse_precision, default="fp32")
def full_precision(cfg, ctx: ArmContext, precision: Optional[str]) -> Change:
    precision = precision or "fp32"
    old = cfg.train.precision
    if old == precision:
        return Change(cfg, {}, f"train.precision is already {old}", not_applicable=f"the run already trains in {old}")
    return Change(
        cfg=_edit(cfg, **{"train.precision": precision}),
        params={"train.precision": precision},
        summary=f"train.precision {old} -> {precision}",
    )


def warmup_steps(ctx: ArmContext) -> int:
    """Reach the full learning rate halfway through the replay, so its second half tests the warmed-up run."""
    return max(1, (ctx.end_step - ctx.start_step) // 2)


@intervention("warmup", "linear learning-rate warmup from the replay's start, reaching the full rate halfway through "
              "(warmup=20: in 20 steps)", parse=parse_steps)
def linear_warmup(cfg, ctx: ArmContext, steps: Optional[int]) -> Change:
    length = steps or warmup_steps(ctx)
    start = ctx.start_step
    return Change(
        cfg=cfg,
        params={"warmup_steps": length, "warmup_start": start},
        summary=f"lr x (step - {start} + 1) / {length} for steps {start}..{start + length - 1}",
        lr_factor=lambda step: min(1.0, (step - start + 1) / length),
    )


@intervention("eps", "multiply the Adam eps (default x1000; eps=x100 for another factor)",
              parse=parse_factor, show=show_factor, default=EPS_FACTOR)
def larger_eps(cfg, ctx: ArmContext, factor: Optional[float]) -> Change:
    factor = EPS_FACTOR if factor is None else factor
    if cfg.train.loop == "user":  # the user's optimizer: scale the eps of its groups (where it has one)
        return Change(cfg=cfg, params={"eps_factor": factor}, summary=f"optimizer eps {show_factor(factor)}", group_scale={"eps": factor})
    has_eps, old = _optimizer_default(cfg, "eps")
    if not has_eps or not isinstance(old, (int, float)):
        optimizer = str(cfg.optim.get("_target_", "the optimizer")).rsplit(".", 1)[-1]
        return Change(cfg, {}, "no eps", not_applicable=f"{optimizer} has no eps")
    new = float(old) * factor
    return Change(
        cfg=_edit(cfg, **{"optim.eps": new}),
        params={"optim.eps": new},
        summary=f"optim.eps {_fmt(float(old))} -> {_fmt(new)}",
        group_scale={"eps": factor},
    )


@intervention("skip-batch", "drop the failing step's batch (no forward, no update) and go on with the next "
              "(skip-batch=47: another step's)", parse=parse_step)
def skip_failing_batch(cfg, ctx: ArmContext, step: Optional[int]) -> Change:
    step = ctx.failing_step if step is None else step
    if step is None:
        return Change(cfg, {}, "no failing batch", not_applicable="the run never failed: there is no failing batch to drop")
    if not ctx.start_step <= step < ctx.end_step:
        return Change(cfg, {}, f"batch of step {step}", not_applicable=f"step {step} is outside the replay ({ctx.start_step}..{ctx.end_step - 1})")
    return Change(
        cfg=cfg,
        params={"skip_step": step},
        summary=f"batch of step {step} dropped",
        skip_steps=frozenset({step}),
    )


@intervention("skip-rows", "drop rows of the failing step's batch (skip-rows=3+17, the rows `replay nan` names) and keep "
              "the rest: is the failure in the data of those rows?", parse=parse_rows, show=lambda rows: "+".join(map(str, rows)),
              by_default=False)
def skip_failing_rows(cfg, ctx: ArmContext, rows: Optional[tuple[int, ...]]) -> Change:
    if rows is None:
        return Change(cfg, {}, "no rows", not_applicable="name the rows to drop: skip-rows=3+17 (replay nan names the rows a "
                                                         "fault keyed on the data came from)")
    if ctx.failing_step is None:
        return Change(cfg, {}, "no failing batch", not_applicable="the run never failed: there is no failing batch to drop rows from")
    if not ctx.start_step <= ctx.failing_step < ctx.end_step:
        return Change(cfg, {}, f"rows of step {ctx.failing_step}", not_applicable=f"step {ctx.failing_step} is outside the replay "
                                                                               f"({ctx.start_step}..{ctx.end_step - 1})")
    shown = "+".join(map(str, rows))
    return Change(cfg=cfg, params={"skip_rows": shown, "skip_rows_step": ctx.failing_step},
                  summary=f"row{'s' if len(rows) > 1 else ''} {shown} of step {ctx.failing_step}'s batch dropped", skip_rows=(ctx.failing_step, rows))


@intervention("zero-grad", "clear the gradients at the start of every step (optimizer.zero_grad()): for a loop that "
              "never clears them, or accumulates them over steps", by_default=False)
def clear_gradients(cfg, ctx: ArmContext, value: None) -> Change:
    if not ctx.carried_gradients:
        return Change(cfg, {}, "gradients cleared", not_applicable="the run's loop cleared its gradients before every "
                                                                   "step's backward: there are none to clear")
    return Change(cfg=cfg, params={"zero_grad": True}, summary="zero_grad() before every step", clear_grads=True)


@intervention("seed", "another data-order and dropout seed from the replay's start (default: the run's + 1; seed=7 for "
              "another): is the failure noise?", parse=parse_seed)
def other_seed(cfg, ctx: ArmContext, seed: Optional[int]) -> Change:
    if cfg.train.loop == "user":
        return Change(cfg, {}, "no data source", not_applicable="the run comes from your own loop: replay has its stored batches, not your data pipeline")
    new = int(cfg.seed) + 1 if seed is None else seed
    if new == int(cfg.seed):
        return Change(cfg, {}, f"seed {new}", not_applicable=f"the run's seed is already {new}")
    return Change(
        cfg=_edit(cfg, seed=new),
        params={"seed": new},
        summary=f"seed {cfg.seed} -> {new} (data order and RNG streams from step {ctx.start_step})",
        reseed=new,
    )
