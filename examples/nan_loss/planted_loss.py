"""A hand-written binary cross-entropy on sigmoid probabilities, and a model whose logits sharpen every
step: once a logit passes ~17, sigmoid rounds to exactly 1.0 in fp32, log(1 - p) = log(0) = -inf and the
loss is infinite, while the model's outputs are still finite (torch's BCEWithLogits works in log space)."""

from __future__ import annotations

import torch
from torch import nn


class SigmoidBCE(nn.Module):
    """One-vs-all BCE over classes, computed from probabilities (the bug) instead of logits."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs = torch.sigmoid(logits.float())
        onehot = torch.nn.functional.one_hot(target, logits.shape[-1]).float()
        return -(onehot * torch.log(probs) + (1 - onehot) * torch.log(1 - probs)).mean()


class SharpeningMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, out_features: int = 10, growth: float = 1.3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
        self.growth = growth
        self.register_buffer("logit_scale", torch.ones(()))  # a sharpening schedule, in the state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.logit_scale.mul_(self.growth)
        return self.body(x.flatten(1)) * self.logit_scale
