"""A custom autograd Function with a hand-written sqrt backward that has no guard at 0: forward and loss
stay finite, the gradient is inf/NaN. The epsilon that hides it is (wrongly) applied only for the first
`eps_steps` steps."""

from __future__ import annotations

import torch
from torch import nn


class _Sqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        root = torch.sqrt(x.clamp_min(0) + eps)
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx, grad):
        (root,) = ctx.saved_tensors
        return grad / (2 * root), None  # the bug: inf where root == 0 (and the clamp's zero slope ignored)


class SqrtActivation(nn.Module):
    def __init__(self, eps: float = 1e-3, eps_steps: int = 12):
        super().__init__()
        self.eps = eps
        self.eps_steps = eps_steps
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        eps = self.eps if self.calls <= self.eps_steps else 0.0
        return _Sqrt.apply(x, eps)


class SqrtMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, out_features: int = 10, eps_steps: int = 12):
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        self.act = SqrtActivation(eps_steps=eps_steps)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.encoder(x.flatten(1))))
