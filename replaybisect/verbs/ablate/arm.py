"""One arm, in a worker process (or in-process): the run restored at the arm's snapshot, the change applied, the
failure's steps replayed over the recorded batches, its losses and first failure handed back."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Optional

from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import BASELINE, ArmContext, Change
from replaybisect.core.trust import Trust
from replaybisect.verbs.ablate.patch import Patch, patched_config, patched_modules


# ---- one arm (runs in a worker process) ---------------------------------------------------------------
def _scale_lr_at_updates(optimizer, factor: Callable[[int], float], hooks) -> None:
    """Multiply every group's lr by factor(step) during optimizer.step() only, so the scheduler keeps
    computing from (and setting) the recorded schedule: works for chainable and closed-form schedulers."""
    saved: list[Any] = []

    def before(opt, args, kwargs):
        scale = factor(hooks.current_step)
        saved[:] = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = group["lr"] * scale

    def after(opt, args, kwargs):
        for group, lr in zip(opt.param_groups, saved):
            group["lr"] = lr

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def _arm_change(cfg, spec: dict[str, Any]) -> Change:
    """The arm's change, applied to the run's config (the baseline's: none)."""
    if spec["arm"] == BASELINE:
        return interventions.baseline_change(cfg)
    if spec.get("patch"):
        return patch_change(cfg, Patch.from_json(spec["patch"]))
    ctx = ArmContext(failing_step=spec["failing_step"], start_step=spec["start_step"], end_step=spec["end_step"],
                     carried_gradients=spec.get("carried_gradients", False))
    return on_optimizer(interventions.get(spec["intervention"]).apply(cfg, ctx, spec["value"]), spec.get("optimizer"))


def on_optimizer(change: Change, optimizer: Optional[str]) -> Change:
    """The change made on one of several optimizers (`lr[D]`), its summary saying which."""
    if optimizer is None:
        return change
    return dataclasses.replace(change, optimizer=optimizer, summary=f"{change.summary} for optimizer {optimizer} only",
                               params={**change.params, "optimizer": optimizer})


def patch_change(cfg, patch: Patch) -> Change:
    """The --patch arm: the run's config building the patch's classes (modules it replaces need no change)."""
    return Change(cfg=patched_config(cfg, patch), params={"patch": patch.path}, summary=patch.summary())


def _replay_prefix(restored, hooks, spec: dict[str, Any], change: Change, patching: Callable[[], None]):
    """The unchanged steps from the snapshot to the arms' start (--from-step after the snapshot).
    Returns (the live state, the step outcome that stopped the replay or None)."""
    from replaybisect.core import loop

    snapshot_step, start = spec["snapshot_step"], spec["start_step"]
    state = restored.state
    if start <= snapshot_step:
        return state, None
    stopped = loop.train_loop(state, restored.batch, snapshot_step, start, hooks)
    if stopped is None and spec["arm"] != BASELINE:
        patching()  # a patch applies from the arms' start: the steps before it ran the recorded code
        # the live state in objects built from the arm's config; a script's own objects (this arm's process has
        # them to itself) take the arm's step settings as they are
        state = loop.under_settings(state, change.cfg) if state.live else loop.clone_state(state, change.cfg)
    return state, stopped


def _apply_optimizer_changes(state, change: Change, hooks) -> None:
    """What the config cannot express, once the state is loaded: scaled group settings, an lr multiplier."""
    for key, scale in change.group_scale.items():
        for group in state.optimizer.param_groups:
            if key in group:
                group[key] = group[key] * scale
    state.clear_grads = change.clear_grads
    if change.lr_factor is not None:
        optimizer = state.optimizer
        if change.optimizer is not None:
            optimizer = getattr(state.optimizer, "named", {}).get(change.optimizer)
            if optimizer is None:
                raise ReplayError(f"the replayed loop has no optimizer named {change.optimizer!r} (the run's tag said so): "
                                  "pass the arm without [name]")
        _scale_lr_at_updates(optimizer, change.lr_factor, hooks)


def _arm_batches(change: Change, restored, start: int):
    """The recorded batches (a skip-rows arm's with its rows dropped), or for a reseeded arm the data built from its
    config with every stream reseeded."""
    from replaybisect.core import loop
    from replaybisect.core.rng import ablation_reseed, isolated_rng, seed_everything

    if change.skip_rows is not None:
        return _without_rows(restored, *change.skip_rows)
    if change.reseed is None:
        return restored.batch
    with isolated_rng():  # building the dataset must not draw from the streams reseeded below
        source, _ = loop.build_data(change.cfg)
    seed_everything(ablation_reseed(change.reseed, start))
    return source.batch


def _without_rows(restored, step: int, rows: tuple[int, ...]):
    """The recorded batches with `rows` dropped from step `step`'s (a skip-rows arm), also where a replay past the
    recorded steps serves that batch again (an own loop's recorded batches, in turn)."""
    from replaybisect.core.user_step import without_rows

    def batch(at: int):
        recorded = restored.batch(at)
        if restored.recorded_step(at) != step:
            return recorded
        return without_rows(recorded, rows, rows_fit(recorded, step, rows))

    return batch


def rows_fit(batch, step: int, rows: tuple[int, ...]) -> int:
    """The failing step's batch has the rows a skip-rows arm drops: its row count, else one line saying what it has."""
    from replaybisect.core.user_step import batch_rows

    size = batch_rows(batch)
    if size is None or max(rows) >= size:
        has = f"{size} rows (0..{size - 1})" if size else "no rows to drop (several micro-batches, or a distributed step)"
        raise ReplayError(f"skip-rows={'+'.join(map(str, rows))}: step {step}'s batch has {has}; pass the rows replay nan named")
    return size


def _replay_suffix(state, batches, hooks, change: Change, start: int, end: int, recorded_step: Callable[[int], Optional[int]]):
    """Replay from the arms' start to the horizon, dropping skipped steps' batches, also where a replay past the
    recorded steps serves such a batch again (an own loop's recorded batches, in turn: `recorded_step`); the stopping
    outcome or None."""
    from replaybisect.core import loop

    skipped = [at for at in range(start, end) if at in change.skip_steps or recorded_step(at) in change.skip_steps] if change.skip_steps else []
    segment_start = start
    for cut in skipped + [end]:
        stopped = loop.train_loop(state, batches, segment_start, cut, hooks)
        if stopped is not None:
            return stopped
        segment_start = cut + 1
    return None


def _by_step(values: dict[int, float]) -> dict[str, float]:
    return {str(step): value for step, value in values.items()}


def _replay_arm(spec: dict[str, Any], on_step: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Replay one arm from its snapshot to the horizon; reads the store, writes nothing."""
    from replaybisect.replay import restore as restore_mod
    from replaybisect.core.inline_step import LoopEnded
    from replaybisect.store import open_store

    started = time.perf_counter()
    store = open_store(spec["tracking_uri"], create=False)  # the parent opened it: it exists
    run_id, start = spec["run_id"], spec["start_step"]
    cfg = restore_mod.run_config(store, run_id, Trust.from_json(spec["trust"]))  # the user's decision, not the run's tag
    change = _arm_change(cfg, spec)
    snapshot = restore_mod.load_snapshot(store, run_id, spec["snapshot_step"])
    hooks = restore_mod.ReplayHooks(on_step=(lambda outcome: on_step(outcome.step)) if on_step else None)
    with contextlib.ExitStack() as patches:  # a --patch arm imports the user's changed modules while it runs
        def patching() -> None:
            if spec.get("patch"):
                patches.enter_context(patched_modules(Patch.from_json(spec["patch"])))

        if start <= spec["snapshot_step"]:
            patching()
        restored = restore_mod.restore(store, run_id, cfg=cfg if start > spec["snapshot_step"] else change.cfg, snapshot=snapshot)
        if restored.step != spec["snapshot_step"]:  # every arm starts from the planned snapshot, or none runs
            raise SnapshotError(f"snapshot {spec['snapshot_step']} does not apply to arm {spec['arm']!r} ({'; '.join(restored.warnings)})")
        raised = None  # (step, "exception"): a step of the arm raised at or after the recorded failure (a crash)
        with restore_mod.stored_batch_errors(restored):  # a stored batch the step raises on: one line, not a crash
            try:
                state, stopped = _replay_prefix(restored, hooks, spec, change, patching)
                hooks.lr_factor = change.lr_factor
                if stopped is None:
                    _apply_optimizer_changes(state, change, hooks)
                    batches = _arm_batches(change, restored, start)
                    try:
                        stopped = _replay_suffix(state, batches, hooks, change, start, spec["end_step"], restored.recorded_step)
                    except LoopEnded:  # a loop recorded as written ran out of iterations: the arm is judged on what it ran
                        restored.warnings.append(f"the script's own loop ended after step {max(hooks.losses, default=start)} "
                                                 "(its iterations count from the snapshot in a replay, each fed a recorded "
                                                 f"batch), before step {spec['end_step'] - 1}: this arm is judged on the "
                                                 "steps it ran")
            except Exception as error:  # noqa: BLE001 - re-raised unless it is the arm's failure
                raised = _raised_as_failure(error, hooks, spec)
    first = hooks.first_nonfinite or raised
    return {
        "arm": spec["arm"],
        "losses": _by_step(hooks.losses),
        "grad_norms": _by_step(hooks.grad_norms),
        "lrs": _by_step(hooks.lrs),
        "first_nonfinite_step": first[0] if first else None,
        "nonfinite_what": first[1] if first else None,
        "nonfinite_loss": (stopped.loss if stopped is not None else math.nan) if first else None,
        "warnings": restored.warnings,
        "seconds": time.perf_counter() - started,
    }


EXCEPTION = "exception"  # an arm's failure that is a step raising, not a non-finite value


def failure_text(what: Optional[str]) -> str:
    return "raised an exception" if what == EXCEPTION else f"non-finite {what}"


def _raised_as_failure(error: Exception, hooks, spec: dict[str, Any]) -> tuple[int, str]:
    """A step the arm replayed raised: at or after the recorded failing step it is the arm's failure, as a
    non-finite step is (a crashed run's step raising again); before it, the run trained through it (re-raised)."""
    if isinstance(error, (ReplayError, MemoryError)) or spec["failing_step"] is None:
        raise error
    step = max(hooks.losses, default=spec["snapshot_step"] - 1) + 1
    if step < spec["failing_step"]:
        raise error
    return step, EXCEPTION


# The progress channel of a local worker process (set by the pool's initializer).
_PROGRESS_QUEUE = None


def init_worker(queue, environment: dict[str, str]) -> None:
    """A local worker, forked from the preloaded server: this ablation's environment (trusted code folders, the
    store), not the one the server started with."""
    from replaybisect.core.processes import adopt_environment

    global _PROGRESS_QUEUE
    _PROGRESS_QUEUE = queue
    adopt_environment(environment)


def run_arm(spec: dict[str, Any], on_step: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Run one arm; the executors' entry point. Takes and returns JSON-safe dicts (no torch objects cross
    process boundaries). Errors come back as {"error": ...} so one broken arm never hides the others."""
    queue = _PROGRESS_QUEUE
    if on_step is None and queue is not None:
        on_step = lambda step: queue.put((spec["arm"], step))  # noqa: E731
    try:
        return _replay_arm(spec, on_step)
    except Exception as error:  # reported per arm; the baseline's error is raised by the caller
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"arm": spec["arm"], "error": f"{type(error).__name__}: {first}", "user_error": isinstance(error, ReplayError)}
