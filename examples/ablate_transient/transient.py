"""Planted transient failure: a fault present only in the original training process.

The model turns its output into NaN on its N-th training forward when PLANTED_FAULT_AT_CALL=N is set in the
environment, as a flaky GPU or a bit flip would. A replay (without that variable) runs clean, so
`replay ablate` must call the result inconclusive rather than credit any arm with a fix."""

import math
import os

from replaybisect.models import MLP


class FlakyMLP(MLP):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0  # a plain attribute: not part of the model's state, so not in any snapshot

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if os.environ.get("PLANTED_FAULT_AT_CALL") == str(self.calls):
                out = out * math.nan
        return out
