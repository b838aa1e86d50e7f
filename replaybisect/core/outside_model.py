"""What a loop recorded as it is written (record/inline.py) takes from outside its model's arguments, and how a
replay of it (core/inline_step.py) gives each back:

  targets   tensors the step's loss meets beside the model's outputs (`criterion(model(x), y)`: y). From a
            training call's return until the step's loss is backpropagated, a torch function mode sees each op
            that takes a tensor computed from the model's outputs; its other tensors (no gradient, no parameter,
            not the model's or the GradScaler's) are stored with the micro-batch, in the order the loop first
            uses them, and a replay puts the stored ones in their place in the same order.
  carried   a model input that is the previous training call's output, repackaged (an RNN's hidden state,
            detached): found by storage when recorded; a replay feeds that output of the call before it in the same
            replayed line (state.carry), so an ablation arm computes its own hidden states; after a restore (a
            snapshot, a probe's copy, an arm's start) there is none, and the stored input is fed.
  numbers   the floats the loop's code reads from its module (an lr a word_language_model-style loop anneals
            and applies by hand): stored as the step opens, set again at the replayed step's first training
            call, as the optimizer's lr is. Counters and flags (ints, bools) keep the replay's own values, so the script's
            loop, evaluations and iteration limit run as they do.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

CARRIED_OUTPUTS = "model outputs"  # state.carry: the last training call's outputs in this replayed line
GLOBAL = "global:"  # a stored number's key: "global:lr", as the step function form names them (user_step.step_variables)


def tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


_LEAF_TYPES = (torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None))


def leaves(value: Any) -> list:
    """`tree_flatten(value)[0]`: the same leaves in the same order (see plain_leaves)."""
    found = plain_leaves(value)
    return found if found is not None else tree_flatten(value)[0]


def plain_leaves(value: Any) -> Optional[list]:
    """`tree_flatten(value)[0]` walked directly where `value` is plain tuples, lists and dicts of tensors and numbers (a
    training call's inputs and outputs, a stored record, an op's arguments: several times a step, where pytree's
    general walk costs tens of microseconds); None for anything else (a namedtuple, an OrderedDict, a class registered
    with pytree such as a ModelOutput), which pytree walks."""
    found: list = []
    return found if _plain_leaves(value, found) else None


def _plain_leaves(value: Any, found: list) -> bool:
    kind = type(value)  # (loops, not all() over a generator: this runs some hundred times a step)
    if kind is tuple or kind is list or kind is dict:
        for item in (value.values() if kind is dict else value):
            if not _plain_leaves(item, found):
                return False
        return True
    if kind in _LEAF_TYPES:
        found.append(value)
        return True
    return False


def _plain_map(function: Callable[[Any], Any], value: Any) -> Any:
    """`tree_map(function, value)` for a `value` plain_leaves walks (the leaves in the same order)."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind([_plain_map(function, item) for item in value])
    if kind is dict:
        return {key: _plain_map(function, item) for key, item in value.items()}
    return function(value)


# ---- targets ----------------------------------------------------------------------------------------------------
class LossInputs(TorchFunctionMode):
    """One step's loss region, in the script's thread: followed from each training call's return (`follow`) until
    the step's loss is backpropagated. Its owner (record/inline.py, core/inline_step.RemoteStep) pauses it during
    the model's next call and for good at that backward (`pause`), so the outputs of every call of the step count
    (micro-batches whose losses are summed after all the calls). Each call's targets go with its micro-batch
    (`targets`): recording, copies are appended; replaying, the i-th target first used after that call is replaced
    by the i-th stored one."""

    def __init__(self, model_tensors: set[int], scaler, replaying: bool, on_error: Optional[Callable] = None):
        super().__init__()
        self._on_error = on_error  # replaying: an op of the loss raised (the recorded crash): what stands for its result
        self._state_ids = model_tensors  # the ids of the model's parameters and buffers (model_tensor_ids)
        self._scaler = scaler  # its scale is made at its first use: looked up then
        self._replaying = replaying
        self._kept: list[torch.Tensor] = []  # every tensor whose id is noted below, kept alive so no other takes its id
        self._derived: set[int] = set()  # tensors computed from the model's outputs in this region
        self._replaced: dict[int, torch.Tensor] = {}  # a target already met -> what stands for it
        self._targets: list = []
        self._taken = 0  # targets met since the current call's return
        self._output_rows: set[int] = set()  # the dim 0 of the model's outputs this step (its inputs' rows)
        self.active = False

    def follow(self, outputs: Any, targets: list) -> None:
        """A training call returned `outputs`; `targets` is its micro-batch's list. The mode is entered only on a
        mode stack holding none but our own (OWN_MODE: a probe's op finder): one the loop entered around the model's
        call (`with torch.device(...)`) would pop ours on its way out, so such a loop's targets are not followed (a
        replay of it reports that it diverged)."""
        for tensor in tensors(outputs):
            self._derive(tensor)
            if tensor.dim():
                self._output_rows.add(tensor.shape[0])
        self._targets, self._taken = targets, 0
        if only_own_modes():
            self.__enter__()
            self.active = True

    def pause(self) -> None:
        """Off while the model runs (its own ops are no loss's), or for good once the loss is backpropagated. Popped
        only when it is the innermost mode: a mode the loop entered after ours and left open keeps ours below it,
        idle."""
        if not self.active:
            return
        self.active = False
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is self:
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        plain = plain_leaves((args, kwargs))
        flat, spec = (plain, None) if plain is not None else tree_flatten((args, kwargs))
        if not any(isinstance(leaf, torch.Tensor) and id(leaf) in self._derived for leaf in flat):
            return func(*args, **kwargs)
        if spec is None:
            args, kwargs = _plain_map(self._target, (args, kwargs))
        else:
            args, kwargs = tree_unflatten([self._target(leaf) for leaf in flat], spec)
        try:
            result = func(*args, **kwargs)
        except Exception as error:
            if self._on_error is None:
                raise
            result = self._on_error(error)  # the step is over; the rest of the script's iteration runs idle on it
        for tensor in tensors(result):
            self._derive(tensor)
        return result

    def _derive(self, tensor: torch.Tensor) -> None:
        self._kept.append(tensor)
        self._derived.add(id(tensor))

    def _target(self, leaf: Any) -> Any:
        """A tensor meeting the model's outputs: a target unless it is computed from them, has gradients, or is
        the model's, a parameter of anything, or the GradScaler's scale."""
        if (not isinstance(leaf, torch.Tensor) or id(leaf) in self._derived or leaf.requires_grad
                or isinstance(leaf, torch.nn.Parameter) or id(leaf) in self._state_ids or self._scalers(leaf)):
            return leaf
        if id(leaf) not in self._replaced:
            index, self._taken = self._taken, self._taken + 1
            self._replaced[id(leaf)] = self._stored(index, leaf) if self._replaying else self._copied(leaf)
            self._kept.append(leaf)
        return self._replaced[id(leaf)]

    def _fits(self, stored: torch.Tensor, leaf: torch.Tensor) -> bool:
        if stored.shape == leaf.shape:
            return True
        return stored.dim() == leaf.dim() > 0 and stored.shape[1:] == leaf.shape[1:] and stored.shape[0] in self._output_rows

    def _scalers(self, leaf: torch.Tensor) -> bool:
        return any(leaf is getattr(self._scaler, name, None) for name in ("_scale", "_growth_tracker"))

    def _copied(self, leaf: torch.Tensor) -> torch.Tensor:
        self._targets.append(leaf.detach().clone())
        return leaf

    def _stored(self, index: int, leaf: torch.Tensor) -> torch.Tensor:
        """The stored target in `leaf`'s place, on its device; the live one where none of that shape and dtype was
        stored there (the loop took another path than the recording's: the replay's losses say so). Rows may differ
        where the model's outputs have the stored target's: the stored inputs hold other rows than the script's
        live batch (an ablation arm dropped some: skip-rows)."""
        stored = self._targets[index] if index < len(self._targets) else None
        if not isinstance(stored, torch.Tensor) or stored.dtype != leaf.dtype or not self._fits(stored, leaf):
            return leaf
        return stored.to(leaf.device)


def only_own_modes() -> bool:
    """No torch function mode but replaybisect's own (a probe's op finder, OWN_MODE) is entered in this thread."""
    depth = torch._C._len_torch_function_stack()
    return all(getattr(torch._C._get_function_stack_at(i), OWN_MODE, False) for i in range(depth))


OWN_MODE = "replaybisect_mode"  # a class attribute, True on our own TorchFunctionModes that LossInputs may sit above


class StepTargets:
    """A step's LossInputs as the recorder and the replay drive it alike: made at the step's first training call's
    return, paused at each later call, ended at the loss's backward or the step's end."""

    def __init__(self, model: torch.nn.Module, scaler, replaying: bool, on_error: Optional[Callable] = None):
        self._model_tensors = model_tensor_ids(model)
        self._scaler, self._replaying, self._on_error = scaler, replaying, on_error
        self._mode: Optional[LossInputs] = None

    def calling(self) -> None:
        if self._mode is not None:
            self._mode.pause()  # the model's own ops are no loss's

    def returned(self, outputs: Any, targets: list) -> None:
        if self._mode is None:
            self._mode = LossInputs(self._model_tensors, self._scaler, self._replaying, self._on_error)
        self._mode.follow(outputs, targets)

    def end(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.pause()


def model_tensor_ids(model: torch.nn.Module) -> set[int]:
    """What LossInputs never takes for a target: the model's parameters and buffers (taken once, not every step)."""
    return {id(tensor) for tensor in (*model.parameters(), *model.buffers())}


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
    for leaf_index, leaf in enumerate(leaves(inputs)):
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


def made_in_step(fed: tuple, live: tuple, outputs: list[torch.Tensor]) -> tuple:
    """Replay: where a training call's live input is what an earlier call of the same replayed step returned (as it
    is, or detached), that live input is fed, not the stored copy: it is the replay's own value, with its graph (a
    GAN's fakes: the generator's gradients come back through the discriminator)."""
    if not outputs:
        return fed
    fed_leaves, spec = tree_flatten(fed)
    live_leaves, live_spec = tree_flatten(live)
    if live_spec != spec:
        return fed
    for index, leaf in enumerate(live_leaves):
        if isinstance(leaf, torch.Tensor) and any(_aliases(leaf, output) for output in outputs):
            fed_leaves[index] = leaf
    return tree_unflatten(fed_leaves, spec)


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


@functools.lru_cache(maxsize=512)  # code objects live as long as their functions; read at every step's opening
def names_read(code) -> frozenset[str]:
    """The global names a code object and the code nested in it (comprehensions, lambdas) refer to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= names_read(constant)
    return frozenset(names)


def loop_numbers(frame: Optional[types.FrameType]) -> dict[str, float]:
    """The floats the loop's code reads from its module's globals: the names its code (and the code nested in it)
    refers to, and those of the module's functions it calls (an update by hand in a helper), as far as they go."""
    if frame is None:
        return {}
    namespace = frame.f_globals
    return {f"{GLOBAL}{name}": float(namespace[name]) for name in sorted(_module_names_read(frame.f_code, namespace))
            if isinstance(namespace.get(name), float) and not name.startswith("__")}


def _module_names_read(code, namespace: dict) -> set[str]:
    names, pending, seen = set(), [code], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in names_read(current):
            names.add(name)
            value = namespace.get(name)
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:  # the script's own function
                pending.append(value.__code__)
    return names


def set_loop_numbers(frame: Optional[types.FrameType], stored: Any) -> None:
    """Set the stored floats again, where the loop's code reads a float of that name today (nothing else is set)."""
    if frame is None or not isinstance(stored, dict):
        return
    current = loop_numbers(frame)
    for key, value in stored.items():
        if key in current and isinstance(value, float):
            frame.f_globals[key[len(GLOBAL):]] = value
