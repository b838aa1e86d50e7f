"""`from replaybisect.hf import ReplayCallback`: record a Hugging Face Trainer run (see record/hf.py).

Recorded runs name `replaybisect.hf.build` and `replaybisect.hf.hf_step` as their build and step functions
(replaybisect's registry): this module keeps those names.
"""

from replaybisect.record.hf import ReplayCallback
from replaybisect.replay.hf import build, hf_step

__all__ = ["ReplayCallback", "build", "hf_step"]
