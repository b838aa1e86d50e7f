"""A dataset read from a CSV file, and a script that writes one with a NaN planted in one row.

    python examples/nan_data/planted_data.py rows.csv          # NaN in the row that step 12 draws
    replay train --config-dir examples/nan_data data.path=$PWD/rows.csv
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

FEATURES = 16
CLASSES = 4


class CsvPairs(Dataset):
    """Rows of `f1,...,fN,label` (float features, integer label) held in memory."""

    def __init__(self, path: str):
        rows = [line.split(",") for line in Path(path).read_text().splitlines() if line.strip()]
        self.inputs = torch.tensor([[float(v) for v in row[:-1]] for row in rows], dtype=torch.float32)
        self.targets = torch.tensor([int(row[-1]) for row in rows], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index]


def write_dataset(path: str | Path, n_rows: int = 512, nan_at_step: int = 12, seed: int = 0, batch_size: int = 32) -> int:
    """Gaussian blobs with one NaN feature in the row that the batch of `nan_at_step` draws (the data order
    of `replay train` is a pure function of (seed, step)). Returns that row's index."""
    from replaybisect.core.loop import BatchSource

    generator = torch.Generator().manual_seed(1234)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 3
    labels = torch.randint(0, CLASSES, (n_rows,), generator=generator)
    inputs = centres[labels] + torch.randn(n_rows, FEATURES, generator=generator)
    nan_row = int(BatchSource(range(n_rows), batch_size, seed).indices(nan_at_step)[5])
    inputs[nan_row, 3] = float("nan")
    lines = [",".join(f"{v:.6f}" for v in row.tolist()) + f",{int(label)}" for row, label in zip(inputs, labels)]
    Path(path).write_text("\n".join(lines) + "\n")
    return nan_row


if __name__ == "__main__":
    row = write_dataset(sys.argv[1] if len(sys.argv) > 1 else "rows.csv")
    print(f"wrote {sys.argv[1] if len(sys.argv) > 1 else 'rows.csv'}: NaN in row {row}")
