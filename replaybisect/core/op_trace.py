"""The ops of one training step, each with a digest of its outputs and the line of the user's code that called it:
what `replay bisect` compares between the last good commit and the first bad one to name the first op whose numbers
the commit changed (torchtitan's numerics debugging hashes each op's outputs the same way).

    REPLAYBISECT_OP_TRACE=/path/ops.json   the first step (0) of `replay train` traced into that file

Unset (always, but in a bisect's numerics trial): one check of a module global per step."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import traceback
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from replaybisect.frames import is_ours, is_user_code

ENV = "REPLAYBISECT_OP_TRACE"
TRACED_STEP = 0
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TARGET: Optional[str] = os.environ.get(ENV) or None


def digest(value: Any) -> str:
    """A short hash of every tensor's bytes in `value` (its shape and dtype too)."""
    hashed = hashlib.sha1()
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().to("cpu").contiguous().reshape(-1)
            hashed.update(f"{tuple(leaf.shape)}{leaf.dtype}".encode())
            hashed.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return hashed.hexdigest()[:16]


_MODEL_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                    for name in ("models", "data"))  # the built-in models' code is a model's code too


def _caller() -> Optional[str]:
    """`file:line  code` of the innermost frame of the model's code in the current stack: the user's, or a built-in
    model's (not torch, not the recorder's)."""
    stack = traceback.extract_stack()[:-3]
    for frame in reversed(stack):
        model_code = frame.filename.startswith(_MODEL_DIRS) or (is_user_code(frame.filename, (_TORCH_DIR,))
                                                                and not is_ours(frame.filename))
        if model_code:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}  {(frame.line or '').strip()}"
    for frame in reversed(stack):  # no model code on the stack: PyTorch's own (an optimizer's update), by its file
        relative = os.path.relpath(frame.filename, _TORCH_DIR) if frame.filename.startswith(_TORCH_DIR) else None
        if relative and not any(part.startswith("_") for part in relative.split(os.sep)):  # (its wrappers: _compile, _ops)
            return f"torch/{relative}:{frame.lineno}  {(frame.line or '').strip()}"
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append({"op": str(func.overloadpacket.__name__), "out": digest(out), "at": _caller()})
        return out


_UNTRACED = contextlib.nullcontext()  # every other step: no context made, nothing read


def traced(step: int):
    """A context tracing the step's ops into $REPLAYBISECT_OP_TRACE when it is set and `step` is the traced one."""
    if _TARGET is None or step != TRACED_STEP:
        return _UNTRACED
    return _written(_TARGET)


@contextlib.contextmanager
def _written(target: str) -> Iterator[None]:
    recorder = _Recorder()
    with recorder:
        yield
    with open(target, "w", encoding="utf-8") as file:
        json.dump(recorder.ops, file)


def first_difference(good: list[dict[str, Any]], bad: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The first op whose name or outputs differ between two traces of the same step, with both sides; None when
    the traces are the same."""
    for index, (before, after) in enumerate(zip(good, bad)):
        if before["op"] != after["op"] or before["out"] != after["out"]:
            return {"index": index, "good": before, "bad": after, "same_op": before["op"] == after["op"]}
    if len(good) != len(bad):
        index = min(len(good), len(bad))
        return {"index": index, "good": good[index] if index < len(good) else None, "bad": bad[index] if index < len(bad) else None,
                "same_op": False}
    return None


def aligned(good: list[dict[str, Any]], bad: list[dict[str, Any]], around: int = 25) -> list[dict[str, Any]]:
    """The two traces side by side, aligned by op name (difflib: an op the commit added or removed leaves a gap on one
    side), cut to `around` rows before and after the first row that differs; each row {"good", "bad", "same"}."""
    import difflib

    matcher = difflib.SequenceMatcher(None, [op["op"] for op in good], [op["op"] for op in bad], autojunk=False)
    rows: list[dict[str, Any]] = []
    for tag, good_start, good_end, bad_start, bad_end in matcher.get_opcodes():
        for offset in range(max(good_end - good_start, bad_end - bad_start)):
            before = good[good_start + offset] if good_start + offset < good_end else None
            after = bad[bad_start + offset] if bad_start + offset < bad_end else None
            rows.append({"good": before, "bad": after,
                         "same": tag == "equal" and before is not None and after is not None and before["out"] == after["out"]})
    first = next((index for index, row in enumerate(rows) if not row["same"]), None)
    return [] if first is None else rows[max(0, first - around): first + around]
