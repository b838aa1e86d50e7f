"""A training script in nanoGPT's train.py shape, recorded as it is written: the loop is left alone (no step function,
no rec.step); recording adds the three lines marked `# replaybisect`. Its shape: settings in globals overridden by
--key=value, training at import, the lr computed in the loop (get_lr(iter_num)) and written into the param groups,
the next batch fetched between micro-steps (X, Y = get_batch() after the forward), a GradScaler, gradient clipping,
an evaluation every eval_interval steps that also saves a checkpoint into out_dir, printing.
At learning_rate=30 with optim=sgd the loss diverges to NaN; with softmax=hand and logit_scale=60 a hand-written
softmax overflows exp() while the weights are still small.
Run: python inline_script.py --optim=sgd --learning_rate=30 --max_iters=40"""
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
eval_iters = 2
max_iters = 40
learning_rate = 1e-2
warmup_iters = 5
gradient_accumulation_steps = 2
batch_size = 8
block_size = 8
vocab_size = 32
dropout = 0.1
grad_clip = 0.0
dtype = "float32"
softmax = "torch"  # hand: exp(logits) / sum(exp(logits)), without subtracting the maximum
logit_scale = 1.0
optim = "adamw"  # or sgd (momentum 0.9)
seed = 1337
crash_at = -1  # a data error at this iteration (a bug of the script's, not a NaN)
stop_on_nan = 0  # 1: the loop ends itself on a non-finite loss
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str))]
for argument in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, value = argument[2:].split("=")
    globals()[key] = type(globals()[key])(value)
config = {k: globals()[k] for k in config_keys}

print(f"tokens per iteration will be: {gradient_accumulation_steps * batch_size * block_size}")
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed)
data = torch.randint(0, vocab_size, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, 32)
        self.fc = nn.Linear(32, 64)
        self.drop = nn.Dropout(dropout)
        self.lm_head = nn.Linear(64, vocab_size)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.drop(F.gelu(self.fc(self.wte(idx))))) * logit_scale
        if targets is None:
            return logits, None
        if softmax == "hand":
            probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
            loss = -torch.log(probs.gather(-1, targets.unsqueeze(-1))).mean()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        X, Y = get_batch()
        logits, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


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
rec = replaybisect.Recorder(model, optimizer, scaler=scaler, config=config, snapshot_every=5)  # replaybisect

X, Y = get_batch()  # fetch the very first batch
iter_num = 0
best_val_loss = 1e9
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        val_loss = estimate_loss()
        print(f"step {iter_num}: val loss {val_loss:.4f}")
        if val_loss < best_val_loss and iter_num > 0:
            best_val_loss = val_loss
            torch.save({"model": model.state_dict(), "iter_num": iter_num}, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if iter_num == crash_at:
            raise RuntimeError(f"corrupt shard at iteration {iter_num}")
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()  # prefetch the next batch while the model works
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item() * gradient_accumulation_steps
    print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.4g}")
    if stop_on_nan and not math.isfinite(lossf):
        break
    iter_num += 1
    if iter_num > max_iters:
        break
rec.close()  # replaybisect
