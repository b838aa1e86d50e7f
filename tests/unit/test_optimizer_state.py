"""An optimizer's own entries (what it keeps in optimizer.state under a key that is no parameter: a step counter, a
running scale) through a snapshot: its tensors file and state.json, and back into a freshly built optimizer."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from replaybisect.core import loop, rng, several
from replaybisect.core.state import apply, optimizer_tensors, state_entries, state_json


class WarmSGD(torch.optim.SGD):
    """Keeps a counter, a tensor and a dict of numbers of its own; its lr is made from them every step."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        self.state["scale"] = self.state.get("scale", torch.ones(())) * 0.9
        self.state["schedule"] = {"warmup": 20, "peak": 0.05}
        for group in self.param_groups:
            group["lr"] = 0.05 * min(1.0, self.state["global_step"] / 20) * float(self.state["scale"])
        return super().step(closure)


def _state(optimizer_of) -> loop.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return loop.TrainState(cfg=None, model=model, optimizer=optimizer_of(model), scheduler=None, scaler=None, loss_fn=None,
                           step_fn=None, device=torch.device("cpu"), precision="fp32", clip_grad_norm=None)


def _train(state: loop.TrainState, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = nn.functional.mse_loss(state.model(x), x.sum(1, keepdim=True))
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        losses.append(loss.item())
    return losses


def _snapshot_and_restore(state: loop.TrainState, fresh: loop.TrainState) -> None:
    """What a snapshot keeps (its tensors, its state.json as text) applied to `fresh`."""
    tensors = {name: value.detach().clone() for name, value in state_entries(state)}
    saved = json.loads(json.dumps(state_json(state, 3, rng.capture_raw(), {"step": 3}, "periodic")))
    apply(fresh, tensors, saved)


@pytest.mark.parametrize("optimizer_of", [
    lambda model: WarmSGD(model.parameters(), lr=0.05, momentum=0.9),
    lambda model: several.Optimizers({"first": WarmSGD(model[0].parameters(), lr=0.05, momentum=0.9),
                                      "last": WarmSGD(model[2].parameters(), lr=0.05)}),
], ids=["one", "several"])
def test_an_optimizers_own_entries_are_kept_and_a_restored_optimizer_trains_on_bit_for_bit(optimizer_of):
    recorded = _state(optimizer_of)
    _train(recorded, 3)
    restored = _state(optimizer_of)
    _snapshot_and_restore(recorded, restored)
    for optimizer, again in zip(several.members(recorded.optimizer), several.members(restored.optimizer)):
        assert again.state["global_step"] == 3 and again.state["schedule"] == {"warmup": 20, "peak": 0.05}
        assert torch.equal(again.state["scale"], optimizer.state["scale"])
    assert _train(restored, 4) == _train(recorded, 4)  # (the lr is made from all three)
    assert [key for param, key, _ in optimizer_tensors(restored.optimizer) if param is None] == ["scale"] * len(several.members(restored.optimizer))


@pytest.mark.parametrize("key, value", [("history", object()), ("", 1), ("7", torch.ones(())), ("a\nb", 1), (("a", 1), 1)],
                         ids=["object", "empty", "number", "two-lines", "tuple"])
def test_an_entry_a_snapshot_cannot_hold_is_left_out_with_one_warning(key, value):
    state = _state(lambda model: torch.optim.SGD(model.parameters(), lr=0.05))
    _train(state, 1)
    state.optimizer.state[key] = value
    with pytest.warns(UserWarning, match=r"which a snapshot cannot hold") as caught:
        names = [name for name, _ in state_entries(state)]
        saved = state_json(state, 1, rng.capture_raw(), {"step": 1}, "periodic")
    assert len(caught) == 1 and not any(name.startswith("optim/own/") for name in names) and "own" not in saved["optimizer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per entry
        state_entries(state)


def test_a_non_finite_own_tensor_of_any_of_several_optimizers_is_found():
    """Two optimizers each keep a "scale": the second one's NaN is seen (a joined view would show the first one's)."""
    from replaybisect.verbs.nan import probes

    state = _state(lambda model: several.Optimizers({"first": WarmSGD(model[0].parameters(), lr=0.05),
                                                     "last": WarmSGD(model[2].parameters(), lr=0.05)}))
    _train(state, 1)
    assert probes.finiteness(state)
    state.optimizer.named["last"].state["scale"] = torch.tensor(float("nan"))
    assert not probes.finiteness(state)
    assert [finding.name for finding in probes.probe_state(state)] == ["optimizer.state:scale"]
