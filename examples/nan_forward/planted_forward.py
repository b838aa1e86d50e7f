"""A hand-written softmax gate with an annealed temperature and no max-subtraction: once x / T passes
~88 (fp32/bf16) or ~11 (fp16), exp overflows to inf and inf / inf gives NaN in the forward pass."""

from __future__ import annotations

import torch
from torch import nn


class NaiveSoftmaxGate(nn.Module):
    def __init__(self, decay: float = 0.8, hold_steps: int = 0):
        super().__init__()
        self.decay = decay
        self.hold_steps = hold_steps
        # buffers, so a snapshot (and therefore a replay) carries the schedule's position
        self.register_buffer("temperature", torch.ones(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls > self.hold_steps:
                self.temperature.mul_(self.decay)
        weights = torch.exp(x / self.temperature)  # the bug: no x.max() subtracted first
        return x * weights / weights.sum(-1, keepdim=True)


class GatedMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, out_features: int = 10, decay: float = 0.8, hold_steps: int = 0):
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        self.gate = NaiveSoftmaxGate(decay, hold_steps)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.encoder(x.flatten(1))))
