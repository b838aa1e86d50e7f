"""A user's own loop with a learning rate too high for it: a small MLP regression under plain SGD. The predictions
grow geometrically until the MSE overflows (about ten steps of growth). Run: python diverging_loop.py LR STEPS"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=config["lr"])}


def train_step(model, optimizer, batch, scaler, config):
    x, y = batch
    loss = F.mse_loss(model(x).squeeze(-1), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def main(lr, steps):
    config = {"lr": lr}
    parts = build(config)
    rec = replaybisect.Recorder(parts["model"], parts["optimizer"], step_fn=train_step, build=build, config=config,
                                snapshot_every=5, layer_stats_every=1)
    generator = torch.Generator().manual_seed(1)
    with rec:
        for _ in range(steps):
            x = torch.randn(32, 8, generator=generator) * 3
            y = x.sum(-1) + 0.1 * torch.randn(32, generator=generator)
            rec.step((x, y))
    print("run", rec.run_id)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
