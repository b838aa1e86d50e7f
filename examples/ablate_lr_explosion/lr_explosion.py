"""Planted failure: a learning-rate warmup to a peak that is too high for plain SGD on a regression.

The loss is fine while the LR is small; once the warmup pushes it past the stability limit (2 / the
largest curvature), each update overshoots by more than the last and the loss grows geometrically to inf.
"""

import torch
from torch import nn

from replaybisect.data import TensorPairs


class NoisyRegression(TensorPairs):
    """y = x . w + noise, with inputs of unit scale: the loss floor is noise**2."""

    def __init__(self, n_samples: int = 2048, n_features: int = 16, noise: float = 0.5, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(n_samples, n_features, generator=generator)
        weights = torch.randn(n_features, 1, generator=generator)
        targets = inputs @ weights + noise * torch.randn(n_samples, 1, generator=generator)
        super().__init__(inputs, targets)


class SmallRegressor(nn.Module):
    def __init__(self, n_features: int = 16, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)
