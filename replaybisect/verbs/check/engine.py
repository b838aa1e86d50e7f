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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.core import loop, reentry, user_step
from replaybisect.core.jsonutil import from_jsonable
from replaybisect.core.inline_step import LoopEnded, RemoteStep
from replaybisect.errors import ConfigError, ReplayError
from replaybisect.core.rng import isolated_rng, seed_everything
from replaybisect.verbs.check import lr_finder
from replaybisect.verbs.check.checks_model import loss_floor
from replaybisect.verbs.check.context import (Check, CheckContext, CheckOptions, REGISTRY, TrainingLr, group_of,
    register_check, training_lr, worst)
from replaybisect.verbs.check.probes import first_line
from replaybisect.verbs.check import checks_data, checks_model, checks_training  # noqa: F401  (each registers its checks)

__all__ = ["Check", "CheckContext", "CheckOptions", "CheckReport", "REGISTRY", "check", "loss_floor", "register_check", "run_checks"]


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
                result = Check(name, "fail", None, f"could not run: {type(error).__name__}: {first_line(error)}")
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

            from replaybisect.replay.script import run_in_script

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
    from replaybisect.replay import restore as restore_mod

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
    from replaybisect.replay import restore as restore_mod
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
