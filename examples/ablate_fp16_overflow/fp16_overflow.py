"""Planted failure: pre-activations that outgrow fp16's range (65504) after some steps.

`gain` is a running statistic updated the wrong way: it multiplies the input and grows 1.5x every training
forward. LayerNorm right after the first layer makes the scale irrelevant in fp32, so fp32 trains fine;
under fp16 autocast the first layer's output overflows to inf once gain passes ~1e5 and LayerNorm turns
inf into NaN.
"""

import torch
from torch import nn


class DriftingGainNet(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, out_features: int = 10, growth: float = 1.5):
        super().__init__()
        self.growth = growth
        self.fc1 = nn.Linear(in_features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, out_features)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        if self.training:
            self.gain.mul_(self.growth)
        h = self.fc1(x.flatten(1) * self.gain)
        return self.head(torch.relu(self.norm(h)))
