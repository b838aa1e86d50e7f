"""When a step's gradients stop it: the one rule the built-in step, the user's own step (`Recorder`) and the
Lightning callback share.

A step stops before its update when some gradient element is inf or NaN, unless an enabled GradScaler is there
to skip the step (an fp16 overflow is routine for it). A GradScaler built with enabled=False (nanoGPT makes one
on CPU and with bf16) skips nothing: the step is checked as without one. The total norm of finite elements
can overflow fp32 (its sum of squares does): that is no fault, and the step trains as plain PyTorch trains it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


def scaler_enabled(scaler: Optional[Any]) -> bool:
    """A GradScaler that scales the loss and skips overflowing steps (not None, not built with enabled=False)."""
    return scaler is not None and scaler.is_enabled()


def gradients(params) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' total 2-norm as clip_grad_norm_ computes it (inf when the sum of squares overflows)."""
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def nonfinite_gradient(grads: list[torch.Tensor], norm: float, scaler: Optional[Any]) -> bool:
    """Whether the step must stop on its gradients: a finite norm needs no look at the elements."""
    if math.isfinite(norm) or scaler_enabled(scaler):
        return False
    return not all(bool(torch.isfinite(_values(grad)).all()) for grad in grads)


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad
