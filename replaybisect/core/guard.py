"""When a step's gradients stop it: the one rule the built-in step, the user's own step (`Recorder`) and the
Lightning callback share.

A step stops before its update when some gradient element is inf or NaN, unless an enabled GradScaler is there
to skip the step (an fp16 overflow is routine for it). A GradScaler built with enabled=False (nanoGPT makes one
on CPU and with bf16) skips nothing: the step is checked as without one. The total norm of finite elements
can overflow fp32 (its sum of squares does): that is no fault, and the step trains as plain PyTorch trains it.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch


def scaler_enabled(scaler: Optional[Any]) -> bool:
    """A GradScaler that scales the loss and skips overflowing steps (not None, not built with enabled=False)."""
    return scaler is not None and scaler.is_enabled()


def gradients(params) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' total 2-norm as clip_grad_norm_ computes it (inf when the sum of squares overflows)."""
    return norms(grads)[0]


def norms(grads: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The total 2-norm, bit for bit as torch.nn.utils.get_total_norm takes it, and each gradient's own norm where
    they are one foreach group (one device and dtype, the common case; else None): torch's total is then the norm of
    those, stacked in the list's order, so a clip of the same gradients in another order can be had from them
    (`norm_in_order`) without another pass over every gradient."""
    from torch.utils._foreach_utils import _has_foreach_support

    if not grads:
        return torch.zeros(()), None
    first = grads[0]
    one_group = len(set(map(_DEVICE_AND_DTYPE, grads))) == 1
    if not (one_group and _has_foreach_support(grads, first.device)):
        return torch.nn.utils.get_total_norm(grads), None
    with torch.no_grad():
        each = list(torch._foreach_norm(grads, 2.0))
        return torch.linalg.vector_norm(torch.stack(each), 2.0), each


_DEVICE_AND_DTYPE = operator.attrgetter("device", "dtype")


def norm_in_order(grads: list[torch.Tensor], each: list[torch.Tensor], theirs: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The total norm of `theirs` as get_total_norm would take it, from `each` (the norms of `grads`, from `norms`),
    where `theirs` is `grads` in some order (the same tensors, each once); else None."""
    by_id = dict(zip(map(id, grads), each))  # (map: no Python loop over the gradients, every step)
    their_ids = list(map(id, theirs))
    if len(their_ids) != len(by_id) or set(their_ids) != by_id.keys():
        return None
    with torch.no_grad():
        return torch.linalg.vector_norm(torch.stack(list(map(by_id.__getitem__, their_ids))), 2.0)


def nonfinite_gradient(grads: list[torch.Tensor], norm: float, scaler: Optional[Any]) -> bool:
    """Whether the step must stop on its gradients: a finite norm needs no look at the elements."""
    if math.isfinite(norm) or scaler_enabled(scaler):
        return False
    return not all(bool(torch.isfinite(_values(grad)).all()) for grad in grads)


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad
