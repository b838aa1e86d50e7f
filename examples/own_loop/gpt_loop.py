"""A hand-written GPT training loop as people write them (causal self-attention, 4 micro-batches per step,
AdamW from a configure_optimizers factory, bf16 autocast), in a Hydra app, recorded by replaybisect.Recorder.
The lines marked `# replaybisect` are all recording takes. Run: python gpt_loop.py [lr=0.01] [steps=100]"""
import math

import hydra
import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect  # replaybisect


class Attention(nn.Module):
    def __init__(self, d, heads, T):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).bool(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = torch.exp(att)  # a hand-written softmax without subtracting the max
        att = att / att.sum(-1, keepdim=True)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, heads, T):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(d, heads, T), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, T):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.Sequential(*[Block(d, heads, T) for _ in range(layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def configure_optimizers(model, lr, weight_decay):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def build(cfg):
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.vocab, cfg.d, cfg.heads, cfg.layers, cfg.T)
    return model, configure_optimizers(model, cfg.lr, cfg.weight_decay)


def train_step(model, optimizer, batch):
    total = 0.0
    for x, y in batch:  # micro-batches: gradient accumulation
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y) / len(batch)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def get_batch(cfg, generator):
    start = torch.randint(0, cfg.vocab, (cfg.micro * cfg.micro_batch, 1), generator=generator)
    noise = torch.randint(0, 4, (cfg.micro * cfg.micro_batch, cfg.T + 1), generator=generator)
    tokens = (start + torch.arange(cfg.T + 1) * 3 + noise) % cfg.vocab  # noisy arithmetic sequences
    return [(tokens[i::cfg.micro, :-1], tokens[i::cfg.micro, 1:]) for i in range(cfg.micro)]


@hydra.main(config_path=".", config_name="config", version_base="1.3")
def main(cfg):
    model, optimizer = build(cfg)
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config=cfg, snapshot_every=25)  # replaybisect
    generator = torch.Generator().manual_seed(cfg.seed)
    with rec:  # replaybisect: ends the run (FAILED on an exception) and flushes snapshots
        for step in range(cfg.steps):
            loss = rec.step(get_batch(cfg, generator))  # replaybisect: was train_step(model, optimizer, batch)
            if step % 25 == 0:
                print(f"step {step}: loss {loss:.4f}")


if __name__ == "__main__":
    main()
