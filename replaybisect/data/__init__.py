"""Built-in map-style datasets that need no download. Items are tensor tuples (input, target)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from replaybisect.core.rng import draws_no_randomness

TEXT_FILE = Path(__file__).parent / "tiny_text.txt"
DIGITS_FILE = Path(__file__).parent / "digits.csv.gz"


class TensorPairs(Dataset):
    """(inputs[i], targets[i]) pairs held in memory."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    @draws_no_randomness
    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index]


class Blobs(TensorPairs):
    """Gaussian blobs: n_classes centres in n_features dimensions, a fixed seed of its own."""

    def __init__(self, n_samples: int = 2048, n_features: int = 32, n_classes: int = 4, spread: float = 1.0, seed: int = 0, split: str = "train"):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(n_classes, n_features, generator=generator) * 3
        if split != "train":  # same centres, other samples
            generator.manual_seed(seed + 10_000)
        targets = torch.randint(0, n_classes, (n_samples,), generator=generator)
        inputs = centres[targets] + spread * torch.randn(n_samples, n_features, generator=generator)
        super().__init__(inputs, targets)


class Digits(TensorPairs):
    """The UCI 8x8 handwritten digits (1797 images, no download), scaled to [0, 1]; the file scikit-learn ships
    as `load_digits`, shipped here too (CC BY 4.0, UCI ML repository), so a run need not import scikit-learn
    (over a second of every process's start).

    split: train (first 80%), val (last 20%) or all. as_images gives (1, 8, 8) inputs for the CNN.
    """

    def __init__(self, split: str = "train", as_images: bool = False, normalize: bool = True):
        table = _digits_table()
        inputs = torch.tensor(table[:, :-1], dtype=torch.float32)
        targets = torch.tensor(table[:, -1].astype(int), dtype=torch.long)
        if normalize:
            inputs = inputs / 16.0
        if as_images:
            inputs = inputs.reshape(-1, 1, 8, 8)
        cut = int(0.8 * len(inputs))
        if split == "train":
            inputs, targets = inputs[:cut], targets[:cut]
        elif split == "val":
            inputs, targets = inputs[cut:], targets[cut:]
        super().__init__(inputs, targets)


def _digits_table():
    """digits.csv.gz as scikit-learn's `load_digits` reads it: 64 pixel columns and the label, float64."""
    import gzip

    import numpy as np

    with gzip.open(DIGITS_FILE, "rt") as rows:
        return np.loadtxt(rows, delimiter=",")


class CharText(Dataset):
    """Character windows of a small text shipped with the package: (x[t:t+T], x[t+1:t+T+1])."""

    def __init__(self, block_size: int = 32, split: str = "train", path: str | None = None):
        text = Path(path or TEXT_FILE).read_text(encoding="utf-8")
        # A fixed printable vocabulary (ASCII 32..126 plus newline) so vocab_size never depends on the text.
        codes = [min(max(ord(ch) - 31, 0), 95) if ch != "\n" else 0 for ch in text]
        tokens = torch.tensor(codes, dtype=torch.long)
        cut = int(0.9 * len(tokens))
        self.tokens = tokens[:cut] if split == "train" else tokens[cut:]
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size - 1

    @draws_no_randomness
    def __getitem__(self, index: int):
        window = self.tokens[index : index + self.block_size + 1]
        return window[:-1], window[1:]
