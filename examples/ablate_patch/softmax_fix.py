"""A fix for examples/nan_forward, proven before it is merged:

    replay ablate --patch examples/ablate_patch/softmax_fix.py --run-id <the nan_forward run>

The config builds `planted_forward.GatedMLP`; this file defines a class of that name, so the patched arm builds this
one instead, loads the recorded weights into it and replays the same batches. The gate keeps its temperature schedule
(the same buffers, so the snapshot loads) and computes the softmax with torch.softmax, which subtracts the max before
exp: x / T can grow without bound, exp never sees more than 0.
"""

from __future__ import annotations

import torch

import planted_forward


class StableSoftmaxGate(planted_forward.NaiveSoftmaxGate):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls > self.hold_steps:
                self.temperature.mul_(self.decay)
        return x * torch.softmax(x / self.temperature, dim=-1)


class GatedMLP(planted_forward.GatedMLP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = StableSoftmaxGate(self.gate.decay, self.gate.hold_steps)
