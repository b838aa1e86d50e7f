"""One instrumented replay of the failing step: every module's forward and backward watched, the first op that
makes a non-finite value from finite inputs named (with its frame), the optimizer's update explained."""

from __future__ import annotations

import contextlib
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from replaybisect.core.shards import local
from replaybisect.core import loop
from replaybisect.verbs.nan.probes import (StateFinding, TensorStats, all_finite, autograd_nodes, display_module,
    format_frame, is_float, nonfinite_rows, op_name, owner_of, param_names, probe_state, tensor_stats, tensors_in,
    user_frame)


# ---- one instrumented step -------------------------------------------------------------------------------
@dataclass
class ModuleCall:
    """One module call in the forward pass, in the order calls finished."""

    order: int
    module: str
    type: str
    inputs: list[tuple[str, TensorStats]]
    outputs: list[tuple[str, TensorStats]]
    own_state_went_nonfinite: list[str] = field(default_factory=list)  # own params/buffers it made non-finite

    @property
    def inputs_finite(self) -> bool:
        return all(stats.finite for _, stats in self.inputs)

    @property
    def outputs_finite(self) -> bool:
        return all(stats.finite for _, stats in self.outputs)


@dataclass
class OpFinding:
    """The first torch op whose output is non-finite while its tensor inputs were finite."""

    op: str
    module: Optional[str]  # the module whose forward ran it ("" the root model; None outside the model)
    source: Optional[str]  # the user's line
    inputs: list[TensorStats]
    output: TensorStats
    calls_done: int = 0  # module calls finished before it (its module's call is the next one of that name)
    rows: list[int] = field(default_factory=list)  # the positions along its output's dim 0 that are non-finite


@dataclass
class GradEvent:
    order: int
    role: str  # grad_output | grad_input | param_grad
    module: str
    tensor: str  # which input/output/parameter
    finite: bool
    norm: float
    key: int = 0  # identity of the tensor (events of one tensor fire together)


@dataclass
class StepProbeResult:
    loss: float
    loss_finite: bool
    forward_calls: list[ModuleCall]
    first_forward: Optional[ModuleCall]  # first call whose output is non-finite while its inputs were finite
    first_nonfinite_output: Optional[ModuleCall]  # first call with a non-finite output at all
    forward_op: Optional[OpFinding]
    model_output_finite: Optional[bool]  # the root model's output (None when the step never called it)
    grad_events: list[GradEvent]
    backward_module: Optional[str]
    backward_detail: Optional[str]
    backward_node: Optional[str]  # the first autograd node whose output is non-finite from finite inputs
    layer_grad_norms: dict[str, float]  # per module (own parameters), at this step
    grad_norm: Optional[float]
    grads_finite: Optional[bool]
    update: Optional["UpdateFinding"]
    corrupted_in_forward: list[tuple[str, list[str]]]  # (module, own tensors it made non-finite)
    intended_nonfinite: list[str] = field(default_factory=list)  # ops that made non-finite values on request


@dataclass
class UpdateFinding:
    """The optimizer update of a step whose gradients were finite."""

    params_finite_after: bool
    state_finite_after: bool
    bad: list[StateFinding]
    hyperparameters: dict[str, Any]
    explanation: Optional[str]


MAX_ROWS = 64  # a fault with more non-finite rows than this is not keyed on a few rows of its batch


class _OpFinder(TorchFunctionMode):
    """Sees every torch call in the forward and the loss; records each op that made a non-finite value nobody
    asked for, and which of them each non-finite tensor descends from.

    An op is a fault when its output holds a non-finite value that none of its inputs explains (for a
    pointwise op, at the same position; for any other op, no non-finite input at all) and the op was not
    asked for one: `masked_fill(mask, -inf)`, `torch.full(..., -inf)` or `torch.where(m, x, -inf)` make the
    intended -inf of a causal mask, which a softmax then absorbs. So the hand-written `exp(att)` that
    overflows after such a mask is the fault, and the mask is not."""

    MAX_TRACKED = 4096  # non-finite tensors kept for lineage (a failing step has few)
    replaybisect_mode = True  # outside_model.OWN_MODE: a replay's stored loss targets are taken in above it

    def __init__(self, current_module, calls_done=lambda: 0):
        super().__init__()
        self.current_module = current_module
        self.calls_done = calls_done
        self.faults: list[OpFinding] = []  # in execution order
        self.intended: list[str] = []  # ops that made non-finite values on request (e.g. a -inf mask)
        self.lineage: dict[int, tuple[torch.Tensor, frozenset]] = {}  # id -> (tensor kept alive, fault indices)
        self.paused = 0
        self.raised: Optional[RaisedOp] = None  # the first torch call that raised (a crashed step)

    @property
    def found(self) -> Optional[OpFinding]:
        return self.faults[0] if self.faults else None

    def faults_behind(self, tensor: Any) -> list[OpFinding]:
        """The faults whose non-finite values reached `tensor` (e.g. the loss), first first."""
        entry = self.lineage.get(id(tensor)) if torch.is_tensor(tensor) else None
        if entry is None or entry[0] is not tensor:
            return []
        return [self.faults[i] for i in sorted(entry[1])]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as error:
            if self.raised is None and not self.paused:
                self.raised = raised_op(func, args, kwargs or {}, error, self.current_module())
            raise
        if self.paused:
            return out
        self.paused += 1
        try:
            self._see(func, args, kwargs or {}, out)
        finally:
            self.paused -= 1
        return out

    def _see(self, func, args, kwargs, out) -> None:
        bad_outputs = [t for _, t in tensors_in(out) if is_float(t) and not all_finite(t)]
        if not bad_outputs:
            return
        inputs = [t for _, t in tensors_in(list(args) + list(kwargs.values())) if is_float(t)]
        inherited: set[int] = set()
        for tensor in inputs:
            entry = self.lineage.get(id(tensor))
            if entry is not None and entry[0] is tensor:
                inherited |= entry[1]
        if _makes_new_nonfinite(func, inputs, bad_outputs):
            if _asks_for_nonfinite(args, kwargs):
                self.intended.append(op_name(func))
            else:
                inherited.add(len(self.faults))
                self.faults.append(
                    OpFinding(
                        op=op_name(func),
                        module=self.current_module(),
                        source=format_frame(user_frame(traceback.extract_stack()[:-2])),
                        inputs=[tensor_stats(t) for t in inputs[:4]],
                        output=tensor_stats(bad_outputs[0]),
                        calls_done=self.calls_done(),
                        rows=nonfinite_rows(bad_outputs[0], MAX_ROWS + 1) if bad_outputs[0].dim() else [],
                    )
                )
        if len(self.lineage) < self.MAX_TRACKED:
            for tensor in bad_outputs:
                self.lineage[id(tensor)] = (tensor, frozenset(inherited))


@dataclass
class RaisedOp:
    """The torch call that raised in a crashed step: the op, the module whose forward ran it, the user's line, its
    tensor inputs (shape, dtype, value range) and the error."""

    op: str
    module: Optional[str]
    source: Optional[str]
    inputs: list[str]
    error: str


def raised_op(func, args, kwargs, error: BaseException, module: Optional[str]) -> RaisedOp:
    from replaybisect.frames import error_message

    inputs = [f"{name}: {value_brief(tensor)}" for name, tensor in tensors_in(list(args) + list(kwargs.values()), "arg")[:4]]
    return RaisedOp(op_name(func), module, format_frame(user_frame(traceback.extract_stack()[:-2])), inputs,
                    f"{type(error).__name__}: {error_message(error)}")


@torch.no_grad()
def value_brief(tensor: torch.Tensor) -> str:
    """dtype[shape] and the range of its values (integers too: an index out of range shows in it)."""
    if is_float(tensor):
        return tensor_stats(tensor).brief()
    text = f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"
    if tensor.numel() and tensor.dtype != torch.bool and not tensor.is_complex():
        low, high = (int(v) for v in torch.aminmax(tensor.detach()))
        text += f" range [{low}, {high}]"
    return text


# Ops whose output element i depends on input element i only (after broadcasting), besides aten's pointwise tag.
_ELEMENTWISE_EXTRA = {"to", "float", "half", "double", "bfloat16", "type", "clone", "contiguous", "detach", "type_as"}
_DUNDER_ALIASES = {"truediv": "div", "floordiv": "floor_divide", "matmul": "matmul", "neg": "neg", "abs": "abs"}
_POINTWISE_CACHE: dict[str, bool] = {}


def _is_pointwise(func) -> bool:
    name = getattr(func, "__name__", "") or ""
    if name not in _POINTWISE_CACHE:
        base = name
        if base.startswith("__") and base.endswith("__"):
            base = base[2:-2]
            if base.startswith("r") and base[1:] in ("add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "mod"):
                base = base[1:]
            if base.startswith("i") and base[1:] in ("add", "sub", "mul", "truediv", "floordiv", "pow", "mod"):
                base = base[1:]
            base = _DUNDER_ALIASES.get(base, base)
        base = base.rstrip("_")
        pointwise = base in _ELEMENTWISE_EXTRA
        packet = getattr(torch.ops.aten, base, None) if base and not pointwise else None
        if packet is not None:
            try:
                pointwise = any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
            except Exception:
                pointwise = False
        _POINTWISE_CACHE[name] = pointwise
    return _POINTWISE_CACHE[name]


@torch.no_grad()
def _makes_new_nonfinite(func, inputs: list[torch.Tensor], bad_outputs: list[torch.Tensor]) -> bool:
    """True when an output's non-finite values are not explained by non-finite inputs: with all inputs finite;
    for a pointwise op, at a position where every (broadcast) input was finite. Any other op that reads a
    non-finite input (a matmul, a reduction, a softmax) passes it on: not new."""
    nonfinite_inputs = [t for t in inputs if not all_finite(t)]
    if not nonfinite_inputs:
        return True
    if not _is_pointwise(func):
        return False
    for output in bad_outputs:
        try:
            explained = torch.zeros(output.shape, dtype=torch.bool, device=output.device)
            for tensor in nonfinite_inputs:
                explained |= ~torch.isfinite(tensor.detach()).broadcast_to(output.shape)
        except RuntimeError:  # shapes that do not line up: cannot map positions
            return False
        if bool((~torch.isfinite(output.detach()) & ~explained).any()):
            return True
    return False


def _asks_for_nonfinite(args, kwargs) -> bool:
    """A non-finite number among an op's arguments (a fill value, a -inf mask value): the caller asked for it."""
    def nonfinite_scalar(value) -> bool:
        if isinstance(value, float):
            return not math.isfinite(value)
        if torch.is_tensor(value) and value.numel() == 1 and is_float(value):
            return not bool(torch.isfinite(value).all())
        if isinstance(value, (list, tuple)):
            return any(nonfinite_scalar(item) for item in value)
        return False

    return any(nonfinite_scalar(value) for value in list(args) + list(kwargs.values()))


class StepProbe(loop.StepObserver):
    """Run one step (`loop.run_step`) on a COPY of the state with hooks on every module (model and loss), every
    gradient and every autograd node, and a look at the optimizer update. Returns what it saw; it never stops at
    the first problem, so the report can show the whole picture."""

    def __init__(self, state: "loop.TrainState"):
        self.state = state
        self.model = state.model
        self.modules = [(name, module) for name, module in state.model.named_modules()]
        if isinstance(state.loss_fn, torch.nn.Module):
            self.modules += [("loss" + (f".{n}" if n else ""), m) for n, m in state.loss_fn.named_modules()]
        self.calls: list[ModuleCall] = []
        self.stack: list[str] = []
        self.grad_events: list[GradEvent] = []
        self.node_finding: Optional[str] = None
        self.handles: list[Any] = []
        self.tensor_handles: list[Any] = []
        self.corrupted: list[tuple[str, list[str]]] = []
        self._own_before: dict[str, dict[str, bool]] = {}
        self._keep_alive: list[torch.Tensor] = []
        # the module whose forward runs an op; None outside the model (the loss function, the step function)
        self.finder = _OpFinder(lambda: self.stack[-1] if self.stack else None, lambda: len(self.calls))
        self.loss_faults: list[OpFinding] = []
        self.layer_norms: dict[str, float] = {}
        self.grads_finite: Optional[bool] = None  # every gradient element finite after backward (None: no gradients)
        self.update_watch: Optional[UpdateWatch] = None
        self.update: Optional[UpdateFinding] = None

    # forward hooks ----------------------------------------------------------------------------------
    def _pre_hook(self, name: str, module: torch.nn.Module):
        def hook(mod, args, kwargs):
            self.finder.paused += 1
            try:
                self.stack.append(name)
                self._own_before[name] = {n: all_finite(t) for n, t in self._own_tensors(mod)}
                for label, tensor in _call_inputs(args, kwargs):
                    if tensor.requires_grad:
                        self._grad_hook(tensor, "grad_input", name, label)
            finally:
                self.finder.paused -= 1

        return hook

    def _post_hook(self, name: str, module: torch.nn.Module):
        def hook(mod, args, kwargs, output):
            self.finder.paused += 1
            try:
                if self.stack and self.stack[-1] == name:
                    self.stack.pop()
                went_bad = [n for n, t in self._own_tensors(mod) if self._own_before.get(name, {}).get(n, True) and not all_finite(t)]
                if went_bad:
                    self.corrupted.append((name, went_bad))
                self.calls.append(
                    ModuleCall(
                        order=len(self.calls),
                        module=name,
                        type=type(mod).__name__,
                        inputs=[(label, tensor_stats(t)) for label, t in _call_inputs(args, kwargs) if is_float(t)][:8],
                        outputs=[(label, tensor_stats(t)) for label, t in tensors_in(output, "output") if is_float(t)][:8],
                        own_state_went_nonfinite=went_bad,
                    )
                )
                for label, tensor in tensors_in(output, "output"):
                    if tensor.requires_grad:
                        self._grad_hook(tensor, "grad_output", name, label)
            finally:
                self.finder.paused -= 1

        return hook

    @staticmethod
    def _own_tensors(module: torch.nn.Module):
        return [(f"param {n}", p) for n, p in module.named_parameters(recurse=False)] + [
            (f"buffer {n}", b) for n, b in module.named_buffers(recurse=False)
        ]

    # gradient hooks -----------------------------------------------------------------------------------
    def _grad_hook(self, tensor: torch.Tensor, role: str, module: str, label: str) -> None:
        self._keep_alive.append(tensor)  # ids stay unique while the pass runs
        key = id(tensor)

        def hook(grad):
            if grad is not None:
                finite = all_finite(grad)
                norm = float(torch.linalg.vector_norm(grad.detach().float())) if finite else math.nan
                self.grad_events.append(GradEvent(len(self.grad_events), role, module, label, finite, norm, key))
            return None

        self.tensor_handles.append(tensor.register_hook(hook))

    def _node_hooks(self, loss: torch.Tensor) -> None:
        """A post-hook on every autograd node: the first node with finite incoming gradients and a
        non-finite result names the backward op (Inf as well as NaN, unlike detect_anomaly)."""
        for node in autograd_nodes(loss):
            self.tensor_handles.append(node.register_hook(self._node_hook(node)))

    def _node_hook(self, node):
        def hook(grad_inputs, grad_outputs):
            if self.node_finding is None:
                incoming_ok = all(all_finite(g) for g in grad_outputs if g is not None)
                outgoing_ok = all(all_finite(g) for g in grad_inputs if g is not None)
                if incoming_ok and not outgoing_ok:
                    self.node_finding = type(node).__name__
            return None

        return hook

    # the step: loop.run_step with this probe as its observer -------------------------------------------
    @contextlib.contextmanager
    def forward_context(self, state):
        for name, module in self.modules:
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(name, module), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_hook(name, module), with_kwargs=True))
        try:
            with self.finder:
                yield
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def after_forward(self, state, loss: torch.Tensor) -> None:
        self.loss_faults = self.finder.faults_behind(loss)
        if loss.requires_grad:
            self._node_hooks(loss)

    def after_backward(self, state) -> None:
        from replaybisect.core.guard import gradients

        self.layer_norms = per_module_grad_norms(state)
        grads = gradients(state.params)
        # by element: a total norm of finite gradients can overflow fp32 and is no fault (core/guard.py)
        self.grads_finite = all(bool(torch.isfinite(g).all()) for g in grads) if grads else None

    def before_update(self, state, outcome: "loop.StepOutcome") -> None:
        if math.isfinite(outcome.loss) and self.grads_finite is not False:
            self.update_watch = UpdateWatch(state)

    def after_update(self, state) -> None:
        if self.update_watch is not None:
            self.update = self.update_watch.finding(state)

    def run(self, step: int, batch: Any) -> StepProbeResult:
        """The step, instrumented: it runs on through a non-finite loss so backward and the update are seen too."""
        names = param_names(self.state)
        for param in self.state.params:
            if param.requires_grad:
                pname = names.get(id(param), "?")
                self._grad_hook(param, "param_grad", owner_of(pname), pname)
        try:
            outcome = loop.run_step(self.state, step, batch, halt_on_nonfinite=False, observer=self)
        finally:
            for handle in self.handles + self.tensor_handles:
                handle.remove()
            self.handles, self.tensor_handles = [], []

        root_calls = [c for c in self.calls if c.module == ""]
        # the op: the first fault on the path to the non-finite loss, else the first fault at all; its module's
        # call (the next one of that name to finish) is the module reported, so module and op agree
        forward_op = self.loss_faults[0] if self.loss_faults else self.finder.found
        if forward_op is not None:
            first_forward = None
            if forward_op.module is not None:
                first_forward = next((c for c in self.calls[forward_op.calls_done:] if c.module == forward_op.module), None)
        else:
            first_forward = next((c for c in self.calls if c.inputs_finite and not c.outputs_finite), None)
        first_bad = next((c for c in self.calls if not c.outputs_finite), None)
        backward_module, backward_detail = self._backward_culprit()
        return StepProbeResult(
            loss=outcome.loss,
            loss_finite=math.isfinite(outcome.loss),
            forward_calls=self.calls,
            first_forward=first_forward,
            first_nonfinite_output=first_bad,
            forward_op=forward_op,
            intended_nonfinite=list(dict.fromkeys(self.finder.intended)),
            model_output_finite=all(c.outputs_finite for c in root_calls) if root_calls else None,  # every micro-batch
            grad_events=self.grad_events,
            backward_module=backward_module,
            backward_detail=backward_detail,
            backward_node=self.node_finding,
            layer_grad_norms=self.layer_norms,
            grad_norm=outcome.grad_norm,
            grads_finite=self.grads_finite if outcome.grad_norm is not None else None,
            update=self.update,
            corrupted_in_forward=self.corrupted,
        )

    def _backward_culprit(self) -> tuple[Optional[str], Optional[str]]:
        """The first module, in backward order, whose gradient turns non-finite while the gradient flowing
        into it (w.r.t. its output) was finite."""
        first_bad = next((e for e in self.grad_events if not e.finite), None)
        if first_bad is None:
            return None, None
        # events of one tensor fire together: a non-finite gradient arriving at module N's output was made
        # by whatever consumed that output: a module (its grad_input event) or a functional op in N's parent
        same_time = [e for e in self.grad_events[first_bad.order :] if not e.finite and e.key == first_bad.key]
        consumer = next((e for e in same_time if e.role == "grad_input"), None)
        if first_bad.role == "param_grad":
            return first_bad.module, f"the gradient of parameter {first_bad.tensor} is non-finite while the gradient into {display_module(first_bad.module, self.model)}'s output was finite"
        if first_bad.role == "grad_input" or consumer is not None:
            event = consumer or first_bad
            return event.module, f"gradient w.r.t. its input {event.tensor} is non-finite while the gradient w.r.t. its output was finite"
        parent = first_bad.module.rsplit(".", 1)[0] if "." in first_bad.module else ""
        if parent == first_bad.module:
            parent = ""
        return parent, f"the gradient arriving at {display_module(first_bad.module, self.model)}'s output is non-finite: an op in the forward of {display_module(parent, self.model)} made it"


def _call_inputs(args, kwargs) -> list[tuple[str, torch.Tensor]]:
    found = tensors_in(list(args), "input")
    return found + tensors_in(dict(kwargs), "input") if kwargs else found


@torch.no_grad()
def per_module_grad_norms(state: "loop.TrainState") -> dict[str, float]:
    norms = {}
    seen: set[int] = set()  # a tied weight (lm_head.weight is wte.weight) counts for its first module only
    for name, module in state.model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        grads = [p.grad.detach().float() for p in own if p.grad is not None]
        if grads:
            norms[name or "(root)"] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    return norms


class UpdateWatch:
    """The optimizer update of a step whose gradients were finite: made right before the update (gradients
    already clipped), asked after it which parameters or moments went non-finite and why."""

    def __init__(self, state: "loop.TrainState"):
        self.before = {id(p): p.detach().clone() for p in state.params}
        self.grads_before = {id(p): (p.grad.detach().clone() if p.grad is not None else None) for p in state.params}
        self.hyperparameters = hyperparameters(state)  # the lr the update uses, before the scheduler moves it

    def finding(self, state: "loop.TrainState") -> UpdateFinding:
        bad = [f for f in probe_state(state) if f.kind in ("parameter", "optimizer state")]
        return UpdateFinding(
            params_finite_after=not any(f.kind == "parameter" for f in bad),
            state_finite_after=not any(f.kind == "optimizer state" for f in bad),
            bad=bad,
            hyperparameters=self.hyperparameters,
            explanation=explain_update(state, bad, self.before, self.grads_before, self.hyperparameters.get("lr", math.nan)) if bad else None,
        )


def hyperparameters(state: "loop.TrainState") -> dict[str, Any]:
    group = state.optimizer.param_groups[0]
    keep = {}
    for key in ("lr", "eps", "betas", "weight_decay", "momentum"):
        if key in group:
            value = group[key]
            keep[key] = float(value) if torch.is_tensor(value) else value
    keep["optimizer"] = type(state.optimizer).__name__
    return keep


@torch.no_grad()
def explain_update(state, bad: list[StateFinding], before: dict, grads_before: dict, lr: float) -> str:
    """Name the arithmetic that failed: lr not finite, or Adam's 0/0 where eps=0 meets zero second moments."""
    group = state.optimizer.param_groups[0]
    lr = float(lr)
    if not math.isfinite(lr):
        return f"the learning rate is {lr}: every update is non-finite"
    names = {name: p for name, p in state.model.named_parameters()}
    for finding in bad:
        pname = finding.name.split(":")[0]
        param = names.get(pname)
        if param is None:
            continue
        grad, old = grads_before.get(id(param)), before.get(id(param))
        moments = {key: local(value) if torch.is_tensor(value) else value for key, value in state.optimizer.state.get(param, {}).items()}
        # a sharded parameter (fully_shard over the replay's one rank): its local tensor is all of it
        param, grad, old = (local(tensor) if tensor is not None else None for tensor in (param, grad, old))
        bad_entries = ~torch.isfinite(param)
        if old is not None and not torch.isfinite(old[bad_entries]).all():
            continue
        eps = group.get("eps")
        if "exp_avg_sq" in moments and eps is not None and float(eps) == 0.0:
            zero_v = int((moments["exp_avg_sq"][bad_entries] == 0).sum())
            zero_g = int((grad[bad_entries] == 0).sum()) if grad is not None else 0
            if zero_v:
                return (
                    f"{type(state.optimizer).__name__} with eps=0: {zero_v} entries of {pname} have exp_avg_sq == 0 "
                    f"({zero_g} of them had a zero gradient), so the update m / (sqrt(v) + eps) is 0/0 = NaN"
                )
        if grad is not None:
            return (
                f"{pname}: finite gradient (max |g| {float(grad.abs().max()):.3g}) and finite weights before the update, "
                f"{finding.nan} NaN / {finding.inf} Inf after it (lr={lr:g}, eps={group.get('eps')})"
            )
    return "finite gradients and weights before the update, non-finite after it"
