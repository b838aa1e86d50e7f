"""Restore a recorded run at a step and replay it, comparing every loss with the logged one.

`replay nan`, `replay ablate` and `replay check --run-id` stand on this module.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from replaybisect.core import faults
from replaybisect.core import config as config_mod
from replaybisect.core import provenance
from replaybisect.errors import ConfigError, ReplayError, SnapshotError
from replaybisect.core import snapshot as fmt
from replaybisect.store import Store
from replaybisect.core.trust import Trust, admit

from replaybisect.core.thresholds import REPLAY_RELATIVE_TOLERANCE as CLOSE_RELATIVE  # noqa: E402  (Megatron-Core)


# ---- what a run recorded -------------------------------------------------------------------------
def run_config(store: Store, run_id: str, trust: Optional[Trust] = None):
    """The resolved config the run logged, its signature verified (core/provenance.py), re-validated by the schema
    and admitted by the trust boundary: a stored config is untrusted input, checked before any of its modules is
    imported (see trust.py).
    `trust` is the user's decision (--code-dir, --trust); default: the working folder and the environment's."""
    trust = trust or Trust.from_user()
    tags = store.tags(run_id)  # RunNotFound first
    try:
        text = store.read_artifact_text(run_id, "config.yaml")
    except Exception as error:
        cause = error.__cause__ or error  # (MLflow wraps what went wrong)
        if isinstance(cause, UnicodeDecodeError) or (isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError)):
            why = "is not text" if isinstance(cause, UnicodeDecodeError) else f"cannot be read ({cause.strerror or cause})"
            raise ReplayError(f"the stored config.yaml of run {run_id} {why}: it is not a config replaybisect wrote "
                              "(changed after recording?); re-record the run") from None
        raise ReplayError(f"run {run_id} has no config.yaml artifact: it was not recorded by `replay train`") from None
    provenance.verify(run_id, text, tags, trust.unsigned)  # what picks code is the recording user's, or nothing runs
    code_dir = tags.get("code_dir")
    cfg = config_mod.from_yaml(text, source=f"the stored config.yaml of run {run_id}")
    artifacts = store.local_artifact_dir(run_id)  # <root>/<experiment>/<run>/artifacts: never a code folder
    artifact_root = artifacts.parents[2] if artifacts else None
    if cfg.train.get("script") is not None:  # a script's run: its file and command line, before anything is imported
        from replaybisect.replay.script import admitted_script

        admitted_script(cfg, trust, run_id, artifact_root, tags)
    admit(cfg, trust, code_dir, source=f"run {run_id}", artifact_root=artifact_root)
    return cfg


def logged_losses(store: Store, run_id: str, rank: int = 0) -> dict[int, float]:
    """The losses the run logged: rank 0's of a distributed run (`loss`), or another rank's own (`loss/rankN`)."""
    return dict(store.metric_history(run_id, "loss" if rank == 0 else f"loss/rank{rank}"))


def snapshot_steps(store: Store, run_id: str) -> list[int]:
    """Steps of every snapshot folder the run has (complete or not: verification decides)."""
    steps = []
    for info in store.list_artifacts(run_id, fmt.SNAPSHOTS):
        step = fmt.step_of(Path(info.path).name)
        if info.is_dir and step is not None:
            steps.append(step)
    return sorted(steps)


def snapshot_folder(store: Store, run_id: str, step: int) -> Path:
    """A local folder holding the snapshot: the artifact folder itself when local, else a download."""
    name = fmt.folder_name(step)
    local = store.local_artifact_dir(run_id)
    if local is not None:
        return local / fmt.SNAPSHOTS / name
    cache = Path(os.environ.get("REPLAYBISECT_CACHE", Path.home() / ".cache" / "replaybisect")) / "snapshots" / run_id
    cache.mkdir(parents=True, exist_ok=True)
    return store.download_artifacts(run_id, f"{fmt.SNAPSHOTS}/{name}", cache)


def load_snapshot(store: Store, run_id: str, step: int) -> fmt.Snapshot:
    return fmt.load(snapshot_folder(store, run_id, step))


def good_snapshots(store: Store, run_id: str, at_or_before: int | None, warnings: list[str]) -> Iterator[fmt.Snapshot]:
    """The snapshots <= step that verify, newest first; each bad one is skipped and said in `warnings`: why, and
    the snapshot used instead (once the next one verifies)."""
    steps = [s for s in snapshot_steps(store, run_id) if at_or_before is None or s <= at_or_before]
    skipped: list[str] = []
    for step in reversed(steps):
        try:
            snapshot = load_snapshot(store, run_id, step)
        except SnapshotError as error:
            skipped.append(str(error))
            continue
        warnings += [f"{why}; using the earlier snapshot {snapshot.folder.name} instead" for why in skipped]
        skipped = []
        yield snapshot
    warnings += [f"{why}; no earlier snapshot verifies" for why in skipped]


def add_warning(warnings: list[str], warning: str) -> None:
    """Add `warning` unless it is said already: one line per damaged snapshot (a warning's first clause, before
    `; `, says which and why; the rest, what was done about it)."""
    if warning.partition("; ")[0] not in {said.partition("; ")[0] for said in warnings}:
        warnings.append(warning)


def newest_good_snapshot(store: Store, run_id: str, at_or_before: int | None, warnings: list[str]) -> fmt.Snapshot:
    """The newest snapshot <= step that verifies; a bad one is reported in `warnings` and the previous used."""
    for snapshot in good_snapshots(store, run_id, at_or_before, warnings):
        return snapshot
    raise _none_verifies(store, run_id, at_or_before, warnings)


def _none_verifies(store: Store, run_id: str, at_or_before: int | None, warnings: list[str]) -> SnapshotError:
    where = f" at or before step {at_or_before}" if at_or_before is not None else ""
    if not warnings:
        return SnapshotError(
            f"run {run_id} has no snapshots{where}; train with snapshot.every > 0 (e.g. snapshot.every=100) to make it replayable"
        )
    return SnapshotError(f"run {run_id}: no snapshot{where} verifies ({'; '.join(warnings)})")


# ---- restore -------------------------------------------------------------------------------------------
@dataclass
class Restored:
    """A run rebuilt at a snapshot: the live training state plus where each step's batch comes from."""

    store: Store
    run_id: str
    cfg: Any
    state: Any  # loop.TrainState, holding the state before step `snapshot.step`
    snapshot: fmt.Snapshot
    warnings: list[str] = field(default_factory=list)
    _stored_batches: dict[int, Any] = field(default_factory=dict, repr=False)
    _loaded_snapshots: set[int] = field(default_factory=set, repr=False)
    _batch_source: Any = field(default=None, repr=False)
    _listed_steps: Optional[list[int]] = field(default=None, repr=False)
    _batch_origin: dict[int, str] = field(default_factory=dict, repr=False)  # step -> the snapshot folder storing its batch
    last_stored_step: Optional[int] = field(default=None, repr=False)  # the step of the last batch served, when a stored one

    def take_batches(self, snapshot: fmt.Snapshot) -> None:
        """Serve the batches `snapshot` stored (each checked when first served)."""
        self._stored_batches.update(snapshot.batches)
        self._batch_origin.update(dict.fromkeys(snapshot.batches, snapshot.folder.name))
        self._loaded_snapshots.add(snapshot.step)

    @property
    def step(self) -> int:
        return self.snapshot.step

    def batch(self, step: int):
        """The batch of `step`: the stored one when a snapshot holds it, else rebuilt from the data source."""
        if step not in self._stored_batches:
            self._load_batches_covering(step)
        if step in self._stored_batches:
            batch = self._stored_batches[step]
            self._check_stored_batch(step, batch)
            self.last_stored_step = step
            return batch
        self.last_stored_step = None
        return self._data_source().batch(step)

    def recorded_step(self, step: int) -> Optional[int]:
        """The recorded step whose stored batch `batch(step)` served: `step` itself, or for an own loop replayed past
        its recorded batches the one it reused; None for a batch the run's data source built."""
        if step in self._stored_batches:
            return step
        if self.cfg.train.loop == "user":  # (no data source to build: the recorded batches come again)
            return self._data_source().recorded_step(step)
        return None

    def _check_stored_batch(self, step: int, batch) -> None:
        """A snapshot's batch is untrusted input like the rest of it (its manifest can be rewritten to match): a
        built-in loop's batch is the collated batch of train.batch_size samples, every tensor in it that many rows."""
        if self.cfg.train.loop != "builtin":
            return
        import torch

        size = self.cfg.train.batch_size
        for tensor in _tensors_in(batch):
            rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else None
            if rows != size:
                held = f"a tensor of {rows} rows" if rows is not None else f"a {type(tensor).__name__} that is not {size} rows"
                raise SnapshotError(
                    f"run {self.run_id}: the batch of step {step} stored in snapshot {self._batch_origin.get(step, '?')} holds "
                    f"{held}, but every batch of the run has train.batch_size={size} rows: its batches were changed after "
                    "recording; re-record the run or examine an earlier step (--step)")

    def has_stored_batch(self, step: int) -> bool:
        self._load_batches_covering(step)
        return step in self._stored_batches

    def _snapshot_steps(self) -> list[int]:
        if self._listed_steps is None:  # list the run's artifacts once, not once per step
            self._listed_steps = snapshot_steps(self.store, self.run_id)
        return self._listed_steps

    def _load_batches_covering(self, step: int) -> None:
        for snap_step in reversed(self._snapshot_steps()):
            if snap_step > step:
                continue
            if snap_step in self._loaded_snapshots:
                return
            self._loaded_snapshots.add(snap_step)
            try:
                self.take_batches(load_snapshot(self.store, self.run_id, snap_step))
            except SnapshotError as error:  # an unverifiable snapshot: try an older one, else the data source
                add_warning(self.warnings, f"{error}; its stored batches are not used: the steps they cover take their "
                                           "batches from an earlier snapshot or the run's data source")
                continue
            if step in self._stored_batches:
                return

    def _data_source(self):
        from replaybisect.core import loop
        from replaybisect.core.rng import isolated_rng

        if self._batch_source is None and self.cfg.train.loop == "user":
            self._batch_source = _RecordedBatchesAgain(self)
        if self._batch_source is None:
            with isolated_rng():  # building a dataset must not shift the restored RNG streams
                try:
                    self._batch_source, _ = loop.build_data(self.cfg)
                except (ConfigError, OSError) as error:
                    raise ReplayError(f"the run's stored batches end before this step and its data source cannot be built: {error}") from None
        return self._batch_source


class _RecordedBatchesAgain:
    """Past the last recorded batch of a run from the user's own loop (an ablation's horizon beyond the failure),
    there is no data pipeline to ask: the recorded batches of the replay's snapshot interval come again, in
    order, and a warning says so."""

    def __init__(self, restored: "Restored"):
        self.restored = restored
        self.steps = sorted(step for step in restored._stored_batches if step >= restored.step)
        if not self.steps:
            raise ReplayError(f"run {restored.run_id} stored no batches from step {restored.step} on; it cannot be replayed")
        self.warned = False

    def batch(self, step: int):
        if not self.warned:
            self.warned = True
            self.restored.warnings.append(
                f"the run comes from your own loop and recorded batches up to step {self.steps[-1]}: steps from {step} on "
                f"reuse the recorded batches of steps {self.steps[0]}..{self.steps[-1]} in order")
        return self.restored._stored_batches[self.recorded_step(step)]

    def recorded_step(self, step: int) -> int:
        return self.steps[(step - self.steps[0]) % len(self.steps)]


def restore(
    store: Store,
    run_id: str,
    step: int | None = None,
    *,
    cfg=None,
    device=None,
    snapshot: fmt.Snapshot | None = None,
) -> Restored:
    """Rebuild model, optimizer, scheduler, scaler, RNG streams and data position from the newest good
    snapshot at or before `step` (the latest one when None). `cfg` replaces the run's config (ablations):
    objects are built from it, state comes from the snapshot."""
    faults.arm()  # (a test's fault injector: a replay flips what its environment asks, as recording did)
    from replaybisect.core import loop
    from replaybisect.core.state import apply

    warnings: list[str] = []
    cfg = cfg if cfg is not None else run_config(store, run_id)
    # A snapshot that verifies can still fail to apply (a tensor of the wrong shape); then the next older one is
    # applied to a freshly built state, so the replay from it is as exact as if it had been chosen first.
    if snapshot is not None:
        candidates = itertools.chain([snapshot], good_snapshots(store, run_id, snapshot.step - 1, warnings))
    else:
        candidates = good_snapshots(store, run_id, step, warnings)
    unapplied: list[str] = []
    for candidate in candidates:
        state = loop.build_state(cfg, device)
        try:
            apply(state, candidate.tensors, candidate.state)
        except SnapshotError as error:
            unapplied.append(f"snapshot {candidate.folder.name}: {error}")
            continue
        warnings += [f"{why}; using the earlier snapshot {candidate.folder.name} instead" for why in unapplied]
        restored = Restored(store=store, run_id=run_id, cfg=cfg, state=state, snapshot=candidate, warnings=warnings)
        restored.take_batches(candidate)
        return restored
    warnings += [f"{why}; no earlier snapshot applies" for why in unapplied]
    raise _none_verifies(store, run_id, step if snapshot is None else snapshot.step, warnings)


def _tensors_in(batch) -> Iterator[Any]:
    """The leaves of a stored batch's structure (tensors, and the scalars a tree may hold)."""
    if isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors_in(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors_in(value)
    elif batch is not None and not isinstance(batch, str):
        yield batch


@contextlib.contextmanager
def stored_batch_errors(restored: "Restored"):
    """A replayed step (`loop.run_step`) that raises on a batch the run stored, at a step the run trained through,
    says so in one line (a SnapshotError naming the batch and what it raised): a snapshot's batches rewritten with
    labels of the wrong type or range, or tensors of the wrong width, make the model or the loss raise, not a crash."""
    try:
        yield
    except (ReplayError, MemoryError):
        raise
    except Exception as error:
        step = restored.last_stored_step
        frames = traceback.extract_tb(error.__traceback__)
        in_step = any(frame.name == "run_step" and frame.filename.endswith(os.path.join("core", "loop.py")) for frame in frames)
        if step is None or not in_step:
            raise
        where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
        message = " ".join(str(error).split())[:200] or "(no message)"
        raise SnapshotError(
            f"run {restored.run_id}: replaying step {step} on the batch stored in snapshot "
            f"{restored._batch_origin.get(step, '?')} raised {type(error).__name__}: {message}{where}; the run trained "
            "on that step, so the stored batch does not fit the model and loss (its batches were changed after "
            "recording, or the code changed since); re-record the run or examine an earlier step (--step)") from error


# ---- replay ----------------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    start_step: int
    end_step: int  # exclusive: the next step to run
    losses: dict[int, float]
    logged: dict[int, float]
    mismatches: list[tuple[int, float, float]]  # (step, logged, replayed)
    reproduced: str  # exact | close | diverged | unchecked
    max_relative_error: float
    stopped: Any = None  # the StepOutcome that stopped the replay (non-finite), else None
    grad_norms: dict[int, float] = field(default_factory=dict)
    ranks_compared: int = 1  # a distributed run: every rank's logged loss (loss/rankN) was compared too

    def to_json(self) -> dict[str, Any]:
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "reproduced": self.reproduced,
            "max_relative_error": self.max_relative_error,
            "mismatches": [{"step": s, "logged": a, "replayed": b} for s, a, b in self.mismatches[:20]],
            **({"ranks_compared": self.ranks_compared} if self.ranks_compared > 1 else {}),
        }


def same_loss(logged: float, replayed: float) -> bool:
    return logged == replayed or (math.isnan(logged) and math.isnan(replayed))


def relative_error(logged: float, replayed: float) -> float:
    if same_loss(logged, replayed):
        return 0.0
    if not (math.isfinite(logged) and math.isfinite(replayed)):
        return math.inf
    return abs(logged - replayed) / max(abs(logged), 1e-12)


def losses_verdict(replayed: dict[int, float], logged: dict[int, float]) -> str:
    """Steps replayed outside `replay` (profiled, watched) against the logged losses: exact (bit for bit) | close
    (within CLOSE_RELATIVE) | diverged | unchecked (no logged step among them)."""
    compared = [(logged[step], value) for step, value in replayed.items() if step in logged]
    if not compared:
        return "unchecked"
    if all(same_loss(a, b) for a, b in compared):
        return "exact"
    return "close" if all(relative_error(a, b) <= CLOSE_RELATIVE for a, b in compared) else "diverged"


class ReplayHooks:
    """LoopHooks for a replay or an ablation arm: record each step's loss, grad norm and lr, optionally observe
    each step, remember the first non-finite step and stop there (or take the step again and go on).

    `lr_factor(step)` is an arm's lr multiplier (the lr logged is the one the update used); `on_step(outcome)`
    is called after every step."""

    def __init__(
        self,
        stop_on_nonfinite: bool = True,
        observer_factory: Callable[[int], Any] | None = None,
        on_step: Callable | None = None,
        lr_factor: Callable[[int], float] | None = None,
    ):
        self.stop_on_nonfinite = stop_on_nonfinite
        self.observer_factory = observer_factory
        self.on_step = on_step
        self.lr_factor = lr_factor
        self.current_step: Optional[int] = None
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}
        self.lrs: dict[int, float] = {}
        self.first_nonfinite: Optional[tuple[int, str]] = None  # (step, "loss" | "grad_norm")
        self.rank_losses: dict[int, list] = {}  # a distributed run: each step's loss on every rank

    def before_step(self, step, state, rng_at_start):
        self.current_step = step

    def observer(self, step):
        return self.observer_factory(step) if self.observer_factory else None

    def on_nonfinite(self, outcome, batch):
        if self.first_nonfinite is None:
            self.first_nonfinite = (outcome.step, outcome.nonfinite)
        return not self.stop_on_nonfinite

    def after_step(self, outcome, batch, step_time, data_time):
        self.losses[outcome.step] = outcome.loss
        if outcome.rank_losses is not None:
            self.rank_losses[outcome.step] = outcome.rank_losses
        if outcome.grad_norm is not None:
            self.grad_norms[outcome.step] = outcome.grad_norm
        self.lrs[outcome.step] = outcome.lr * (self.lr_factor(outcome.step) if self.lr_factor else 1.0)
        if self.on_step:
            self.on_step(outcome)
        return True

    def after_validation(self, step, val_loss):
        pass


def replay(
    restored: Restored,
    until: int,
    *,
    logged: dict[int, float] | None = None,
    stop_on_nonfinite: bool = True,
    observer_factory: Callable[[int], Any] | None = None,
    on_step: Callable | None = None,
    start: int | None = None,
) -> ReplayResult:
    """Run steps start..until-1 from the restored state, comparing each loss with `logged` when given."""
    from replaybisect.core import loop

    start = restored.step if start is None else start
    hooks = ReplayHooks(stop_on_nonfinite, observer_factory, on_step)
    stopped = loop.train_loop(restored.state, restored.batch, start, until, hooks)
    end = (stopped.step if stopped is not None else until)
    mismatches = []
    worst = 0.0
    from replaybisect.core.ranks import recorded_world_size

    ranks = recorded_world_size(restored.cfg)
    if logged is not None:
        compared = [(step, logged, loss) for step, loss in sorted(hooks.losses.items())]
        for rank in range(1, ranks):  # the other ranks' losses of a distributed run, as each rank logged its own
            logged_here = dict(restored.store.metric_history(restored.run_id, f"loss/rank{rank}"))
            compared += [(step, logged_here, losses[rank]) for step, losses in sorted(hooks.rank_losses.items())]
        for step, logged_losses_of, loss in compared:
            if step in logged_losses_of and not same_loss(logged_losses_of[step], loss):
                mismatches.append((step, logged_losses_of[step], loss))
                worst = max(worst, relative_error(logged_losses_of[step], loss))
        reproduced = "exact" if not mismatches else ("close" if worst <= CLOSE_RELATIVE else "diverged")
    else:
        reproduced = "unchecked"
    return ReplayResult(
        start_step=start,
        end_step=end,
        losses=hooks.losses,
        logged={s: logged[s] for s in hooks.losses if logged and s in logged},
        mismatches=mismatches,
        reproduced=reproduced,
        max_relative_error=worst,
        stopped=stopped,
        grad_norms=hooks.grad_norms,
        ranks_compared=ranks,
    )


def code_changes(tags: dict[str, str], cfg) -> list[str]:
    """Warnings for the run's own modules (its step and build functions, its LightningModule) whose files changed or
    are not found since the run was recorded; `cfg` is the admitted config (restore.run_config), which names them."""
    from omegaconf import OmegaConf

    from replaybisect.core.repo import SOURCE_TAG, changed_sources

    targets = [OmegaConf.select(cfg, key) for key in ("train.step_fn._target_", "train.build._target_", "user.module._target_")]
    modules = [target.rsplit(".", 1)[0] for target in targets if isinstance(target, str) and "." in target]
    return changed_sources(tags.get(SOURCE_TAG), modules)
