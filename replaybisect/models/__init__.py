"""Small built-in models (no downloads): an MLP, a small CNN and a tiny character-level transformer."""

from __future__ import annotations

import math

import torch
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU}


class MLP(nn.Module):
    """Linear -> activation (-> dropout) blocks, then a linear head."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        out_features: int = 10,
        depth: int = 2,
        dropout: float = 0.0,
        activation: str = "relu",
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head, for 8x8 digits or any small image."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, channels: int = 16, image_size: int = 8, dropout: float = 0.0):
        super().__init__()
        self.in_channels = in_channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * channels * (image_size // 2) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # flat pixels, e.g. digits as 64 features
            side = int(math.isqrt(x.shape[1] // self.in_channels))
            x = x.reshape(len(x), self.in_channels, side, side)
        elif x.dim() == 3:
            x = x.unsqueeze(1)
        return self.head(self.dropout(self.features(x).flatten(1)))


class CharTransformer(nn.Module):
    """A tiny GPT-style character model: (B, T) token ids -> (B, T, vocab) logits."""

    def __init__(self, vocab_size: int = 96, block_size: int = 32, d_model: int = 64, n_heads: int = 4, n_layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # enable_nested_tensor=False: the nested fast path is inference-only and changes numerics.
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        mask = torch.triu(torch.full((block_size, block_size), -math.inf), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))
