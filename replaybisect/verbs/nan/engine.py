"""`replay nan --run-id X`: where did the first NaN/Inf come from, and why.

  1. the failing step t: the run's tag, else the first non-finite loss / grad_norm (or --step N);
  2. restore the newest good snapshot strictly before t, replay s..t-1 comparing every loss with the
     logged one (exact | close | diverged), and compare the replayed state with the snapshot saved at t;
  3. step t, plain, on a copy: finite on replay -> `transient`;
  4. probes on copies: the batch, the state before the step (corrupt -> trace back to the step that
     corrupted it), forward hooks, the loss, backward hooks, the update; then detect_anomaly for the op;
  5. the verdict: category, module, op, evidence, the loss / grad-norm history, the ablate arms to try.

Nothing is written to the store here: `replaybisect.verbs.nan.report.publish` records the report as a child run.

Every probe pass runs on a deep copy of the state under `isolated_rng()` with step t's RNG restored; the
plain step is run again at the end and must give bit-identical results (checked and reported).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.replay import restore as restore_mod
from replaybisect.core import reentry
from replaybisect.core.tags import failing_step
from replaybisect.store import Store
from replaybisect.verbs.nan.divergence import LayerHistory, buffer_scaling, recorded_layer_series
from replaybisect.verbs.nan.copies import StepResults, bits, calls_differ, fingerprint, isolation_warning, on_copy, plain_run
from replaybisect.verbs.nan.crash import classify_crash, name_rows, probe_crash
from replaybisect.core.trend import history_fit
from replaybisect.verbs.nan.request import target_step
from replaybisect.verbs.nan.result import NanReport, headline
from replaybisect.verbs.nan.suggest import never_cleared, suggest_arms, suggest_for_crash
from replaybisect.verbs.nan.verdict import classify_step, judge_divergence


# ---- the command ----------------------------------------------------------------------------------------
def find_nan(
    store: Store,
    run_id: str,
    step: int | None = None,
    *,
    device=None,
    log: Callable[[str], None] | None = None,
    trust=None,
) -> NanReport:
    """Find where the first non-finite value of run `run_id` came from, and why; reads the store, writes nothing.
    `trust`: the user's decision on the stored config's code (replaybisect.core.trust.Trust; default: the
    working folder)."""
    from replaybisect.core import ranks
    from replaybisect.core.rng import capture_raw, isolated_rng

    log = log or (lambda message: None)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    tags = store.tags(run_id)  # RunNotFound: one line, exit 2
    recorded = failing_step(store, run_id)
    losses = restore_mod.logged_losses(store, run_id)
    grad_norms = dict(store.metric_history(run_id, "grad_norm"))
    target = target_step(run_id, step, recorded, tags, losses, grad_norms)  # (rank 0's: the same on every rank)
    cfg = restore_mod.run_config(store, run_id, trust)
    here = ranks.replaying_rank()  # replay nan --nproc: each rank compares its own logged losses
    own_losses = restore_mod.logged_losses(store, run_id, here[0]) if here is not None else losses
    if cfg.train.get("script") is not None and not reentry.replaying():  # a script's run: diagnosed inside the script
        from replaybisect.replay.script import run_in_script

        arguments = {"step": step, "device": str(device) if device is not None else None}
        return NanReport.from_json(run_in_script("nan", store, run_id, cfg, trust, arguments, log))
    snapshot, at_target, warnings = _choose_snapshots(store, run_id, target)
    warnings.extend(restore_mod.code_changes(tags, cfg))

    with isolated_rng():  # the whole diagnosis leaves this process's RNG streams as it found them
        from replaybisect.core import loop

        log(f"restoring snapshot {snapshot.step}, replaying steps {snapshot.step}..{target - 1}")
        restored = restore_mod.restore(store, run_id, cfg=cfg, device=device, snapshot=snapshot)
        snapshot = restored.snapshot  # an earlier one when the chosen snapshot did not apply
        state = restored.state
        start_tensors = restored.snapshot.tensors  # the state the replay starts from (did a buffer scale itself?)
        layers = LayerHistory()
        evidence: list[str] = []
        # a step that raises on a batch the run stored (rewritten after recording) is one line, not a crash
        with restore_mod.stored_batch_errors(restored):
            replayed = restore_mod.replay(
                restored, target, logged=own_losses, stop_on_nonfinite=cfg.snapshot.on_nonfinite == "stop",
                observer_factory=layers.observer,
            ) if target > snapshot.step else None
            examined = target
            if replayed is not None and replayed.stopped is not None:
                examined = replayed.stopped.step
                evidence.append(
                    f"the replay went non-finite at step {examined}, before the recorded failing step {target}: "
                    f"the replay does not follow the recorded run; examining step {examined}"
                )
            reproduced = "unchecked" if replayed is None else ("diverged" if examined != target else replayed.reproduced)
            warnings.extend(ranks.collective_offer(run_id, cfg, reproduced))
            timings["replay_s"] = time.perf_counter() - started
            rng_at_step = capture_raw()

            batch = loop.to_device(restored.batch(examined), state.device)
            stored_batch = restored.has_stored_batch(examined)
            state_match = None
            if at_target is not None and at_target.step == examined and replayed is not None:
                state_match = _state_match(state, rng_at_step, at_target, examined, batch)
            dataset_rows = _dataset_indices(snapshot, examined)
            step0 = None
            if replayed is None and snapshot.step == examined == 0 and not state.live:  # (a script's objects: not rebuilt)
                log("step 0: rebuilding the state from the config to check the reproduction")
                step0 = _reproduce_step0(cfg, state, rng_at_step, snapshot, batch, own_losses.get(0), tags.get("nonfinite_what"))
                reproduced = step0["reproduced"]

            probes_started = time.perf_counter()
            crashed = tags.get("failure") == "exception" and examined == recorded  # the step raised: replay it so
            if crashed:
                result = probe_crash(state, examined, batch, rng_at_step, dataset_rows, log)
            else:
                result = _probe_step(state, examined, batch, rng_at_step, dataset_rows, log)
            timings["probes_s"] = time.perf_counter() - probes_started

        for warning in restored.warnings:  # after the replay, which adds some (a snapshot whose batches it could not use)
            restore_mod.add_warning(warnings, warning)
        report = NanReport(
            run_id=run_id,
            failing_step=examined,
            recorded_failing_step=recorded,
            snapshot_step=snapshot.step,
            reproduced=reproduced,
            category="",
            phase="none",
            module=None,
            op=None,
            source=None,
            evidence=evidence,
            suggestion="",
            arms=[],
            ablate_command=None,
            state_match=state_match,
            warnings=warnings,
            replay=replayed.to_json() if replayed is not None else {"reproduced": "unchecked", "start_step": snapshot.step, "end_step": snapshot.step},
            precision=state.precision,
        )
        if step0 is not None:
            report.replay = {**report.replay, **step0}
            report.evidence.insert(0, step0["sentence"])
        else:
            report.evidence.insert(0, _replay_sentence(report, replayed, stored_batch, ranks_reduce=_ranks_reduce(cfg)))
        if state_match is not None:
            report.evidence.insert(1, f"the replayed state before step {examined} vs the snapshot the run saved there: {state_match}")
        report.loss_history = sorted((s, v) for s, v in losses.items() if s < examined)
        report.grad_norm_history = sorted((s, v) for s, v in grad_norms.items() if s < examined)
        report.history = history_fit(report.loss_history, report.grad_norm_history)
        report.gradients_never_cleared = never_cleared(store, run_id, examined)

        if crashed:
            classify_crash(report, result, tags)
            name_rows(report, result.nonfinite, batch, dataset_rows)
            suggest_for_crash(report)
        else:
            classify_step(report, result, restored, store, run_id, cfg, log)
            if report.category in ("forward", "loss"):
                name_rows(report, result.probe.forward_op, batch, dataset_rows)
            scaled = buffer_scaling(state.model, start_tensors)
            judge_divergence(report, result, state.model, layers, recorded_layer_series(store, run_id, "grad_norm"),
                              recorded_layer_series(store, run_id, "weight_norm"), scaled)
            suggest_arms(report, result, (cfg.train.get("script") or {}).get("path"))
        report.headline = headline(report)
    timings["total_s"] = time.perf_counter() - started
    report.timings = {k: round(v, 3) for k, v in timings.items()}
    return report


def _choose_snapshots(store: Store, run_id: str, target: int):
    """The newest verified snapshot strictly before t (so the replay of s..t-1 proves reproduction), and the
    one saved at t (the state before t, for a bit-for-bit comparison). Bad snapshots are reported."""
    steps = restore_mod.snapshot_steps(store, run_id)
    if not steps:
        raise SnapshotError(
            f"run {run_id} has no snapshots; train with snapshot.every > 0 (e.g. snapshot.every=100) to make it replayable"
        )
    warnings: list[str] = []
    at_target = None
    if target in steps:
        try:
            at_target = restore_mod.load_snapshot(store, run_id, target)
        except SnapshotError as error:
            warnings.append(f"{error}; the replayed state cannot be compared with it")
    snapshot = None
    if any(s < target for s in steps):
        try:
            snapshot = restore_mod.newest_good_snapshot(store, run_id, target - 1, warnings)
        except SnapshotError as error:
            if at_target is None:
                raise SnapshotError(f"{error}; the run cannot be replayed") from None
    if snapshot is None:
        if at_target is None:
            raise SnapshotError(
                f"run {run_id}: no snapshot at or before step {target} verifies ({'; '.join(warnings) or 'none saved'}); "
                "the run cannot be replayed"
            )
        warnings.append(
            f"no verified snapshot before step {target} (periodic snapshots off or corrupt): starting from the snapshot "
            f"saved at step {target} itself, so the replay cannot prove it reproduces the run"
        )
        snapshot = at_target
    return snapshot, at_target, warnings


def _ranks_reduce(cfg) -> str:
    """How the recorded ranks averaged their gradients, as the one-process replay does it."""
    from replaybisect.core import ranks

    return "FSDP's reduce-scatter" if ranks.recorded_sharded(cfg) else "DDP"


def _replay_sentence(report: NanReport, replayed, stored_batch: bool, ranks_reduce: str = "DDP") -> str:
    batch_from = "the stored batch" if stored_batch else "a batch rebuilt from the data source"
    if replayed is None:
        return f"restored the snapshot of step {report.snapshot_step} (no earlier snapshot: reproduction unchecked); step {report.failing_step} uses {batch_from}"
    from replaybisect.core import ranks

    n = replayed.end_step - replayed.start_step
    losses = f"the losses of all {replayed.ranks_compared} ranks" if replayed.ranks_compared > 1 else "losses"
    where = f" on one process (each rank's batch, gradients averaged as {ranks_reduce} does)" if replayed.ranks_compared > 1 else ""
    if (here := ranks.replaying_rank()) is not None:  # one rank of replay nan --nproc (the launcher words the job's sentence)
        rank, world_size = here
        losses, where = f"rank {rank}'s losses", f" over the real collective ({world_size} processes)"
    text = (f"replayed {n} step(s) {replayed.start_step}..{replayed.end_step - 1} from the snapshot of step "
            f"{report.snapshot_step}{where}: {losses} {report.reproduced}")
    if replayed.mismatches:
        text += f" (max relative error {replayed.max_relative_error:.3g})"
    return text + f"; step {report.failing_step} uses {batch_from}"


def _reproduce_step0(cfg, state, rng_at_step, snapshot, batch, logged_loss, recorded_what) -> dict[str, Any]:
    """A failure at step 0 has no earlier snapshot to replay from. Its reproduction: build the state from the
    config (construction is seeded), compare it with the step-0 snapshot bit for bit (tensors and RNG streams),
    run step 0 from both, and compare the two outcomes with each other and with what the run logged.
    exact: same state, bit-identical outcomes, and the logged outcome (the same loss, or non-finite as logged)."""
    from replaybisect.core import loop
    from replaybisect.core.rng import capture_raw, isolated_rng

    with isolated_rng():
        try:
            built = loop.build_state(cfg, device=state.device)
        except Exception as error:  # the config no longer builds (code changed): cannot check
            return {"reproduced": "unchecked", "reproduced_from": "config",
                    "sentence": f"step 0 has no earlier snapshot, and rebuilding the state from the config failed ({type(error).__name__}): reproduction unchecked"}
        try:
            loop.build_data(cfg)  # as `replay train` does before step 0: a dataset may draw from the RNG streams
        except Exception:
            pass  # the data source is gone (the stored batch is used): the RNG comparison then says so
        state_match, differ = _compare_with_snapshot(built, capture_raw(), snapshot)
        from_config, config_signature = plain_run(0, batch)(built)
    from_snapshot, snapshot_signature = on_copy(state, rng_at_step, plain_run(0, batch))
    # Python's `random` stream is drawn between building and step 0 by code outside the step (the tracking
    # client): the step's tensors and torch's stream decide the step, so only those count as the state here
    same_state = not [name for name in differ if name != "rng/python"]
    same_outcome = config_signature[:2] == snapshot_signature[:2]
    logged_nonfinite = logged_loss is not None and not math.isfinite(logged_loss)
    if logged_loss is None or logged_nonfinite:
        as_logged = from_snapshot.nonfinite is not None and (recorded_what is None or from_snapshot.nonfinite == recorded_what or logged_nonfinite)
    else:
        as_logged = bits(from_snapshot.loss) == bits(logged_loss)
    reproduced = "exact" if same_state and same_outcome and as_logged else ("close" if same_outcome and as_logged else "diverged")
    outcome = f"loss {from_snapshot.loss:.6g}" + (f", non-finite {from_snapshot.nonfinite.replace('_', ' ')}" if from_snapshot.nonfinite else "")
    if same_state and differ:
        state_match = "bit-identical tensors and torch RNG stream (Python's `random` stream differs: drawn outside the step)"
    sentence = (
        f"step 0 has no earlier snapshot: rebuilt the state from the config; vs the step-0 snapshot: {state_match}; "
        f"step 0 from the config and from the snapshot: {'bit-identical outcomes' if same_outcome else 'different outcomes'} ({outcome}), "
        f"{'as' if as_logged else 'not as'} the run logged: reproduced {reproduced}"
    )
    return {"reproduced": reproduced, "reproduced_from": "config", "state_vs_snapshot": state_match,
            "same_outcome": same_outcome, "as_logged": as_logged, "sentence": sentence}


def _state_match(state, rng_raw, snapshot, step: int, batch) -> str:
    """Compare the replayed state before `step` with the snapshot the run saved there, bit for bit."""
    from replaybisect.core import rng, user_step

    _, step_rng = user_step.unpack(batch)
    if step_rng is not None:  # the user's own loop: the step runs with the RNG states stored with its batch
        rng_raw = {**rng_raw, **{key: value for key, value in rng.from_tensors(step_rng).items() if key != "cuda"}}  # CUDA: the replay's own, as the snapshot holds it
    text, _ = _compare_with_snapshot(state, rng_raw, snapshot)
    return text


def _compare_with_snapshot(state, rng_raw, snapshot) -> tuple[str, list[str]]:
    """Bit-for-bit: every tensor of the state and the RNG streams against a snapshot."""
    import torch

    from replaybisect.core import rng
    from replaybisect.core.state import GRAD_PREFIX, live_tensors

    live = live_tensors(state, grads=any(name.startswith(GRAD_PREFIX) for name in snapshot.tensors))
    differ = []
    for name in sorted(set(live) | set(snapshot.tensors)):
        a, b = live.get(name), snapshot.tensors.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            differ.append(name)
            continue
        a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b = b.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            differ.append(name)
    saved_rng = snapshot.state.get("rng", {})
    replayed_rng = rng.to_json(rng_raw)
    rng_differ = [k for k in ("python", "numpy", "torch") if saved_rng.get(k) != replayed_rng.get(k)]
    other_rank = _another_ranks_streams()
    if other_rank:
        rng_differ = []
    if not differ and not rng_differ:
        compared = "; the snapshot holds rank 0's RNG streams, not compared" if other_rank else " and the RNG streams"
        return f"bit-identical ({len(live)} tensors{compared})", []
    parts = []
    if differ:
        parts.append(f"{len(differ)} of {len(live)} tensors differ ({', '.join(differ[:5])}{'...' if len(differ) > 5 else ''})")
    if rng_differ:
        parts.append(f"RNG streams differ ({', '.join(rng_differ)})")
    return "differs: " + "; ".join(parts), differ + [f"rng/{k}" for k in rng_differ]


def _another_ranks_streams() -> bool:
    """A rank other than 0 of replay nan --nproc: the snapshots hold rank 0's RNG streams, not this rank's."""
    from replaybisect.core.ranks import replaying_rank

    here = replaying_rank()
    return here is not None and here[0] != 0


def _dataset_indices(snapshot, step: int) -> Optional[list[int]]:
    """Which dataset rows made the batch of `step`: the data order is a pure function of (seed, step), so
    this needs only the dataset's length from the snapshot, not the dataset itself."""
    from replaybisect.core import loop

    position = snapshot.state.get("data") or {}
    try:
        source = loop.BatchSource(range(int(position["dataset_len"])), int(position["batch_size"]), int(position["seed"]))
        return [int(i) for i in source.indices(step)]
    except (KeyError, TypeError, ValueError, ReplayError):
        return None


def _probe_step(state, step, batch, rng_at_step, dataset_rows, log) -> StepResults:
    from replaybisect.core import ranks, rng
    from replaybisect.verbs.nan import probes, step_probe
    from replaybisect.verbs.nan.anomaly import anomaly_pass

    live_before = fingerprint(state)
    rng_before = rng.to_json(rng.capture_raw())
    log(f"step {step}: plain replay")
    plain, plain_signature = on_copy(state, rng_at_step, plain_run(step, batch))
    plain_calls = calls_differ(state, step)
    batch_findings = probes.probe_batch(batch, dataset_rows)
    state_findings = probes.probe_state(state)
    log(f"step {step}: probes (forward hooks, gradient hooks, update)")
    probe = on_copy(state, rng_at_step, lambda copy: step_probe.StepProbe(copy).run(step, batch))
    log(f"step {step}: detect_anomaly")
    alone = ranks.replaying_rank() is None  # (replay nan --nproc: every rank runs each pass to its end)
    anomaly = on_copy(state, rng_at_step, lambda copy: anomaly_pass(copy, step, batch, raise_on_nan=alone))
    _, again = on_copy(state, rng_at_step, plain_run(step, batch))
    isolation = {
        "state_unchanged": fingerprint(state) == live_before,
        "rng_unchanged": rng.to_json(rng.capture_raw()) == rng_before,
        "step_repeatable": again == plain_signature,
    }
    return StepResults(plain, batch_findings, state_findings, probe, anomaly, isolation,
                       isolation_warning(isolation, state, step, plain_calls))
