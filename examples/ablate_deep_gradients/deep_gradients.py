"""Planted failure: exploding gradients in a deep net.

Sixteen Linear+ReLU blocks initialised with a gain of 1.8 per layer (He init is ~1.41): the gradient grows by
the gain at every layer going backwards, so the first layers get norms thousands of times the last's, and
plain SGD's updates blow the weights up after a few steps."""

import torch
from torch import nn


class DeepNet(nn.Module):
    def __init__(self, in_features: int = 64, width: int = 32, depth: int = 16, out_features: int = 10, gain: float = 1.8):
        super().__init__()
        layers = []
        size = in_features
        for _ in range(depth):
            linear = nn.Linear(size, width)
            nn.init.normal_(linear.weight, std=gain / size**0.5)
            nn.init.zeros_(linear.bias)
            layers += [linear, nn.ReLU()]
            size = width
        layers.append(nn.Linear(size, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x.flatten(1))
