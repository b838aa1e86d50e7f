"""The step of a loop recorded as it is written (no step function, no `rec.step`: record/inline.py), replayed.

Such a step is no function a replay can call: it is the script's own loop body. So a replay re-enters the script
(core/reentry.py) and lets the script's loop run the steps, one loop iteration per step the replay asks for. The
replay's engine (`replay nan`'s probes, an ablation arm) runs in a thread of its own and calls `RemoteStep` as it
would call a step function; the script's thread, stopped at the model's first training forward of each iteration,
takes the request, feeds the model the stored step's inputs (each forward's arguments in turn) and runs on; the
iteration ends at the next iteration's first forward. The two threads take turns, never running together, so the
engine's in-place state copies and RNG restores happen while the script waits, exactly where the recording took
them. A step the engine halts makes no update: the optimizer's `step` does nothing for it, and the script's loop
goes on to the next request.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from replaybisect.core import outside_model, several
from replaybisect.core.rng import capture_raw, restore_raw
from replaybisect.core.step_watch import StepHalted, StepWatch
from replaybisect.core.reentry import WriteRefused
from replaybisect.errors import ReplayError

# a stored micro-batch: one training forward's arguments; the targets its loss met outside the model and which of its
# inputs carried the previous call's outputs (core/outside_model.py)
ARGS, KWARGS, OUTSIDE, CARRIED = "args", "kwargs", "outside", "carried"
MODEL = "model"  # of several models (core/several.py): the name of the one called


# why the script's loop ended, as a replay asking for another step is told (RemoteStep._ended_why)
_TOO_FEW = ("the script's loop ended (it reached rec.close()) before the replay ran every step it needs; let the script "
            "run more iterations (its own iteration limit counts from 0 again in a replay)")
_AFTER_HALT = ("the script's loop ended (it reached rec.close()) right after a step the replay halted: its own code after "
               "the step saw the halted step's values (a NaN loss, no gradients) and stopped; skip that check when "
               "replaybisect.replaying() is True")
_AFTER_CRASH = "the script's loop ended as a replayed step raised (the run's crash, replayed): no step after it runs in this replay"


# why a replayed step's training calls can differ from its recording's (RemoteStep.calls_differ), as reports say it
CALLS_DECIDED = ("the script's loop decides them from what a replay does not restore (an int counter such as an episode "
                 "number, an environment's state)")


def calls_differing(made: int, stored: int, stopped: Optional[int]) -> Optional[tuple[int, int]]:
    """(calls counted, calls recorded) where a replayed step's iteration decided otherwise than its recording; None where
    it did not. A step that stopped (halted, failed: the rest of its iteration runs idle) counts its calls up to the
    stop, and only more than recorded differ: the recording of the run's failing step stored those it reached before
    the same stop, and stopping earlier is a changed step's (an arm's), not its loop's."""
    if stopped is None:
        return (made, stored) if made != stored else None
    return (stopped, stored) if stopped > stored else None


class LoopEnded(ReplayError):
    """The script's loop ended (it reached `rec.close()`) while the replay wanted another step."""


def intercept_training_calls(model: torch.nn.Module, on_call: Callable[[tuple, dict], tuple[tuple, dict]],
                             on_return: Callable[[Any], None],
                             on_error: Optional[Callable[[Exception], None]] = None) -> Callable[[], None]:
    """Every training call of `model` (train mode, gradients on) goes through `on_call(args, kwargs)`, which returns
    the inputs the model then runs on, and `on_return(outputs)` after it; returns what undoes it. It runs before the model's own pre-hooks: hooks a
    probe adds or removes there (the root module's too) are seen whole, never mid-dispatch. Through the attribute
    nn.Module.__call__ runs when set (Module.compile sets it too; kept: wrapped), which nn.Module leaves out of its
    copies and pickles."""
    inner = model._compiled_call_impl
    call_impl = inner or model._call_impl

    def call(*args, **kwargs):
        if not (model.training and torch.is_grad_enabled()):  # evaluation is the script's own business
            return call_impl(*args, **kwargs)
        args, kwargs = on_call(args, kwargs)
        try:
            outputs = call_impl(*args, **kwargs)
        except Exception as error:  # the model raised (an out-of-memory activation, a shape it cannot take)
            if on_error is not None:
                on_error(error)
            raise
        on_return(outputs)
        return outputs

    model._compiled_call_impl = call
    return lambda: setattr(model, "_compiled_call_impl", inner)


def micro_batch(args: tuple, kwargs: dict, model: Optional[str] = None) -> dict[str, Any]:
    """One training forward's inputs as a recorded step stores them (of several models: which one was called)."""
    return {ARGS: tuple(args), KWARGS: dict(kwargs), **({MODEL: model} if model is not None else {})}


@dataclass
class _Request:
    micro_batches: list
    watch: StepWatch
    numbers: Any = None  # the floats the loop read as the recorded step opened (outside_model.loop_numbers)
    params_at_halt: Optional[list] = None  # updating by hand: the parameters as a halted step left them
    forwards: dict = field(default_factory=dict)  # training calls so far, by model (several: core/several.py)
    stepped: set = field(default_factory=set)  # ids of the optimizers that stepped (several: core/several.py)
    reached_update: bool = False  # each of them stepped (optimizer.step(), or its GradScaler's step): the next forward is the next step's
    outputs: list = field(default_factory=list)  # the step's training calls' outputs so far, as a later call may take them
    halted: bool = False
    calls_at_stop: Optional[int] = None  # training calls made when the step halted or failed (the rest run idle)
    error: Optional[Exception] = None  # raised by the step's backward or update in the script's thread
    rng_after: Optional[dict] = None  # the RNG streams where the step ended (its update, or its halt)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Call:
    """A function the engine has the script's thread run between steps (RemoteStep.in_script_thread)."""

    fn: Callable[[], Any]
    error: Optional[Exception] = None
    done: threading.Event = field(default_factory=threading.Event)


class RemoteStep:
    """Stands for the step function of an inline run: called (in the engine's thread) with a stored step's
    micro-batches, it has the script's loop run them and returns when the iteration is over. It takes `scheduler`
    (see user_step.steps_scheduler_itself): the script's loop steps its own scheduler."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler, start: Callable[[], None],
                 updates_by_hand: bool = False):
        self._start = start  # hands the live objects to the replay (in a thread of its own), at the first forward
        self._started = False
        self._ended_why: Optional[str] = None  # the loop is over: what a replay asking for another step is told
        self._replay_thread: Optional[threading.Thread] = None
        self._requests: "queue.Queue[_Request]" = queue.Queue()
        self._current: Optional[_Request] = None
        self._watch: Optional[StepWatch] = None
        self._numbers = None
        self._optimizer, self._scaler = optimizer, scaler
        self._manual = updates_by_hand  # the optimizer is a user_step.ManualUpdate: the loop updates by hand
        self._stored_targets: list = []
        # step -> (training calls the script's iteration made, calls the recording made), where they differed: the
        # first replay of the step that differed
        self.calls_differ: dict[int, tuple[int, int]] = {}
        self._targets = outside_model.StepTargets(model, scaler, replaying=True, on_error=self._raised_in_loss)
        for name, member in several.named_models(model):
            intercept_training_calls(member, functools.partial(self._inputs, name), self._returned, self._raised_in_model)
        self._optimizers = {id(member) for member in several.members(optimizer)}
        for member in several.members(optimizer):
            self._skip_halted_updates(member)
        self._note_scaler_steps(scaler)

    # ---- the engine's side --------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        """The script's loop is over (rec.close(), or its model raised in a replayed step): no more steps run."""
        return self._ended_why is not None

    def attach(self, watch: StepWatch, numbers: Any) -> None:
        """The watch of the step about to be asked for, and the floats the loop read as it was recorded (user_step.run).
        A halt marks the step instead of raising into the script's code: the script's loop must go on to the next
        request."""
        self._watch = watch
        self._numbers = numbers
        if watch.on_fault is not None:
            watch.on_fault = self._halt
        watch.on_error = self._failed
        watch.on_loss = self._targets.end

    def __call__(self, batch, scheduler=None):
        if not isinstance(batch, list) or not all(isinstance(item, dict) and ARGS in item for item in batch):
            raise ReplayError("a stored step of this run holds no model inputs (it was recorded with step_fn=); the "
                              "snapshot does not match this Recorder: re-record the run")
        if self._ended_why is not None:
            raise LoopEnded(self._ended_why)
        watch, self._watch = self._watch, None
        watch.close_forward()  # opened in this thread; the script's thread opens its own around its forwards
        request = _Request(batch, watch, self._numbers)
        self._requests.put(request)
        request.done.wait()
        if request.error is not None:
            raise request.error
        if request.halted:
            raise StepHalted
        return None

    def in_script_thread(self, fn: Callable[[], Any]) -> None:
        """Run `fn` in the script's thread, between steps (where that thread waits for the next step), and return when
        it has run: what must happen in the thread that runs the loop (a profiler started and stopped there)."""
        call = _Call(fn)
        self._requests.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error

    # ---- the script's side --------------------------------------------------------------------------------
    def _next_request(self) -> _Request:
        """The next step asked for, running what the engine asked to run in this thread first."""
        while True:
            item = self._requests.get()
            if not isinstance(item, _Call):
                return item
            _run_here(item)

    def _inputs(self, model: Optional[str], live_args: tuple, live_kwargs: dict) -> tuple[tuple, dict]:
        """The stored inputs for this training forward (of several models: the next stored call of the one named
        `model`), taking the next request when a step is over."""
        if not self._started:
            self._started = True
            self._replay_thread = threading.Thread(target=self._start, name="replaybisect-replay", daemon=True)
            self._replay_thread.start()
        self._targets.calling()
        current = self._current
        if current is not None and self._update_reached(current):
            self._complete(current)
            current = None
        if current is None:
            current = self._current = self._next_request()
            outside_model.set_loop_numbers(outside_model.loop_frame(), current.numbers)
            current.watch.open_forward()
        # a step the recording stopped part-way (its first non-finite loss) stored the micro-batches it reached; reused
        # past the failure (an ablation arm), it feeds them again in turn; a model it never reached runs on the
        # script's own inputs
        calls = current.forwards.get(model, 0)
        current.forwards[model] = calls + 1
        own = [stored for stored in current.micro_batches if stored.get(MODEL) == model]
        if not own:
            return live_args, live_kwargs
        stored = own[calls % len(own)]
        carry = current.watch.state.carry or {}
        args, kwargs = outside_model.fed_inputs((tuple(stored[ARGS]), dict(stored[KWARGS])), stored.get(CARRIED),
                                                carry.get(outside_model.CARRIED_OUTPUTS, []))
        # what an earlier call of this step made (a GAN's fakes, given to its discriminator) is the replay's own
        args, kwargs = outside_model.made_in_step((args, kwargs), (tuple(live_args), dict(live_kwargs)), current.outputs)
        self._stored_targets = list(stored.get(OUTSIDE) or [])
        return tuple(args), dict(kwargs)

    def _returned(self, outputs: Any) -> None:
        """The training call returned: its outputs are what the next one may carry on from, and the stored targets
        stand in for the live ones until its loss's backward."""
        current = self._current
        if current is None:
            return
        carried = outside_model.carried_outputs(outputs)
        current.outputs += carried
        if current.watch.state.carry is not None:
            current.watch.state.carry[outside_model.CARRIED_OUTPUTS] = carried
        self._targets.returned(outputs, self._stored_targets)

    def _update_reached(self, request: _Request) -> bool:
        """The step is over: its optimizer stepped; updating by hand, its one backward returned or the step halted."""
        return request.reached_update or self._manual and (request.halted or self._optimizer.marked())

    def script_done(self) -> None:
        """The script's loop is over (`rec.close()`): the step in hand ends here, a replay asking for another is told
        so, and the script waits for the replay to end the process (its own exit would race the replay's result)."""
        self._targets.end()
        self._ended_why = _AFTER_HALT if self._current is not None and self._current.halted else _TOO_FEW
        if self._current is not None:
            if not self._update_reached(self._current) and self._current.error is None and not self._current.halted:
                self._current.error = LoopEnded("the script's loop ended (it reached rec.close()) in the middle of a step, "
                                                "before its optimizer step")
            self._complete(self._current)
        self.serve_until_replay_ends()

    def script_raised(self, error: BaseException) -> bool:
        """The script's code raised `error` inside a replayed step (before its optimizer's update; updating by hand,
        before the next step's first call): the step's, as recorded (record/inline.py crashed), or, where the step
        had failed already (its loss raised), that first error ends it (_end_by_crash). Whether it was taken (else
        it is the script's, returned at once)."""
        current = self._current
        if current is None or not isinstance(error, Exception) or isinstance(error, (ReplayError, WriteRefused)):
            return False
        if current.error is None and (current.halted or current.reached_update and not self._manual):
            return False  # the script's own: after the replay halted the step (its code saw the NaN), or after its
        self._end_by_crash(current, error if current.error is None else None)  # optimizer's update (as recorded)
        return True

    def _end_by_crash(self, current: _Request, error: Optional[Exception]) -> None:
        """The replayed step `current` raised `error` (or an error of its own earlier): the engine gets it, the loop
        is over, and this thread serves the replay until its end."""
        if error is not None:
            self._failed(error)
        self._ended_why = _AFTER_CRASH
        self._complete(current)
        self.serve_until_replay_ends()

    def serve_until_replay_ends(self) -> None:
        """The loop is over: the script's thread runs what the replay asks of it (a profiler's stop) until the replay
        ends the process (returns where none started, or its thread is gone)."""
        while self._replay_thread is not None and self._replay_thread.is_alive():
            with contextlib.suppress(queue.Empty):
                item = self._requests.get(timeout=1.0)
                if not isinstance(item, _Call):  # (a step asked for after the loop ended)
                    item.error = LoopEnded(self._ended_why or _TOO_FEW)
                _run_here(item)

    def _note_scaler_steps(self, scaler) -> None:
        """A GradScaler that skips an overflowing update never calls `optimizer.step()`: its `step` ends the step too.
        In a halted step (no gradients made) its unscale_, step and update do nothing: they would assert on it."""
        if scaler is None:
            return
        for name in ("unscale_", "step", "update"):
            original = getattr(scaler, name)

            def idle_when_halted(*args, _original=original, _name=name, **kwargs):
                if self._current is not None and _name == "step":
                    self._current.stepped.add(id(args[0]) if args else None)
                    self._current.reached_update = self._current.stepped >= self._optimizers
                if self._current is not None and self._current.halted:
                    return None
                try:
                    return _original(*args, **kwargs)
                finally:
                    if _name == "step":
                        self._ended_here()

            setattr(scaler, name, idle_when_halted)

    def _complete(self, request: _Request) -> None:
        differing = calls_differing(sum(request.forwards.values()), len(request.micro_batches), request.calls_at_stop)
        if differing is not None:
            self.calls_differ.setdefault(request.watch.outcome.step, differing)
        self._targets.end()
        if request.rng_after is not None:
            restore_raw(request.rng_after)
        if request.params_at_halt is not None:  # what the loop's own update did in a halted step is undone
            with torch.no_grad():
                for param, kept in zip(self._optimizer._params(), request.params_at_halt):
                    param.copy_(kept)
                    param.grad = None
        request.watch.close_forward()
        self._current = None
        request.done.set()

    def _ended_here(self) -> None:
        """The step is over (updated, halted or failed): the RNG streams as it leaves them, put back when the
        iteration ends, so what the script draws between steps (its evaluation, the next batch) is not the step's."""
        if self._current is not None and self._current.rng_after is None:
            self._current.rng_after = capture_raw()

    def _halt(self) -> None:
        """The watch's fault, in the script's thread: the step stops here (StepHalted, caught where it would reach the
        script's code: our backward and optimizer.step); the rest of the iteration runs idle."""
        if self._current is not None:
            self._stop_here(self._current)
        raise StepHalted

    def _failed(self, error: Exception) -> None:
        """The step raised (an anomaly-mode backward, a probe): no more of it is applied, and the engine gets it."""
        if self._current is not None:
            self._current.error = error
            self._stop_here(self._current)

    def _raised_in_model(self, error: Exception) -> None:
        """The model raised inside a replayed step (a recorded crash replayed: an activation past memory): the engine
        gets the error as the step's. The script's own code after the call cannot go on without the model's outputs,
        so its thread waits here for the replay to end the process; a replay asking for another step is told so.
        Outside a step it is the script's."""
        if self._current is not None:
            self._end_by_crash(self._current, error)

    def _raised_in_loss(self, error: Exception) -> torch.Tensor:
        """An op of the step's loss raised in the script's thread (a recorded crash replayed: a BCELoss refusing a
        NaN): the engine gets the error as the step's, and the script's code goes on idle, on a NaN standing for the
        op's result (its backward and update do nothing), to the next request. Outside a step it is the script's."""
        if self._current is None:
            raise error
        if self._current.error is None:  # (later ops on the stand-in may raise too: the first error is the step's)
            self._failed(error)
        return torch.tensor(float("nan"))

    def _stop_here(self, request: _Request) -> None:
        """No more of the step is applied. A loop that updates by hand still runs its update: on zero gradients where
        it has none, and undone when the iteration ends."""
        self._ended_here()
        if request.calls_at_stop is None:
            request.calls_at_stop = sum(request.forwards.values())
        request.halted = True
        request.watch.stopped = True
        if self._manual:
            request.params_at_halt = [param.detach().clone() for param in self._optimizer._params()]
            for param in self._optimizer._params():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)

    def _skip_halted_updates(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()` (a GradScaler's too: it calls it) makes no update in a halted step. Updating by hand,
        the step ends where its backward returns (ManualUpdate.mark)."""
        if self._manual:
            mark = optimizer.mark

            def marked():
                mark()
                self._ended_here()

            optimizer.mark = marked
            return
        original = optimizer.step

        def step(*args, **kwargs):
            current = self._current
            if current is None:
                return original(*args, **kwargs)
            current.stepped.add(id(optimizer))
            current.reached_update = current.stepped >= self._optimizers
            if current.halted:
                return None
            try:
                return original(*args, **kwargs)
            except StepHalted:  # the watch stopped the step at its gradients, before the update
                return None
            except Exception as error:  # in the update or its hooks: the engine gets it, the script's loop goes on
                self._failed(error)
                return None
            finally:
                self._ended_here()

        # a bound method, as `optimizer.step` is: an LR scheduler the script makes afterwards wraps it by its __func__
        optimizer.step = types.MethodType(lambda _optimizer, *args, **kwargs: step(*args, **kwargs), optimizer)


def _run_here(item: "_Call | _Request") -> None:
    """Run a _Call in this thread (its error handed back to the engine's), and tell the engine it is done."""
    if isinstance(item, _Call):
        try:
            item.fn()
        except Exception as error:
            item.error = error
    item.done.set()
