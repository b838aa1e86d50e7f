"""Small planted pathologies for `replay diagnose`: each class is one bug a real training run can have.

Use one of the configs in this folder, e.g.

    replay train --config-dir examples/diagnose_pathologies --config-name dead_relu
    replay diagnose --run-id <the run id it prints>
"""

from __future__ import annotations

import time

import torch

from replaybisect.data import Digits, TensorPairs
from replaybisect.models import MLP


class NaNInitMLP(MLP):
    """A bad initialisation: one weight of the first layer is NaN, so the very first loss is NaN."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with torch.no_grad():
            self.net[0].weight[0, 0] = float("nan")


class DetachedMLP(MLP):
    """The logits are cut from the graph (`.detach()`, re-enabled for the loss): no parameter ever gets a
    gradient, the optimizer never moves anything, and the loss stays where it started."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).detach().requires_grad_(True)


class DeadReluMLP(MLP):
    """A huge negative bias on the first layer: every pre-activation is negative, its ReLU outputs only zeros."""

    def __init__(self, bias: float = -100.0, **kwargs):
        super().__init__(**kwargs)
        with torch.no_grad():
            self.net[0].bias.fill_(bias)


class TinyDigits(TensorPairs):
    """The first `n` training digits only: a model memorises them and overfits."""

    def __init__(self, n: int = 64, split: str = "train"):
        full = Digits(split=split)
        super().__init__(full.inputs[:n], full.targets[:n])


class ShiftedDigits(TensorPairs):
    """Validation digits from another distribution (pixels mirrored left-right and inverted, as a
    mismatched preprocessing step would make them)."""

    def __init__(self, split: str = "val"):
        digits = Digits(split=split)
        images = digits.inputs.reshape(-1, 8, 8).flip(-1)
        super().__init__(1.0 - images.reshape(-1, 64), digits.targets)


class BadRowsDigits(TensorPairs):
    """Training digits where a few rows are garbage (values of +-`scale`, as from a misread file): the
    batches holding them make loss and gradient spikes."""

    def __init__(self, every: int = 300, scale: float = 1000.0, split: str = "train"):
        digits = Digits(split=split)
        inputs = digits.inputs.clone()
        generator = torch.Generator().manual_seed(0)
        inputs[::every] = scale * torch.randn(inputs[::every].shape, generator=generator)
        super().__init__(inputs, digits.targets)


class SlowDigits(TensorPairs):
    """Training digits read slowly (a blocking read per item): the step waits for data, not compute."""

    def __init__(self, delay_s: float = 0.001, split: str = "train"):
        digits = Digits(split=split)
        self.delay_s = delay_s
        super().__init__(digits.inputs, digits.targets)

    def __getitem__(self, index: int):
        time.sleep(self.delay_s)
        return super().__getitem__(index)


class DigitValues(TensorPairs):
    """Digits with the digit's value as a float target: a regression problem for MSELoss."""

    def __init__(self, split: str = "train"):
        digits = Digits(split=split)
        super().__init__(digits.inputs, digits.targets.float())


class LinearRegressor(torch.nn.Module):
    """One linear layer, (B, 64) -> (B,): with plain SGD and too high an LR the weights grow by a constant
    factor every step until the loss overflows to inf, some steps into the run."""

    def __init__(self, in_features: int = 64, **unused):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)).squeeze(-1)


class TeacherDigits(TensorPairs):
    """Digits with a target a fixed linear function of the pixels makes: a linear model can fit it exactly, so the
    loss at the optimum is zero and what is left of it is the optimizer's own motion around the optimum."""

    def __init__(self, split: str = "train", seed: int = 0):
        digits = Digits(split=split)
        teacher = torch.randn(digits.inputs[0].numel(), generator=torch.Generator().manual_seed(seed))
        super().__init__(digits.inputs, digits.inputs.flatten(1) @ teacher)
