"""A user's own loop for the tests: an MLP with dropout, two micro-batches per step, a StepLR the recorder
steps, a GradScaler under fp16, batches drawn from the global torch, Python and NumPy RNGs between steps (what a
replay must not depend on), a step that draws from all three, and micro-batches as namedtuples (read by field name).
With schedule="loop", no scheduler: the loop sets each step's lr itself (warmup, then decay), as nanoGPT's does.
Run: python tiny_loop.py PRECISION STEPS [nan_at]"""
import random
import sys
from collections import namedtuple

import numpy as np

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Micro = namedtuple("Micro", ["x", "y"])


class Net(nn.Module):
    def __init__(self, nan_at=-1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
        self.nan_at = nan_at
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        out = self.body(x)
        if int(self.calls) == self.nan_at:  # a planted fault: the forward of micro-batch N turns NaN
            out = torch.sqrt(out - 1e3)  # sqrt of a negative: NaN
        return out


def build(config):
    model = Net(config["nan_at"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7) if config.get("schedule") != "loop" else None
    scaler = torch.amp.GradScaler("cpu") if config["precision"] == "fp16" else None
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}


def train_step(model, optimizer, batch, scaler, config):
    total = 0.0
    jitter = (1 + 0.01 * random.random()) * (1 + 0.01 * float(np.random.rand()))  # a step drawing from Python and NumPy
    for micro in batch:
        x, y = micro.x, micro.y
        with torch.autocast("cpu", dtype=DTYPES.get(config["precision"], torch.float32), enabled=config["precision"] != "fp32"):
            loss = F.cross_entropy(model(x), y) * jitter / len(batch)
        (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return total


def get_lr(step):
    return 1e-2 * min(1.0, (step + 1) / 8) * 0.95 ** step


def main(precision, steps, nan_at, schedule="steplr"):
    config = {"precision": precision, "nan_at": nan_at, "schedule": schedule}
    parts = build(config)
    rec = replaybisect.Recorder(parts["model"], parts["optimizer"], scheduler=parts["scheduler"], scaler=parts["scaler"],
                                step_fn=train_step, build=build, config=config, snapshot_every=10, layer_stats_every=5)
    with rec:
        for step in range(steps):
            if schedule == "loop":
                for group in parts["optimizer"].param_groups:
                    group["lr"] = get_lr(step)
            x = torch.randn(16, 8)  # the loop draws from the global RNGs between steps
            x[:, 2:] += random.gauss(0, 1) + float(np.random.randn())
            y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
            print("loss", rec.step([Micro(x[:8], y[:8]), Micro(x[8:], y[8:])]))  # user code prints to stdout
    print("run", rec.run_id)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else -1)
