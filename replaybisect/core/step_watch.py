"""The moments of one optimizer step, written once for every path that runs one: the built-in step
(`core/loop.py` `run_step`), the user's own step (`core/user_step.py`: recorded by `Recorder`, replayed for
`Recorder` and Lightning runs) and the Lightning callback while the Trainer records (`record/lightning.py`).

  forward       an observer's forward_context is open around each forward (closed when the loss is backpropagated)
  loss(t)       each loss about to be backpropagated: after_forward, the step's running loss, the non-finite loss rule
  gradients()   gradients unscaled, before any clip: the total norm, after_backward, the non-finite gradient rule
                (core/guard.py), then an ablation arm's clip (`train.clip_grad_norm`) and before_update
  updated()     the optimizer applied its update: after_update
  settle()      after the step: whether an enabled GradScaler skipped it

A fault (the step's first non-finite loss or gradient) sets `outcome.nonfinite` and the loss the step had so far,
then calls `on_fault`: the built-in and the user's step raise StepHalted there, so nothing of the step is applied
(`halt_on_nonfinite`); the Lightning callback asks its recording hooks whether to stop.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from replaybisect.core import faults, guard, several
from replaybisect.core.observer import forward_context, notify


@dataclass
class StepOutcome:
    """What one optimizer step did, as the recorder logs it and a replay compares it. `loss` and `grad_norm` may be
    set to 0-dim tensors not read yet (a recorded step that defers its reads, StepWatch(defer_reads=True)): they are
    read on the host, once, when first asked for; `unread` hands them to a batched reader first."""

    step: int
    loss_value: Any = math.nan  # a float, or a 0-dim tensor on the device not read yet
    grad_norm_value: Any = None  # pre-clip total norm (after unscaling for fp16); the same
    lr: float = 0.0
    nonfinite: Optional[str] = None  # "loss" | "grad_norm" | ANOTHER_RANK when the step failed
    updated: bool = False  # the optimizer applied an update
    scaler_skipped: bool = False  # fp16: the GradScaler skipped an overflowing step (normal)
    rank_losses: Optional[list] = None  # a distributed run's replayed step: each rank's loss (core/ranks.py)
    # a user's loop: the gradients its first backward added to (the loop did not clear them), by parameter name,
    # taken when `backpropagated` (after it the live gradients are the step's own)
    carried_grads: Optional[dict] = None
    backpropagated: bool = False

    def __init__(self, step: int, loss: Any = math.nan, grad_norm: Any = None, lr: float = 0.0, nonfinite: Optional[str] = None,
                 updated: bool = False, scaler_skipped: bool = False, rank_losses: Optional[list] = None):
        self.step, self.loss_value, self.grad_norm_value, self.lr = step, loss, grad_norm, lr
        self.nonfinite, self.updated, self.scaler_skipped, self.rank_losses = nonfinite, updated, scaler_skipped, rank_losses
        self.carried_grads, self.backpropagated = None, False

    @property
    def loss(self) -> float:
        if isinstance(self.loss_value, torch.Tensor):
            self.loss_value = float(self.loss_value.item())
        return self.loss_value

    @loss.setter
    def loss(self, value) -> None:
        self.loss_value = value

    @property
    def grad_norm(self) -> Optional[float]:
        if isinstance(self.grad_norm_value, torch.Tensor):
            self.grad_norm_value = float(self.grad_norm_value.item())
        return self.grad_norm_value

    @grad_norm.setter
    def grad_norm(self, value) -> None:
        self.grad_norm_value = value


_VERSION = operator.attrgetter("_version")  # a tensor's count of in-place changes
ANOTHER_RANK = "loss on another rank"  # a distributed job's rank halted because another rank's loss went non-finite


class StepHalted(BaseException):
    """Stops a step before its optimizer update (a BaseException: a broad `except Exception` in the user's step
    does not swallow it)."""


def halt() -> None:
    raise StepHalted


def finite(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 1 and tensor.dtype.is_floating_point:  # a loss: one read of its value, not three ops and a read
        return math.isfinite(tensor.item())
    return bool(torch.isfinite(tensor.detach()).all())


class StepWatch:
    """One step's moments: observer calls, the non-finite rules, an ablation arm's clip. `state` is a TrainState
    (model, optimizer, scaler, clip_grad_norm); `on_fault` is called at the first non-finite loss or gradient."""

    def __init__(self, state, outcome: StepOutcome, observer=None, on_fault: Optional[Callable[[], None]] = None,
                 ranks_agree: Optional[Callable[[bool], bool]] = None, defer_reads: bool = False, device_guard=None):
        self.state, self.outcome, self.observer, self.on_fault = state, outcome, observer, on_fault
        # a recorded step: the losses' non-finite flag stays on the device and is read once, with the gradients'
        # (their norm, the loss and the norm logged later, in one read per metrics flush); earlier only where
        # something could change the state first (judge_losses: a GradScaler's unscale or step, another optimizer)
        self.defer_reads = defer_reads and ranks_agree is None
        # record/device_guard.py: the verdict is not read in the step at all; the optimizer skips on the device
        self.device_guard = device_guard if self.defer_reads and not isinstance(state.optimizer, several.Optimizers) else None
        self.verdict: Optional[torch.Tensor] = None  # with device_guard: [loss failed, gradients failed], on the device
        # with defer_reads: the losses not judged yet, each as a 0-dim tensor of its own, finite exactly when it is
        self._unjudged: list[torch.Tensor] = []
        # a rank of a distributed job: a non-finite loss is not halted before its backward (the other ranks wait in
        # its all-reduce); after the backward every rank says whether its loss failed, and all halt if one did
        self.ranks_agree = ranks_agree
        self.on_error: Optional[Callable[[Exception], None]] = None  # set: an error in a backward goes here, not up
        self.stopped = False  # an inline run's replay halted the step; its script's iteration runs on, idle
        self.on_loss: Optional[Callable[[], None]] = None  # set: called as each loss is about to be backpropagated
        self.running_loss: Optional[torch.Tensor] = None  # the sum of the losses backpropagated so far
        self.saw_gradients = False  # gradients() ran for this step
        # what gradients() took: the gradients, their total norm, each one's norm (or None), and their versions
        self.measured: Optional[tuple[list, torch.Tensor, Optional[list], list]] = None
        self._backpropagated = False  # a loss of this step was backpropagated
        self._gradients_of: set[int] = set()  # several optimizers (core/several.py): those whose gradients() ran
        self._forward = None
        scaler = state.scaler
        self._scale_before = scaler.get_scale() if guard.scaler_enabled(scaler) else None

    # ---- forward regions: from the step's start (and after each backward) until the next backward or update ----
    def open_forward(self) -> None:
        if self._forward is None and self.observer is not None:
            self._forward = forward_context(self.observer, self.state)
            self._forward.__enter__()

    def close_forward(self) -> None:
        opened, self._forward = self._forward, None
        if opened is not None:
            opened.__exit__(None, None, None)

    # ---- the moments ------------------------------------------------------------------------------------------
    def loss(self, loss: torch.Tensor, part: Optional[torch.Tensor] = None) -> None:
        """`loss` is about to be backpropagated (`part`: the share of it that is, e.g. divided by the micro-batch
        count, when that differs)."""
        if self.on_loss is not None:
            self.on_loss()
        if not self._backpropagated:
            self._backpropagated = True
            if self.state.user_loop:
                self.outcome.carried_grads = carried_gradients(self.state.model, self.state.params)
            self.outcome.backpropagated = True  # (after: where the copy failed, the live gradients are still these)
        faults.at_loss(self.outcome.step, loss)  # (a test's fault injector: nothing unless it is set)
        self.close_forward()
        notify(self.observer, "after_forward", self.state, loss)
        share = (loss if part is None else part).detach()
        share = (share.double() if share.dtype == torch.float64 else share.float()).sum()  # (fp64 stays fp64)
        self.running_loss = share if self.running_loss is None else self.running_loss + share
        if self.defer_reads:  # judged with the gradients, before the update: one read for both
            if loss.numel():  # (a scalar's `share` is its value, copied; else its largest magnitude: NaN or inf if one is)
                self._unjudged.append(share if part is None and loss.numel() == 1 else loss.detach().abs().amax())
            return
        if self.outcome.nonfinite is None and not finite(loss):
            self._fault("loss")

    def gradients(self, optimizer=None) -> None:
        """The gradients are complete and unscaled, and not yet clipped: the loop's clip or its update is next.
        Once per step (a step that clips reaches it at the clip, and not again at the update). With several
        optimizers, once per `optimizer` that updates, over its own parameters: the step's norm joins theirs."""
        if optimizer is None and self.saw_gradients or optimizer is not None and id(optimizer) in self._gradients_of:
            return
        if optimizer is not None:
            self._gradients_of.add(id(optimizer))
        self.saw_gradients = True
        self.close_forward()
        params = self.state.params if optimizer is None else [p for group in optimizer.param_groups for p in group["params"]]
        faults.at_gradients(self.outcome.step, params)
        grads = guard.gradients(params)
        norm, each = guard.norms(grads)
        self.measured = (grads, norm, each, list(map(_VERSION, grads)))
        still_scaled = getattr(optimizer or self.state.optimizer, "grad_scale", None)  # a fused optimizer a GradScaler
        if isinstance(still_scaled, torch.Tensor):  # steps unscales inside its step, after this moment (no read: on the device)
            norm = norm / still_scaled.to(norm.device)
        earlier = self.outcome.grad_norm_value if optimizer is not None else None  # another optimizer's, this step
        if self.defer_reads:
            self.outcome.grad_norm = _joined(earlier, norm.detach())  # read later, with the step's other metrics
            if self.device_guard is not None:
                self._verdict_on_device(grads, norm)
            else:
                self._judge_deferred(grads, norm)
        else:
            value = float(norm.item())
            self.outcome.grad_norm = value if earlier is None else math.hypot(earlier, value)
        notify(self.observer, "after_backward", self.state)
        if not self.defer_reads and self.outcome.nonfinite is None and guard.nonfinite_gradient(grads, value, self.state.scaler):
            self._fault("grad_norm")
        if self.state.clip_grad_norm is not None and grads:  # an ablation arm's clip (a user's own clip came first)
            torch.nn.utils.clip_grads_with_norm_(params, self.state.clip_grad_norm, norm)
            self.measured = None  # (the gradients changed)
        notify(self.observer, "before_update", self.state, self.outcome)

    def norm_of(self, theirs: list) -> Optional[torch.Tensor]:
        """The 2-norm of the gradients `theirs`, from the one gradients() just took where they are the same tensors
        (in any order: a model's parameters against an optimizer's groups), unscaled and unchanged since: the step's
        clip need not take it again. None where it cannot be had so. Once: the clip changes them."""
        measured, self.measured = self.measured, None
        if measured is None or getattr(self.state.optimizer, "grad_scale", None) is not None:
            return None
        grads, norm, each, versions = measured
        if list(map(_VERSION, grads)) != versions:  # changed in place since by a tracked op (not through `.data`, nor by
            return None  # a GradScaler's unscale: the callers reuse the norm only where nothing such runs in between)
        if len(theirs) == len(grads) and all(mine is their for mine, their in zip(grads, theirs)):
            return norm
        return guard.norm_in_order(grads, each, theirs) if each is not None else None

    def judge_losses(self) -> None:
        """With deferred reads: read the flag of the losses backpropagated since the last judgement, before anything
        could change the state (a GradScaler's unscale or step: a halted step must leave the scaler as it was;
        another optimizer's update). With an enabled GradScaler this is the step's one read: its gradients need
        none (the scaler skips a non-finite step itself)."""
        pending = self._pending_loss_flag()
        if not self.defer_reads or pending is None or self.outcome.nonfinite is not None:
            return
        if bool(pending):
            self.outcome.loss = self.loss_so_far()
            self._fault("loss")

    def _judge_deferred(self, grads: list, norm: torch.Tensor) -> None:
        """The step's one read: did a loss, or (without an enabled GradScaler, which skips such steps itself) the
        gradients' norm, go non-finite? A non-finite norm is a fault only when an element is (guard's rule)."""
        if guard.scaler_enabled(self.state.scaler):
            self.judge_losses()  # (normally done already, before the unscale)
            return
        failed_loss, failed_norm = torch.stack([self._take_loss_flag(norm.device), ~torch.isfinite(norm)]).tolist()
        if self.outcome.nonfinite is not None:
            return
        if failed_loss:  # as a step that halts at its loss: no gradient measured (these came from a non-finite loss)
            self.outcome.grad_norm = None
            self.outcome.loss = self.loss_so_far()
            self._fault("loss")
        elif failed_norm and guard.nonfinite_gradient(grads, float(norm), self.state.scaler):
            self._fault("grad_norm")

    def _verdict_on_device(self, grads: list, norm: torch.Tensor) -> None:
        """No read: did a loss, or a gradient element (its largest magnitude: inf or NaN), go non-finite? Kept on the
        device for the optimizer to skip on (record/device_guard.py) and the hooks to read at the flush."""
        device = norm.device
        largest = torch.nn.utils.get_total_norm(grads, norm_type=math.inf).to(device) if grads else torch.zeros((), device=device)
        self.verdict = torch.stack([self._take_loss_flag(device), ~torch.isfinite(largest)])

    def _take_loss_flag(self, device: torch.device) -> torch.Tensor:
        """The flag of the losses not judged yet (False when none), on `device`; they count as judged now."""
        pending = self._pending_loss_flag()
        return pending.to(device) if pending is not None else torch.zeros((), dtype=torch.bool, device=device)

    def _pending_loss_flag(self) -> Optional[torch.Tensor]:
        """Whether a loss not judged yet was not finite, on the device (None: there was none), judged together in one
        op; they count as judged now."""
        losses, self._unjudged = self._unjudged, []
        if not losses:
            return None
        device = losses[0].device
        return ~torch.isfinite(torch.stack([loss.to(device) for loss in losses])).all()

    def backward_done(self) -> None:
        """A backward returned. A rank of a distributed job asks every rank whether its loss went non-finite (each
        rank's loss is its own; the gradients after DDP's all-reduce are the same on every rank, so their rule needs
        no asking): all halt here together if one did, before any update, scaler or scheduler step."""
        if self.ranks_agree is None or not self.ranks_agree(self.outcome.nonfinite is not None):
            return
        if self.outcome.nonfinite is None:  # another rank's loss failed: this one halts with it
            self.outcome.nonfinite = ANOTHER_RANK
            self.outcome.loss = self.loss_so_far()
        if self.on_fault is not None:
            self.on_fault()

    def updated(self) -> None:
        self.outcome.updated = True
        notify(self.observer, "after_update", self.state)

    def settle(self) -> None:
        """After the step: an enabled GradScaler that lowered its scale skipped the update (routine in fp16)."""
        self.close_forward()
        if self._scale_before is not None:
            self.outcome.scaler_skipped = self.state.scaler.get_scale() < self._scale_before
            self.outcome.updated = self.outcome.updated and not self.outcome.scaler_skipped

    def loss_so_far(self) -> float:
        return float(self.running_loss.item()) if self.running_loss is not None else math.nan

    def _fault(self, what: str) -> None:
        self.outcome.nonfinite = what
        self.outcome.loss = self.loss_so_far()  # the loss a halted step logs: what it backpropagated so far
        if self.on_fault is not None and not (what == "loss" and self.ranks_agree is not None):  # (see backward_done)
            self.on_fault()


def holds_gradients(params) -> bool:
    """Whether any parameter holds a gradient (on the host: no device read)."""
    return any(param.grad is not None for param in params)


def _joined(earlier, norm: torch.Tensor) -> torch.Tensor:
    """On the device: the norm of one optimizer's gradients joined to another's of the same step (None: the first)."""
    if earlier is None:
        return norm
    return torch.linalg.vector_norm(torch.stack([torch.as_tensor(earlier, dtype=norm.dtype, device=norm.device), norm]))


def carried_gradients(model: torch.nn.Module, params: list) -> Optional[dict[str, torch.Tensor]]:
    """The gradients a step's first backward adds to, copied (None: none, the loop cleared them as it should): a loop
    that never zeroes them, or accumulates over several steps. A replay must start the step with them. (`params`,
    the optimizer's flat list, is checked first: naming the model's parameters walks its whole tree.)"""
    if not holds_gradients(params):
        return None
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters() if param.grad is not None}
    return grads or None


def fault_handler(halt_on_nonfinite: bool) -> Optional[Callable[[], Any]]:
    """The built-in and user steps: halt at a fault, or (a replay that goes on past it) carry on."""
    return halt if halt_on_nonfinite else None
