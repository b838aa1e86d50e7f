"""The verdict on a probed step: which category (data, forward, loss, backward, optimizer, corrupt state,
transient), the op and module, the step a corrupt state came from, and whether a divergence stands
behind the fault; the report's headline."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

from replaybisect.errors import SnapshotError
from replaybisect.replay import restore as restore_mod
from replaybisect.verbs.nan.divergence import LayerHistory, decide, moderate_fault
from replaybisect.verbs.nan.copies import StepResults, on_copy
from replaybisect.core.trend import fmt
from replaybisect.verbs.nan.result import FAULTS, FIELDS_SHOWN, NanReport


# ---- the verdict --------------------------------------------------------------------------------------------
def classify_step(report: NanReport, results: StepResults, restored, store, run_id, cfg, log) -> None:
    """The verdict: the first category whose decision applies, in the order a step computes (state, batch,
    forward, loss, backward, update); what no probe isolated is reported as such."""
    _record_probe_facts(report, results)
    if _is_transient(report, results, restored, run_id):
        return
    from replaybisect.core.ranks import agreed

    # the state before the step is already non-finite (on any rank of replay nan --nproc, whose buffers are its own):
    # trace back to the step that corrupted it
    if agreed(bool(results.state)):
        _classify_corrupt(report, results, restored, store, run_id, cfg, log)
        return
    if _is_data(report, results, restored.state.model):
        return
    report.evidence.append("the batch is finite; parameters, buffers and optimizer state before the step are finite")
    for classify in (_is_forward, _is_loss, _is_backward, _is_update):
        if classify(report, results, restored.state):
            return
    _not_isolated(report, results)


def _record_probe_facts(report: NanReport, results: StepResults) -> None:
    """What every probe saw, kept on the report whatever the verdict."""
    from replaybisect.core.jsonutil import to_jsonable

    probe, plain = results.probe, results.plain
    report.batch = results.batch
    report.state_findings = results.state
    report.anomaly = to_jsonable(results.anomaly)
    report.isolation = results.isolation
    report.layer_grad_norms = probe.layer_grad_norms
    report.plain_step = {"loss": plain.loss, "grad_norm": plain.grad_norm, "nonfinite": plain.nonfinite}
    report.forward = _forward_json(probe)
    report.backward = {
        "module": probe.backward_module, "detail": probe.backward_detail, "node": probe.backward_node,
        "grad_norm": probe.grad_norm, "events": len(probe.grad_events),
    }
    report.update = to_jsonable(probe.update) if probe.update is not None else None
    if results.isolation_warning:
        report.warnings.append(results.isolation_warning)


def _is_transient(report: NanReport, results: StepResults, restored, run_id: str) -> bool:
    """Finite on replay: not a bug in the code or the data."""
    plain, t = results.plain, report.failing_step
    if plain.nonfinite is not None:
        return False
    report.category, report.phase = "transient", "none"
    recorded_what = "value"
    tags = restored.store.tags(run_id)
    if report.recorded_failing_step == t:
        recorded_what = (tags.get("nonfinite_what") or "value").replace("_", " ")
    report.evidence.append(
        f"step {t} was non-finite in the recorded run but is finite on replay from the same state and batch "
        f"(loss {plain.loss:.6g}, grad norm {fmt(plain.grad_norm)})"
    )
    report.evidence.append(
        "a transient fault: the code, the data and the state do not produce it. Likely a hardware fault (a bit flip, "
        "bad accelerator memory), a nondeterministic kernel, or something the run read that is not part of its "
        f"recorded state (an environment variable, a file, a module attribute outside state_dict); the recorded non-finite "
        f"{recorded_what} happened only in the original process"
    )
    report.evidence.append(_machines(tags.get("device_label"), run_id))
    return True


def _machines(recorded_on, run_id: str) -> str:
    """Which machine recorded the run and which replayed it: replay verify's device labels, told apart."""
    from replaybisect.core.faults import device_label

    here = device_label()
    if recorded_on is None:
        return f"replayed on {here}; the run did not record its machine (recorded before device labels)"
    if recorded_on == here:
        return (f"recorded and replayed on the same machine ({here}): it does not reproduce its own recording, a fault while "
                f"recording; `replay verify --run-id {run_id}` compares its other steps bit for bit")
    return (f"recorded on {recorded_on}, replayed on {here}: run `replay nan` (or `replay verify --run-id {run_id}`) on "
            f"{recorded_on}; non-finite there again is that machine's own (its hardware), finite there too is transient")


def _is_data(report: NanReport, results: StepResults, model) -> bool:
    """The batch holds non-finite values."""
    from replaybisect.verbs.nan.probes import display_module

    if not results.batch:
        return False
    report.category, report.phase = "data", "data"
    for finding in results.batch[:FIELDS_SHOWN]:
        rows = finding.rows[:10]
        where = f"rows {rows}" + (f" (dataset rows {finding.dataset_rows[:10]})" if finding.dataset_rows else "")
        report.evidence.append(f"batch field {finding.field} {finding.shape} holds {finding.nan} NaN / {finding.inf} Inf in {where}")
    if len(results.batch) > FIELDS_SHOWN:  # (a step of many training calls: every field is in report.json's batch)
        report.evidence.append(f"... and {len(results.batch) - FIELDS_SHOWN} more batch fields hold non-finite values (report.json: batch)")
    first = results.probe.first_nonfinite_output
    if first is not None:
        report.module = display_module(first.module, model)
        report.evidence.append(f"the first module to output non-finite values is {report.module} ({first.type}), fed the bad rows")
    report.evidence.append("parameters and optimizer state before the step are finite")
    return True


def _loss_call(probe):
    """The loss function's call when the probe saw it go non-finite from finite inputs, else None."""
    call = probe.first_forward
    return call if call is not None and call.module.startswith("loss") else None


def _is_forward(report: NanReport, results: StepResults, state) -> bool:
    """The first module whose output is non-finite while its inputs were finite, inside the model."""
    from replaybisect.verbs.nan.probes import display_module

    probe = results.probe
    call = probe.first_forward
    if call is None or _loss_call(probe) is not None or probe.model_output_finite is True:
        return False
    report.category, report.phase = "forward", "forward"
    report.module = display_module(call.module, state.model)
    report.evidence.append(f"forward: {report.module} ({call.type}) is the first module whose output is non-finite while its inputs were finite")
    for label, stats in call.inputs[:3]:
        report.evidence.append(f"  input {label}: {stats.brief()}")
    for label, stats in call.outputs[:3]:
        report.evidence.append(f"  output {label}: {stats.brief()}")
    _name_forward_op(report, probe.forward_op, probe.intended_nonfinite)
    return True


def _is_loss(report: NanReport, results: StepResults, state) -> bool:
    """Finite model outputs, a non-finite loss."""
    probe = results.probe
    if probe.loss_finite:
        return False
    report.category, report.phase = "loss", "loss"
    call = _loss_call(probe)
    if call is not None:
        report.module = f"{call.module} ({call.type})"
    elif state.loss_fn is None:  # a run from the user's own loop: the loss is computed in their step
        report.module = "loss (computed in your code, outside the model)"
    else:
        report.module = f"loss ({getattr(state.loss_fn, '__name__', type(state.loss_fn).__name__)})"
    report.evidence.append(f"forward: every module's output is finite; the loss is {probe.loss}")
    if call is not None:
        for label, stats in call.inputs[:2]:
            report.evidence.append(f"  loss input {label}: {stats.brief()}")
    _name_forward_op(report, probe.forward_op, probe.intended_nonfinite)
    return True


def _is_backward(report: NanReport, results: StepResults, state) -> bool:
    """Finite forward and loss, a gradient turns non-finite."""
    from replaybisect.verbs.nan.probes import display_module

    probe, anomaly = results.probe, results.anomaly
    if probe.grads_finite is not False:
        return False
    report.category, report.phase = "backward", "backward"
    report.module = display_module(probe.backward_module, state.model) if probe.backward_module is not None else None
    report.evidence.append(f"forward and loss are finite (loss {probe.loss:.6g}); the gradient norm is {fmt(probe.grad_norm)}")
    if probe.backward_detail:
        report.evidence.append(f"backward: {report.module}: {probe.backward_detail}")
    report.op = anomaly.op or probe.backward_node
    report.source = anomaly.source
    if report.op:
        report.evidence.append(f"the first autograd node with finite incoming and non-finite outgoing gradients: {report.op}"
                               + (f", created at {anomaly.source}" if anomaly.source else ""))
    if anomaly.nan_op and anomaly.nan_op != report.op:
        report.evidence.append(f"detect_anomaly (NaN only) raised later, in {anomaly.nan_op}: {report.op} made Inf, which became NaN downstream")
    return True


def _is_update(report: NanReport, results: StepResults, state) -> bool:
    """Finite gradients, and this step's optimizer update made the weights or moments non-finite."""
    update = results.probe.update
    if update is None or (update.params_finite_after and update.state_finite_after):
        return False
    _optimizer_verdict(report, update, report.failing_step, results.probe.grad_norm)
    return True


def _not_isolated(report: NanReport, results: StepResults) -> None:
    """The plain step is non-finite, but no probe saw where."""
    nonfinite = results.plain.nonfinite
    report.category = "forward" if nonfinite == "loss" else "backward"
    report.phase = report.category
    report.evidence.append(
        f"the plain replay of step {report.failing_step} is non-finite ({nonfinite}) but the instrumented pass did not isolate a module; "
        "the failure may depend on something the hooks change (in-place ops on hooked tensors)"
    )


def _name_forward_op(report: NanReport, op, intended: list[str] = ()) -> None:
    if op is None:
        return
    report.op = op.op
    report.source = op.source
    inputs = ", ".join(s.brief() for s in op.inputs[:2])
    where = "your code outside the model (the loss)" if op.module is None else (op.module or "(root)")
    report.evidence.append(
        f"the first op on the path to the non-finite loss to make a non-finite value from finite inputs: {op.op} in {where}"
        + (f" at {op.source}" if op.source else "") + f" (inputs {inputs} -> {op.output.brief()})"
    )
    if intended:
        report.evidence.append(
            f"not counted: non-finite values made on request ({', '.join(intended[:3])} with a -inf/NaN argument, e.g. a causal mask)"
        )


def _forward_json(probe) -> dict[str, Any]:
    from replaybisect.core.jsonutil import to_jsonable

    def call_json(call):
        if call is None:
            return None
        return {
            "module": call.module, "type": call.type, "order": call.order,
            "inputs": [{"name": n, **to_jsonable(s)} for n, s in call.inputs],
            "outputs": [{"name": n, **to_jsonable(s)} for n, s in call.outputs],
        }

    return {
        "first_nonfinite_from_finite": call_json(probe.first_forward),
        "first_nonfinite_output": call_json(probe.first_nonfinite_output),
        "op": to_jsonable(probe.forward_op),
        "loss": probe.loss,
        "model_output_finite": probe.model_output_finite,
        "modules_called": len(probe.forward_calls),
    }


def _optimizer_verdict(report: NanReport, update, step: int, grad_norm) -> None:
    from replaybisect.core.jsonutil import to_jsonable

    report.category, report.phase = "optimizer", "update"
    report.update = to_jsonable(update)
    first = update.bad[0] if update.bad else None
    if first is not None:
        report.module = first.module or "(root)"
    report.op = f"{update.hyperparameters.get('optimizer', 'optimizer')}.step"
    report.evidence.append(
        f"step {step}: gradients finite (norm {fmt(grad_norm)}), parameters finite before the update; after optimizer.step(): "
        + ", ".join(f"{f.kind} {f.name} ({f.nan} NaN, {f.inf} Inf of {f.numel})" for f in update.bad[:4])
    )
    if update.explanation:
        report.evidence.append(update.explanation)
    report.evidence.append(f"hyperparameters: {update.hyperparameters}")


def _classify_corrupt(report: NanReport, results: StepResults, restored, store, run_id, cfg, log) -> None:
    """The state before t is non-finite. Find the step k that made it so: finite grads and finite weights
    before k's optimizer.step(), non-finite after it -> `optimizer` at k (the update did it); weights made
    non-finite during k's forward (a module writing into its own parameters/buffers), non-finite at
    initialization, or no step found -> `corrupt-state`."""
    from replaybisect.verbs.nan.probes import display_module

    ev = report.evidence
    t = report.failing_step
    listed = ", ".join(f"{f.kind} {f.name} ({f.nan} NaN, {f.inf} Inf of {f.numel})" for f in results.state[:5])
    ev.append(f"the state before step {t} is already non-finite: {listed or 'on another rank'}")
    report.phase = "state"
    first = results.state[0] if results.state else None
    report.module = display_module(first.module, restored.state.model) if first is not None and first.kind != "param group" else None
    log("the state is already corrupt: tracing back to the step that corrupted it")
    from replaybisect.core import loop

    # a script's live objects are the ones the fresh restores load into: the examined state is put back after
    with loop.kept_in_place(restored.state) if restored.state.live else contextlib.nullcontext():
        origin = find_corrupting_step(store, run_id, cfg, restored, t, report.warnings)
    report.origin_step = origin.get("step")
    kind = report.origin = origin["kind"]
    if kind == "optimizer":
        update = origin["update"]
        k = origin["step"]
        ev.append(f"traced back: the state was finite before step {k}; step {k}'s optimizer update made it non-finite")
        _optimizer_verdict(report, update, k, origin.get("grad_norm"))
        ev.append(
            f"reported as `optimizer`, not `corrupt-state`: the state was finite before step {k}, its gradients were finite, and "
            f"the non-finite values appeared in optimizer.step() itself; steps {k + 1}..{t} then computed with them"
        )
        return
    report.category = "corrupt-state"
    if kind == "forward-write":
        k = origin["step"]
        module, tensors = origin["writer"]
        report.module = display_module(module, restored.state.model)
        report.phase = "forward"
        ev.append(
            f"traced back: the state was finite before step {k}; during step {k}'s forward, {report.module} made its own "
            f"{', '.join(tensors)} non-finite (they were finite when it was called): it writes into its own state"
        )
        ev.append("reported as `corrupt-state`, not `optimizer`: the values went bad outside the optimizer update, before backward")
    elif kind == "initial":
        ev.append(f"traced back: the state is already non-finite in the earliest verified snapshot (step {origin['step']})"
                  + (": the model was built with non-finite values" if origin["step"] == 0 else ""))
    else:
        ev.append(f"could not find the step that corrupted the state ({origin.get('why', 'the replay stayed finite')})")


class _StopWhenStateNonfinite(restore_mod.ReplayHooks):
    """Replay hooks that check the state after every step and stop the replay at the first step that left
    it non-finite (`corrupted_at`; None when every step kept it finite)."""

    def __init__(self, state, stop_on_nonfinite: bool):
        super().__init__(stop_on_nonfinite)
        self.state = state
        self.corrupted_at: Optional[int] = None

    def after_step(self, outcome, batch, step_time, data_time):
        from replaybisect.core.ranks import agreed
        from replaybisect.verbs.nan import probes

        keep_going = super().after_step(outcome, batch, step_time, data_time)
        if agreed(not probes.finiteness(self.state)):  # (replay nan --nproc: every rank stops at the same step)
            self.corrupted_at = outcome.step
            return False
        return keep_going


def find_corrupting_step(store, run_id, cfg, restored, t: int, warnings: list[str]) -> dict[str, Any]:
    """Replay from the newest snapshot whose state is finite, checking the state after every step; then probe
    the first step that left it non-finite (from a fresh restore, on a copy)."""
    from replaybisect.core.rng import capture_raw
    from replaybisect.verbs.nan import probes, step_probe

    start = earliest = None
    for snap_step in reversed([s for s in restore_mod.snapshot_steps(store, run_id) if s <= restored.step]):
        try:
            snapshot = restored.snapshot if snap_step == restored.step else restore_mod.load_snapshot(store, run_id, snap_step)
        except SnapshotError as error:
            warnings.append(f"{error}; skipped while tracing the corruption back")
            continue
        if all(probes.all_finite(tensor) for tensor in snapshot.tensors.values()):
            start = snapshot
            break
        earliest = snapshot
    if start is None:
        if earliest is None:
            return {"kind": "unknown", "why": "no earlier snapshot verifies"}
        return {"kind": "initial", "step": earliest.step}

    def fresh():
        return restore_mod.restore(store, run_id, cfg=cfg, device=restored.state.device, snapshot=start)

    from replaybisect.core import loop

    candidate = fresh()
    watch = _StopWhenStateNonfinite(candidate.state, stop_on_nonfinite=cfg.snapshot.on_nonfinite == "stop")
    loop.train_loop(candidate.state, candidate.batch, candidate.step, t, watch)
    k = watch.corrupted_at
    if k is None:
        return {"kind": "unknown", "why": (f"replaying steps {start.step}..{t - 1} from the snapshot of step {start.step} kept the state "
                                           "finite: the recorded state went bad outside the replayed steps")}
    again = fresh()
    if k > start.step:
        restore_mod.replay(again, k, stop_on_nonfinite=cfg.snapshot.on_nonfinite == "stop")
    rng_at_k = capture_raw()
    batch_k = loop.to_device(again.batch(k), again.state.device)
    result = on_copy(again.state, rng_at_k, lambda copy: step_probe.StepProbe(copy).run(k, batch_k))
    if result.corrupted_in_forward:
        return {"kind": "forward-write", "step": k, "writer": result.corrupted_in_forward[0]}
    if result.update is not None and not (result.update.params_finite_after and result.update.state_finite_after):
        return {"kind": "optimizer", "step": k, "update": result.update, "grad_norm": result.grad_norm}
    return {"kind": "unknown", "step": k, "why": f"step {k} left the state non-finite, but its instrumented replay did not show where"}


# ---- divergence or fault ---------------------------------------------------------------------------------------
def judge_divergence(report: NanReport, results: StepResults, model, layers: LayerHistory, recorded_grads: dict,
                      recorded_weights: dict, scaled_buffer) -> None:
    """Turn an op-level verdict into `divergence` when the curves climbed by orders of magnitude before the
    failure, the op met runaway values (not moderate ones) and no buffer scaled itself (divergence.py)."""
    t = report.failing_step
    layer_grads = _merge_series(recorded_grads, layers.grad_norms, t)
    for name, value in report.layer_grad_norms.items():
        layer_grads.setdefault(name, {})[t] = value
    report.layer_history = {name: dict(sorted(points.items())) for name, points in layer_grads.items()}
    if report.category not in FAULTS:
        return
    losses, grad_norms = list(report.loss_history), list(report.grad_norm_history)
    plain = report.plain_step
    if plain.get("loss") is not None and math.isfinite(plain["loss"]):
        losses.append((t, plain["loss"]))
    if plain.get("grad_norm") is not None and math.isfinite(plain["grad_norm"]):
        grad_norms.append((t, plain["grad_norm"]))
    probe = results.probe
    op_inputs = probe.forward_op.inputs if probe.forward_op is not None and report.phase in ("forward", "loss") else []
    verdict = decide(losses, grad_norms, layer_grads, _merge_series(recorded_weights, layers.weight_norms, t),
                     scaled_buffer, moderate_fault(op_inputs, report.op))
    report.divergence = verdict.to_json()
    if verdict.precursor is not None:
        report.divergence["precursor_type"] = _module_type(model, verdict.precursor)
    if not verdict.divergence:
        if verdict.growth is not None:  # the curves did climb: say why the op is still to blame
            report.evidence.append(f"not a divergence: {verdict.reason}")
        return
    report.overflow = {"category": report.category, "phase": report.phase, "module": report.module, "op": report.op,
                       "source": report.source}
    where = " ".join(part for part in (report.module, report.op) if part)
    report.category = "divergence"
    # the module the climb began in; none named where the layers' norms cannot tell (the overflow's place is a symptom)
    report.module, report.op, report.source = verdict.precursor, None, None
    report.evidence[1:1] = verdict.evidence
    report.evidence.append(
        f"where the runaway values first overflowed: {report.overflow['phase']}" + (f" ({where})" if where else "")
        + ": a symptom of the divergence; no op is at fault"
    )


def _module_type(model, name: str) -> Optional[str]:
    try:
        return type(model if name == "(root)" else model.get_submodule(name)).__name__
    except AttributeError:
        return None


def _merge_series(recorded: dict[str, dict[int, float]], replayed: dict[str, dict[int, float]], before: int) -> dict[str, dict[int, float]]:
    """Per-layer series: the recorded points, with every replayed step added (steps before `before`)."""
    merged = {name: {s: v for s, v in points.items() if s < before} for name, points in recorded.items()}
    for name, points in replayed.items():
        merged.setdefault(name, {}).update({s: v for s, v in points.items() if s < before})
    return {name: points for name, points in merged.items() if points}
