"""What may watch a step: the observer hooks `run_step` calls, in order, and the helpers that call them."""

from __future__ import annotations

import contextlib


class StepObserver:
    """Hooks into one step, for recorders, checks and probes; they may read and instrument (module hooks,
    tensor hooks, a TorchFunctionMode), never change a value the step computes. Every hook is optional:
    `run_step` calls only those an observer defines, so observers need not subclass this (it documents the order).

      forward_context(state)        a context manager entered around forward and loss (outside autocast);
                                    with accumulation, around each micro-batch's forward
      after_forward(state, loss)    the live loss tensor, before backward (to hook its autograd graph)
      after_backward(state)         gradients unscaled, not yet clipped
      before_update(state, outcome) gradients clipped, right before the optimizer (and scaler) step
      after_update(state)           after the optimizer step and the scheduler step
    """

    def forward_context(self, state):
        return contextlib.nullcontext()

    def after_forward(self, state, loss) -> None: ...
    def after_backward(self, state) -> None: ...
    def before_update(self, state, outcome) -> None: ...
    def after_update(self, state) -> None: ...


def notify(observer, hook: str, *args) -> None:
    """Call the observer's hook if it has one (no observer, or a hook it does not define: nothing)."""
    method = getattr(observer, hook, None)
    if method is not None:
        method(*args)


def forward_context(observer, state):
    method = getattr(observer, "forward_context", None)
    return method(state) if method is not None else contextlib.nullcontext()
