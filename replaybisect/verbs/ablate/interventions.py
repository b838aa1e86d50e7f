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

__all__ = ["ArmContext", "Change", "Intervention", "REGISTRY", "BASELINE", "names", "get", "baseline_change"]

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


@dataclass
class Change:
    """One arm's change: the config to build from, plus what must be done after the snapshot loads."""

    cfg: Any
    params: dict[str, Any]  # logged as the arm's MLflow params
    summary: str  # one line for the report, e.g. "optim.lr 0.3 -> 0.03"
    lr_factor: Optional[Callable[[int], float]] = None  # step -> multiplier on the scheduled lr at that step's update
    group_scale: dict[str, float] = field(default_factory=dict)  # param-group key -> multiplier after restore
    skip_steps: frozenset = frozenset()  # steps whose batch is dropped (no forward, no update)
    reseed: Optional[int] = None  # another data-order and RNG seed from the arm's start on
    note: str = ""  # extra advice shown with the arm (e.g. the suggested clip threshold)
    not_applicable: Optional[str] = None  # why this change means nothing for this run (then it is not run)


@dataclass(frozen=True)
class Intervention:
    name: str
    description: str
    apply: Callable[[Any, ArmContext], Change]


REGISTRY: dict[str, Intervention] = {}


def intervention(name: str, description: str):
    def register(function: Callable[[Any, ArmContext], Change]):
        REGISTRY[name] = Intervention(name, description, function)
        return function

    return register


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Intervention:
    return REGISTRY[name]


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
@intervention("lr", "divide the learning rate by 10 (at every update, on top of any scheduler)")
def lower_lr(cfg, ctx: ArmContext) -> Change:
    has_lr, old = _optimizer_default(cfg, "lr")
    new = old / LR_DIVISOR if isinstance(old, (int, float)) else None
    summary = f"optim.lr {_fmt(old)} -> {_fmt(new)}" if new is not None else "learning rate x0.1"
    # The scheduler keeps its own schedule; the multiplier scales what it sets, at the update only,
    # so closed-form and chainable schedulers alike see the recorded values.
    return Change(
        cfg=_edit(cfg, **{"optim.lr": new}) if new is not None and has_lr else cfg,
        params={"optim.lr": new if new is not None else "x0.1", "lr_factor": 1 / LR_DIVISOR},
        summary=summary,
        lr_factor=lambda step: 1 / LR_DIVISOR,
    )


@intervention("clip", "clip the total gradient norm at 1.0 (reports this run's 95th-percentile norm as a threshold)")
def clip_gradients(cfg, ctx: ArmContext) -> Change:
    old = cfg.train.clip_grad_norm
    suggested = percentile(ctx.grad_norms, CLIP_PERCENTILE)
    note = (
        f"suggested threshold: {suggested:.3g} (the {CLIP_PERCENTILE:.0f}th percentile of this run's {len(ctx.grad_norms)} "
        "recorded pre-clip gradient norms; clipping should be rare, not constant)"
        if suggested is not None
        else ""
    )
    if cfg.train.loop == "user" and old is None:  # the user's step may clip too: ours comes after theirs
        return Change(
            cfg=_edit(cfg, **{"train.clip_grad_norm": CLIP_MAX_NORM}),
            params={"train.clip_grad_norm": CLIP_MAX_NORM, "suggested_clip": suggested},
            summary=f"clip the gradient norm at {CLIP_MAX_NORM} before each update (after any clipping in your step)",
            note=note,
        )
    if old is not None and old <= CLIP_MAX_NORM:
        return Change(cfg, {}, f"train.clip_grad_norm is already {_fmt(old)}", note=note,
                      not_applicable=f"the run already clips at {_fmt(old)} <= {CLIP_MAX_NORM}")
    return Change(
        cfg=_edit(cfg, **{"train.clip_grad_norm": CLIP_MAX_NORM}),
        params={"train.clip_grad_norm": CLIP_MAX_NORM, "suggested_clip": suggested},
        summary=f"train.clip_grad_norm {_fmt(old) if old is not None else 'off'} -> {CLIP_MAX_NORM}",
        note=note,
    )


@intervention("precision", "train in fp32 instead of bf16/fp16 autocast")
def full_precision(cfg, ctx: ArmContext) -> Change:
    old = cfg.train.precision
    if old == "fp32":
        return Change(cfg, {}, "train.precision is already fp32", not_applicable="the run already trains in fp32")
    return Change(
        cfg=_edit(cfg, **{"train.precision": "fp32"}),
        params={"train.precision": "fp32"},
        summary=f"train.precision {old} -> fp32",
    )


def warmup_steps(ctx: ArmContext) -> int:
    """Reach the full learning rate halfway through the replay, so its second half tests the warmed-up run."""
    return max(1, (ctx.end_step - ctx.start_step) // 2)


@intervention("warmup", "linear learning-rate warmup from the replay's start, reaching the full rate halfway through")
def linear_warmup(cfg, ctx: ArmContext) -> Change:
    length = warmup_steps(ctx)
    start = ctx.start_step
    return Change(
        cfg=cfg,
        params={"warmup_steps": length, "warmup_start": start},
        summary=f"lr x (step - {start} + 1) / {length} for steps {start}..{start + length - 1}",
        lr_factor=lambda step: min(1.0, (step - start + 1) / length),
    )


@intervention("eps", "multiply the Adam eps by 1000")
def larger_eps(cfg, ctx: ArmContext) -> Change:
    if cfg.train.loop == "user":  # the user's optimizer: scale the eps of its groups (where it has one)
        return Change(cfg=cfg, params={"eps_factor": EPS_FACTOR}, summary=f"optimizer eps x{EPS_FACTOR:g}", group_scale={"eps": EPS_FACTOR})
    has_eps, old = _optimizer_default(cfg, "eps")
    if not has_eps or not isinstance(old, (int, float)):
        optimizer = str(cfg.optim.get("_target_", "the optimizer")).rsplit(".", 1)[-1]
        return Change(cfg, {}, "no eps", not_applicable=f"{optimizer} has no eps")
    new = float(old) * EPS_FACTOR
    return Change(
        cfg=_edit(cfg, **{"optim.eps": new}),
        params={"optim.eps": new},
        summary=f"optim.eps {_fmt(float(old))} -> {_fmt(new)}",
        group_scale={"eps": EPS_FACTOR},
    )


@intervention("skip-batch", "drop the failing step's batch (no forward, no update) and go on with the next")
def skip_failing_batch(cfg, ctx: ArmContext) -> Change:
    if ctx.failing_step is None:
        return Change(cfg, {}, "no failing batch", not_applicable="the run never failed: there is no failing batch to drop")
    return Change(
        cfg=cfg,
        params={"skip_step": ctx.failing_step},
        summary=f"batch of step {ctx.failing_step} dropped",
        skip_steps=frozenset({ctx.failing_step}),
    )


@intervention("seed", "another data-order and dropout seed from the replay's start: is the failure noise?")
def other_seed(cfg, ctx: ArmContext) -> Change:
    if cfg.train.loop == "user":
        return Change(cfg, {}, "no data source", not_applicable="the run comes from your own loop: replay has its stored batches, not your data pipeline")
    new = int(cfg.seed) + 1
    return Change(
        cfg=_edit(cfg, seed=new),
        params={"seed": new},
        summary=f"seed {cfg.seed} -> {new} (data order and RNG streams from step {ctx.start_step})",
        reseed=new,
    )
