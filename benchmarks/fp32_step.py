"""examples/own_loop/gpt_loop.py's step without its bf16 autocast: the benchmarks' GPT trained in fp32
(`overhead.py --precision fp32`). On a CPU that emulates bf16 matmuls (no AVX-512 BF16 or AMX) a bf16 step of that
GPT takes some ten times an fp32 one, which hides the recorder's cost."""

from __future__ import annotations

import torch


def train_step(model, optimizer, batch):
    total = 0.0
    for x, y in batch:  # micro-batches: gradient accumulation
        loss = model(x, y) / len(batch)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total
