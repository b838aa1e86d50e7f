"""torch.autograd.detect_anomaly over the failing step, on a copy: the first backward node that made a NaN,
with the forward frame that created it."""

from __future__ import annotations

import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from replaybisect.core import loop
from replaybisect.frames import QUOTED_FRAME, is_ours
from replaybisect.verbs.nan.probes import all_finite, autograd_nodes, format_frame, user_frame


# ---- detect_anomaly -----------------------------------------------------------------------------------------
@dataclass
class AnomalyFinding:
    op: Optional[str]  # the first autograd node whose output is non-finite from finite gradients, e.g. LogBackward0
    source: Optional[str]  # the user's line of the forward call that created that node
    nan_op: Optional[str] = None  # the node detect_anomaly raised on (it checks NaN only, so it can come later)
    nan_source: Optional[str] = None
    message: Optional[str] = None  # the error detect_anomaly raised, if it raised
    traceback: list[str] = field(default_factory=list)


_ERROR_IN = re.compile(r"Error detected in (\w+)\.")
_FUNCTION_NAN = re.compile(r"Function '(\w+)' returned nan values")
_FRAME = re.compile(QUOTED_FRAME.pattern + r"\n\s*(.*)")  # with the frame's code line


class _FirstBadNode(loop.StepObserver):
    """A post-hook on every autograd node of the loss: the first whose output is non-finite from finite gradients."""

    def __init__(self):
        self.node = None
        self.handles: list[Any] = []
        self.in_backward = False  # between the forward and the end of backward: where detect_anomaly raises

    def after_forward(self, state, loss: torch.Tensor) -> None:
        self.in_backward = True
        if loss.requires_grad:
            self.handles = [node.register_hook(self._hook(node)) for node in autograd_nodes(loss)]

    def after_backward(self, state) -> None:
        self.in_backward = False

    def _hook(self, node):
        def hook(grad_inputs, grad_outputs):
            if self.node is None:
                if all(all_finite(g) for g in grad_outputs if g is not None) and not all(all_finite(g) for g in grad_inputs if g is not None):
                    self.node = node
            return None

        return hook


def anomaly_pass(state: "loop.TrainState", step: int, batch: Any, raise_on_nan: bool = True) -> AnomalyFinding:
    """The step (`loop.run_step`) under torch.autograd.detect_anomaly, on a COPY of the state.

    detect_anomaly raises only on NaN produced in backward; a post-hook on every node also catches Inf, and
    the forward traceback anomaly mode stores on every node names the user's line either way. A rank replayed over
    the real collective (replay nan --nproc) does not raise: a backward left midway would leave the other ranks
    waiting in its all-reduce."""
    watch = _FirstBadNode()
    message = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=raise_on_nan):
                loop.run_step(state, step, batch, halt_on_nonfinite=False, observer=watch)
        except RuntimeError as error:
            if not watch.in_backward:
                raise
            message = str(error).splitlines()[0]
        finally:
            for handle in watch.handles:
                handle.remove()

    nan_op = nan_source = None
    nan_lines: list[str] = []
    if message and _FUNCTION_NAN.search(message):
        nan_op = _FUNCTION_NAN.search(message).group(1)
    for warning in caught:
        text = str(warning.message)
        match = _ERROR_IN.search(text)
        if match:
            nan_op = nan_op or match.group(1)
            nan_lines = _frames(text)
            break
    nan_source = _source(nan_lines)
    if watch.node is not None:
        node = watch.node
        lines = _frames("".join(getattr(node, "metadata", {}).get("traceback_", [])))
        return AnomalyFinding(type(node).__name__, _source(lines), nan_op, nan_source, message, lines)
    return AnomalyFinding(nan_op, nan_source, nan_op, nan_source, message, nan_lines)


def _source(lines: list[str]) -> Optional[str]:
    if not lines:
        return None
    frames = [traceback.FrameSummary(f, int(n), fn, line=code) for f, n, fn, code in (_FRAME.match(l).groups() for l in lines)]
    return format_frame(user_frame(frames))


def _frames(text: str) -> list[str]:
    """The traceback's frames inside the step: those after replaybisect's own (its callers are not the step)."""
    frames = [m for m in _FRAME.finditer(text)]
    ours = [i for i, m in enumerate(frames) if is_ours(m.group(1))]
    return [m.group(0) for m in frames[(ours[-1] + 1 if ours else 0):]]
