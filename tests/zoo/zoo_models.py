"""A small zoo of realistic models, each healthy by default and with the plants real runs suffer from.

  GPT        nanoGPT-style: causal mask written `masked_fill(mask == 0, float('-inf'))`, weight tying
             (lm_head.weight is wte.weight). plant=: handwritten_softmax (exp(att)/sum without subtracting the
             max), fp16_attention (q @ k^T before the 1/sqrt(d) scale: overflows fp16), layernorm_overflow
             (an unbounded residual gain before ln_2 of the last block), detached_attention (the attention
             branch's output is .detach()ed), softmax_output (probabilities fed to cross-entropy)
  LSTMLM     PyTorch's word_language_model shape: embedding -> LSTM -> decoder, trained with SGD and clip 0.25
  BNConvNet  a CNN with BatchNorm on 8x8 digits; plant frozen_first (conv1 never trains)
  OwnLossMLP a model that computes its own loss (forward(x, y) -> loss), as HuggingFace models do
  Tokens / DigitImages  datasets; nan_row= puts a NaN in one row (a bad record)

Failures are driven by training dynamics (a high learning rate growing the attention logits), as in the wild,
except the residual gain, a buffer multiplied each training step (kept in state_dict, so replay is exact).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset


# ---- data ---------------------------------------------------------------------------------------------------
class Tokens(Dataset):
    """Character windows of a made-up text with structure to learn (repeated words, a fixed seed)."""

    def __init__(self, block_size: int = 16, n_tokens: int = 6000, vocab_size: int = 32, seed: int = 0, split: str = "train"):
        generator = torch.Generator().manual_seed(seed + (0 if split == "train" else 1))
        words = [torch.randint(1, vocab_size, (int(n),), generator=generator) for n in torch.randint(2, 6, (40,), generator=generator)]
        stream: list[torch.Tensor] = []
        total = 0
        while total < n_tokens:
            word = words[int(torch.randint(0, len(words), (1,), generator=generator))]
            stream += [word, torch.zeros(1, dtype=torch.long)]
            total += len(word) + 1
        self.tokens = torch.cat(stream)[:n_tokens]
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size - 1

    def __getitem__(self, index: int):
        window = self.tokens[index : index + self.block_size + 1]
        return window[:-1], window[1:]


class DigitImages(Dataset):
    """8x8 digits as (1, 8, 8) images; nan_row >= 0 makes that row NaN (a corrupt record)."""

    def __init__(self, split: str = "train", nan_row: int = -1):
        from replaybisect.data import Digits

        digits = Digits(split=split, as_images=True)
        self.inputs, self.targets = digits.inputs.clone(), digits.targets
        if nan_row >= 0:
            self.inputs[nan_row] = float("nan")

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index]


class DigitVectors(DigitImages):
    """The digits as flat 64-vectors in a dict batch (input, target): for the model that computes its own loss."""

    def __getitem__(self, index: int):
        return {"input": self.inputs[index].reshape(-1), "target": self.targets[index]}


# ---- a GPT -------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, plant: str):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.plant = plant
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.plant == "fp16_attention":
            att = (q * 256.0) @ k.transpose(-2, -1)  # PLANT fp16: logits x256 before the scale overflow 65504
            att = att * (1.0 / (256.0 * math.sqrt(k.size(-1))))
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        if self.plant == "handwritten_softmax":
            att = torch.exp(att)  # PLANT softmax: no max subtraction
            att = att / att.sum(dim=-1, keepdim=True)
        else:
            att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, plant: str, last: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, plant)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)
        self.plant = plant
        self.gain_plant = plant == "layernorm_overflow" and last
        self.register_buffer("residual_gain", torch.ones(()))

    def forward(self, x):
        branch = self.attn(self.ln_1(x))
        if self.plant == "detached_attention":
            branch = branch.detach()  # PLANT: the attention branch never gets a gradient
        x = x + branch
        if self.gain_plant:
            if self.training:
                self.residual_gain *= 1e3
            x = x * self.residual_gain  # PLANT: an unbounded residual gain; ln_2 overflows
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 32, block_size: int = 16, n_layer: int = 2, n_head: int = 2, n_embd: int = 32, plant: str = "none"):
        super().__init__()
        self.plant = plant
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size, plant, i == n_layer - 1) for i in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if self.plant == "softmax_output":
            return F.softmax(logits, dim=-1)  # PLANT: probabilities, and the loss is cross-entropy
        return logits


# ---- an LSTM language model --------------------------------------------------------------------------------
class LSTMLM(nn.Module):
    """PyTorch examples' word_language_model RNNModel, small: encoder, LSTM, decoder, dropout."""

    def __init__(self, vocab_size: int = 32, n_embd: int = 32, n_hidden: int = 32, n_layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, n_embd)
        self.rnn = nn.LSTM(n_embd, n_hidden, n_layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(n_hidden, vocab_size)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, idx):
        emb = self.drop(self.encoder(idx))
        output, _ = self.rnn(emb)
        return self.decoder(self.drop(output))


# ---- a CNN with BatchNorm ----------------------------------------------------------------------------------
class BNConvNet(nn.Module):
    def __init__(self, channels: int = 8, n_classes: int = 10, plant: str = "none"):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels * 4 * 4, n_classes)
        if plant == "frozen_first":  # PLANT: a layer left frozen (requires_grad=False) from a fine-tuning recipe
            for param in list(self.conv1.parameters()) + list(self.bn1.parameters()):
                param.requires_grad_(False)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


# ---- a model that computes its own loss ---------------------------------------------------------------------
class OwnLossMLP(nn.Module):
    """forward(input, target) -> scalar loss, like a HuggingFace model given labels."""

    def __init__(self, in_features: int = 64, hidden: int = 32, n_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, n_classes)

    def forward(self, input, target):
        logits = self.classifier(self.body(input))
        return F.cross_entropy(logits, target)


def own_loss_step(model, batch, loss_fn):
    """step_fn for a model that returns its loss: the config's `loss` is not used."""
    return model(batch["input"], batch["target"])
