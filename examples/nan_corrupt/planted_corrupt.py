"""A layer that corrupts its own weight in its forward (as a buggy in-place kernel or a bad custom
weight-normalisation would), at step `fault_step`, after computing its output: that step's loss and
gradients stay finite, the optimizer carries the NaN on, and the NEXT step fails."""

from __future__ import annotations

import torch
from torch import nn


class SelfCorruptingLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, fault_step: int = 13):
        super().__init__(in_features, out_features)
        self.fault_step = fault_step
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            if int(self.calls) == self.fault_step:
                self.weight.data[0, 0] = float("nan")  # .data: invisible to autograd, like a kernel bug
            self.calls += 1
        return out


class CorruptingMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, out_features: int = 10, fault_step: int = 13):
        super().__init__()
        self.encoder = SelfCorruptingLinear(in_features, hidden, fault_step)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(hidden, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x.flatten(1)))
