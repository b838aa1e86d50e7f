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

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from replaybisect.errors import ReplayError, SnapshotError
from replaybisect import restore as restore_mod
from replaybisect.core import reentry
from replaybisect.store import Store
from replaybisect.verbs.nan.divergence import LayerHistory, buffer_scaling, decide, moderate_fault, recorded_layer_series

CATEGORIES = ("divergence", "data", "forward", "loss", "backward", "optimizer", "corrupt-state", "transient", "exception")
FAULTS = ("forward", "loss", "backward", "optimizer")  # verdicts a divergence can stand behind (the op met runaway values)
ARMS = ("lr", "clip", "precision", "warmup", "eps", "skip-batch", "skip-rows", "seed", "zero-grad")  # `replay ablate` arm names
HISTORY_WINDOW = 50  # fit log(grad_norm) over the last <= 50 finite steps before t
HISTORY_MIN_POINTS = 8
from replaybisect.core.thresholds import GRAD_NORM_TREND_EXPLODING_FACTOR as EXPLODING_FACTOR  # noqa: E402
from replaybisect.core.thresholds import GRAD_NORM_TREND_P as EXPLODING_P  # noqa: E402


@dataclass
class HistoryFit:
    """The loss / grad-norm curves before the failing step, and an exponential fit of the grad norm."""

    steps: int  # points in the fit
    first_step: Optional[int]
    last_step: Optional[int]
    growth_per_step: Optional[float]  # exp(slope) - 1 of log(grad_norm) vs step
    growth_over_window: Optional[float]  # fitted grad_norm(last) / grad_norm(first)
    r_squared: Optional[float]
    p_value: Optional[float]
    exploding: bool
    last_grad_norm: Optional[float]
    last_loss: Optional[float]
    summary: str


@dataclass
class NanReport:
    run_id: str
    failing_step: int  # the step examined
    recorded_failing_step: Optional[int]  # the run's first non-finite step
    snapshot_step: int
    reproduced: str  # exact | close | diverged | unchecked (no snapshot before t)
    category: str
    phase: str  # data | state | forward | loss | backward | update | none
    module: Optional[str]
    op: Optional[str]
    source: Optional[str]  # the user's source line that made the op
    evidence: list[str]
    suggestion: str
    arms: list[str]
    ablate_command: Optional[str]
    suggestion_reason: str = ""  # why those arms
    replay_run_id: Optional[str] = None
    origin_step: Optional[int] = None  # corrupt-state / optimizer: the step that made the state non-finite
    origin: Optional[str] = None  # how the state went bad: optimizer | forward-write | initial | unknown
    state_match: Optional[str] = None  # replayed state vs the snapshot saved at t
    warnings: list[str] = field(default_factory=list)
    replay: dict[str, Any] = field(default_factory=dict)
    history: Optional[HistoryFit] = None
    batch: list[Any] = field(default_factory=list)
    state_findings: list[Any] = field(default_factory=list)
    forward: dict[str, Any] = field(default_factory=dict)
    backward: dict[str, Any] = field(default_factory=dict)
    update: Optional[dict[str, Any]] = None
    anomaly: Optional[dict[str, Any]] = None
    plain_step: dict[str, Any] = field(default_factory=dict)
    layer_grad_norms: dict[str, float] = field(default_factory=dict)
    isolation: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    grad_norm_history: list[tuple[int, float]] = field(default_factory=list)
    precision: str = "fp32"
    headline: str = ""  # the answer in one line, the same words in every verb that reports it
    divergence: dict[str, Any] = field(default_factory=dict)  # divergence or fault: the evidence and the reason
    overflow: Optional[dict[str, Any]] = None  # a divergence: where the runaway values first overflowed
    layer_history: dict[str, dict[int, float]] = field(default_factory=dict)  # layer -> step -> grad norm (picture)
    fix: Optional[dict[str, str]] = None  # an op-level fault of a known pattern: the change, and the command proving it
    # a step that raised (the run's tag failure=exception): what it raised on replay, where, and what came before
    exception: Optional[dict[str, Any]] = None
    # a fault keyed on the data: the batch rows its first non-finite op made them in ({"rows", "of", "dataset_rows"})
    rows: Optional[dict[str, Any]] = None
    # every step from 1 to the failing one began with the gradients of the steps before it (the loop never clears them)
    gradients_never_cleared: bool = False

    def to_json(self) -> dict[str, Any]:
        from replaybisect.core.jsonutil import to_jsonable

        data = to_jsonable(self)
        # DESIGN §5 keys first
        ordered = {key: data.pop(key) for key in (
            "run_id", "failing_step", "snapshot_step", "reproduced", "headline", "category", "phase", "module", "op",
            "evidence", "suggestion", "replay_run_id",
        )}
        ordered.update(data)
        ordered["loss_history"] = ordered["loss_history"][-HISTORY_WINDOW:]
        ordered["grad_norm_history"] = ordered["grad_norm_history"][-HISTORY_WINDOW:]
        return ordered

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "NanReport":
        """The report as `to_json` wrote it: how a diagnosis made in a re-entered script comes back (the terminal
        report, the plot and the child run are made from it here). Numbers JSON keeps as text are numbers again."""
        from dataclasses import fields

        values = {name: data[name] for name in (f.name for f in fields(cls)) if name in data}
        if values.get("history") is not None:
            values["history"] = HistoryFit(**values["history"])
        for key in ("loss_history", "grad_norm_history"):
            values[key] = [(int(step), _number(value)) for step, value in values.get(key, [])]
        values["layer_history"] = {name: {int(step): _number(value) for step, value in series.items()}
                                   for name, series in values.get("layer_history", {}).items()}
        values["layer_grad_norms"] = {name: _number(value) for name, value in values.get("layer_grad_norms", {}).items()}
        return cls(**values)


def _number(value: Any) -> Any:
    """A float JSON could not hold ("nan", "inf", "-inf" from jsonutil.to_jsonable) as the float again."""
    return float(value) if value in ("nan", "inf", "-inf") else value


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
    recorded = restore_mod.failing_step(store, run_id)
    losses = restore_mod.logged_losses(store, run_id)
    grad_norms = dict(store.metric_history(run_id, "grad_norm"))
    target = _target_step(run_id, step, recorded, tags, losses, grad_norms)  # (rank 0's: the same on every rank)
    cfg = restore_mod.run_config(store, run_id, trust)
    here = ranks.replaying_rank()  # replay nan --nproc: each rank compares its own logged losses
    own_losses = restore_mod.logged_losses(store, run_id, here[0]) if here is not None else losses
    if cfg.train.get("script") is not None and not reentry.replaying():  # a script's run: diagnosed inside the script
        from replaybisect.script_replay import run_in_script

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
                result = _probe_crash(state, examined, batch, rng_at_step, dataset_rows, log)
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
        report.gradients_never_cleared = _never_cleared(store, run_id, examined)

        if crashed:
            _classify_crash(report, result, tags)
            _name_rows(report, result.nonfinite, batch, dataset_rows)
            _suggest_for_crash(report)
        else:
            _classify(report, result, restored, store, run_id, cfg, log)
            if report.category in ("forward", "loss"):
                _name_rows(report, result.probe.forward_op, batch, dataset_rows)
            scaled = buffer_scaling(state.model, start_tensors)
            _judge_divergence(report, result, state.model, layers, recorded_layer_series(store, run_id, "grad_norm"),
                              recorded_layer_series(store, run_id, "weight_norm"), scaled)
            _suggest(report, result, (cfg.train.get("script") or {}).get("path"))
        report.headline = headline(report)
    timings["total_s"] = time.perf_counter() - started
    report.timings = {k: round(v, 3) for k, v in timings.items()}
    return report


def _target_step(run_id: str, step: int | None, recorded: int | None, tags: dict, losses: dict, grad_norms: dict) -> int:
    if step is None:
        if recorded is None:
            if tags.get("status") == "nonfinite":
                raise SnapshotError(
                    f"run {run_id} stopped on a non-finite value but recorded no metrics or snapshots (recorder off); "
                    "retrain with snapshot.enabled=true and snapshot.every > 0 to make it replayable"
                )
            raise ReplayError(
                f"run {run_id} never went non-finite (every logged loss and grad_norm is finite); "
                f"to read its curves run `replay diagnose --run-id {run_id}`"
            )
        return recorded
    if step < 0:
        raise ReplayError(f"--step {step} is negative; pass a step of run {run_id} (its first non-finite step is {recorded})")
    logged = [v for v in (losses.get(step), grad_norms.get(step)) if v is not None]
    last = max(list(losses) + list(grad_norms) + ([recorded] if recorded is not None else []), default=-1)
    if step > last:
        raise ReplayError(f"--step {step} is past the run's last step ({last}); pass a step the run reached")
    if step != recorded and logged and all(math.isfinite(v) for v in logged):
        where = f"its first non-finite step is {recorded}" if recorded is not None else "the run never went non-finite"
        raise ReplayError(f"step {step} of run {run_id} was finite (loss {losses.get(step)}); nothing to diagnose there; {where}")
    return step


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
        as_logged = _bits(from_snapshot.loss) == _bits(logged_loss)
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


def fingerprint(state) -> str:
    """sha256 over every tensor a step depends on (bytes, so NaN payloads count too)."""
    import torch

    from replaybisect.core.state import live_tensors

    digest = hashlib.sha256()
    for name, tensor in sorted(live_tensors(state).items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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


# ---- probing the failing step ------------------------------------------------------------------------------
@dataclass
class _StepResults:
    plain: Any  # StepOutcome of the plain step
    batch: list
    state: list
    probe: Any  # StepProbeResult
    anomaly: Any  # AnomalyFinding
    isolation: dict


def on_copy(state, rng_at_step, function):
    """Run `function(copy)` on a deep copy of the state with the step's RNG streams, leaving both untouched."""
    from replaybisect.core import loop
    from replaybisect.core.rng import isolated_rng, restore_raw

    with isolated_rng(), loop.state_copy(state) as copy:
        restore_raw(rng_at_step)
        return function(copy)


def plain_run(step, batch):
    """A function of a state copy: the plain step on it -> (outcome, bit signature of loss, grad norm, state, RNG)."""
    from replaybisect.core import loop
    from replaybisect.core.rng import capture_raw, to_json

    def run(copy):
        outcome = loop.run_step(copy, step, batch, halt_on_nonfinite=True)
        return outcome, (_bits(outcome.loss), _bits(outcome.grad_norm), fingerprint(copy), str(to_json(capture_raw())))

    return run


def _bits(value) -> Optional[str]:
    import struct

    return None if value is None else struct.pack("<d", value).hex()


def _probe_step(state, step, batch, rng_at_step, dataset_rows, log) -> _StepResults:
    from replaybisect.core import ranks, rng
    from replaybisect.verbs.nan import probes

    live_before = fingerprint(state)
    rng_before = rng.to_json(rng.capture_raw())
    log(f"step {step}: plain replay")
    plain, plain_signature = on_copy(state, rng_at_step, plain_run(step, batch))
    batch_findings = probes.probe_batch(batch, dataset_rows)
    state_findings = probes.probe_state(state)
    log(f"step {step}: probes (forward hooks, gradient hooks, update)")
    probe = on_copy(state, rng_at_step, lambda copy: probes.StepProbe(copy).run(step, batch))
    log(f"step {step}: detect_anomaly")
    alone = ranks.replaying_rank() is None  # (replay nan --nproc: every rank runs each pass to its end)
    anomaly = on_copy(state, rng_at_step, lambda copy: probes.anomaly_pass(copy, step, batch, raise_on_nan=alone))
    _, again = on_copy(state, rng_at_step, plain_run(step, batch))
    isolation = {
        "state_unchanged": fingerprint(state) == live_before,
        "rng_unchanged": rng.to_json(rng.capture_raw()) == rng_before,
        "step_repeatable": again == plain_signature,
    }
    return _StepResults(plain, batch_findings, state_findings, probe, anomaly, isolation)


# ---- a step that raised -------------------------------------------------------------------------------------
@dataclass
class _CrashResults:
    error: Optional[str]  # "Type: message" the plain step raised on replay (None: it did not raise)
    frame: Optional[str]  # the user's innermost frame it raised in
    probe: Any  # the StepProbe, as far as the step got
    raised: Any  # probes.RaisedOp: the torch call that raised, when one did
    nonfinite: Any  # probes.OpFinding: the first op that made a non-finite value before the error, if any
    batch: list  # "name: dtype[shape] range" of each tensor of the batch
    batch_findings: list  # non-finite values in the batch
    isolation: dict


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


def _probe_crash(state, step, batch, rng_at_step, dataset_rows, log) -> _CrashResults:
    """The recorded step that raised, replayed: plain (does it raise again, the same?), then under the probes (which
    op raised, in which module; did a non-finite value come first, and from where), then plain again (repeatable)."""
    from replaybisect.core import rng, user_step
    from replaybisect.verbs.nan import probes

    from replaybisect.core.inline_step import RemoteStep
    from replaybisect.frames import error_message, raised_at

    live_before = fingerprint(state)
    rng_before = rng.to_json(rng.capture_raw())
    data = user_step.data_of(user_step.unpack(batch)[0]) if state.user_loop else batch
    shapes = [f"{name}: {probes.value_brief(tensor)}" for name, tensor in probes.tensors_in(data, "batch")][:8]

    def probed(copy):
        probe = probes.StepProbe(copy)
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
                         shapes, probes.probe_batch(data, dataset_rows), isolation)


def _classify_crash(report: NanReport, results: _CrashResults, tags: dict) -> None:
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
    if not all(results.isolation.values()):
        report.warnings.append(f"probe isolation check failed: {results.isolation} (please report this)")
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
        where = f" in the forward of {_shown_module(report.module)}" if raised.module is not None else ""
        report.evidence.append(f"raised by {raised.op}{where}; its inputs: " + "; ".join(raised.inputs))
    report.evidence.append("the batch: " + "; ".join(results.batch))
    if first is not None:
        where = f" in {_shown_module(first.module)}" if first.module is not None else ""
        report.evidence.append(f"before it, {first.op}{where} made a non-finite value from finite inputs"
                               + (f" at {first.source}" if first.source else "") + f" ({first.output.brief()})")
        report.module, report.op, report.phase = first.module, first.op, "forward"
        report.source = first.source or report.source
    for finding in results.batch_findings:
        report.evidence.append(f"the batch's {finding.field} holds non-finite values in rows {finding.rows[:8]}")
    report.arms, report.ablate_command = [], None
    if first is not None:
        from replaybisect.verbs.nan import fixes

        report.suggestion = (f"fix {first.op} at {_line_of(report.source)}: {fixes.fix_for(first.op) or 'keep its values finite'} "
                             f"(its non-finite value made step {t} raise {results.error})")
    else:
        report.suggestion = (f"fix the step at {_line_of(report.source) if report.source else 'the line that raised'}: it "
                             f"raised {results.error} on the batch of step {t} (the snapshot of step {report.snapshot_step} "
                             "and the stored batches replay it)")


def _name_rows(report: NanReport, fault, batch, dataset_rows: Optional[list[int]]) -> None:
    """A fault keyed on the data: the first op to make a non-finite value made it in a few rows of its output whose
    dim 0 is the batch's, and the other rows stayed finite through it. Those rows of the batch are named. Not an
    overflow (an exp or a product: the largest rows overflow first), nor a run whose gradients grew exponentially."""
    from replaybisect.core import user_step
    from replaybisect.verbs.nan import fixes
    from replaybisect.verbs.nan.probes import MAX_ROWS

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
    report.evidence.append(f"{fault.op} made its non-finite values in {_rows_text(rows)} of the batch's {size}{also} only: "
                           "the fault is keyed on the data of those rows")


def _rows_text(rows: list[int]) -> str:
    return f"row {rows[0]}" if len(rows) == 1 else f"rows {rows}"


def _skip_rows_arm(report: NanReport) -> str:
    return "skip-rows=" + "+".join(str(row) for row in report.rows["rows"])


def _suggest_for_crash(report: NanReport) -> None:
    """A step that raised after a fault keyed on rows of its batch: the rows to look at, and the arm proving it."""
    if report.rows is None or report.category != "exception":
        return
    choice = _ArmChoice()
    _arms_for_rows(report, choice)
    fix = report.suggestion
    _write_suggestion(report, choice)
    report.suggestion += "\n" + fix


def _shown_module(name: Optional[str]) -> str:
    return "the model" if name == "" else str(name)


# ---- the verdict --------------------------------------------------------------------------------------------
def _classify(report: NanReport, results: _StepResults, restored, store, run_id, cfg, log) -> None:
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


def _record_probe_facts(report: NanReport, results: _StepResults) -> None:
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
    if not all(results.isolation.values()):
        report.warnings.append(f"probe isolation check failed: {results.isolation} (please report this)")


def _is_transient(report: NanReport, results: _StepResults, restored, run_id: str) -> bool:
    """Finite on replay: not a bug in the code or the data."""
    plain, t = results.plain, report.failing_step
    if plain.nonfinite is not None:
        return False
    report.category, report.phase = "transient", "none"
    recorded_what = "value"
    if report.recorded_failing_step == t:
        recorded_what = (restored.store.tags(run_id).get("nonfinite_what") or "value").replace("_", " ")
    report.evidence.append(
        f"step {t} was non-finite in the recorded run but is finite on replay from the same state and batch "
        f"(loss {plain.loss:.6g}, grad norm {_fmt(plain.grad_norm)})"
    )
    report.evidence.append(
        "a transient fault: the code, the data and the state do not produce it. Likely a hardware fault (a bit flip, "
        "bad accelerator memory), a nondeterministic kernel, or something the run read that is not part of its "
        f"recorded state (an environment variable, a file, a module attribute outside state_dict); the recorded non-finite "
        f"{recorded_what} happened only in the original process"
    )
    return True


def _is_data(report: NanReport, results: _StepResults, model) -> bool:
    """The batch holds non-finite values."""
    from replaybisect.verbs.nan.probes import display_module

    if not results.batch:
        return False
    report.category, report.phase = "data", "data"
    for finding in results.batch:
        rows = finding.rows[:10]
        where = f"rows {rows}" + (f" (dataset rows {finding.dataset_rows[:10]})" if finding.dataset_rows else "")
        report.evidence.append(f"batch field {finding.field} {finding.shape} holds {finding.nan} NaN / {finding.inf} Inf in {where}")
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


def _is_forward(report: NanReport, results: _StepResults, state) -> bool:
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


def _is_loss(report: NanReport, results: _StepResults, state) -> bool:
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


def _is_backward(report: NanReport, results: _StepResults, state) -> bool:
    """Finite forward and loss, a gradient turns non-finite."""
    from replaybisect.verbs.nan.probes import display_module

    probe, anomaly = results.probe, results.anomaly
    if probe.grads_finite is not False:
        return False
    report.category, report.phase = "backward", "backward"
    report.module = display_module(probe.backward_module, state.model) if probe.backward_module is not None else None
    report.evidence.append(f"forward and loss are finite (loss {probe.loss:.6g}); the gradient norm is {_fmt(probe.grad_norm)}")
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


def _is_update(report: NanReport, results: _StepResults, state) -> bool:
    """Finite gradients, and this step's optimizer update made the weights or moments non-finite."""
    update = results.probe.update
    if update is None or (update.params_finite_after and update.state_finite_after):
        return False
    _optimizer_verdict(report, update, report.failing_step, results.probe.grad_norm)
    return True


def _not_isolated(report: NanReport, results: _StepResults) -> None:
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
        f"step {step}: gradients finite (norm {_fmt(grad_norm)}), parameters finite before the update; after optimizer.step(): "
        + ", ".join(f"{f.kind} {f.name} ({f.nan} NaN, {f.inf} Inf of {f.numel})" for f in update.bad[:4])
    )
    if update.explanation:
        report.evidence.append(update.explanation)
    report.evidence.append(f"hyperparameters: {update.hyperparameters}")


def _classify_corrupt(report: NanReport, results: _StepResults, restored, store, run_id, cfg, log) -> None:
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
    from replaybisect.verbs.nan import probes

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
    result = on_copy(again.state, rng_at_k, lambda copy: probes.StepProbe(copy).run(k, batch_k))
    if result.corrupted_in_forward:
        return {"kind": "forward-write", "step": k, "writer": result.corrupted_in_forward[0]}
    if result.update is not None and not (result.update.params_finite_after and result.update.state_finite_after):
        return {"kind": "optimizer", "step": k, "update": result.update, "grad_norm": result.grad_norm}
    return {"kind": "unknown", "step": k, "why": f"step {k} left the state non-finite, but its instrumented replay did not show where"}


# ---- divergence or fault ---------------------------------------------------------------------------------------
def _judge_divergence(report: NanReport, results: _StepResults, model, layers: LayerHistory, recorded_grads: dict,
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


def headline(report: NanReport) -> str:
    """The answer in one line: what went wrong, where; the same words in nan, diagnose, watch and the JSON."""
    t = report.failing_step
    category = report.category
    if category == "divergence":
        growth = (report.divergence or {}).get("growth") or {}
        climb = (f"{growth['metric']} x{growth['factor']:.2g} over {growth['last_step'] - growth['onset_step']} steps"
                 if growth else "the curves climbed by orders of magnitude")
        kind = (report.divergence or {}).get("precursor_type")
        began = f"; the climb began in {report.module}" + (f" ({kind})" if kind else "") if report.module else ""
        return f"divergence at step {t}: {climb}{began} (learning rate, clipping or init, not an op)"
    if category == "transient":
        if report.exception is not None:
            return f"transient at step {t}: raised {report.exception['recorded']} in the run, runs through on replay"
        return f"transient at step {t}: non-finite in the run, finite on replay from the same state and batch"
    if category == "exception":
        crash = report.exception or {}
        line = f" at {_line_of(crash.get('frame'))}" if crash.get("frame") else ""
        by = f" (raised by {crash['op']}" + (f" in {_shown_module(crash.get('module'))}" if crash.get("module") is not None else "") + ")" \
            if crash.get("op") else ""
        first = crash.get("nonfinite_before")
        before = ""
        if first:
            before = f", after {first['op']}" + (f" in {_shown_module(first['module'])}" if first.get("module") is not None else "") + " made a non-finite value"
        return f"exception at step {t}: {crash.get('replayed')}{line}{by}{before}"
    if category == "data":
        fields = ", ".join(sorted({finding.field for finding in report.batch})) or "a field"
        return f"data at step {t}: the batch holds non-finite values ({fields})"
    if category == "corrupt-state":
        origin = f", made so at step {report.origin_step}" if report.origin_step is not None else ""
        return f"corrupt-state at step {t}: the state before the step was already non-finite{origin}" + (f" ({report.module})" if report.module else "")
    what = f"{report.op}" if report.op else "a non-finite value"
    where = f" in {report.module}" if report.module else ""
    line = f" at {_line_of(report.source)}" if report.source else ""
    if category == "optimizer":
        owner = f"{report.module}'s" if report.module else "the"
        return f"optimizer at step {report.origin_step if report.origin_step is not None else t}: {what} made {owner} weights or moments non-finite from finite gradients"
    return f"{category} at step {t}: {what}{where} made a non-finite value from finite inputs{line}"


# ---- history -----------------------------------------------------------------------------------------------------
def history_fit(losses: list[tuple[int, float]], grad_norms: list[tuple[int, float]]) -> HistoryFit:
    """Fit log(grad_norm) vs step over the last <= 50 finite steps: exponential growth shows as a straight line."""
    points = [(s, g) for s, g in grad_norms if math.isfinite(g) and g > 0][-HISTORY_WINDOW:]
    last_loss = next((v for _, v in reversed(losses) if math.isfinite(v)), None)
    last_grad = points[-1][1] if points else None
    if len(points) < HISTORY_MIN_POINTS:
        return HistoryFit(len(points), points[0][0] if points else None, points[-1][0] if points else None, None, None, None, None,
                          False, last_grad, last_loss, f"too few grad-norm points before the failure ({len(points)}) to fit a trend")
    steps = [s for s, _ in points]
    logs = [math.log(g) for _, g in points]
    if max(logs) - min(logs) < 1e-12:
        fit_slope, r_value, p_value = 0.0, 0.0, 1.0
    else:
        fit_slope, r_value, p_value = linear_fit(steps, logs)
    growth = math.exp(fit_slope) - 1
    over = math.exp(fit_slope * (steps[-1] - steps[0]))
    exploding = fit_slope > 0 and p_value <= EXPLODING_P and over >= EXPLODING_FACTOR
    if exploding:
        summary = (f"exploding gradients: the grad norm grew exponentially, x{over:.3g} over steps {steps[0]}..{steps[-1]} "
                   f"({growth * 100:+.3g}% per step, r^2={r_value ** 2:.2f})")
    elif fit_slope > 0 and p_value <= EXPLODING_P:
        summary = f"grad norm rising {growth * 100:+.3g}% per step (x{over:.3g} over {len(points)} steps), below the x{EXPLODING_FACTOR:g} of exploding gradients"
    else:
        summary = f"no exponential growth of the grad norm before the failure ({growth * 100:+.3g}% per step, p={p_value:.2g}; last {_fmt(last_grad)})"
    return HistoryFit(len(points), steps[0], steps[-1], growth, over, r_value ** 2, p_value, exploding, last_grad, last_loss, summary)


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(slope, r, two-sided p of a zero slope) of a least-squares line through points with distinct xs and ys not all
    equal (history_fit's), as scipy.stats.linregress computes them, with the Student t from scipy.special:
    scipy.stats takes half a second to import, a tenth of a `replay nan`."""
    import numpy as np
    from scipy.special import stdtr

    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    ssxm, ssxym, _, ssym = (float(value) for value in np.cov(x, y, bias=True).flat)
    r = min(max(ssxym / math.sqrt(ssxm * ssym), -1.0), 1.0)
    slope = ssxym / ssxm
    df = len(x) - 2
    t = r * math.sqrt(df / ((1.0 - r + 1e-20) * (1.0 + r + 1e-20)))
    return slope, r, float(2 * stdtr(df, -abs(t)))


# ---- what to try next --------------------------------------------------------------------------------------------
def _suggest(report: NanReport, results: _StepResults, script: Optional[str] = None) -> None:
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


def _never_cleared(store, run_id: str, step: int) -> bool:
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
    where = f" at {_line_of(report.source)}" if report.source else ""
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
    choice.add(f"look at {_rows_text(rows)} of step {report.failing_step}'s batch (e.g. a blank image, an empty sequence, "
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
    return f"`{report.op}`" + (f" at {_line_of(report.source)}" if report.source else "")


def _line_of(source: Optional[str]) -> str:
    """`file.py:24` of a source line `path/file.py:24 in function: code`."""
    location = (source or "").split(" in ", 1)[0]
    return location.rsplit("/", 1)[-1]


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


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if math.isfinite(value) else str(value)
