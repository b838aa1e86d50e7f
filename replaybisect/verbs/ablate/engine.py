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
import time
from pathlib import Path
from typing import Callable, Optional

from replaybisect.errors import ReplayError
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import BASELINE, ArmContext, ArmSpec, Change
from replaybisect.core.trust import Trust
from replaybisect.verbs.ablate.patch import PATCH_ARM
from replaybisect.core.jobs import JobSettings
from replaybisect.verbs.ablate.request import DEFAULT_HORIZON, AblateRequest, check_options, parse_arms
from replaybisect.verbs.ablate.arm import run_arm
from replaybisect.verbs.ablate.executors import ProgressFn, run_here, run_local, run_submitit, local_pool
from replaybisect.verbs.ablate.outcome import (AblationResult, ArmOutcome, BLOWUP_FACTOR, finish_outcome,
    conclusion_text, divergence_onset, judge_arm, judge_baseline)
from replaybisect.verbs.ablate.plan import ArmPlan, arm_specs, auto_workers, plan_arms

__all__ = ["ablate", "run_arm", "judge_arm", "judge_baseline", "conclusion_text", "divergence_onset", "parse_arms",
           "AblationResult", "ArmOutcome", "DEFAULT_HORIZON", "BLOWUP_FACTOR"]


def _run_arms(specs: list[dict], executor: str, workers: int, submitit_options: Optional[JobSettings],
              progress: Optional[ProgressFn], pool=None) -> dict[str, dict]:
    if executor == "local" and workers == 1:
        return run_here(specs, progress)
    if executor == "local":
        return run_local(specs, workers, progress, pool)
    return run_submitit(specs, workers, submitit_options or JobSettings(), progress)


ARM_STEP = "arm step "  # a script's arm reports each replayed step on its progress channel as this, then the step


def _run_in_scripts(specs: list[dict], store, run_id: str, cfg, trust: Trust, workers: int,
                    progress: Optional[ProgressFn]) -> dict[str, dict]:
    """A run recorded from a script: each arm runs the script again and replays inside it (replay/script.py, the
    script's own objects in a process of their own), `workers` scripts at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from replaybisect.replay.script import run_in_script, stop_all

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


def _baseline_outcome(raw: dict, plan: ArmPlan) -> tuple[ArmOutcome, bool, Optional[str]]:
    """(the baseline's outcome, whether it failed as recorded, why the ablation is inconclusive or None).
    A baseline that crashed is an error: without it the arms mean nothing."""
    if "error" in raw:
        raise (ReplayError if raw.get("user_error") else RuntimeError)(f"the baseline replay failed: {raw['error']}")
    baseline = ArmOutcome(name=BASELINE, change=interventions.baseline_change(plan.cfg).summary)
    finish_outcome(baseline, raw)
    _keep_warnings(plan, raw)
    baseline.reproduced = _reproduced(baseline.losses, plan.logged, plan.failing_step)
    baseline_failed, inconclusive = judge_baseline(baseline, plan.failing_step, plan.threshold, plan.end)
    return baseline, baseline_failed, inconclusive


def _keep_warnings(plan: ArmPlan, raw: dict) -> None:
    """An arm's warnings in the ablation's, each once (every arm meets the same damaged snapshot)."""
    from replaybisect.replay.restore import add_warning

    for warning in raw.get("warnings", []):
        add_warning(plan.warnings, warning)


def _arm_outcome(spec: ArmSpec, change: Change, raw: Optional[dict], plan: ArmPlan, baseline_failed: bool,
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
        finish_outcome(outcome, raw)
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

    plan, snapshot = plan_arms(store, run_id, specs, from_step, horizon, trust, check_path(patch) if patch else None)
    if plan.cfg.train.get("script") is not None and executor != "local":
        raise ReplayError(f"run {run_id} was recorded from a script, which each arm runs again on this machine with the "
                          "script's own code: leave out --executor submitit")
    runner = _Runner(store, run_id, plan, trust, executor, workers, submitit_options, progress, on_plan)
    if sweep is not None:
        from replaybisect.verbs.ablate.sweep import run_sweep

        runner.workers = workers or auto_workers(store, run_id, plan.cfg, snapshot, 8 * (plan.end - plan.snapshot_step), 8, executor)
        with contextlib.ExitStack() as stack:
            if executor == "local" and runner.workers > 1:
                runner.pool = stack.enter_context(local_pool(runner.workers))
            outcomes, sweep_result = run_sweep(sweep, plan, runner)
        conclusion = sweep_result.pop("conclusion")
    else:
        runner.workers = workers or auto_workers(store, run_id, plan.cfg, snapshot, plan.estimated_steps, len(plan.runnable), executor)
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

    def __init__(self, store, run_id: str, plan: ArmPlan, trust: Trust, executor: str, workers: Optional[int],
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
        every = [spec for spec in arm_specs(self.store, self.run_id, self.plan, self.trust) if spec["arm"] in runnable]
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
    from replaybisect.replay.restore import CLOSE_RELATIVE, relative_error, same_loss

    compared = [(logged[s], v) for s, v in losses.items() if s in logged and (failing_step is None or s < failing_step)]
    if not compared:
        return "unchecked"
    worst = max((relative_error(a, b) for a, b in compared if not same_loss(a, b)), default=0.0)
    return "exact" if worst == 0.0 else ("close" if worst <= CLOSE_RELATIVE else "diverged")
