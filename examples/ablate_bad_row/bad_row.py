"""Planted failure: one NaN in one row of the training data. The step whose batch holds that row
produces a NaN loss; every other batch is fine."""

import math

from replaybisect.data import Blobs


class BlobsWithBadRow(Blobs):
    def __init__(self, nan_row: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.inputs[nan_row, 0] = math.nan
