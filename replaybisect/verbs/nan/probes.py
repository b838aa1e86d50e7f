"""Probes for one training step: where does the first non-finite value appear?

Each probe only reads. Every pass that runs the step runs it through `loop.run_step` (the one code path) as
a `loop.StepObserver`, on a copy of the training state (`loop.clone_state`) and under `isolated_rng()` with
the step's RNG state restored, so a probe never changes the training state or any RNG stream; `replay nan`
checks this by re-running the plain step afterwards.

  probe_batch        which field, which rows of the batch are non-finite
  probe_state        parameters, buffers, optimizer state and grad scaler before the step
  StepProbe          one instrumented step: forward hooks on every module (first module whose output is
                     non-finite while its inputs were finite, with input/output statistics), the first
                     torch op whose output is non-finite from finite inputs (and the user's source line),
                     the loss, gradient hooks in backward order (first module whose gradient turns
                     non-finite while the gradient flowing into it was finite), the optimizer update
  anomaly_pass       the step's forward/backward under torch.autograd.detect_anomaly: the autograd op
                     (e.g. LogSoftmaxBackward0) and the forward line that created it
  finiteness         a cheap check of the whole state, used while replaying to find where state went bad

Other verbs (ablate, check, diagnose) may import these.
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from replaybisect.core import loop
from replaybisect.core.state import optimizer_tensors
from replaybisect.frames import is_ours, is_user_code

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # also when torch is not under site-packages (a source build)


# ---- small helpers ----------------------------------------------------------------------------------
def is_float(tensor: Any) -> bool:
    return torch.is_tensor(tensor) and (tensor.is_floating_point() or tensor.is_complex())


def all_finite(tensor: torch.Tensor) -> bool:
    return not is_float(tensor) or bool(torch.isfinite(tensor).all())


def tensors_in(value: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a nested tuple/list/dict (a batch, a module's inputs or outputs)."""
    if torch.is_tensor(value):
        return [(prefix or "tensor", value)]
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += tensors_in(item, f"{prefix}[{key!r}]" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found += tensors_in(item, f"{prefix}[{index}]" if prefix else f"[{index}]")
    return found


def autograd_nodes(loss: torch.Tensor):
    """Every autograd node behind `loss` (leaf accumulators excluded), each once."""
    seen = set()
    todo = [loss.grad_fn] if loss.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ != "AccumulateGrad":
            yield node
        todo += [next_node for next_node, _ in node.next_functions]


@dataclass
class TensorStats:
    """What a reader needs to see about a tensor that went (or did not go) non-finite."""

    shape: list[int]
    dtype: str
    nan: int
    inf: int
    min: Optional[float]  # over the finite entries
    max: Optional[float]
    abs_mean: Optional[float]

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0

    def brief(self) -> str:
        text = f"{self.dtype}{self.shape}"
        if self.finite:
            if self.min is not None:
                text += f" range [{self.min:.3g}, {self.max:.3g}] mean|x| {self.abs_mean:.3g}"
            return text
        counts = ", ".join(f"{count} {kind}" for kind, count in (("nan", self.nan), ("inf", self.inf)) if count)
        text += f" {self.nan + self.inf} of {math.prod(self.shape)} non-finite ({counts})"
        if self.min is not None:
            text += f"; the finite ones in [{self.min:.3g}, {self.max:.3g}], mean|x| {self.abs_mean:.3g}"
        return text


@torch.no_grad()
def tensor_stats(tensor: torch.Tensor) -> TensorStats:
    data = tensor.detach()
    shape = list(data.shape)
    if not is_float(data):
        return TensorStats(shape, str(data.dtype).replace("torch.", ""), 0, 0, None, None, None)
    data = data.float() if not data.is_complex() else data.abs().float()
    if data.numel() and bool(torch.isfinite(data).all()):  # the common case: no masking, one pass each
        nan = inf = 0
        low, high = (float(v) for v in torch.aminmax(data))
        return TensorStats(shape, str(tensor.dtype).replace("torch.", ""), 0, 0, low, high, float(data.abs().mean()))
    nan = int(torch.isnan(data).sum())
    inf = int(torch.isinf(data).sum())
    finite = data[torch.isfinite(data)]
    if finite.numel():
        low, high, abs_mean = float(finite.min()), float(finite.max()), float(finite.abs().mean())
    else:
        low = high = abs_mean = None
    return TensorStats(shape, str(tensor.dtype).replace("torch.", ""), nan, inf, low, high, abs_mean)


def user_frame(frames: list[traceback.FrameSummary]) -> Optional[traceback.FrameSummary]:
    """The innermost frame of the user's code inside the step: after replaybisect's own frames (whoever called
    replaybisect is not the step), and not torch, the standard library or installed packages. Our torch function
    modes pass a call through (a replay's stored loss targets): their frames are no caller."""
    ours = [i for i, frame in enumerate(frames) if is_ours(frame.filename) and frame.name != "__torch_function__"]
    if ours:
        frames = frames[ours[-1] + 1 :]
    return next((frame for frame in reversed(frames) if is_user_code(frame.filename, (_TORCH_DIR,))), None)


def format_frame(frame: Optional[traceback.FrameSummary]) -> Optional[str]:
    if frame is None:
        return None
    line = (frame.line or "").strip()
    return f"{frame.filename}:{frame.lineno} in {frame.name}" + (f": {line}" if line else "")


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", None) or ""
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if module in ("torch._C._nn", "torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    return name


def param_names(state: "loop.TrainState") -> dict[int, str]:
    return {id(param): name for name, param in state.model.named_parameters()}


def owner_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def display_module(name: str, model: torch.nn.Module | None = None) -> str:
    if name:
        return name
    return f"(root) {type(model).__name__}" if model is not None else "(root)"


# ---- the batch ------------------------------------------------------------------------------------------


@dataclass
class BatchFinding:
    field: str  # e.g. "[0]" (inputs of a tuple batch) or "input" (a dict batch)
    rows: list[int]  # positions in the batch (dim 0) holding a non-finite value
    nan: int
    inf: int
    shape: list[int]
    dataset_rows: Optional[list[int]] = None  # the dataset indices of those rows, when the data order is known
    rank: Optional[int] = None  # a distributed run: the rank whose batch it is


def probe_batch(batch: Any, dataset_indices: Optional[list[int]] = None) -> list[BatchFinding]:
    from replaybisect.core import ranks, user_step

    if ranks.is_ranks_record(batch):  # a distributed run's global step: each rank's own batch
        findings = []
        for rank, record in enumerate(ranks.rank_records(batch)):
            for finding in probe_batch(user_step.data_of(user_step.unpack(record)[0])):
                finding.field, finding.rank = f"rank {rank}'s {finding.field}", rank
                findings.append(finding)
        return findings
    findings = []
    for name, tensor in batch_fields(user_step.data_of(user_step.unpack(batch)[0])):
        if not is_float(tensor) or all_finite(tensor):
            continue
        rows = nonfinite_rows(tensor) if tensor.dim() else [0]
        findings.append(
            BatchFinding(
                field=name,
                rows=rows,
                nan=int(torch.isnan(tensor).sum()),
                inf=int(torch.isinf(tensor).sum()),
                shape=list(tensor.shape),
                dataset_rows=[int(dataset_indices[r]) for r in rows] if dataset_indices is not None and tensor.dim() else None,
            )
        )
    return findings


def batch_fields(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a step's batch, named as the user's code sees it: batch[0] (inputs) of a
    (inputs, targets) batch; a loop recorded as written: what it passed the model, model(arg 0) or model(ids=), and
    the targets its loss met outside the model (loss target 0), "micro-batch N:" first where the step made several training calls."""
    from replaybisect.core.inline_step import ARGS, KWARGS, OUTSIDE

    if isinstance(batch, list) and batch and all(isinstance(call, dict) and ARGS in call for call in batch):
        fields = []
        for index, call in enumerate(batch):
            where = f"micro-batch {index}: " if len(batch) > 1 else ""
            for position, value in enumerate(call[ARGS]):
                fields += tensors_in(value, f"{where}model(arg {position})")
            for key, value in (call.get(KWARGS) or {}).items():
                fields += tensors_in(value, f"{where}model({key}=)")
            for position, value in enumerate(call.get(OUTSIDE) or []):
                fields += tensors_in(value, f"{where}loss target {position}")
        return fields
    roles = {"batch[0]": "batch[0] (inputs)", "batch[1]": "batch[1] (targets)"} if isinstance(batch, (tuple, list)) and len(batch) == 2 else {}
    return [(roles.get(name, name), tensor) for name, tensor in tensors_in(batch, "batch")]


def nonfinite_rows(tensor: torch.Tensor, limit: Optional[int] = None) -> list[int]:
    """The positions along dim 0 of a tensor (with one) that hold a non-finite value, the first `limit` of them."""
    bad = ~torch.isfinite(tensor.detach())
    rows = bad.reshape(len(tensor), -1).any(dim=1).nonzero().flatten()
    return rows[:limit].tolist()


# ---- the state before the step ----------------------------------------------------------------------------
@dataclass
class StateFinding:
    kind: str  # parameter | buffer | optimizer state | grad scaler | param group
    name: str
    module: str
    nan: int
    inf: int
    numel: int


def probe_state(state: "loop.TrainState") -> list[StateFinding]:
    """Every non-finite tensor a step reads: parameters, buffers, optimizer moments, the grad scale, lr."""
    findings = []
    for name, param in state.model.named_parameters():
        if not all_finite(param):
            findings.append(StateFinding("parameter", name, owner_of(name), int(param.isnan().sum()), int(param.isinf().sum()), param.numel()))
    for name, buffer in state.model.named_buffers():
        if not all_finite(buffer):
            findings.append(StateFinding("buffer", name, owner_of(name), int(buffer.isnan().sum()), int(buffer.isinf().sum()), buffer.numel()))
    names = param_names(state)
    for param, key, value in optimizer_tensors(state.optimizer):
        if not all_finite(value):
            pname = names.get(id(param), "?") if param is not None else "optimizer.state"  # (an entry of its own)
            findings.append(StateFinding("optimizer state", f"{pname}:{key}", owner_of(pname) if param is not None else "",
                                         int(value.isnan().sum()), int(value.isinf().sum()), value.numel()))
    for index, group in enumerate(state.optimizer.param_groups):
        for key in ("lr", "eps", "weight_decay", "momentum"):
            value = group.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                findings.append(StateFinding("param group", f"param_groups[{index}].{key}={value}", "", int(math.isnan(value)), int(math.isinf(value)), 1))
    if state.scaler is not None and state.scaler.is_enabled():
        scale = state.scaler.get_scale()
        if not math.isfinite(scale):
            findings.append(StateFinding("grad scaler", f"scale={scale}", "", int(math.isnan(scale)), int(math.isinf(scale)), 1))
    return findings


@torch.no_grad()
def finiteness(state: "loop.TrainState") -> bool:
    """True when parameters, buffers and optimizer tensors are all finite (one fused reduction per group)."""
    tensors = [t for t in state.model.parameters() if is_float(t)] + [t for t in state.model.buffers() if is_float(t)]
    tensors += [value for _, _, value in optimizer_tensors(state.optimizer) if is_float(value)]
    if not tensors:
        return True
    # isfinite, not a norm: a norm of large finite values can overflow to Inf and look corrupt
    return all(bool(torch.isfinite(t).all()) for t in tensors)
