"""Planted pathologies for `replay check`: each config in this folder plants exactly one.

    replay check --config-dir examples/check_pathologies --config-name softmax_ce
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from replaybisect.data import Digits
from replaybisect.models import MLP


# ---- data -----------------------------------------------------------------------------------------
class DigitsWithNaN(Digits):
    """Digits with one NaN pixel in every `every`-th image."""

    def __init__(self, every: int = 50, split: str = "train"):
        super().__init__(split=split)
        self.inputs = self.inputs.clone()
        self.inputs[::every, 5] = float("nan")


class ShiftedLabels(Digits):
    """Digits labelled 5..14 (an off-by-`shift` label map) for a 10-way model."""

    def __init__(self, shift: int = 5, split: str = "train"):
        super().__init__(split=split)
        self.targets = self.targets + shift


class SortedStream(Dataset):
    """Digits sorted by class, read as a stream: __getitem__ ignores the index it is given and returns the
    next item in class order, so the shuffled order the loop asks for never reaches the model."""

    def __init__(self, split: str = "train"):
        digits = Digits(split=split)
        order = torch.argsort(digits.targets, stable=True)
        self.inputs, self.targets = digits.inputs[order], digits.targets[order]
        self.position = 0

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        item = self.inputs[self.position], self.targets[self.position]
        self.position = (self.position + 1) % len(self.inputs)
        return item


class ImbalancedDigits(Digits):
    """Digits keeping every 0 but one image in 40 of the other classes."""

    def __init__(self, split: str = "train"):
        super().__init__(split=split)
        keep = (self.targets == 0) | (torch.arange(len(self.targets)) % 40 == 0)
        self.inputs, self.targets = self.inputs[keep], self.targets[keep]


class UniformLabels(Dataset):
    """No plant: `n` samples whose labels are drawn uniformly from `classes` (balanced by design); with 6 samples a
    class, chance alone makes the most common class 11x the rarest (seed 3), which is no imbalance to fix."""

    def __init__(self, n: int = 240, classes: int = 40, features: int = 64, seed: int = 3, split: str = "train"):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.rand(n, features, generator=generator)
        self.targets = torch.randint(classes, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index]


# ---- models ------------------------------------------------------------------------------------------
class SoftmaxMLP(MLP):
    """An MLP whose last layer is a Softmax, fed to CrossEntropyLoss (which applies log_softmax itself)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net.append(nn.Softmax(dim=1))


class ConstantInitMLP(MLP):
    """Every layer initialized to one constant: in each layer every unit is the same unit, and since they
    all get the same gradient they stay that way."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 0.05)
                nn.init.zeros_(module.bias)


class OneConstantLayerMLP(MLP):
    """Only the first layer initialized to one constant: its units start identical, but the next layer's
    random weights give them different gradients, so the updates separate them (a warning, not a trap)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        nn.init.constant_(self.net[0].weight, 0.05)


class DeadReLUMLP(MLP):
    """A large negative bias on the first layer: its ReLU never fires."""

    def __init__(self, bias: float = -10.0, **kwargs):
        super().__init__(**kwargs)
        nn.init.constant_(self.net[0].bias, bias)


class SaturatedTanhMLP(MLP):
    """A tanh MLP whose first layer's weights are 40x too large: the tanh sits at +-1."""

    def __init__(self, scale: float = 40.0, **kwargs):
        super().__init__(**{**kwargs, "activation": "tanh"})
        with torch.no_grad():
            self.net[0].weight.mul_(scale)


class FrozenAndUnusedMLP(MLP):
    """The first layer frozen (requires_grad=False) and a projection that forward never uses."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net[0].requires_grad_(False)
        self.projection = nn.Linear(kwargs.get("out_features", 10), kwargs.get("out_features", 10))


class DetachedMLP(MLP):
    """The network's output is detached: only a per-class bias can learn, so one batch cannot be fitted."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.class_bias = nn.Parameter(torch.zeros(kwargs.get("out_features", 10)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).detach() + self.class_bias


class DeepSigmoid(MLP):
    """Twelve sigmoid layers: the gradient reaching the first layer all but vanishes."""

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "activation": "sigmoid", "depth": 12})


class LoudHead(MLP):
    """The output layer's weights 50x too large: confident, wrong logits at init."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with torch.no_grad():
            self.net[-1].weight.mul_(50.0)


class FunctionalSoftmaxMLP(MLP):
    """A softmax applied inside forward() (no Softmax module to point at), fed to CrossEntropyLoss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(super().forward(x), dim=1)


# ---- step functions ------------------------------------------------------------------------------------
class _SortedStream:
    """Digits in class order, 64 at a time, wrapping around."""

    def __init__(self):
        digits = Digits(split="train")
        order = torch.argsort(digits.targets, stable=True)
        self.inputs, self.targets = digits.inputs[order], digits.targets[order]
        self.position = 0

    def next(self, count: int):
        index = (torch.arange(count) + self.position) % len(self.inputs)
        self.position = int(index[-1]) + 1
        return self.inputs[index], self.targets[index]


_STREAM: list[_SortedStream] = []


def sorted_stream_step(model, batch, loss_fn):
    """A step function that ignores the (shuffled) batch it is given and trains on its own class-sorted stream."""
    if not _STREAM:
        _STREAM.append(_SortedStream())
    inputs, targets = _STREAM[0].next(len(batch[0]))
    return loss_fn(model(inputs.to(batch[0].device)), targets.to(batch[0].device))
