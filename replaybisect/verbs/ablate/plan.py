"""Planning an ablation before any arm runs: the failing step, the snapshot the arms start from (before the
divergence began), the reference loss, the arms a run suggests, their specs, how many workers."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import BASELINE, ArmContext, ArmSpec, Change
from replaybisect.core.trust import Trust
from replaybisect.verbs.ablate.request import checked_failing_step
from replaybisect.verbs.ablate.patch import PATCH_ARM, Patch
from replaybisect.verbs.ablate.arm import on_optimizer, rows_fit, patch_change
from replaybisect.verbs.ablate.outcome import BLOWUP_FACTOR, REFERENCE_WINDOW, divergence_onset
# --workers auto: a pool of workers pays ~3 s (its server imports torch + MLflow once, measured on these 2-core
# machines; more under load) before its first step, so arms whose replays are estimated (recorded step_time x
# steps) to take less than this in total run in-process, one after another.
AUTO_IN_PROCESS_SECONDS = 20.0


# ---- planning the arms ------------------------------------------------------------------------------
def auto_workers(store, run_id: str, cfg, snapshot, total_steps: int, tasks: int, executor: str) -> int:
    """One worker per arm up to the cores the recorded thread count leaves room for; in-process (1) when the
    whole ablation is estimated to take less than a worker's start-up is worth."""
    threads = int(cfg.train.num_threads or snapshot.state.get("num_threads") or 1)
    parallel = max(1, min(tasks, (os.cpu_count() or 1) // threads))
    if executor != "local":
        return tasks  # SLURM: every arm its own job
    step_times = [v for _, v in store.metric_history(run_id, "step_time") if math.isfinite(v)]
    estimate = total_steps * statistics.median(step_times) if step_times else math.inf
    return 1 if estimate < AUTO_IN_PROCESS_SECONDS else parallel


def _absolute_uri(uri: str) -> str:
    """Workers may start elsewhere (SLURM nodes): a relative SQLite path becomes absolute."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and uri[len(prefix):] != ":memory:":
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def _choose_snapshot(store, run_id: str, failing_step: Optional[int], from_step: Optional[int], onset: Optional[int],
                     warnings: list[str]):
    from replaybisect.replay import restore as restore_mod

    if from_step is not None:
        return restore_mod.newest_good_snapshot(store, run_id, from_step, warnings), from_step
    # The snapshot before the failure: before the loss began its climb to it when it climbed (an LR
    # explosion), else strictly before the failing step, so the arms act before the state went bad;
    # else the state just before the failing step.
    before = min(failing_step, onset if onset is not None else failing_step) - 1
    if before >= 0:
        try:
            snapshot = restore_mod.newest_good_snapshot(store, run_id, before, warnings)
            return snapshot, snapshot.step
        except SnapshotError:
            pass
    snapshot = restore_mod.newest_good_snapshot(store, run_id, failing_step, warnings)
    return snapshot, snapshot.step


@dataclass
class ArmPlan:
    """Where the arms start and end, what they change, and what their outcomes are judged against."""

    cfg: Any
    failing_step: Optional[int]
    onset: Optional[int]
    snapshot_step: int
    start: int
    end: int
    logged: dict[int, float]
    reference: Optional[float]
    threshold: Optional[float]
    grad_norms: list[float]
    changes: dict[str, Change]
    specs: list[ArmSpec]  # the arms asked for, then those the report adds (a suggested value), then the patch
    patch: Optional[Patch]
    runnable: list[str]
    estimated_steps: int
    warnings: list[str]
    carried_gradients: bool = False  # the run's loop carried gradients into a step (zero-grad applies)


def _reference_loss(logged: dict[int, float], start: int, anchor: int, onset: Optional[int]) -> tuple[Optional[float], Optional[float]]:
    """(the pre-failure reference loss, the blow-up threshold): the median of the recorded losses before the climb
    (when the loss climbed), else of the REFERENCE_WINDOW steps before the arms' start plus those from the start
    to the failure."""
    healthy_end = onset if onset is not None else max(anchor, start + 1)
    first = max(0, min(start, healthy_end) - REFERENCE_WINDOW)
    window = [v for s, v in sorted(logged.items()) if first <= s < healthy_end and math.isfinite(v)]
    reference = statistics.median(window) if window else None
    threshold = BLOWUP_FACTOR * reference if reference is not None and reference > 0 else None
    return reference, threshold


def _healthy_grad_norms(store, run_id: str, onset: Optional[int], failing_step: Optional[int]) -> list[float]:
    """The run's recorded gradient norms before the climb (or the failure): the clip suggestion's sample."""
    until = onset if onset is not None else failing_step if failing_step is not None else math.inf
    return [v for s, v in store.metric_history(run_id, "grad_norm") if s < until]


def _suggested_arms(specs: list[ArmSpec], grad_norms: list[float]) -> list[ArmSpec]:
    """The values the report suggests, as arms: a clip arm adds one at the run's own percentile threshold, so the
    suggestion is printed with the verdict of its replay (nothing is suggested that did not run)."""
    threshold = interventions.suggested_clip(grad_norms)
    if threshold is None or not any(spec.intervention == "clip" for spec in specs):
        return []
    suggested = ArmSpec("clip", threshold, suggested=interventions.clip_suggestion_note(grad_norms))
    if any(spec.intervention == "clip" and spec.label == suggested.label for spec in specs):
        return []
    return [suggested]


def plan_arms(store, run_id: str, specs: list[ArmSpec], from_step: Optional[int], horizon: int, trust: Trust,
               patch_path: Optional[Path] = None):
    """(the arms' plan, the snapshot they start from)."""
    from replaybisect.replay import restore as restore_mod

    cfg = restore_mod.run_config(store, run_id, trust)  # RunNotFound first
    if patch_path is not None and cfg.train.get("script") is not None:  # before the patch is read, let alone imported
        raise ReplayError(f"run {run_id} was recorded from a script, which each arm runs again on this machine with the "
                          "script's own code: leave out --patch (edit the script and record again)")
    failing_step = checked_failing_step(store, run_id, from_step)
    warnings: list[str] = []
    logged = restore_mod.logged_losses(store, run_id)
    onset = divergence_onset(logged, failing_step) if failing_step is not None else None
    snapshot, start = _choose_snapshot(store, run_id, failing_step, from_step, onset, warnings)
    warnings.extend(restore_mod.code_changes(store.tags(run_id), cfg))
    anchor = failing_step if failing_step is not None else start
    end = anchor + horizon
    reference, threshold = _reference_loss(logged, start, anchor, onset)
    grad_norms = _healthy_grad_norms(store, run_id, onset, failing_step)
    carried = bool(store.metric_history(run_id, "grads_carried"))  # (the recorder logs it where a loop carried them)
    ctx = ArmContext(failing_step=failing_step, start_step=start, end_step=end, grad_norms=grad_norms,
                     carried_gradients=carried)
    specs = specs + _suggested_arms(specs, grad_norms)
    _check_optimizers(store.tags(run_id), specs, run_id)
    changes = {spec.name: on_optimizer(interventions.get(spec.intervention).apply(cfg, ctx, spec.value), spec.optimizer)
               for spec in specs}
    _check_rows(snapshot, changes.values())
    patch = None
    if patch_path is not None:
        from replaybisect.verbs.ablate.patch import load_patch

        patch = load_patch(patch_path, cfg)
        specs = specs + [ArmSpec(PATCH_ARM)]
        changes[PATCH_ARM] = patch_change(cfg, patch)
    runnable = [BASELINE] + [spec.name for spec in specs if changes[spec.name].not_applicable is None]
    return ArmPlan(cfg=cfg, failing_step=failing_step, onset=onset, snapshot_step=snapshot.step, start=start, end=end,
                    carried_gradients=carried,
                    logged=logged, reference=reference, threshold=threshold, grad_norms=grad_norms, changes=changes,
                    specs=specs, patch=patch, runnable=runnable, estimated_steps=len(runnable) * (end - snapshot.step),
                    warnings=warnings), snapshot


def _check_optimizers(tags: dict[str, str], specs: list[ArmSpec], run_id: str) -> None:
    """An arm on one optimizer (`lr[D]`) names one the run was recorded with (the Recorder's names: the tag)."""
    from replaybisect.core.several import OPTIMIZERS_TAG

    recorded = [name for name in tags.get(OPTIMIZERS_TAG, "").split(",") if name]
    for spec in specs:
        if spec.optimizer is not None and spec.optimizer not in recorded:
            has = f"its optimizers are {', '.join(recorded)}" if recorded else "it was recorded with one optimizer"
            raise ReplayError(f"arm {spec.name}: run {run_id} has no optimizer named {spec.optimizer!r} ({has}); "
                              f"pass {spec.intervention}[NAME] with one of its names, or {spec.intervention} for all")


def _check_rows(snapshot, changes) -> None:
    """A skip-rows arm names rows the failing step's batch has, before any arm runs, where the arms' snapshot holds
    that batch (the interval a run's failure ends holds it); otherwise the arm says so as it reaches the step."""
    for change in changes:
        if change.skip_rows is not None and change.skip_rows[0] in snapshot.batches:
            step, rows = change.skip_rows
            rows_fit(snapshot.batches[step], step, rows)


def arm_specs(store, run_id: str, plan: ArmPlan, trust: Trust) -> list[dict[str, Any]]:
    """One JSON-safe spec per runnable arm: what a worker needs to replay it."""
    uri = _absolute_uri(store.uri)
    by_name = {spec.name: spec for spec in plan.specs}
    specs = []
    for name in plan.runnable:
        arm = by_name.get(name)
        specs.append({"tracking_uri": uri, "run_id": run_id, "arm": name, "snapshot_step": plan.snapshot_step,
                      "start_step": plan.start, "end_step": plan.end, "failing_step": plan.failing_step,
                      "intervention": arm.intervention if arm else None, "value": arm.value if arm else None,
                      "optimizer": arm.optimizer if arm else None, "carried_gradients": plan.carried_gradients,
                      "patch": plan.patch.to_json() if name == PATCH_ARM and plan.patch else None,
                      "params": plan.changes[name].params if name in plan.changes else {}, "trust": trust.to_json()})
    return specs
