"""Healthy training loops of your own that `replay check --run-id` must not flag (each the shape of a common
recipe, small enough for a test):

    python healthy_loops.py lm 60        # PyTorch's word_language_model: sequence-first (T, B) tokens, an LSTM,
                                         # T*B flattened targets of a Zipf-distributed vocabulary, SGD lr 20, clip 0.25
    python healthy_loops.py cosine 60    # nanoGPT's schedule: warmup, cosine to lr/10, set by the loop before each step
    python healthy_loops.py mnist 60     # PyTorch's MNIST example: a CNN with a wide first dense layer, Adadelta lr 1,
                                         # StepLR(gamma 0.7), on the digits upsampled to 16x16

    python healthy_loops.py lm,cosine,mnist 60   # each in turn, a run each

Then: replay check --run-id <the run id a loop printed (one line each)>
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect

VOCAB, BPTT, LM_BATCH = 200, 8, 16


# ---- a word language model, sequence first ---------------------------------------------------------------
class RNNModel(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = 32):
        super().__init__()
        self.encoder = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, tokens):  # (T, B) -> (T * B, V), as word_language_model returns it
        output, _ = self.rnn(self.encoder(tokens))
        return self.decoder(output).view(-1, self.decoder.out_features)


def zipf_stream(length: int, seed: int = 0) -> torch.Tensor:
    """Tokens whose frequencies follow Zipf's law (rank r drawn with probability ~ 1/r), as words in text do; each
    token half the time follows from the one before it, so there is something to learn beyond the frequencies."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    tokens = torch.multinomial(weights, length, replacement=True, generator=generator)
    follows = torch.rand(length, generator=generator) < 0.5
    tokens[1:][follows[1:]] = (tokens[:-1][follows[1:]] * 7 + 3) % VOCAB
    return tokens


def lm_batches(steps: int):
    stream = zipf_stream((steps * BPTT + 1) * LM_BATCH)
    columns = stream[: (len(stream) // LM_BATCH) * LM_BATCH].view(LM_BATCH, -1).t().contiguous()  # batchify: (N, B)
    for step in range(steps):
        start = (step * BPTT) % (len(columns) - BPTT - 1)
        yield columns[start:start + BPTT], columns[start + 1:start + 1 + BPTT].reshape(-1)


def build_lm(config):
    model = RNNModel()
    return model, torch.optim.SGD(model.parameters(), lr=20.0)


def lm_step(model, optimizer, batch):
    data, targets = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    return loss


# ---- a classifier under nanoGPT's learning-rate schedule -----------------------------------------------------
def digits():
    from replaybisect.data import Digits

    data = Digits()
    return data.inputs, data.targets


def build_cosine(config):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def nanogpt_lr(step: int, peak: float = 1e-3, warmup: int = 5, decay_steps: int = 40) -> float:
    """Linear warmup, cosine decay to peak/10, then peak/10 (nanoGPT's get_lr)."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if step > decay_steps:
        return peak / 10
    ratio = (step - warmup) / (decay_steps - warmup)
    return peak / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - peak / 10)


def classifier_step(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss


# ---- PyTorch's MNIST example, on the digits upsampled to 16x16 ---------------------------------------------
class MnistNet(nn.Module):
    """The example's network on 16x16 images (its first dense layer reads 2304 features, 9216 on 28x28 MNIST), with 8
    channels in conv1 (32 there) to be fast."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 64, 3, 1)
        self.fc1 = nn.Linear(64 * 6 * 6, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def build_mnist(config):
    model = MnistNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)


def mnist_step(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    loss = F.nll_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss


def image_batches(steps: int, size: int = 16, batch: int = 64):
    inputs, targets = digits()
    images = F.interpolate(inputs.view(-1, 1, 8, 8), size=(size, size), mode="bilinear", align_corners=False)
    images = (images - 0.1307) / 0.3081  # the MNIST example's normalization
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(len(images), (batch,), generator=generator)
        yield images[rows], targets[rows]


def vector_batches(steps: int, batch: int = 64):
    inputs, targets = digits()
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(len(inputs), (batch,), generator=generator)
        yield inputs[rows], targets[rows]


def main(kind: str, steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    build, step_fn, batches = {
        "lm": (build_lm, lm_step, lm_batches),
        "cosine": (build_cosine, classifier_step, vector_batches),
        "mnist": (build_mnist, mnist_step, image_batches),
    }[kind]
    parts = build({})
    scheduler = parts[2] if len(parts) > 2 else None
    rec = replaybisect.Recorder(parts[0], parts[1], scheduler=scheduler, step_fn=step_fn, build=build, config={"kind": kind},
                                snapshot_every=10, layer_stats_every=0)
    with rec:
        for step, batch in enumerate(batches(steps)):
            if kind == "cosine":  # nanoGPT sets the lr in its loop, not through a scheduler
                for group in parts[1].param_groups:
                    group["lr"] = nanogpt_lr(step)
            rec.step(batch)
    print(rec.run_id)


if __name__ == "__main__":
    for kind in sys.argv[1].split(","):
        main(kind, int(sys.argv[2]))
