"""A recorded step's deferred loss rule (StepWatch(defer_reads=True)): the losses backpropagated in a step are judged
together, once, with its gradients; each loss is judged on its own value, whatever the loop does to it afterwards."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from replaybisect.core.step_watch import StepOutcome, StepWatch

INF, NAN = math.inf, math.nan


def judged(losses: list[torch.Tensor], after=lambda losses: None, divided: bool = False):
    """The step's verdict after `losses` were backpropagated (and `after` ran on them), at its gradients; `divided`:
    each backpropagated as a share of it, divided by the count (the built-in step's micro-batches)."""
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    state = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=None,
                            user_loop=False, params=list(model.parameters()), clip_grad_norm=None)
    outcome = StepOutcome(step=0)
    watch = StepWatch(state, outcome, defer_reads=True)
    for loss in losses:
        watch.loss(loss, loss / len(losses) if divided else None)
    after(losses)
    watch.gradients()
    return outcome.nonfinite, outcome.loss


@pytest.mark.parametrize("losses, verdict", [
    ([torch.tensor(1.0), torch.tensor(2.0)], None),
    ([torch.tensor(1.0), torch.tensor(NAN), torch.tensor(2.0)], "loss"),
    ([torch.tensor(1.0), torch.tensor(INF, dtype=torch.float64)], "loss"),
    ([torch.tensor(INF, dtype=torch.bfloat16)], "loss"),
    ([torch.tensor([1.0, INF])], "loss"),  # a loss of several elements, judged element by element
    ([torch.tensor(1.0), torch.tensor([1.0, 2.0])], None),
    ([torch.tensor(3e38), torch.tensor(3e38)], None),  # finite losses whose sum overflows fp32: no fault
], ids=["finite", "nan-in-the-middle", "inf-fp64", "inf-bf16", "inf-element", "mixed-shapes", "finite-but-huge"])
def test_the_losses_of_a_step_are_judged_together_and_each_on_its_own(losses, verdict):
    assert judged(losses)[0] == verdict


def test_losses_backpropagated_as_shares_are_judged_on_the_losses():
    assert judged([torch.tensor(1.0), torch.tensor(INF)], divided=True)[0] == "loss"
    assert judged([torch.tensor(3e38), torch.tensor(3e38)], divided=True)[0] is None
    assert judged([torch.tensor([]), torch.tensor(1.0)])[0] is None  # an empty loss has no value to fail


def test_a_loss_the_loop_changes_after_its_backward_is_judged_as_it_was():
    """`total = loss.detach(); total += next_loss` changes the first loss's storage: the verdict is the backward's."""
    verdict, loss = judged([torch.tensor(NAN), torch.tensor(1.0)], after=lambda losses: losses[0].detach().zero_())
    assert verdict == "loss" and math.isnan(loss)
    assert judged([torch.tensor(1.0)], after=lambda losses: losses[0].detach().fill_(NAN))[0] is None
