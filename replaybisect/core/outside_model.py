"""What a loop recorded as it is written (record/inline.py) takes from outside its model's arguments, and how a
replay of it (core/inline_step.py) gives each back:

  targets   tensors the step's loss meets beside the model's outputs (`criterion(model(x), y)`: y). From a
            training call's return until its loss is backpropagated, a torch function mode sees each op that
            takes a tensor derived from the model's outputs; its other tensors (no gradient, not the model's
            own) are stored with the micro-batch, in the order the loop first uses them, and a replay puts the
            stored ones in their place in the same order.
  carried   a model input that is the previous training call's output, repackaged (an RNN's hidden state,
            detached): found by storage when recorded; a replay feeds that output of the call before it in the same
            replayed line (state.carry), so an ablation arm computes its own hidden states; after a restore (a
            snapshot, a probe's copy, an arm's start) there is none, and the stored input is fed.
  numbers   the floats the loop's code reads from its module (an lr a word_language_model-style loop anneals
            and applies by hand): stored as the step opens, set again before the replayed step, as the
            optimizer's lr is. Counters and flags (ints, bools) keep the replay's own values, so the script's
            loop, evaluations and iteration limit run as they do.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

CARRIED_OUTPUTS = "model outputs"  # state.carry: the last training call's outputs in this replayed line
GLOBAL = "global:"  # a stored number's key: "global:lr", as the step function form names them (user_step.step_variables)


def tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


# ---- targets ----------------------------------------------------------------------------------------------------
class LossInputs(TorchFunctionMode):
    """Active in the script's thread from a training call's return until its loss is backpropagated. Recording
    (`stored` None): `seen` (`sink`, when given) collects copies of the targets. Replaying: the i-th target the loop uses is replaced by
    `stored[i]` (a loop that uses more than were stored runs on its own)."""

    def __init__(self, model: torch.nn.Module, outputs: Any, stored: Optional[list] = None, sink: Optional[list] = None):
        super().__init__()
        self._model_tensors = {id(tensor) for tensor in (*model.parameters(), *model.buffers())}
        self._derived = tensors(outputs)  # kept alive while the region lasts, so their ids stay theirs
        self._derived_ids = {id(tensor) for tensor in self._derived}
        self._stored = stored
        self._targets: dict[int, torch.Tensor] = {}  # a live target's id -> what stands for it (itself, or the stored one)
        self.seen: list[torch.Tensor] = sink if sink is not None else []
        self.active = True

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        if not any(isinstance(leaf, torch.Tensor) and id(leaf) in self._derived_ids for leaf in leaves):
            return func(*args, **kwargs)
        args, kwargs = tree_unflatten([self._target(leaf) for leaf in leaves], spec)
        result = func(*args, **kwargs)
        for tensor in tensors(result):
            self._derived.append(tensor)
            self._derived_ids.add(id(tensor))
        return result

    def _target(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or id(leaf) in self._derived_ids or leaf.requires_grad or id(leaf) in self._model_tensors:
            return leaf
        if id(leaf) not in self._targets:
            index = len(self._targets)
            if self._stored is None:
                self.seen.append(leaf.detach().clone())
                self._targets[id(leaf)] = leaf
            else:
                self._targets[id(leaf)] = self._stored[index] if index < len(self._stored) else leaf
            self._derived.append(leaf)  # kept alive: its id must not be reused by a tensor made later
        return self._targets[id(leaf)]


def enter(mode: LossInputs) -> LossInputs:
    mode.__enter__()
    return mode


def leave(mode: Optional[LossInputs]) -> None:
    """End the region: popped when it is the innermost mode (a mode the loop entered inside it and left open is
    not ours to pop: ours then only stops looking)."""
    if mode is None or not mode.active:
        return
    mode.active = False
    depth = torch._C._len_torch_function_stack()
    if depth and torch._C._get_function_stack_at(depth - 1) is mode:
        mode.__exit__(None, None, None)


# ---- carried inputs -----------------------------------------------------------------------------------------------
def _aliases(value: torch.Tensor, other: torch.Tensor) -> bool:
    """`value` is `other` detached: the same storage, place, shape, strides and dtype."""
    return (value.layout == other.layout == torch.strided and value.numel() > 0 and value.dtype == other.dtype
            and value.shape == other.shape and value.stride() == other.stride() and value.storage_offset() == other.storage_offset()
            and value.untyped_storage().data_ptr() == other.untyped_storage().data_ptr())


def carried_inputs(inputs: tuple, previous_outputs: list[torch.Tensor]) -> list[list[int]]:
    """Recording: which of a training call's input tensors are the previous call's outputs, repackaged (detached):
    [input leaf, output leaf] pairs, in the order tree_flatten gives them."""
    pairs = []
    for leaf_index, leaf in enumerate(tree_flatten(inputs)[0]):
        if isinstance(leaf, torch.Tensor):
            match = next((index for index, output in enumerate(previous_outputs) if _aliases(leaf, output)), None)
            if match is not None:
                pairs.append([leaf_index, match])
    return pairs


def fed_inputs(stored: tuple, carried: Any, previous_outputs: list[torch.Tensor]) -> tuple:
    """Replay: the inputs a training call runs on: the stored ones, but where the recorded input carried the previous
    call's output (`carried` pairs), that output of the previous call in this replayed line, when there is one."""
    if not previous_outputs or not carried:
        return stored
    leaves, spec = tree_flatten(stored)
    for leaf_index, output_index in carried:
        if leaf_index < len(leaves) and output_index < len(previous_outputs):
            leaves[leaf_index] = previous_outputs[output_index]
    return tree_unflatten(leaves, spec)


def carried_outputs(outputs: Any) -> list[torch.Tensor]:
    """A training call's outputs as the next call may carry them: detached (the graph is not kept), sharing storage."""
    return [tensor.detach() for tensor in tensors(outputs)]


# ---- numbers ----------------------------------------------------------------------------------------------------
_OURS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def loop_frame() -> Optional[types.FrameType]:
    """The frame of the user's code that called the model (the first one outside torch and replaybisect)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame = frame.f_back
    return frame


def names_read(code) -> set[str]:
    """The global names a code object and the code nested in it (comprehensions, lambdas) refer to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= names_read(constant)
    return names


def loop_numbers(frame: Optional[types.FrameType]) -> dict[str, float]:
    """The floats the loop's code (and the code nested in it) reads from its module's globals."""
    if frame is None:
        return {}
    namespace = frame.f_globals
    return {f"{GLOBAL}{name}": namespace[name] for name in sorted(names_read(frame.f_code))
            if type(namespace.get(name)) is float and not name.startswith("__")}


def set_loop_numbers(frame: Optional[types.FrameType], stored: Any) -> None:
    """Set the stored floats again, where the loop's code reads a float of that name today (nothing else is set)."""
    if frame is None or not isinstance(stored, dict):
        return
    current = loop_numbers(frame)
    for key, value in stored.items():
        if key in current and type(value) is float:
            frame.f_globals[key[len(GLOBAL):]] = value
