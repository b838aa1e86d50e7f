"""pytorch/examples regression/main.py as written: fit a degree-4 polynomial with one Linear layer, the gradients
cleared with fc.zero_grad(), the parameters updated by hand (`param.add_(-0.1 * param.grad)`, no optimizer), the
loop running until the loss is below 1e-3. The random target polynomial is seeded and the loop capped at
--max-batches so the run has an end; recording adds the lines marked `# replaybisect`.
Run: python regression_script.py [--max-batches 400]"""
import argparse

import torch
import torch.nn.functional as F

import replaybisect  # replaybisect

parser = argparse.ArgumentParser()
parser.add_argument("--max-batches", type=int, default=400)
args = parser.parse_args()

POLY_DEGREE = 4
torch.manual_seed(0)
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    """Builds features i.e. a matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    """Approximated function."""
    return x.mm(W_target) + b_target.item()


def get_batch(batch_size=32):
    """Builds a batch i.e. (x, f(x)) pair."""
    random = torch.randn(batch_size)
    x = make_features(random)
    y = f(x)
    return x, y


fc = torch.nn.Linear(W_target.size(0), 1)
rec = replaybisect.Recorder(fc)  # replaybisect

for batch_idx in range(1, args.max_batches + 1):
    batch_x, batch_y = get_batch()
    fc.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()
    output.backward()
    for param in fc.parameters():
        param.data.add_(-0.1 * param.grad)
    if loss < 1e-3:
        break

print("Loss: {:.6f} after {} batches".format(loss, batch_idx))
