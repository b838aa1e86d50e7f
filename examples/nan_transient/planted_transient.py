"""A model that sees a one-off fault during training only: when NAN_TRANSIENT_FAULT_STEP is set, the
forward of that step returns NaN (as a bit flip in accelerator memory would). A replay, without the
variable, computes the step finite: `replay nan` reports `transient`."""

from __future__ import annotations

import os

import torch
from torch import nn


class FlakyMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, out_features: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x.flatten(1))
        if self.training:
            fault = os.environ.get("NAN_TRANSIENT_FAULT_STEP")
            if fault is not None and int(self.calls) == int(fault):
                out = out * float("nan")
            self.calls += 1
        return out
