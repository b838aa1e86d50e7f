"""A failing step that raised (an exception, an out-of-memory error): replayed under the probes once, the
exception classified (after a NaN, or the code's own), the rows it names, what to try."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from replaybisect.verbs.nan.copies import fingerprint, isolation_warning, on_copy
from replaybisect.verbs.nan.result import NanReport, line_of, shown_module
from replaybisect.verbs.nan.suggest import rows_text


# ---- a step that raised -------------------------------------------------------------------------------------
@dataclass
class _CrashResults:
    error: Optional[str]  # "Type: message" the plain step raised on replay (None: it did not raise)
    frame: Optional[str]  # the user's innermost frame it raised in
    probe: Any  # the StepProbe, as far as the step got
    raised: Any  # step_probe.RaisedOp: the torch call that raised, when one did
    nonfinite: Any  # step_probe.OpFinding: the first op that made a non-finite value before the error, if any
    batch: list  # "name: dtype[shape] range" of each tensor of the batch
    batch_findings: list  # non-finite values in the batch
    isolation: dict
    isolation_warning: Optional[str] = None  # copies.isolation_warning


def _run_catching(step, batch):
    """A function of a state copy: the step run through (no halt at a non-finite value: the recorded step raised
    before any halt) -> (the error it raised or None, the user's frame, the outcome)."""
    from replaybisect.core import loop
    from replaybisect.frames import error_message, raised_at

    def run(copy):
        try:
            outcome = loop.run_step(copy, step, batch, halt_on_nonfinite=False)
        except Exception as error:  # noqa: BLE001 - the user's step raised: that is the finding
            return f"{type(error).__name__}: {error_message(error)}", raised_at(error), None
        return None, None, outcome

    return run


def probe_crash(state, step, batch, rng_at_step, dataset_rows, log) -> _CrashResults:
    """The recorded step that raised, replayed: plain (does it raise again, the same?), then under the probes (which
    op raised, in which module; did a non-finite value come first, and from where), then plain again (repeatable)."""
    from replaybisect.core import rng, user_step
    from replaybisect.verbs.nan import probes, step_probe

    from replaybisect.core.inline_step import RemoteStep
    from replaybisect.frames import error_message, raised_at

    live_before = fingerprint(state)
    rng_before = rng.to_json(rng.capture_raw())
    data = user_step.data_of(user_step.unpack(batch)[0]) if state.user_loop else batch
    shapes = [f"{name}: {step_probe.value_brief(tensor)}" for name, tensor in probes.batch_fields(data)][:8]

    def probed(copy):
        probe = step_probe.StepProbe(copy)
        probe.raised_error = (None, None)
        try:
            probe.run(step, batch)
        except Exception as error:  # noqa: BLE001 - as the plain step: what the probe saw up to the error is the finding
            probe.raised_error = (f"{type(error).__name__}: {error_message(error)}", raised_at(error))
        return probe

    # a loop recorded as written whose model raised cannot run that step again (the script's code after the call
    # has no outputs to go on with): the probed run is the one run, its error the step's
    once = isinstance(state.step_fn, RemoteStep)
    if once:
        log(f"step {step}: the step that raised, under the probes (forward hooks, the op that raised)")
        probe = on_copy(state, rng_at_step, probed)
        error, frame = probe.raised_error
        again = None if state.step_fn.ended else on_copy(state, rng_at_step, _run_catching(step, batch))[:2]
    else:
        log(f"step {step}: plain replay of the step that raised")
        error, frame, _ = on_copy(state, rng_at_step, _run_catching(step, batch))
        log(f"step {step}: probes (forward hooks, the op that raised)")
        probe = on_copy(state, rng_at_step, probed)
        again = on_copy(state, rng_at_step, _run_catching(step, batch))[:2]
    isolation = {"state_unchanged": fingerprint(state) == live_before,
                 "rng_unchanged": rng.to_json(rng.capture_raw()) == rng_before}
    if again is not None:  # (None: the script's loop ended with the step, which therefore ran once)
        isolation["step_repeatable"] = again == (error, frame)
    return _CrashResults(error, frame, probe, probe.finder.raised, probe.finder.found,
                         shapes, probes.probe_batch(data, dataset_rows), isolation, isolation_warning(isolation, state, step))


def classify_crash(report: NanReport, results: _CrashResults, tags: dict) -> None:
    """The verdict on a step that raised: reproduced (the same error), where (the user's frame, the op and module),
    and a non-finite value made before it (the op that made it, as for a NaN loss)."""
    from replaybisect.core.jsonutil import to_jsonable

    t = report.failing_step
    recorded = f"{tags.get('error_type') or 'an exception'}: {tags.get('error') or ''}".rstrip(": ")
    report.batch = results.batch_findings
    report.isolation = results.isolation
    raised, first = results.raised, results.nonfinite
    report.exception = {
        "recorded": recorded, "recorded_frame": tags.get("error_frame"), "replayed": results.error,
        "frame": results.frame, "as_recorded": results.error is not None and results.error.startswith(recorded),
        "op": raised.op if raised else None, "module": raised.module if raised else None,
        "op_inputs": raised.inputs if raised else [], "batch": results.batch,
        "nonfinite_before": to_jsonable(first) if first is not None else None,
    }
    if results.isolation_warning:
        report.warnings.append(results.isolation_warning)
    if tags.get("failure_kind") == "out_of_memory" and results.error is None:  # the run's cap, not the step, made it fail
        report.category, report.phase = "out-of-memory", "step"
        report.evidence.append(f"step {t} ran out of memory in the recorded run ({recorded}); replayed here without "
                               "the run's memory cap it runs through")
        report.arms, report.ablate_command = [], None
        report.suggestion = (f"replay memory --run-id {report.run_id}: where the step's memory went, by module, and a "
                             "batch size that fits the cap, proven under it")
        return
    if results.error is None:
        report.category, report.phase = "transient", "none"
        report.evidence.append(f"step {t} raised {recorded} in the recorded run but runs through on replay from the same "
                               "state and batch: something outside the recorded state (a file, the environment, the "
                               "device) made it raise")
        report.suggestion = (f"resume from the snapshot of step {report.snapshot_step}; if it recurs, record what the step "
                             "reads outside its state")
        return
    report.category = "exception"
    report.phase = "forward" if raised is not None and raised.module is not None else "step"
    report.module = raised.module if raised is not None else None
    report.op = raised.op if raised is not None else None
    report.source = results.frame or (raised.source if raised is not None else None)
    same = "as recorded" if report.exception["as_recorded"] else f"(the run recorded {recorded})"
    report.evidence.append(f"step {t} raised {results.error} again on replay, {same}, at {results.frame or 'a frame outside your code'}")
    if raised is not None:
        where = f" in the forward of {shown_module(report.module)}" if raised.module is not None else ""
        report.evidence.append(f"raised by {raised.op}{where}; its inputs: " + "; ".join(raised.inputs))
    report.evidence.append("the batch: " + "; ".join(results.batch))
    if first is not None:
        where = f" in {shown_module(first.module)}" if first.module is not None else ""
        report.evidence.append(f"before it, {first.op}{where} made a non-finite value from finite inputs"
                               + (f" at {first.source}" if first.source else "") + f" ({first.output.brief()})")
        report.module, report.op, report.phase = first.module, first.op, "forward"
        report.source = first.source or report.source
    for finding in results.batch_findings:
        report.evidence.append(f"the batch's {finding.field} holds non-finite values in rows {finding.rows[:8]}")
    report.arms, report.ablate_command = [], None
    if first is not None:
        from replaybisect.verbs.nan import fixes

        report.suggestion = (f"fix {first.op} at {line_of(report.source)}: {fixes.fix_for(first.op) or 'keep its values finite'} "
                             f"(its non-finite value made step {t} raise {results.error})")
    else:
        report.suggestion = (f"fix the step at {line_of(report.source) if report.source else 'the line that raised'}: it "
                             f"raised {results.error} on the batch of step {t} (the snapshot of step {report.snapshot_step} "
                             "and the stored batches replay it)")


def name_rows(report: NanReport, fault, batch, dataset_rows: Optional[list[int]]) -> None:
    """A fault keyed on the data: the first op to make a non-finite value made it in a few rows of its output whose
    dim 0 is the batch's, and the other rows stayed finite through it. Those rows of the batch are named. Not an
    overflow (an exp or a product: the largest rows overflow first), nor a run whose gradients grew exponentially."""
    from replaybisect.core import user_step
    from replaybisect.verbs.nan import fixes
    from replaybisect.verbs.nan.step_probe import MAX_ROWS

    if fault is None or not fault.rows or not fault.output.shape or fixes.overflows(fault.op):
        return
    if report.history is not None and report.history.exploding:
        return
    size = user_step.batch_rows(batch)
    if size is None or fault.output.shape[0] != size or len(fault.rows) >= size or len(fault.rows) > MAX_ROWS:
        return
    rows = list(fault.rows)
    known = dataset_rows is not None and len(dataset_rows) == size
    report.rows = {"rows": rows, "of": size, "dataset_rows": [int(dataset_rows[r]) for r in rows] if known else None}
    also = f" (dataset rows {report.rows['dataset_rows']})" if known else ""
    report.evidence.append(f"{fault.op} made its non-finite values in {rows_text(rows)} of the batch's {size}{also} only: "
                           "the fault is keyed on the data of those rows")
