"""`from replaybisect.lightning import ReplayCallback`: record a PyTorch Lightning run (see record/lightning.py).

Recorded runs name `replaybisect.lightning.build` and `replaybisect.lightning.lightning_step` as their build and
step functions (replaybisect's registry): this module keeps those names.
"""

from replaybisect.record.lightning import ReplayCallback
from replaybisect.replay.lightning import build, lightning_step

__all__ = ["ReplayCallback", "build", "lightning_step"]
