"""A script shaped like pytorch/examples' word_language_model/main.py, recorded as it is written: argparse settings,
a token corpus batchified into columns, an RNN (relu) read in bptt-long chunks, `train()` with `model.zero_grad()`,
the hidden state repackaged (detached) at every chunk, the loss taken outside the model (`criterion(output,
targets)`), gradients clipped, the parameters updated by hand (`p.data.add_(p.grad, alpha=-lr)`, no optimizer
object), `lr` a module global annealed (/4) when validation does not improve, the best model saved with
`open(args.save, "wb")`. The corpus is made here (a noisy cyclic token stream) instead of read from files, and the
log prints every batch's loss. The three lines marked `# replaybisect` record it.
Run: python wlm_script.py --lr 20 --epochs 3 (trains); --lr 210 --epochs 40 (NaN at step 17)"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect  # replaybisect

parser = argparse.ArgumentParser(description="RNN language model (word_language_model's shape)")
parser.add_argument("--emsize", type=int, default=16)
parser.add_argument("--nhid", type=int, default=32)
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--bptt", type=int, default=8)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--save", type=str, default="model.pt")
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cpu")

ntokens = 12
stream = (torch.arange(2000) * 5 + torch.randint(0, 2, (2000,))) % ntokens  # a corpus with something to learn


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous().to(device)


eval_batch_size = 4
train_data = batchify(stream[:args.batch_size * args.bptt * 10 + args.batch_size], args.batch_size)  # 10 chunks an epoch
val_data = batchify(stream[1000:1200], eval_batch_size)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, dropout):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.RNN(ninp, nhid, 1, nonlinearity="relu")
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(1, bsz, self.nhid)


model = RNNModel(ntokens, args.emsize, args.nhid, args.dropout).to(device)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()

        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)

        total_loss += loss.item()
        print("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | loss {:.6f}".format(
            epoch, batch, len(train_data) // args.bptt, lr, loss.item()))


lr = args.lr
best_val_loss = None
rec = replaybisect.Recorder(model, config=vars(args), snapshot_every=4)  # replaybisect

try:
    for epoch in range(1, args.epochs + 1):
        epoch_start_time = time.time()
        train()
        val_loss = evaluate(val_data)
        print("| end of epoch {:3d} | time: {:5.2f}s | valid loss {:5.2f}".format(epoch, (time.time() - epoch_start_time), val_loss))
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, "wb") as f:
                torch.save(model, f)
            best_val_loss = val_loss
        else:
            lr /= 4.0
except KeyboardInterrupt:
    print("-" * 89)
    print("Exiting from training early")
rec.close()  # replaybisect
