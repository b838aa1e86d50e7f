"""What a trainer's callback records, whichever trainer calls it: the run, each optimizer step's batches and
moments, the step's end, a non-finite step, the run's end. `record/lightning.py` and `record/hf.py` adapt it to
their trainer's hooks (each a short class over this one, as Lightning's SpikeDetection is over Fabric's)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from replaybisect.core.config import OnNonfinite
from replaybisect.core.step_watch import StepOutcome, StepWatch
from replaybisect.record.recorder import _checked_arguments, loop_data_started, nonfinite_step


@dataclass
class StepInProgress:
    """The optimizer step the trainer is in: its accumulated batches and where each sat in the trainer's loop, the
    RNG state it started with, its watch."""

    watch: StepWatch
    started: float
    data_started: float
    batches: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    rng: Optional[dict] = None
    stepped: bool = False  # the optimizer step was reached
    loss: Optional[torch.Tensor] = None  # what the trainer's callback adds up for the step's loss, where it does

    def add(self, packed: dict, position: dict) -> None:
        """One accumulated batch (user_step.pack's copy); a later one keeps the RNG state it starts with."""
        from replaybisect.core import user_step

        if self.rng is None:
            self.rng = packed[user_step.RECORD_RNG]
        position["rng"] = packed[user_step.RECORD_RNG] if self.batches else None
        self.batches.append(packed[user_step.RECORD_BATCH])
        self.positions.append(position)


class TrainerRecording:
    """One recorded run of a trainer. `keys` name the step record's batches and positions (the replay's step
    function reads them); `ranked` is one rank of a DDP job (record/ranked.py); `ended(status)` follows the run's
    end (a trainer's own MLflow run)."""

    def __init__(self, session, cfg, state, hooks, keys: tuple[str, str], *, ranked=None, defer_reads: bool = False,
                 ended: Optional[Callable[[str], None]] = None):
        from replaybisect.core.loop import BufferGuard

        self.session, self.cfg, self.state, self.hooks = session, cfg, state, hooks
        self.keys, self.ranked, self.defer_reads, self.ended = keys, ranked, defer_reads, ended
        self.buffers = BufferGuard(state.model)
        self.steps_taken = 0
        self.first_nonfinite_step: Optional[int] = None
        self.step: Optional[StepInProgress] = None
        self.undo: list[Callable[[], Any]] = []  # what the callback installed, undone when the run ends
        self._last_step_end: Optional[float] = None

    @property
    def open(self) -> bool:
        return not self.session.ended

    # ---- one step ---------------------------------------------------------------------------------------------
    def begin_step(self, called: float, rng_at_start: Optional[dict] = None) -> StepInProgress:
        """An optimizer step begins (`called`: when the trainer handed it over; the time since the last step's end
        is the step's wait for data; `rng_at_start`: the RNG streams captured then, where the caller has them)."""
        from replaybisect.core import loop

        step = self.steps_taken
        loop.open_step(step, self.state, self.hooks, self.buffers, rng_at_start)
        if self.ranked is not None:
            self.ranked.opened(step, self.state)
        outcome = StepOutcome(step=step, loss=math.nan, lr=float(self.state.optimizer.param_groups[0]["lr"]))
        watch = StepWatch(self.state, outcome, self.hooks.observer(step), on_fault=self.nonfinite,
                          ranks_agree=self.state.ranks_agree, defer_reads=self.defer_reads)
        now = time.perf_counter()
        self.step = StepInProgress(watch=watch, started=now, data_started=loop_data_started(self._last_step_end, called, now))
        return self.step

    def end_step(self, loss) -> None:
        """After the update: the step's loss (a float, or a tensor read at the flush) and its record."""
        step, self.step = self.step, None
        outcome = step.watch.outcome
        outcome.loss = loss
        step.watch.settle()
        ended = time.perf_counter()
        self._recorded(step, self._stored(step), ended - step.started, step.started - step.data_started)
        self._last_step_end = time.perf_counter()  # after the recorder's own flush of the step

    def nonfinite(self) -> None:
        """The step watch's fault: the state is still the one before this step, and the hooks save it with the
        failing batch. Continue: put the forward's buffer updates back and go on; stop: record the step, end the
        run FAILED and raise NonFiniteStep."""
        step = self.step
        outcome = step.watch.outcome
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = outcome.step
        stored = self._stored(step)  # (once: in a DDP job rank 0 gathers it from every rank)
        if self.buffers.ask_as_before_step(lambda: self.hooks.on_nonfinite(outcome, stored)):
            return
        step.watch.close_forward()
        self.step = None
        self._recorded(step, stored, time.perf_counter() - step.started, 0.0)
        self.finish()
        raise nonfinite_step(outcome, self.session.run_id)

    def _recorded(self, step: StepInProgress, stored, took: float, waited: float) -> None:
        outcome = step.watch.outcome
        self.hooks.after_step(outcome, stored, took, waited)
        if self.ranked is not None:
            self.ranked.finished(outcome.step, outcome.loss, self.hooks)
        self.steps_taken = outcome.step + 1

    def _stored(self, step: StepInProgress):
        """What the run stores for the step: its record (lists copied: later batches do not change it); in a DDP
        job, every rank's (rank 0 gathers them)."""
        from replaybisect.core import user_step

        batches, positions = self.keys
        record = {user_step.RECORD_BATCH: {batches: list(step.batches), positions: list(step.positions)},
                  user_step.RECORD_RNG: step.rng}
        return self.ranked.stored(step.watch.outcome.step, record) if self.ranked is not None else record

    # ---- the run's end ----------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Every pending write done; the run FINISHED, or FAILED after a non-finite step (or a write that failed)."""
        if self.open:
            self._unwatch()
            if self.session.finish() == "nonfinite" and self.ended is not None:
                self.ended("FAILED")

    def fail(self, error: BaseException) -> None:
        """An exception ended the training (Ctrl-C: KILLED, else FAILED); what was recorded stays."""
        if not self.open:
            return
        self._unwatch()
        if self.ranked is not None and self.ranked.is_writer:
            error = self.ranked.blamed(error, self.session.store, self.session.run_id)
        self.session.fail(error)
        if self.ended is not None:
            self.ended("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")

    def _unwatch(self) -> None:
        while self.undo:
            self.undo.pop()()
        if self.step is not None:
            self.step.watch.close_forward()
            self.step = None


class RecordingCallback:
    """What both trainers' ReplayCallbacks take and expose: the recording's settings, the run, how far it went.

    tracking_uri: the store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db). snapshot_every: a snapshot (model,
    optimizer, scheduler, scaler, RNG) every N optimizer steps, with every batch in between. layer_stats_every:
    per-layer statistics every N steps. on_nonfinite: "stop" (the trainer's fit/train raises NonFiniteStep) or
    "continue"."""

    def __init__(self, *, tracking_uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 snapshot_every: int = 100, layer_stats_every: int = 50, on_nonfinite: OnNonfinite = "stop"):
        _checked_arguments(tracking_uri, experiment, run_name, None, snapshot_every, layer_stats_every, None, on_nonfinite)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.snapshot_every, self.layer_stats_every, self.on_nonfinite = snapshot_every, layer_stats_every, on_nonfinite
        self.recording: Optional[TrainerRecording] = None
        self._constructed()

    def _constructed(self) -> None:
        """What a trainer's callback sets up beyond the shared settings (its signature stays this one)."""

    @property
    def run_id(self) -> Optional[str]:
        return self.recording.session.run_id if self.recording is not None else None

    @property
    def steps_taken(self) -> int:
        return self.recording.steps_taken if self.recording is not None else 0

    @property
    def first_nonfinite_step(self) -> Optional[int]:
        return self.recording.first_nonfinite_step if self.recording is not None else None

    @property
    def _session(self):  # (recorder._watch_unclosed reads it, as it reads a Recorder's)
        return self.recording.session

    @property
    def _open(self) -> bool:
        return self.recording is not None and self.recording.open

    @property
    def _step(self) -> Optional[StepInProgress]:
        return self.recording.step if self.recording is not None else None

    def close(self) -> None:
        """Every pending write done, the run FINISHED (or FAILED after a non-finite step)."""
        if self.recording is not None:
            self.recording.finish()

    def _fail(self, error: BaseException) -> None:
        if self.recording is not None:
            self.recording.fail(error)
