"""The non-finite guard kept on the device: `replay train`'s recorded step with a fused optimizer reads nothing.

A fused AdamW/Adam/SGD takes `found_inf` as a GradScaler hands it: a flag on the device that makes its kernel skip
the update (parameters, moments, step counts). Each step's verdict (a loss or a gradient element not finite) is
or-ed into a sticky flag that this step and every later one hand their optimizer, so from the failing step on no
update is applied, without the host waiting for the device. The verdicts are read with the metrics, at each flush
and before each snapshot: a failure found there puts back what the skipped steps still changed (the scheduler and
the lr it set, the buffers the forwards updated), and the failing step is recorded as a step halted at once would
be: the snapshot of the state before it, with its batch, and nothing past it logged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from replaybisect.core import guard


@dataclass
class PendingStep:
    """A step taken since the last read of the verdicts, and what to put back if it failed."""

    step: int
    rng_at_start: dict
    groups: list[dict]  # each param group's settings but its params (the lr, and what a scheduler moves with it)
    states: int  # how many parameters had optimizer state (a skipped first update still creates it; state is
    # only ever added, in order, so the later entries are the ones to drop)
    scheduler_state: Optional[dict]
    buffers: list[torch.Tensor]
    outcome: Any = None  # StepOutcome once the step ran
    batch: Any = None
    verdict: Optional[torch.Tensor] = None  # [loss failed, gradients failed], on the device


@dataclass
class DeviceGuard:
    state: Any  # TrainState
    failed: Optional[torch.Tensor] = None  # sticky: 1.0 from the first failing step on
    pending: list[PendingStep] = field(default_factory=list)
    _buffers: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list)  # (buffer, its version, copy)

    @staticmethod
    def applies(cfg, state) -> bool:
        """A recorded step of one process (`replay train`'s, or a `Recorder`'s step function), stopping at a
        failure, with a fused optimizer that takes found_inf, and no enabled GradScaler (which hands the optimizer
        its own). Not a loop recorded as written (its steps are watched, not run: record/inline.py)."""
        optimizer = state.optimizer
        return (state.ranks_agree is None and cfg.snapshot.on_nonfinite == "stop"
                and bool(getattr(optimizer, "defaults", {}).get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)
                and not guard.scaler_enabled(state.scaler))

    def opened(self, step: int, rng_at_start: dict) -> None:
        """A step opens: what it may change without its update (its buffers are the forward's, its lr the
        scheduler's) is kept until its verdict is read."""
        scheduler, optimizer = self.state.scheduler, self.state.optimizer
        self.pending.append(PendingStep(
            step=step, rng_at_start=rng_at_start,
            groups=[copy.deepcopy({key: value for key, value in group.items() if key != "params"}) for group in optimizer.param_groups],
            states=len(optimizer.state),
            scheduler_state=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            buffers=self._buffer_copies()))

    def _buffer_copies(self) -> list[torch.Tensor]:
        """The model's buffers as this step starts: a new copy only of those changed since the last step's (the
        forward's running statistics), the copy kept before for the others (an attention mask never changes)."""
        buffers = [buffer for buffer in self.state.model.buffers() if buffer.numel()]
        if len(self._buffers) != len(buffers):
            self._buffers = [(buffer, -1, buffer) for buffer in buffers]
        self._buffers = [(buffer, buffer._version, kept if version == buffer._version else buffer.detach().clone())
                         for buffer, (_, version, kept) in zip(buffers, self._buffers)]
        return [kept for _, _, kept in self._buffers]

    def found_inf(self, verdict: torch.Tensor) -> torch.Tensor:
        """The flag this step's optimizer gets: 1.0 when this step or an earlier one failed."""
        self.pending[-1].verdict = verdict
        step_failed = verdict.any().float()
        self.failed = step_failed if self.failed is None else torch.maximum(self.failed, step_failed)
        return self.failed

    def step_with(self, optimizer, verdict: torch.Tensor) -> None:
        """optimizer.step(), skipped on the device when the sticky flag is set."""
        self.arm(optimizer, verdict)
        try:
            optimizer.step()
        finally:
            self.disarm(optimizer)

    def arm(self, optimizer, verdict: torch.Tensor) -> None:
        """Before the optimizer's step (a user's step calls it: its pre-step hook arms it), as a GradScaler does."""
        optimizer.grad_scale, optimizer.found_inf = None, self.found_inf(verdict)

    @staticmethod
    def disarm(optimizer) -> None:
        for name in ("grad_scale", "found_inf"):
            if name in vars(optimizer):
                delattr(optimizer, name)

    def ran(self, outcome, batch) -> None:
        self.pending[-1].outcome, self.pending[-1].batch = outcome, batch

    def verdict_points(self) -> list[tuple[str, Any, int]]:
        """The pending steps' verdicts as points to read with the metrics (in the same transfer)."""
        return [(f"verdict/{name}", step.verdict[index], step.step) for step in self.pending if step.verdict is not None
                for index, name in enumerate(("loss", "gradients"))]

    def first_failure(self, read: dict[tuple[str, int], float]) -> Optional[tuple[PendingStep, str]]:
        """The first pending step whose verdict (read) failed, and what failed; the pending steps are done."""
        pending, self.pending = self.pending, []
        for step in pending:
            if step.outcome is None:  # (interrupted before its end: Ctrl-C, an error; not recorded)
                continue
            if read.get(("verdict/loss", step.step)):
                return step, "loss"
            if read.get(("verdict/gradients", step.step)):
                return step, "grad_norm"
        return None

    def put_back(self, failed: PendingStep) -> None:
        """The state before the failing step: its updates and every later one were skipped on the device; the
        scheduler and what it set (lr, momentum...), the optimizer state a skipped first update created and the
        forwards' buffer updates are put back."""
        optimizer = self.state.optimizer
        for group, settings in zip(optimizer.param_groups, failed.groups):
            group.update(settings)
        for param in list(optimizer.state)[failed.states:]:
            del optimizer.state[param]
        if failed.scheduler_state is not None:
            self.state.scheduler.load_state_dict(failed.scheduler_state)
        with torch.no_grad():
            buffers = [buffer for buffer in self.state.model.buffers() if buffer.numel()]
            for buffer, kept in zip(buffers, failed.buffers):
                buffer.copy_(kept)
