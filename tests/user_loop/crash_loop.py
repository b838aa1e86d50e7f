"""A user's own loop whose step raises on one batch, with no NaN anywhere: the loop's data has a label out of range
at step BAD (a class the per-class weights do not have), so the weight lookup raises IndexError there.
Run: python crash_loop.py STEPS BAD"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect

CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 1.0, 0.5])


def build(config):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, batch):
    x, y = batch
    losses = F.cross_entropy(model(x), y.clamp(max=3), reduction="none")
    weights = CLASS_WEIGHTS[y]  # IndexError for a label of 4
    loss = (losses * weights).mean()
    loss.backward()
    optimizer.step()
    return loss


def main(steps, bad):
    torch.manual_seed(0)
    model, optimizer = build({})
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config={"steps": steps, "bad": bad},
                                snapshot_every=4, layer_stats_every=2)
    with rec:
        for step in range(steps):
            x = torch.randn(16, 8)
            y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
            if step == bad:
                y[5] = 4  # the data bug: a label past the last class
            rec.step((x, y))
    print("run", rec.run_id)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
