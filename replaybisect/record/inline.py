"""A loop recorded as it is written: `Recorder(model, optimizer)` with no step function and no `rec.step`. The
Recorder watches the model and the optimizer instead of running a step:

  opens     at the first training forward after the last update (model.training, gradients on): the RNG state
            then, the lr the loop set, a snapshot when one is due (loop.open_step)
  inputs    each training forward's arguments, in turn: the step's micro-batches (what a replay feeds the model),
            with the targets its loss meets outside the model and the floats the loop reads (core/outside_model.py)
  loss      what is backpropagated (the sum over micro-batches), as for a step function (user_step.watching)
  gradients checked when the optimizer steps, before its update; a non-finite loss or gradient raises
            NonFiniteStep there (from `loss.backward()` or `optimizer.step()`), so nothing of the step is applied.
            A loop with no optimizer (it updates by hand: user_step.ManualUpdate) is checked as its one backward
            returns, and its update is whatever it does to the parameters before the next step
  closes    at the next step's first training forward, or at `rec.close()`

A replay runs the script again and lets its loop run each step it asks for (core/inline_step.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from replaybisect.core import loop, outside_model, several, user_step
from replaybisect.core.inline_step import CARRIED, OUTSIDE, intercept_training_calls, micro_batch
from replaybisect.core.config import needs_closure
from replaybisect.core.step_watch import StepOutcome, StepWatch, holds_gradients
from replaybisect.errors import ConfigError, NonFiniteStep, ReplayError


@dataclass
class _OpenStep:
    step: int
    record: dict
    outcome: StepOutcome
    watch: StepWatch
    hooks_on: contextlib.ExitStack
    opened: float  # when the recorder's opening of the step was over: the step's time starts here
    data_time: float
    stepped: set = field(default_factory=set)  # ids of the optimizers that stepped in it (several: core/several.py)
    reached_update: bool = False  # each of them stepped
    update_ended: Optional[float] = None  # when its optimizer (or GradScaler) step returned


class InlineRecording:
    """The steps of `recorder`'s loop, found by watching its model and optimizer (see the module's text)."""

    def __init__(self, recorder):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if needs_closure(recorder.state.optimizer):
            raise ConfigError(f"{type(recorder.state.optimizer).__name__} re-evaluates the loss inside step(closure): "
                              "without step_fn the recorder cannot tell its forwards from the next step's; pass step_fn=")
        self.recorder = recorder
        self.state = recorder.state
        self._open: Optional[_OpenStep] = None
        self._targets = outside_model.StepTargets(self.state.model, self.state.scaler, replaying=False)
        self._last_outputs: list[torch.Tensor] = []  # the last training call's, which the next one may carry on from
        self._warned_opaque = False
        self._manual = isinstance(self.state.optimizer, user_step.ManualUpdate)
        self._last_update_end = time.perf_counter()  # the loop's data time runs from here to its next training call
        self._undo = [*(intercept_training_calls(model, functools.partial(self._forward, name), self._returned)
                        for name, model in several.named_models(self.state.model)),
                      self._watch_scaler_steps(self.state.scaler), self._targets.end]
        # global hooks: nothing of ours in the optimizers' own state (deepcopy, pickle)
        self._optimizers = {id(optimizer) for optimizer in several.members(self.state.optimizer)}
        reached = register_optimizer_step_pre_hook(lambda stepping, args, kwargs: self._reached_update(stepping) if id(stepping) in self._optimizers else None)
        returned = register_optimizer_step_post_hook(lambda stepping, args, kwargs: self._update_returned() if id(stepping) in self._optimizers else None)
        self._undo += [reached.remove, returned.remove]

    def _forward(self, model: Optional[str], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A training call of the model (of several: the one named `model`): the step it belongs to (opened if the
        last one reached its update), its inputs stored; the model runs on them unchanged."""
        arrived = time.perf_counter()
        self._targets.calling()
        if self._open is not None and self._update_reached():
            self.close_step()
        if self._open is None:
            self._open = self._open_step(outside_model.loop_frame(), arrived)
        self._note_autocast()
        carried = outside_model.carried_inputs((tuple(args), dict(kwargs)), self._last_outputs)
        self._open.record[user_step.RECORD_BATCH].append({**user_step.copied(micro_batch(args, kwargs, model)), OUTSIDE: [], CARRIED: carried})
        return args, kwargs

    def _returned(self, outputs) -> None:
        """The training call returned: the targets its loss meets go with its micro-batch, until that loss's backward."""
        self._last_outputs = outside_model.carried_outputs(outputs)
        if not self._last_outputs and not self._warned_opaque:
            self._warned_opaque = True
            warnings.warn(f"replaybisect: your model's training call returned a {type(outputs).__name__} holding no tensor "
                          "torch's pytree can see: the targets its loss meets outside the model and a hidden state it "
                          "carries are not followed, so a replay may differ; return tensors in tuples, lists or dicts, "
                          "or register the class with torch.utils._pytree", stacklevel=2)
        if self._open is not None:
            self._targets.returned(outputs, self._open.record[user_step.RECORD_BATCH][-1][OUTSIDE])

    def _update_reached(self, closing: bool = False) -> bool:
        """The step made its update: its optimizer stepped, or (updating by hand) the parameters changed after its
        backward."""
        if self._open.reached_update:
            return True
        if not (self._manual and self.state.optimizer.marked()):
            return False
        if not closing and self.state.optimizer.untouched():
            raise ConfigError("your loop backpropagated again before it updated the parameters: a loop that updates by "
                              "hand is recorded one backward per update; for gradient accumulation use a torch.optim "
                              "optimizer, or pass step_fn=")
        return True

    def _note_autocast(self) -> None:
        """An autocast region the loop entered before the model's call (or once, around the whole loop) is the
        run's precision too."""
        seen, device = self.recorder._precision_seen, self.state.device.type
        if seen is not None and torch.is_autocast_enabled(device):
            seen.append(user_step.precision_name(torch.get_autocast_dtype(device)))

    def _reached_update(self, stepping) -> None:
        if self._open is None:
            raise ConfigError("the optimizer stepped with no training call of the model since its last step: the "
                              "recorder sees a step through the model it was given, called in train mode with "
                              "gradients on (model.train()); pass step_fn= for a loop that trains otherwise")
        self._open.stepped.add(id(stepping))
        self._open.reached_update = self._open.stepped >= self._optimizers

    def _update_returned(self) -> None:
        if self._open is not None:
            self._open.update_ended = time.perf_counter()

    def _watch_scaler_steps(self, scaler):
        """A GradScaler that skips an overflowing update never calls `optimizer.step()`: its own `step` ends the
        step too."""
        if scaler is None:
            return lambda: None
        original = scaler.step

        def step(optimizer, *args, **kwargs):
            if id(optimizer) not in self._optimizers:
                return original(optimizer, *args, **kwargs)
            self._reached_update(optimizer)
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                self._update_returned()  # (an update the scaler skipped ends here too)

        scaler.step = step
        return lambda: setattr(scaler, "step", original)

    # ---- a step's opening and end -------------------------------------------------------------------------
    def _open_step(self, frame, arrived: float) -> _OpenStep:
        """The step the training call that `arrived` begins. Its data time is the loop's own, from the last update's
        end to that call (an update made by hand is seen only at the next call: none); its step time starts after
        the recorder's opening (snapshot, RNG, the loop's numbers)."""
        recorder, state = self.recorder, self.state
        step = recorder.steps_taken
        if step == 0 and frame is not None:  # where the loop is: diagnose's findings name it
            recorder._tag_loop(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        rng_at_start = loop.open_step(step, state, recorder._hooks, recorder._buffers)
        # the lr the loop set for this step, and the floats its code reads (an lr it applies by hand)
        record = user_step.pack([], state.device, rng_at_start, state.optimizer, variables=outside_model.loop_numbers(frame),
                                grads_carried=holds_gradients(state.params),
                                eval_modules=user_step.eval_modules(state.model))
        outcome = StepOutcome(step=step, loss=math.nan, lr=float(state.optimizer.param_groups[0]["lr"]))
        watch = StepWatch(state, outcome, recorder._hooks.observer(step), on_fault=self._halt)
        watch.on_loss = self._targets.end
        hooks_on = contextlib.ExitStack()
        hooks_on.enter_context(recorder._noting_precision())
        hooks_on.enter_context(user_step.watching(watch))
        data_time = max(0.0, arrived - self._last_update_end)
        return _OpenStep(step, record, outcome, watch, hooks_on, time.perf_counter(), data_time)

    def close_step(self) -> None:
        """The open step is over (its update made, or the loop ended): logged, its record kept."""
        if self._open is not None and self._manual and self.state.optimizer.marked():
            self.state.optimizer.step()  # stands for the update the loop made by hand (its hooks: the step's after_update)
        current, self._open = self._open, None
        if current is None:
            return
        self._targets.end()
        try:
            current.watch.settle()
            current.outcome.loss = current.watch.loss_so_far()
        finally:
            current.hooks_on.close()
        self._finish(current)

    def _halt(self) -> None:
        """The step's first non-finite loss or gradient, before the update: the run stops here, as `rec.step` does."""
        current = self._stop_before_update()
        # (one of several optimizers updated already: the state before the step is not the live one)
        self.recorder._hooks.on_nonfinite(current.outcome, current.record, state_intact=not current.stepped)
        self._finish(current)
        self.recorder._stop(current.outcome)

    def _stop_before_update(self, undo_buffers: bool = True) -> _OpenStep:
        """The open step ends where it is, before its update: our watch off, the forward's buffer updates undone (the
        state before the step is kept; not `undo_buffers`: its update had begun, the state is past it)."""
        current, self._open = self._open, None
        self._targets.end()
        current.hooks_on.close()
        if undo_buffers:
            self.recorder._buffers.restore()
        return current

    def crashed(self, error: BaseException) -> None:
        """An exception ended the loop inside a step, before its update (a loss that checks its input, an index out
        of range): that step is the run's failing step, kept as a non-finite one is (the state before it, its
        micro-batches so far). One raised inside its update (the optimizer's step), or after some of several optimizers
        updated, keeps only the step's batch (reached from a snapshot); one raised after the update (the loop's logging,
        its evaluation) is the run's crash only."""
        current = self._open
        step_failed = isinstance(error, Exception) and not isinstance(error, (ReplayError, NonFiniteStep))
        if current is not None and self._update_reached(closing=True):
            if self._manual and step_failed:  # raised after the one backward: before the update by hand, or in it
                before = _untouched(self.state.optimizer)  # (or after it: which one, nothing tells; its line does)
                self._stop_before_update(undo_buffers=before)
                self.recorder._hooks.on_exception(current.step, error, current.record, updated=not before, outcome=current.outcome)
                return
            if current.update_ended is not None or not step_failed:  # a step the loop completed is logged
                with contextlib.suppress(Exception):  # (the run's crash is `error`, whatever its logging meets)
                    self.close_step()
                return
            # it raised inside its optimizer's step: its batch is kept, the state may be part-way through the update
            self._stop_before_update(undo_buffers=False)
            self.recorder._hooks.on_exception(current.step, error, current.record, updated=True, outcome=current.outcome)
            return
        if current is None or not current.record[user_step.RECORD_BATCH] or not step_failed:
            return
        self._stop_before_update()
        self.recorder._hooks.on_exception(current.step, error, current.record, updated=bool(current.stepped), outcome=current.outcome)

    def _finish(self, current: _OpenStep) -> None:
        """The step logged: its time up to its update's end (a step closed at the next training call, or stopped
        before its update: up to now), then the recorder's own flush, which is neither the step's time nor the loop's."""
        ended = current.update_ended if current.update_ended is not None else time.perf_counter()
        self._last_update_end = ended
        self.recorder._hooks.after_step(current.outcome, current.record, ended - current.opened, current.data_time)
        self.recorder._stepped(current.outcome)

    def close(self) -> None:
        """The loop is over: its last step closed, the model and optimizer left as they were."""
        try:
            if self._open is not None and self._update_reached(closing=True):  # a step the loop left half-done is no step
                self.close_step()
        finally:
            self.remove()

    def remove(self) -> None:
        """Our watch off the model, optimizer and scaler (an open step's too): after close, or a failed run."""
        current, self._open = self._open, None
        if current is not None:
            current.hooks_on.close()
        for undo in self._undo:
            undo()
        self._undo = []


def _untouched(update: user_step.ManualUpdate) -> bool:
    """Whether an update by hand had not begun (False where that cannot be told: a device that failed)."""
    try:
        return update.untouched()
    except Exception:
        return False
