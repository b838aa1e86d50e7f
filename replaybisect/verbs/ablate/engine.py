"""`replay ablate ARMS --run-id X`: which single change makes the failure go away.

1. Find the failing step t and the snapshot before it (or `--from-step S`).
2. Run a baseline arm (the run unchanged) and one arm per intervention, each from that state over the same
   batches to `t + horizon`, in parallel on an executor (local processes, or submitit for SLURM).
   Each arm runs `loop.train_loop`: the one code path `replay train` runs.
3. The baseline must fail again at t, else the result is `inconclusive`. Each arm gets a verdict:
   fixes | delays | no-effect | worse (or not-applicable / error), from its first non-finite step and
   whether its loss blew up.
4. The engine reads the store and writes nothing. `ablate.report.publish` (called by the command) makes every
   replayed arm an MLflow run (kind=ablation-arm) with its change as params and its loss curve, under one run per
   ablation (kind=ablation, a child of the failed run) that holds the report (ablation.md, ablation.json, ablation.png).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import BASELINE, ArmContext, ArmSpec, Change
from replaybisect.core.jsonutil import to_jsonable as _json_float
from replaybisect.core.trust import Trust
from replaybisect.verbs.ablate.patch import PATCH_ARM, Patch, patched_config, patched_modules
# the options and their checks are the request's (light): the engine checks them again for its direct callers
from replaybisect.core.jobs import JobSettings
from replaybisect.verbs.ablate.request import DEFAULT_HORIZON, AblateRequest, check_options, parse_arms

__all__ = ["ablate", "run_arm", "judge_arm", "judge_baseline", "conclusion_text", "divergence_onset", "parse_arms",
           "AblationResult", "ArmOutcome", "DEFAULT_HORIZON", "BLOWUP_FACTOR"]

# "The loss blows up": the mean loss over the arm's last FINAL_WINDOW steps exceeds BLOWUP_FACTOR x the
# pre-failure reference. 4x is the divergence criterion of LR range tests (Lightning, fastai,
# torch-lr-finder stop at loss > 4x best); the mean over 10 steps keeps one noisy batch from deciding.
BLOWUP_FACTOR = 4.0
FINAL_WINDOW = 10
# The pre-failure reference: median of the recorded losses of the REFERENCE_WINDOW steps before the arms'
# start plus the steps from the start to the failure.
REFERENCE_WINDOW = 20
# --workers auto: a pool of workers pays ~3 s (its server imports torch + MLflow once, measured on these 2-core
# machines; more under load) before its first step, so arms whose replays are estimated (recorded step_time x
# steps) to take less than this in total run in-process, one after another.
AUTO_IN_PROCESS_SECONDS = 20.0
# An arm's verdict (the baseline's is fails-again | inconclusive, or reference for a run that never failed).
VERDICTS = ("fixes", "delays", "no-effect", "worse", "inconclusive", "not-applicable", "error")


# ---- results ----------------------------------------------------------------------------------------
@dataclass
class ArmOutcome:
    name: str
    change: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # the arm with the value it ran at (`lr=x0.1`, also for a bare `lr`)
    intervention: str = ""  # lr, clip, ...; "patch" for --patch; "" for the baseline
    value: Any = None  # the value asked for (None: the intervention's default)
    suggested: str = ""  # why the report added this arm (a value it suggests, run to prove it)
    verdict: str = ""
    reason: str = ""
    first_nonfinite_step: Optional[int] = None
    nonfinite_what: Optional[str] = None
    final_loss: Optional[float] = None  # the loss of the last finite step
    final_loss_mean: Optional[float] = None  # mean over the last FINAL_WINDOW finite steps (the blow-up test)
    steps_run: int = 0
    run_id: Optional[str] = None
    note: str = ""
    error: Optional[str] = None
    reproduced: Optional[str] = None  # baseline: exact | close | diverged against the recorded losses
    seconds: float = 0.0
    losses: dict[int, float] = field(default_factory=dict, repr=False)
    grad_norms: dict[int, float] = field(default_factory=dict, repr=False)
    lrs: dict[int, float] = field(default_factory=dict, repr=False)  # the lr each update used
    nonfinite_loss: Optional[float] = field(default=None, repr=False)  # the loss at first_nonfinite_step

    def to_json(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "label": self.label or self.name,
            "intervention": self.intervention,
            "value": self.value,
            "change": self.change,
            "verdict": self.verdict,
            "reason": self.reason,
            "first_nonfinite_step": self.first_nonfinite_step,
            "nonfinite_what": self.nonfinite_what,
            "final_loss": _json_float(self.final_loss),
            "final_loss_mean": _json_float(self.final_loss_mean),
            "steps_run": self.steps_run,
            "run_id": self.run_id,
            "seconds": round(self.seconds, 2),
        }
        if self.note:
            data["note"] = self.note
        if self.suggested:
            data["suggested"] = self.suggested
        if self.error:
            data["error"] = self.error
        if self.reproduced is not None:
            data["reproduced"] = self.reproduced
        return data


@dataclass
class AblationResult:
    run_id: str
    failing_step: Optional[int]
    snapshot_step: int
    start_step: int
    end_step: int  # exclusive
    horizon: int
    reference_loss: Optional[float]
    blowup_threshold: Optional[float]
    baseline: ArmOutcome
    arms: list[ArmOutcome]
    status: str  # conclusive | inconclusive
    conclusion: str
    suggested_clip: Optional[float] = None
    divergence_onset: Optional[int] = None  # where the loss began its climb to the failure (None: no climb)
    warnings: list[str] = field(default_factory=list)
    executor: str = "local"
    workers: int = 1
    seconds: float = 0.0
    tracking_uri: str = ""
    artifacts: list[str] = field(default_factory=list)
    report_run_id: Optional[str] = None  # the ablation's own run (its arms are children of it), set by report.publish
    patch: Optional[str] = None  # what --patch replaced (its summary), when given
    sweep: Optional[dict[str, Any]] = None  # --sweep's search: its rounds, the stable range and the arms that prove it

    @property
    def replays(self) -> int:
        """The replays this ablation ran: the baseline and every arm that was not skipped as not applicable."""
        return 1 + sum(arm.verdict != "not-applicable" for arm in self.arms)

    def verdicts(self) -> dict[str, str]:
        return {arm.name: arm.verdict for arm in self.arms}

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "failing_step": self.failing_step,
            "snapshot_step": self.snapshot_step,
            "start_step": self.start_step,
            "end_step": self.end_step,
            "horizon": self.horizon,
            "divergence_onset": self.divergence_onset,
            "reference_loss": _json_float(self.reference_loss),
            "blowup_threshold": _json_float(self.blowup_threshold),
            "status": self.status,
            "baseline": self.baseline.to_json(),
            "arms": [arm.to_json() for arm in self.arms],
            "conclusion": self.conclusion,
            "suggested_clip": self.suggested_clip,
            "suggested_clip_verdict": next((a.verdict for a in self.arms if a.suggested and a.intervention == "clip"), None),
            "patch": self.patch,
            "sweep": self.sweep,
            "warnings": self.warnings,
            "replays": self.replays,
            "executor": self.executor,
            "workers": self.workers,
            "seconds": round(self.seconds, 2),
            "artifacts": self.artifacts,
            "report_run_id": self.report_run_id,
        }


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
    return _on_optimizer(interventions.get(spec["intervention"]).apply(cfg, ctx, spec["value"]), spec.get("optimizer"))


def _on_optimizer(change: Change, optimizer: Optional[str]) -> Change:
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
        return without_rows(recorded, rows, _rows_fit(recorded, step, rows))

    return batch


def _rows_fit(batch, step: int, rows: tuple[int, ...]) -> int:
    """The failing step's batch has the rows a skip-rows arm drops: its row count, else one line saying what it has."""
    from replaybisect.core.user_step import batch_rows

    size = batch_rows(batch)
    if size is None or max(rows) >= size:
        has = f"{size} rows (0..{size - 1})" if size else "no rows to drop (several micro-batches, or a distributed step)"
        raise ReplayError(f"skip-rows={'+'.join(map(str, rows))}: step {step}'s batch has {has}; pass the rows replay nan named")
    return size


def _replay_suffix(state, batches, hooks, change: Change, start: int, end: int):
    """Replay from the arms' start to the horizon, dropping skipped steps' batches; the stopping outcome or None."""
    from replaybisect.core import loop

    segment_start = start
    for cut in sorted(s for s in change.skip_steps if start <= s < end) + [end]:
        stopped = loop.train_loop(state, batches, segment_start, cut, hooks)
        if stopped is not None:
            return stopped
        segment_start = cut + 1
    return None


def _by_step(values: dict[int, float]) -> dict[str, float]:
    return {str(step): value for step, value in values.items()}


def _replay_arm(spec: dict[str, Any], on_step: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Replay one arm from its snapshot to the horizon; reads the store, writes nothing."""
    from replaybisect import restore as restore_mod
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
                        stopped = _replay_suffix(state, batches, hooks, change, start, spec["end_step"])
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


def _init_worker(queue, environment: dict[str, str]) -> None:
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


# ---- executors ---------------------------------------------------------------------------------------
ProgressFn = Callable[[str, str, int], None]  # (arm, event: "step"|"done", value)


def _run_here(specs: list[dict], progress: Optional[ProgressFn]) -> dict[str, dict]:
    """--workers 1: the arms one after another in this process (no interpreter to start). Each arm restores
    everything a step reads (model, optimizer, RNG streams, thread count), so the order does not matter."""
    from replaybisect.core.rng import isolated_rng

    import torch

    results = {}
    threads = torch.get_num_threads()
    for spec in specs:
        arm = spec["arm"]
        on_step = (lambda step, arm=arm: progress(arm, "step", step)) if progress else None
        try:
            with isolated_rng():
                results[arm] = run_arm(spec, on_step)
        finally:
            torch.set_num_threads(threads)
        if progress:
            progress(arm, "done", 0)
    return results


@contextlib.contextmanager
def local_pool(workers: int):
    """A process pool and its progress channel. The workers are forked from a server that has imported torch and
    MLflow and nothing else (core/processes.py): no torch or MLflow state of this process, and no seconds of imports
    each. multiprocessing hands them this process's working folder and sys.path; the environment is handed here.
    A sweep keeps one pool across its rounds."""
    from concurrent.futures import ProcessPoolExecutor

    from replaybisect.core.processes import preloaded_forkserver

    context = preloaded_forkserver()
    channel = context.Queue()
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker,
                             initargs=(channel, dict(os.environ))) as pool:
        yield pool, channel


def _run_local(specs: list[dict], workers: int, progress: Optional[ProgressFn], pool=None) -> dict[str, dict]:
    """The arms on a local process pool (this call's, or `pool` from `local_pool`); each worker applies the recorded
    thread count when it restores, so verdicts do not depend on --workers."""
    if pool is None:
        with local_pool(max(1, min(workers, len(specs)))) as own:
            return _run_local(specs, workers, progress, own)
    import queue as queue_mod
    from concurrent.futures import FIRST_COMPLETED, wait

    pool, channel = pool
    results: dict[str, dict] = {}

    def drain() -> None:
        while True:
            try:
                arm, step = channel.get_nowait()
            except queue_mod.Empty:
                return
            if progress:
                progress(arm, "step", step)

    pending = {pool.submit(run_arm, spec): spec["arm"] for spec in specs}
    while pending:
        done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
        drain()
        for future in done:
            arm = pending.pop(future)
            try:
                results[arm] = future.result()
            except Exception as error:  # the worker process died (BrokenProcessPool, killed)
                results[arm] = {"arm": arm, "error": f"{type(error).__name__}: {error}"}
            if progress:
                progress(arm, "done", 0)
    drain()
    return results


def _run_submitit(specs: list[dict], workers: int, options: JobSettings, progress: Optional[ProgressFn]) -> dict[str, dict]:
    executor = options.executor("replay-ablate", parallelism=workers)
    jobs = executor.map_array(run_arm, specs)
    results: dict[str, dict] = {}
    pending = {job.job_id: (job, spec["arm"]) for job, spec in zip(jobs, specs)}
    while pending:
        for job_id, (job, arm) in list(pending.items()):
            if not job.done():
                continue
            del pending[job_id]
            try:
                results[arm] = job.result()
            except Exception as error:  # the job failed outside run_arm (scheduler, timeout, node)
                first = str(error).strip().splitlines()
                results[arm] = {"arm": arm, "error": f"submitit job {job_id} failed: {first[-1] if first else type(error).__name__}"}
            if progress:
                progress(arm, "done", 0)
        if pending:
            time.sleep(0.25)
    return results


# ---- verdicts ----------------------------------------------------------------------------------------
def _steps(values: dict[str, float]) -> dict[int, float]:
    return dict(sorted((int(s), float(v)) for s, v in values.items()))


def _finish_outcome(outcome: ArmOutcome, raw: dict) -> None:
    outcome.losses = _steps(raw.get("losses", {}))
    outcome.grad_norms = _steps(raw.get("grad_norms", {}))
    outcome.lrs = _steps(raw.get("lrs", {}))
    outcome.nonfinite_loss = raw.get("nonfinite_loss")
    outcome.first_nonfinite_step = raw.get("first_nonfinite_step")
    outcome.nonfinite_what = raw.get("nonfinite_what")
    outcome.seconds = float(raw.get("seconds", 0.0))
    finite = [v for v in outcome.losses.values() if math.isfinite(v)]
    outcome.steps_run = len(outcome.losses)
    outcome.final_loss = finite[-1] if finite else None
    tail = finite[-FINAL_WINDOW:]
    outcome.final_loss_mean = sum(tail) / len(tail) if tail else None


def _blew_up(outcome: ArmOutcome, threshold: Optional[float]) -> bool:
    return threshold is not None and outcome.final_loss_mean is not None and outcome.final_loss_mean > threshold


def judge_arm(arm: ArmOutcome, failing_step: Optional[int], baseline_failed: bool, threshold: Optional[float], end: int) -> None:
    first = arm.first_nonfinite_step
    blown = _blew_up(arm, threshold)
    if failing_step is None or not baseline_failed:
        # No failure to fix (a healthy run ablated with --from-step): only "worse" or "no-effect",
        # unless the baseline's loss blew up and the arm's did not.
        if first is not None:
            arm.verdict, arm.reason = "worse", f"{failure_text(arm.nonfinite_what)} at step {first}; the baseline stayed finite"
        elif blown:
            arm.verdict, arm.reason = "worse", f"the loss blew up (final mean {arm.final_loss_mean:.4g} > {threshold:.4g})"
        else:
            arm.verdict, arm.reason = "no-effect", "finite, as the baseline"
        return
    through = last_step_of(arm, end)
    if first is None and through <= failing_step:
        arm.verdict, arm.reason = "inconclusive", f"the arm ran to step {through} only, not past the failing step {failing_step}"
        return
    if first is None:
        if blown:
            arm.verdict = "delays"
            arm.reason = f"finite through step {through}, but the loss blew up (final mean {arm.final_loss_mean:.4g} > {threshold:.4g})"
        else:
            arm.verdict = "fixes"
            arm.reason = f"finite through step {through}" + (
                f"; final mean loss {arm.final_loss_mean:.4g} <= {threshold:.4g}" if threshold is not None and arm.final_loss_mean is not None else ""
            )
    elif first > failing_step:
        arm.verdict, arm.reason = "delays", f"{failure_text(arm.nonfinite_what)} at step {first}, {first - failing_step} step{'' if first - failing_step == 1 else 's'} later"
    elif first == failing_step:
        arm.verdict, arm.reason = "no-effect", f"{failure_text(arm.nonfinite_what)} at step {first}, as the baseline"
    else:
        arm.verdict, arm.reason = "worse", f"{failure_text(arm.nonfinite_what)} at step {first}, {failing_step - first} step{'' if failing_step - first == 1 else 's'} earlier"


def judge_baseline(baseline: ArmOutcome, failing_step: Optional[int], threshold: Optional[float], end: int) -> tuple[bool, Optional[str]]:
    """(the baseline failed as recorded, why the result is inconclusive or None)."""
    first = baseline.first_nonfinite_step
    if failing_step is None:
        baseline.verdict = "reference"
        if first is not None:
            baseline.reason = f"{failure_text(baseline.nonfinite_what)} at step {first}"
        else:
            baseline.reason = "finite through step " + str(end - 1) + (" (the loss blew up)" if _blew_up(baseline, threshold) else "")
        return False, None
    if first == failing_step:
        baseline.verdict = "fails-again"
        baseline.reason = f"{failure_text(baseline.nonfinite_what)} at step {first}, as recorded"
        return True, None
    baseline.verdict = "inconclusive"
    if first is None:
        baseline.reason = (
            f"the baseline replay stayed finite through step {end - 1}: the failure at step {failing_step} did not recur "
            "from the snapshot (a transient fault: hardware, nondeterminism, or something present only during the original training)"
        )
    else:
        baseline.reason = (
            f"the baseline replay failed at step {first}, not at the recorded step {failing_step}: the replay is not faithful "
            "(nondeterministic kernels or state outside the snapshot)"
        )
    return False, baseline.reason


def _proven_suggestion(arm: ArmOutcome) -> str:
    """A value the report suggests, with the verdict of the arm that ran it."""
    where = f" (non-finite at step {arm.first_nonfinite_step})" if arm.first_nonfinite_step is not None else ""
    return f"suggested {arm.intervention} {arm.label.partition('=')[2]} ({arm.suggested}), run as arm {arm.label}: {arm.verdict}{where}"


# arms that remove a cause, and what it is: an lr or clip arm that also helps only hides it
CAUSES = {"zero-grad": "the loop never clears its gradients (add optimizer.zero_grad())",
          "skip-rows": "those rows of the batch make the failure", "skip-batch": "the failing batch makes the failure"}
CAUSE_ORDER = tuple(CAUSES)


def conclusion_text(result_arms: list[ArmOutcome], failing_step: Optional[int], inconclusive: Optional[str],
                    run_id: Optional[str] = None) -> str:
    """One line: which arms (with the values they ran at) fix, delay or worsen the failure; every value suggested
    is printed with the verdict of the arm that ran it; when none fixes it, the next step (with the run's id)."""
    if inconclusive:
        return f"inconclusive: {inconclusive}"
    by_verdict: dict[str, list[str]] = {}
    kinds = {arm.intervention or arm.name for arm in result_arms if arm.verdict == "fixes"}
    seed = next((arm for arm in result_arms if (arm.intervention or arm.name) == "seed"), None)
    seed_fails = seed is not None and seed.verdict in ("no-effect", "delays", "worse")
    for arm in result_arms:
        if (seed_fails and arm is seed) or arm.intervention == PATCH_ARM:  # seed: "is it noise?", not "does it help"
            continue
        by_verdict.setdefault(arm.verdict, []).append(arm.label or arm.name)
    if failing_step is None:
        worse = by_verdict.get("worse", [])
        return ("the run did not fail; " + (f"made worse by: {', '.join(worse)}" if worse else "no arm changed that"))
    fixes = by_verdict.get("fixes", [])
    patch = next((arm for arm in result_arms if arm.intervention == PATCH_ARM), None)
    parts = []
    if patch is not None:
        parts.append(f"fixed by your patch ({patch.reason})" if patch.verdict == "fixes"
                     else f"your patch does not fix it: {patch.verdict} ({patch.reason})")
    if fixes:
        parts.append(f"fixed by: {', '.join(fixes)}")
        if "skip-batch" in kinds:
            parts.append("the failing batch itself triggers it: inspect it (`replay nan`) and the data pipeline")
        if "seed" in kinds:
            parts.append("another seed avoids it: the failure depends on the data order or random draws")
        if "precision" in kinds:
            parts.append("reduced-precision overflow/underflow: keep the failing ops in fp32 or use bf16")
        masking = [arm.label or arm.name for arm in result_arms
                   if arm.intervention in ("lr", "clip", "warmup") and arm.verdict in ("fixes", "delays")]
        if kinds & set(CAUSES) and masking:  # a cause found: smaller updates only hide it
            cause = next(kind for kind in CAUSE_ORDER if kind in kinds)
            parts.append(f"{', '.join(masking)} only mask{'s' if len(masking) == 1 else ''} it: {CAUSES[cause]}")
    elif patch is None:
        parts.append("no single change fixes the failure")
        if run_id is not None:
            parts.append(f"next: replay nan --run-id {run_id} names the op that made the first non-finite value (its fix) "
                         "and, where a few rows of the batch made it, those rows (skip-rows=R proves it)")
    elif len(result_arms) > 1:
        parts.append("no other arm fixes it")
    parts += [_proven_suggestion(arm) for arm in result_arms if arm.suggested and arm.verdict != "not-applicable"]
    if seed_fails:
        where = f"at step {seed.first_nonfinite_step}" if seed.first_nonfinite_step is not None else "(its loss blew up)"
        parts.append(f"another seed fails too {where}: the failure is systematic, not noise")
    if by_verdict.get("delays"):
        parts.append(f"delayed by: {', '.join(by_verdict['delays'])}")
    if by_verdict.get("worse"):
        parts.append(f"made worse by: {', '.join(by_verdict['worse'])}")
    return "; ".join(parts)


# ---- planning the arms ------------------------------------------------------------------------------
def _auto_workers(store, run_id: str, cfg, snapshot, total_steps: int, tasks: int, executor: str) -> int:
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


def divergence_onset(logged: dict[int, float], failing_step: int, window: int = REFERENCE_WINDOW) -> Optional[int]:
    """The step where the run's final climb to the failure began: the earliest u < t such that every recorded
    loss from u to t-1 exceeds BLOWUP_FACTOR x the median of the `window` losses before u. None when the loss
    was not climbing (a failure out of the blue: bad batch, overflow)."""
    steps = [s for s in sorted(logged) if s < failing_step and math.isfinite(logged[s])]
    if len(steps) < 2:
        return None
    values = [logged[s] for s in steps]
    suffix_min = values[:]
    for i in range(len(values) - 2, -1, -1):
        suffix_min[i] = min(values[i], suffix_min[i + 1])
    onset = None
    for i in range(len(values) - 1, 0, -1):
        before = values[max(0, i - window) : i]
        if suffix_min[i] > BLOWUP_FACTOR * statistics.median(before):
            onset = steps[i]
    return onset


def _choose_snapshot(store, run_id: str, failing_step: Optional[int], from_step: Optional[int], onset: Optional[int],
                     warnings: list[str]):
    from replaybisect.errors import SnapshotError
    from replaybisect import restore as restore_mod

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
class _ArmPlan:
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


def _checked_failing_step(store, run_id: str, from_step: Optional[int]) -> Optional[int]:
    """The run's first non-finite step; a run that never failed needs --from-step, which must not be after it."""
    from replaybisect import restore as restore_mod

    failing_step = restore_mod.failing_step(store, run_id)
    if failing_step is None and from_step is None:
        raise ReplayError(
            f"run {run_id} never failed (no non-finite loss or gradient norm recorded); "
            "pass --from-step S to ablate it from step S anyway"
        )
    if failing_step is not None and from_step is not None and from_step > failing_step:
        raise ReplayError(f"--from-step {from_step} is after the failing step {failing_step}; pass a step <= {failing_step}")
    return failing_step


def last_step_of(arm: ArmOutcome, end: int) -> int:
    """The last step `arm` ran before `end` (exclusive): a script's own loop may end sooner."""
    return min(max(arm.losses, default=end - 1), end - 1)


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


def _plan_arms(store, run_id: str, specs: list[ArmSpec], from_step: Optional[int], horizon: int, trust: Trust,
               patch_path: Optional[Path] = None):
    """(the arms' plan, the snapshot they start from)."""
    from replaybisect import restore as restore_mod

    cfg = restore_mod.run_config(store, run_id, trust)  # RunNotFound first
    if patch_path is not None and cfg.train.get("script") is not None:  # before the patch is read, let alone imported
        raise ReplayError(f"run {run_id} was recorded from a script, which each arm runs again on this machine with the "
                          "script's own code: leave out --patch (edit the script and record again)")
    failing_step = _checked_failing_step(store, run_id, from_step)
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
    changes = {spec.name: _on_optimizer(interventions.get(spec.intervention).apply(cfg, ctx, spec.value), spec.optimizer)
               for spec in specs}
    _check_rows(snapshot, changes.values())
    patch = None
    if patch_path is not None:
        from replaybisect.verbs.ablate.patch import load_patch

        patch = load_patch(patch_path, cfg)
        specs = specs + [ArmSpec(PATCH_ARM)]
        changes[PATCH_ARM] = patch_change(cfg, patch)
    runnable = [BASELINE] + [spec.name for spec in specs if changes[spec.name].not_applicable is None]
    return _ArmPlan(cfg=cfg, failing_step=failing_step, onset=onset, snapshot_step=snapshot.step, start=start, end=end,
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
            _rows_fit(snapshot.batches[step], step, rows)


def _arm_specs(store, run_id: str, plan: _ArmPlan, trust: Trust) -> list[dict[str, Any]]:
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


def _run_arms(specs: list[dict], executor: str, workers: int, submitit_options: Optional[JobSettings],
              progress: Optional[ProgressFn], pool=None) -> dict[str, dict]:
    if executor == "local" and workers == 1:
        return _run_here(specs, progress)
    if executor == "local":
        return _run_local(specs, workers, progress, pool)
    return _run_submitit(specs, workers, submitit_options or JobSettings(), progress)


ARM_STEP = "arm step "  # a script's arm reports each replayed step on its progress channel as this, then the step


def _run_in_scripts(specs: list[dict], store, run_id: str, cfg, trust: Trust, workers: int,
                    progress: Optional[ProgressFn]) -> dict[str, dict]:
    """A run recorded from a script: each arm runs the script again and replays inside it (script_replay, the
    script's own objects in a process of their own), `workers` scripts at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from replaybisect.script_replay import run_in_script, stop_all

    def one(spec: dict) -> dict:
        arm = spec["arm"]

        def log(line: str) -> None:
            if progress and line.startswith(ARM_STEP):
                progress(arm, "step", int(line[len(ARM_STEP):]))

        try:
            result = run_in_script("arm", store, run_id, cfg, trust, {"spec": spec}, log)
        except ReplayError as error:  # the script did not reach its first step, say: this arm's error
            result = {"arm": arm, "error": f"{type(error).__name__}: {error}", "user_error": True}
        if progress:
            progress(arm, "done", 0)
        return result

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(specs)))) as threads:
        try:
            return {spec["arm"]: result for spec, result in zip(specs, threads.map(one, specs))}
        except BaseException:  # Ctrl-C, SIGTERM: every arm's script stops, not only the one this thread waited on
            threads.shutdown(wait=False, cancel_futures=True)
            stop_all()
            raise


def _baseline_outcome(raw: dict, plan: _ArmPlan) -> tuple[ArmOutcome, bool, Optional[str]]:
    """(the baseline's outcome, whether it failed as recorded, why the ablation is inconclusive or None).
    A baseline that crashed is an error: without it the arms mean nothing."""
    if "error" in raw:
        raise (ReplayError if raw.get("user_error") else RuntimeError)(f"the baseline replay failed: {raw['error']}")
    baseline = ArmOutcome(name=BASELINE, change=interventions.baseline_change(plan.cfg).summary)
    _finish_outcome(baseline, raw)
    _keep_warnings(plan, raw)
    baseline.reproduced = _reproduced(baseline.losses, plan.logged, plan.failing_step)
    baseline_failed, inconclusive = judge_baseline(baseline, plan.failing_step, plan.threshold, plan.end)
    return baseline, baseline_failed, inconclusive


def _keep_warnings(plan: _ArmPlan, raw: dict) -> None:
    """An arm's warnings in the ablation's, each once (every arm meets the same damaged snapshot)."""
    from replaybisect.restore import add_warning

    for warning in raw.get("warnings", []):
        add_warning(plan.warnings, warning)


def _arm_outcome(spec: ArmSpec, change: Change, raw: Optional[dict], plan: _ArmPlan, baseline_failed: bool,
                 inconclusive: Optional[str]) -> ArmOutcome:
    patched = spec.intervention == PATCH_ARM
    outcome = ArmOutcome(name=spec.name, change=change.summary, params=change.params, note=change.note,
                         label=spec.name if patched else spec.label, intervention=spec.intervention, value=spec.value,
                         suggested=spec.suggested)
    if change.not_applicable:
        outcome.verdict, outcome.reason = "not-applicable", change.not_applicable
    elif "error" in raw:
        outcome.verdict, outcome.error = "error", raw["error"]
        outcome.reason = f"the arm crashed: {raw['error']}"
    else:
        _finish_outcome(outcome, raw)
        _keep_warnings(plan, raw)  # e.g. a user-loop run's recorded batches reused past the failure
        if inconclusive:
            outcome.verdict, outcome.reason = "inconclusive", "the baseline did not fail again as recorded"
        else:
            judge_arm(outcome, plan.failing_step, baseline_failed, plan.threshold, plan.end)
    return outcome


def ablate(
    store,
    run_id: str,
    arms: Optional[str | list[str]] = None,
    *,
    from_step: Optional[int] = None,
    horizon: int = DEFAULT_HORIZON,
    workers: Optional[int] = None,
    executor: str = "local",
    submitit_options: Optional[JobSettings] = None,
    progress: Optional[Callable[[str, str, int], None]] = None,
    on_plan: Optional[Callable[[list[str], int, int], None]] = None,
    trust: Optional[Trust] = None,
    patch: Optional[str | Path] = None,
    sweep: Optional[str] = None,
) -> AblationResult:
    """Replay the failure of `run_id` unchanged (the baseline) and once per arm, in parallel; judge each arm.
    Reads the store and writes nothing: `ablate.report.publish(store, result)` records the arms' child runs
    and the report.

    `arms`: names, with a value or not (`lr=x0.3,clip=265,precision`), or the ArmSpecs a checked request holds
    (its options checked with them: not again). `patch`: a .py file or a folder of the user's
    changed modules, replayed as one more arm. `sweep`: "lr" or "clip", searched for the stable range instead of arms.
    `progress(arm, "step"|"done", step)` reports work as it happens; `on_plan(arm_names, start, end)` is
    called once the arms and steps are known (per round for a sweep).
    """
    patch = str(patch) if patch is not None else None
    checked = isinstance(arms, list) and all(isinstance(arm, ArmSpec) for arm in arms)
    specs = arms if checked else check_options(arms, horizon=horizon, workers=workers, executor=executor,
                                               from_step=from_step, patch=patch, sweep=sweep)
    started = time.perf_counter()
    trust = trust or Trust.from_user()  # the workers inherit it
    from replaybisect.verbs.ablate.patch import check_path

    plan, snapshot = _plan_arms(store, run_id, specs, from_step, horizon, trust, check_path(patch) if patch else None)
    if plan.cfg.train.get("script") is not None and executor != "local":
        raise ReplayError(f"run {run_id} was recorded from a script, which each arm runs again on this machine with the "
                          "script's own code: leave out --executor submitit")
    runner = _Runner(store, run_id, plan, trust, executor, workers, submitit_options, progress, on_plan)
    if sweep is not None:
        from replaybisect.verbs.ablate.sweep import run_sweep

        runner.workers = workers or _auto_workers(store, run_id, plan.cfg, snapshot, 8 * (plan.end - plan.snapshot_step), 8, executor)
        with contextlib.ExitStack() as stack:
            if executor == "local" and runner.workers > 1:
                runner.pool = stack.enter_context(local_pool(runner.workers))
            outcomes, sweep_result = run_sweep(sweep, plan, runner)
        conclusion = sweep_result.pop("conclusion")
    else:
        runner.workers = workers or _auto_workers(store, run_id, plan.cfg, snapshot, plan.estimated_steps, len(plan.runnable), executor)
        outcomes, sweep_result = runner.run(plan.specs), None
        conclusion = conclusion_text(outcomes, plan.failing_step, runner.inconclusive, run_id)
    return AblationResult(
        run_id=run_id,
        failing_step=plan.failing_step,
        snapshot_step=plan.snapshot_step,
        start_step=plan.start,
        end_step=plan.end,
        horizon=horizon,
        reference_loss=plan.reference,
        blowup_threshold=plan.threshold,
        baseline=runner.baseline,
        arms=outcomes,
        status="inconclusive" if runner.inconclusive and plan.failing_step is not None else "conclusive",
        conclusion=conclusion,
        suggested_clip=next((arm.value for arm in outcomes if arm.suggested and arm.intervention == "clip"), None),
        divergence_onset=plan.onset,
        warnings=plan.warnings,
        executor=executor,
        workers=runner.workers,
        seconds=time.perf_counter() - started,
        tracking_uri=store.uri,
        patch=plan.patch.summary() if plan.patch else None,
        sweep=sweep_result,
    )


def ablate_request(store, request: AblateRequest, *, progress: Optional[Callable[[str, str, int], None]] = None,
                   on_plan: Optional[Callable[[list[str], int, int], None]] = None) -> AblationResult:
    """`ablate` as a checked request asks it (`replay ablate` and `replaybisect.ablate`)."""
    return ablate(store, request.run_id, request.specs, from_step=request.from_step, horizon=request.horizon,
                  workers=request.workers, executor=request.executor, submitit_options=request.jobs,
                  progress=progress, on_plan=on_plan, trust=request.trusted, patch=request.patch, sweep=request.sweep)


class _Runner:
    """Runs arms from the plan's snapshot (the baseline with the first batch) and judges them against the baseline."""

    def __init__(self, store, run_id: str, plan: _ArmPlan, trust: Trust, executor: str, workers: Optional[int],
                 submitit_options: Optional[JobSettings], progress: Optional[ProgressFn], on_plan):
        self.store, self.run_id, self.plan, self.trust = store, run_id, plan, trust
        self.executor, self.workers, self.submitit_options = executor, workers or 1, submitit_options
        self.progress, self.on_plan = progress, on_plan
        self.pool = None  # a sweep's local process pool, kept across its rounds
        self.baseline: Optional[ArmOutcome] = None
        self.baseline_failed = False
        self.inconclusive: Optional[str] = None

    def add(self, specs: list[ArmSpec]) -> list[ArmSpec]:
        """Specs not yet in the plan, with their changes: for a sweep's later rounds."""
        ctx = ArmContext(failing_step=self.plan.failing_step, start_step=self.plan.start, end_step=self.plan.end,
                         grad_norms=self.plan.grad_norms)
        known = {spec.name for spec in self.plan.specs}
        new = [spec for spec in specs if spec.name not in known]
        for spec in new:
            self.plan.changes[spec.name] = interventions.get(spec.intervention).apply(self.plan.cfg, ctx, spec.value)
            self.plan.specs.append(spec)
            if self.plan.changes[spec.name].not_applicable is None:
                self.plan.runnable.append(spec.name)
        return new

    def run(self, specs: list[ArmSpec]) -> list[ArmOutcome]:
        """Replay the specs' arms (and the baseline, the first time), in parallel; their judged outcomes."""
        names = {spec.name for spec in specs} | ({BASELINE} if self.baseline is None else set())
        runnable = [name for name in self.plan.runnable if name in names]
        if self.on_plan:
            self.on_plan(runnable, self.plan.snapshot_step, self.plan.end)
        every = [spec for spec in _arm_specs(self.store, self.run_id, self.plan, self.trust) if spec["arm"] in runnable]
        if not runnable:
            raw = {}
        elif self.plan.cfg.train.get("script") is not None:
            raw = _run_in_scripts(every, self.store, self.run_id, self.plan.cfg, self.trust, self.workers, self.progress)
        else:
            raw = _run_arms(every, self.executor, self.workers, self.submitit_options, self.progress, self.pool)
        if self.baseline is None:
            self.baseline, self.baseline_failed, self.inconclusive = _baseline_outcome(raw[BASELINE], self.plan)
            from replaybisect.core import ranks

            for offer in ranks.collective_offer(self.run_id, self.plan.cfg, self.baseline.reproduced):
                self.plan.warnings.append(f"{offer}; the arms here replay on one process, as the baseline did (ablate "
                                          "has no --nproc)")
        return [_arm_outcome(spec, self.plan.changes[spec.name], raw.get(spec.name), self.plan, self.baseline_failed,
                             self.inconclusive) for spec in specs]


def _reproduced(losses: dict[int, float], logged: dict[int, float], failing_step: Optional[int]) -> str:
    """The baseline's losses against the recorded ones, before the failure (exact | close | diverged)."""
    from replaybisect.restore import CLOSE_RELATIVE, relative_error, same_loss

    compared = [(logged[s], v) for s, v in losses.items() if s in logged and (failing_step is None or s < failing_step)]
    if not compared:
        return "unchecked"
    worst = max((relative_error(a, b) for a, b in compared if not same_loss(a, b)), default=0.0)
    return "exact" if worst == 0.0 else ("close" if worst <= CLOSE_RELATIVE else "diverged")
