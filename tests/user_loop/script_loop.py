"""A training script written the way research code is (nanoGPT's shape): settings in globals overridden by
--key=value arguments, training at import time, the learning rate computed in the loop (get_lr(iter_num)),
micro-batches accumulated under a GradScaler, evaluation, a checkpoint and a log written into out_dir, printing.
Recording it adds the lines marked `# replaybisect`: the loop body's update becomes a nested function closing over
the script's own model, optimizer and scaler, and no `build` is written (a replay runs this script again).
At learning_rate=3 the loss diverges to NaN within 20 steps; softmax=hand with logit_scale=60 overflows exp().
Run: python script_loop.py --learning_rate=3.0 --max_iters=30"""
import contextlib
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect  # replaybisect

out_dir = "out"
eval_interval = 10
max_iters = 30
learning_rate = 1e-2
warmup_iters = 5
grad_accum = 2
batch_size = 8
block = 8
vocab = 32
grad_clip = 0.0
dtype = "float32"
softmax = "torch"  # hand: exp(logits) / sum(exp(logits)), without subtracting the maximum
logit_scale = 1.0
optim = "adamw"  # or sgd (momentum 0.9)
seed = 1337
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str))]
for argument in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, value = argument[2:].split("=")
    globals()[key] = type(globals()[key])(value)
config = {k: globals()[k] for k in config_keys}

print(f"tokens per iteration will be: {grad_accum * batch_size * block}")
torch.manual_seed(seed)
os.makedirs(out_dir, exist_ok=True)
data = torch.randint(0, vocab, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block - 1, (batch_size,))
    return torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.hidden = nn.Linear(32, 64)
        self.head = nn.Linear(64, vocab)

    def forward(self, idx, targets):
        logits = self.head(F.gelu(self.hidden(self.embed(idx)))) * logit_scale
        if softmax == "hand":
            probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
            return -torch.log(probs.gather(-1, targets.unsqueeze(-1))).mean()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    return learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, (it - warmup_iters) / max_iters)))


model = TinyLM()
if optim == "sgd":
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=0.9)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
ctx = contextlib.nullcontext() if dtype == "float32" else torch.autocast("cpu", dtype=getattr(torch, dtype))


def step(batch):  # replaybisect: the loop body's update, as a nested function
    for X, Y in batch:
        with ctx:
            loss = model(X, Y) / grad_accum
        scaler.scale(loss).backward()
    if grad_clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


rec = replaybisect.Recorder(model, optimizer, step_fn=step, scaler=scaler, config=config, snapshot_every=5)  # replaybisect

iter_num = 0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and iter_num > 0:
        model.eval()
        with torch.no_grad():
            val_loss = model(*get_batch()).item()
        model.train()
        torch.save({"model": model.state_dict(), "iter_num": iter_num}, os.path.join(out_dir, "ckpt.pt"))
        print(f"step {iter_num}: val loss {val_loss:.4f}")
    try:
        loss = rec.step([get_batch() for _ in range(grad_accum)])  # replaybisect
    except replaybisect.NonFiniteStep as stop:  # replaybisect
        print("stopped:", stop)
        break
    print(f"iter {iter_num}: loss {loss:.4f}, lr {lr:.4g}")
    with open(os.path.join(out_dir, "log.txt"), "a") as log:
        log.write(f"{iter_num} {loss}\n")
    iter_num += 1
    if iter_num > max_iters:
        break
rec.close()  # replaybisect
print("run", rec.run_id)
