"""A user's own loop that carries state from step to step: a linear recurrence (nothing squashes its hidden state)
over one long token stream, read in chunks of 8; each step starts from the hidden state the previous step ended
with, detached (truncated backpropagation through time, as word_language_model's repackage_hidden does). The step
keeps that state in the recorder's `carry`. At lr=1.0 the recurrent weights grow until the hidden state overflows
(the loss is NaN in the teens of steps); at lr=0.1 they do not.
Run: python rnn_loop.py LR STEPS"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect

VOCAB, HIDDEN, CHUNK, ROWS = 16, 32, 8, 4


class LinearRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.recur = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, hidden):
        outputs = []
        for position in range(tokens.shape[1]):
            hidden = self.recur(hidden) + self.embed(tokens[:, position])
            outputs.append(self.head(hidden))
        return torch.stack(outputs, 1), hidden


def build(config):
    model = LinearRNN()
    return model, torch.optim.SGD(model.parameters(), lr=config["lr"])


def train_step(model, optimizer, batch, carry):
    tokens, targets = batch
    hidden = carry.get("hidden", torch.zeros(tokens.shape[0], HIDDEN))
    logits, hidden = model(tokens, hidden)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    carry["hidden"] = hidden.detach()  # the next step starts where this one ended
    return loss


def main(lr, steps):
    torch.manual_seed(0)
    config = {"lr": lr}
    model, optimizer = build(config)
    stream = torch.randint(0, VOCAB, (ROWS, steps * CHUNK + 1))
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config=config, snapshot_every=5)
    try:
        with rec:
            for step in range(steps):
                chunk = stream[:, step * CHUNK: (step + 1) * CHUNK + 1]
                print("loss", rec.step((chunk[:, :-1], chunk[:, 1:])))
    except replaybisect.NonFiniteStep as stop:
        print("stopped", stop)
    print("run", rec.run_id)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
