"""A loop whose step 6 gets a batch 512 times larger than the others, under an address-space cap: it runs out of
memory in that step's forward (the activations of the wide layers), as a job on a machine with little memory does."""

import resource
import sys

import torch

import replaybisect

WIDTH = 1024


def build(cfg):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model, optimizer, batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def batches():
    generator = torch.Generator().manual_seed(1)
    for step in range(10):
        rows = 8 * 2048 if step == 6 else 8
        yield torch.randn(rows, 64, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


if __name__ == "__main__":
    model, optimizer = build(None)
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config={"width": WIDTH}, snapshot_every=4)
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * resource.getpagesize()
    cap = size + int(sys.argv[1]) * 2**20 if len(sys.argv) > 1 else size + 200 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    for batch in batches():
        print("loss", float(rec.step(batch)))
    rec.close()
