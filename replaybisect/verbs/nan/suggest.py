"""What to try next: the `replay ablate` arms a verdict points to (each category's), and the fix proposed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from replaybisect.verbs.nan.copies import StepResults
from replaybisect.verbs.nan.result import ARMS, CATEGORIES, NanReport, line_of


def rows_text(rows: list[int]) -> str:
    return f"row {rows[0]}" if len(rows) == 1 else f"rows {rows}"


def _skip_rows_arm(report: NanReport) -> str:
    return "skip-rows=" + "+".join(str(row) for row in report.rows["rows"])


def suggest_for_crash(report: NanReport) -> None:
    """A step that raised after a fault keyed on rows of its batch: the rows to look at, and the arm proving it."""
    if report.rows is None or report.category != "exception":
        return
    choice = _ArmChoice()
    _arms_for_rows(report, choice)
    fix = report.suggestion
    _write_suggestion(report, choice)
    report.suggestion += "\n" + fix


# ---- what to try next --------------------------------------------------------------------------------------------
def suggest_arms(report: NanReport, results: StepResults, script: Optional[str] = None) -> None:
    """The ablate arms to try, chosen from the verdict's fields (category, precision, history, update, origin)."""
    if report.category == "transient":
        report.suggestion = (
            f"no code change needed: resume from the snapshot of step {report.snapshot_step} (the same run continues finite on replay). "
            "If it recurs, check the machine (GPU memory test, another host), and record anything the model reads outside "
            "its state (environment, files) as a buffer"
        )
        report.arms, report.ablate_command = [], None
        return
    choice = _ArmChoice()
    if report.gradients_never_cleared:
        choice.add("zero-grad: the loop never clears its gradients (from step 1 each step's backward added to all earlier "
                   "steps'), so every update applies their sum; zero-grad clears them before each step, as "
                   "optimizer.zero_grad() in the loop would", "zero-grad")
    if report.rows is not None:  # keyed on the data: no lr or clip fixes what a few rows of the batch make
        _arms_for_rows(report, choice)
    else:
        _arms_for_data(report, choice)
        _arms_for_precision(report, choice)
        _arms_for_history(report, choice)
        CATEGORY_ARMS.get(report.category, lambda report, choice: None)(report, choice)
    assert report.category in CATEGORIES and {arm.partition("=")[0] for arm in choice.arms} <= set(ARMS), (report.category, choice.arms)
    _write_suggestion(report, choice)
    _propose_fix(report, script)


def never_cleared(store, run_id: str, step: int) -> bool:
    """Every step from 1 up to `step` began with gradients its loop had not cleared (the recorder's grads_carried)."""
    carried = {int(at) for at, _ in store.metric_history(run_id, "grads_carried")}
    return step > 1 and set(range(1, step)) <= carried


def _propose_fix(report: NanReport, script: Optional[str]) -> None:
    """An op-level fault of a known pattern: the change to make at the op's line, and the command proving it (none
    for a run recorded by a script, `script`: its arms take no --patch)."""
    from replaybisect.verbs.nan import fixes

    change = fixes.fix_for(report.op) if report.category in ("forward", "loss", "backward") else None
    if change is None:
        return
    prove = fixes.patch_command(report.run_id, report.source, script)
    report.fix = {"op": report.op, "change": change, **({"prove": prove} if prove else {})}
    where = f" at {line_of(report.source)}" if report.source else ""
    report.suggestion += f"\nfix {report.op}{where}: {change}" + (
        f"\nprove the fix on this failure: copy {fixes.source_file(report.source).name} to fixed/, change it, then {prove}" if prove else "")


@dataclass
class _ArmChoice:
    arms: list[str] = field(default_factory=list)  # in the order they were chosen, each once
    why: list[str] = field(default_factory=list)
    from_step: Optional[int] = None  # apply the arms from this step (the state before t is already corrupt)

    def add(self, reason: str, *names: str) -> None:
        self.arms.extend(name for name in names if name not in self.arms)
        self.why.append(reason)


def _arms_for_data(report: NanReport, choice: _ArmChoice) -> None:
    if report.category == "data":
        rows = sorted({r for f in report.batch for r in (f.dataset_rows or [])})
        choice.add("skip-batch drops the failing batch" + (f"; then clean dataset rows {rows[:10]}" if rows else ""), "skip-batch")


def _arms_for_rows(report: NanReport, choice: _ArmChoice) -> None:
    rows = report.rows["rows"]
    choice.add(f"look at {rows_text(rows)} of step {report.failing_step}'s batch (e.g. a blank image, an empty sequence, "
               f"a value the op cannot take); {_skip_rows_arm(report)} drops them from that batch: if the step is then "
               "finite, the data of those rows made the failure", _skip_rows_arm(report))


def _arms_for_precision(report: NanReport, choice: _ArmChoice) -> None:
    if report.precision != "fp32" and report.category in ("forward", "loss", "backward"):
        choice.add(f"precision: the run trains in {report.precision}; fp32 tells whether the overflow is a range problem", "precision")


def _arms_for_history(report: NanReport, choice: _ArmChoice) -> None:
    if report.category == "divergence":
        return  # the divergence's own arms say it
    if report.history is not None and report.history.exploding:
        choice.add("lr / clip / warmup: the grad norm grew exponentially before the failure", "lr", "clip", "warmup")


def _arms_for_divergence(report: NanReport, choice: _ArmChoice) -> None:
    choice.add("lr / clip: a divergence is stopped by smaller or bounded updates; the ablation says which, and by how much "
               "(--sweep lr finds the largest stable learning rate)", "lr", "clip")


def _op_named(report: NanReport) -> str:
    return f"`{report.op}`" + (f" at {line_of(report.source)}" if report.source else "")


def _arms_for_forward(report: NanReport, choice: _ArmChoice) -> None:
    from replaybisect.verbs.nan import fixes

    fix = f"fix {_op_named(report)} ({fixes.fix_for(report.op) or 'bound its input'})" if report.op else "find the op with `replay nan --step`"
    choice.add(f"lr / clip: smaller updates keep activations in range longer; if they only delay it, {fix}", "lr", "clip")


def _arms_for_loss(report: NanReport, choice: _ArmChoice) -> None:
    op = f"{_op_named(report)} met" if report.op else "the loss met"
    choice.add(f"lr / clip: {op} an impossible value (e.g. log(0)); if they only delay it, clamp or use a log-space loss", "lr", "clip")


def _arms_for_backward(report: NanReport, choice: _ArmChoice) -> None:
    if report.op:
        why = (f"the gradient of {_op_named(report)} is non-finite at this input; clip cannot repair NaN, so fix the op "
               "(add an eps) if the arms do not help")
    else:
        why = "a gradient turned non-finite in backward with no op isolated; clipping and skipping the batch tell whether it is the update size or this input"
    choice.add(why, "clip", "skip-batch")


def _arms_for_optimizer(report: NanReport, choice: _ArmChoice) -> None:
    """From the update's hyperparameters: eps ~ 0 (Adam's 0/0), a non-finite lr, else a smaller step."""
    hyper = (report.update or {}).get("hyperparameters", {})
    eps, lr = hyper.get("eps"), hyper.get("lr")
    if _is_number(eps) and eps < 1e-12:
        choice.add("eps: the update divides by sqrt(v) + eps with eps ~ 0", "eps")
    if not (_is_number(lr) and math.isfinite(lr)):
        choice.add("lr: the learning rate is not finite", "lr")
    choice.add("lr / clip: smaller updates, in case the step size rather than the arithmetic is to blame", "lr", "clip")
    if report.origin_step is not None and report.origin_step < report.snapshot_step:
        choice.from_step = report.origin_step  # the snapshot before t is already corrupt: apply the arms before it


def _arms_for_corrupt_state(report: NanReport, choice: _ArmChoice) -> None:
    if report.origin == "forward-write":
        choice.why.append(f"no ablation arm repairs a module that writes into its own weights: fix {report.module}'s forward")
    elif report.origin == "initial":
        choice.add("seed: the state was non-finite from the start; another seed tells whether initialization is to blame", "seed")
    else:
        choice.add("lr / clip from the last finite snapshot; the state went bad where the replay could not see it", "lr", "clip")
        choice.from_step = report.origin_step


CATEGORY_ARMS = {
    "divergence": _arms_for_divergence, "forward": _arms_for_forward, "loss": _arms_for_loss, "backward": _arms_for_backward,
    "optimizer": _arms_for_optimizer, "corrupt-state": _arms_for_corrupt_state,
}


def _is_number(value) -> bool:
    return isinstance(value, (int, float))


def _write_suggestion(report: NanReport, choice: _ArmChoice) -> None:
    report.arms = choice.arms
    if not choice.arms:
        report.ablate_command = None
        report.suggestion = "; ".join(choice.why) or "no ablation arm applies"
        return
    command = f"replay ablate {','.join(choice.arms)} --run-id {report.run_id}"
    if choice.from_step is not None:
        command += f" --from-step {choice.from_step}"
    report.ablate_command = command
    report.suggestion_reason = "; ".join(choice.why)
    report.suggestion = command + "   # " + report.suggestion_reason
