"""What an ablation says: each arm's outcome and verdict (fixes | delays | no-effect | worse), the baseline's,
and the conclusion (which change fixes it, and when a change only masks the cause)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from replaybisect.core.jsonutil import to_jsonable as _json_float
from replaybisect.verbs.ablate.patch import PATCH_ARM
from replaybisect.verbs.ablate.arm import failure_text

# "The loss blows up": the mean loss over the arm's last FINAL_WINDOW steps exceeds BLOWUP_FACTOR x the
# pre-failure reference. 4x is the divergence criterion of LR range tests (Lightning, fastai,
# torch-lr-finder stop at loss > 4x best); the mean over 10 steps keeps one noisy batch from deciding.
BLOWUP_FACTOR = 4.0
FINAL_WINDOW = 10
# The pre-failure reference: median of the recorded losses of the REFERENCE_WINDOW steps before the arms'
# start plus the steps from the start to the failure.
REFERENCE_WINDOW = 20
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


# ---- verdicts ----------------------------------------------------------------------------------------
def _steps(values: dict[str, float]) -> dict[int, float]:
    return dict(sorted((int(s), float(v)) for s, v in values.items()))


def finish_outcome(outcome: ArmOutcome, raw: dict) -> None:
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


def last_step_of(arm: ArmOutcome, end: int) -> int:
    """The last step `arm` ran before `end` (exclusive): a script's own loop may end sooner."""
    return min(max(arm.losses, default=end - 1), end - 1)
