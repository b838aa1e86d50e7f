"""A tiny GPT-2 trained by a loop written with accelerate (prepare, accumulate, backward, clip_grad_norm_), as its
docs write one; the three lines marked `# replaybisect` record it. Its plants: --lr (with --optim sgd, no clip) and
--plant ROW (a token whose embedding scale is infinite, in one example)."""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import replaybisect  # replaybisect

VOCAB, LENGTH = 64, 16
RARE = VOCAB - 1


class ScaledEmbeddingGPT2(GPT2LMHeadModel):
    """GPT-2 with per-token embedding scales, an inverse frequency from counts: the rare token's count is 0."""

    def __init__(self, config):
        super().__init__(config)
        counts = torch.full((config.vocab_size,), 100.0)
        counts[RARE] = 0.0
        self.register_buffer("token_counts", counts)

    def forward(self, input_ids=None, labels=None, **kwargs):
        scale = self.token_counts.mean() / self.token_counts[input_ids]
        embeds = self.transformer.wte(input_ids) * scale.unsqueeze(-1)
        return super().forward(inputs_embeds=embeds, labels=labels, **kwargs)


parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
parser.add_argument("--clip", type=float, default=1.0)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--plant", type=int, default=None)
args = parser.parse_args()

set_seed(0)
accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True)
config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0)
model = ScaledEmbeddingGPT2(config) if args.plant is not None else GPT2LMHeadModel(config)
ids = torch.randint(0, RARE, (256, LENGTH), generator=torch.Generator().manual_seed(0))
if args.plant is not None:
    ids[args.plant, 5] = RARE
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4, shuffle=True)
optimizer = (torch.optim.SGD(model.parameters(), lr=args.lr) if args.optim == "sgd"
             else torch.optim.AdamW(model.parameters(), lr=args.lr))
scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=args.steps)
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
rec = replaybisect.Recorder(model, optimizer, config=vars(args), snapshot_every=5)  # replaybisect

step = 0
while step < args.steps:
    for (batch,) in data:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            accelerator.print(f"step {step} loss {loss.item():.4f}")
            step += 1
            if step == args.steps:
                break
rec.close()  # replaybisect
