"""An MLP whose forward looks up a per-bucket scale; at its Nth call the bucket index is past the table (IndexError)."""
import torch
from torch import nn


class BucketMLP(nn.Module):
    def __init__(self, raise_at: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.raise_at = raise_at

    def forward(self, x):
        self.calls += 1
        bucket = torch.where(self.calls == self.raise_at, 4, 0)  # the bug: bucket 4 of a 4-entry table
        return self.net(x) * self.scale[bucket]
