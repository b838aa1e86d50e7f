"""A model that prints, as real third-party code does (nanoGPT prints its parameter count), from Python and from
C-level writes to file descriptor 1, and that overflows after a number of training steps (a counter kept as a
buffer, so snapshots hold it and replay is exact)."""

import os

import torch
from torch import nn


class NoisyMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 16, out_features: int = 10, blow_up_after: int = 15):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
        self.blow_up_after = blow_up_after
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        print(f"number of parameters: {sum(p.numel() for p in self.parameters())}")
        os.write(1, b"{ not json, written straight to fd 1\n")

    def forward(self, x):
        print("forward", tuple(x.shape))
        if self.training:
            self.calls += 1
        out = self.net(x)
        if self.blow_up_after and int(self.calls) > self.blow_up_after:
            out = out * torch.exp(torch.full_like(out, 1000.0))  # overflow to inf
        return out


def configure_optimizers(model: nn.Module, weight_decay: float, lr: float, betas: tuple = (0.9, 0.95)):
    """nanoGPT's recipe: decay the matrices, not the biases; it needs the model, not a flat parameter list."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))
