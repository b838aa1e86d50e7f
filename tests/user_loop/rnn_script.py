"""A script shaped like pytorch/examples' word_language_model: argparse settings, an RNN over a token stream read in
bptt-long chunks, the hidden state repackaged (detached) at every chunk, the parameters updated by hand
(`p.data.add_(p.grad, alpha=-lr)`, no optimizer object), `lr` a module global the epoch loop changes (here it grows
by --growth each epoch, a warmup). Recording adds the lines marked `# replaybisect`: the step becomes a nested
function and the hidden state goes through the recorder's `carry`. With --lr 0.5 --growth 4 the second epoch
overflows (NaN); at a tenth of the update it trains.
Run: python rnn_script.py --lr 0.5 --growth 4 --epochs 3"""
import argparse

import torch
import torch.nn as nn

import replaybisect  # replaybisect

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.5)
parser.add_argument("--growth", type=float, default=1.0)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--bptt", type=int, default=8)
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--seed", type=int, default=1111)
args = parser.parse_args()

torch.manual_seed(args.seed)
VOCAB, HIDDEN = 16, 32
train_data = torch.randint(0, VOCAB, (args.bptt * 10 + 1, args.batch_size))  # [time, batch], 10 chunks an epoch


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = nn.RNN(HIDDEN, HIDDEN, nonlinearity="relu")
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, data, hidden):
        output, hidden = self.rnn(self.encoder(data), hidden)
        return self.decoder(output).flatten(0, 1), hidden

    def init_hidden(self, batch_size):
        return torch.zeros(1, batch_size, HIDDEN)


def repackage_hidden(h):
    return h.detach()


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].flatten()


model = RNNModel()
criterion = nn.CrossEntropyLoss()
lr = args.lr


def step(batch, carry):  # replaybisect: the chunk's update, as a nested function; the hidden state in carry
    data, targets = batch
    hidden = repackage_hidden(carry.get("hidden", model.init_hidden(args.batch_size)))
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    carry["hidden"] = hidden
    return loss


rec = replaybisect.Recorder(model, None, step_fn=step, config=vars(args), snapshot_every=4)  # replaybisect


def train():
    model.train()
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        loss = rec.step(get_batch(train_data, i))  # replaybisect
        print(f"| epoch {epoch} | batch {batch} | lr {lr:.3g} | loss {loss:.3f}")


try:
    for epoch in range(1, args.epochs + 1):
        train()
        lr *= args.growth
except replaybisect.NonFiniteStep as stop:  # replaybisect
    print("stopped:", stop)
rec.close()  # replaybisect
print("run", rec.run_id)
