"""The recorded step's guard on gradients (replaybisect/core/guard.py), in the three paths that record a step:

- a GradScaler built with enabled=False (nanoGPT makes one on CPU and with bf16) does not turn the gradient check
  off: a NaN gradient stops the step before its update, and `replay nan` names the backward at that step;
- a total gradient norm that overflows fp32 while every element is finite is no fault: the step trains exactly as
  plain PyTorch trains it (clipping included), and its grad_norm is logged as it is (inf).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from torch import nn

from tests.helpers import Workspace
from replaybisect.core import config as config_mod
from replaybisect.core import guard, loop

PLANT_AT = 7  # the step whose gradient is planted

# ---- a user's own loop: the NaN plant with a GradScaler(enabled=False), as nanoGPT makes one on CPU and for bf16 ---
OWN_LOOP = '''
"""An own loop; at step PLANT_AT the gradient through one layer is planted: NaN (`nan`, with a disabled
GradScaler) or times 1e20 (`overflow`, without a scaler: every element finite, the total norm past fp32's range).
The same loop runs plainly first, then recorded. Run: python guard_loop.py MODE STEPS PLANT_AT"""
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaybisect

GAINS = {"nan": float("nan"), "overflow": 1e20}


class Planted(torch.autograd.Function):
    """The identity forward; its backward multiplies the gradient by `gain` (None: unchanged)."""

    @staticmethod
    def forward(ctx, x, gain):
        ctx.gain = gain
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.gain is None else grad * ctx.gain), None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 16)
        self.second = nn.Linear(16, 1)

    def forward(self, x, gain=None):
        return self.second(Planted.apply(torch.tanh(self.first(x)), gain))


def build(config):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=False) if config["mode"] == "nan" else None
    return model, optimizer, None, scaler


def train_step(model, optimizer, scaler, batch, step, config):
    x, y = batch
    gain = GAINS[config["mode"]] if step == config["plant_at"] else None
    loss = F.mse_loss(model(x, gain).squeeze(-1), y)
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return loss.detach()


def plain(config, batches):
    torch.manual_seed(0)
    model, optimizer, _, scaler = build(config)
    losses = []
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(train_step(model, optimizer, scaler, batch, step, config)))
    return losses, model.state_dict()


def main(mode, steps, plant_at):
    config = {"mode": mode, "plant_at": plant_at}
    x = torch.randn(steps, 8, 4, generator=torch.Generator().manual_seed(1))
    batches = [(x[i], x[i].sum(-1)) for i in range(steps)]
    plain_losses, plain_state = plain(config, batches)
    torch.manual_seed(0)
    model, optimizer, _, scaler = build(config)
    rec = replaybisect.Recorder(model, optimizer, scaler=scaler, step_fn=train_step, build=build, config=config,
                                snapshot_every=5, layer_stats_every=5)
    losses = []
    with rec:
        for step, batch in enumerate(batches):
            before = {name: value.clone() for name, value in model.state_dict().items()}
            try:
                losses.append(rec.step(batch))
            except replaybisect.NonFiniteStep:
                unchanged = all(torch.equal(before[name], value) for name, value in model.state_dict().items())
                print("RESULT", json.dumps({"run": rec.run_id, "halted": step, "unchanged": unchanged}))
                raise
    same = losses == plain_losses and all(torch.equal(plain_state[k], v) for k, v in model.state_dict().items())
    print("RESULT", json.dumps({"run": rec.run_id, "halted": None, "same_as_plain": same}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
'''


def _record_own_loop(workspace: Workspace, mode: str, steps: int) -> dict:
    folder = workspace.path / "guard_project"
    folder.mkdir(exist_ok=True)
    (folder / "guard_loop.py").write_text(textwrap.dedent(OWN_LOOP))
    done = subprocess.run([sys.executable, "guard_loop.py", mode, str(steps), str(PLANT_AT)], cwd=folder,
                          env=workspace.env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return {**json.loads(lines[-1][len("RESULT "):]), "returncode": done.returncode, "stderr": done.stderr}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    workspace = Workspace(tmp_path_factory.mktemp("nan_run"))
    return workspace, _record_own_loop(workspace, "nan", 12)


@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory):
    workspace = Workspace(tmp_path_factory.mktemp("overflow_run"))
    return workspace, _record_own_loop(workspace, "overflow", 12)


def test_a_disabled_scaler_still_stops_a_nan_gradient_before_the_update(nan_run):
    workspace, result = nan_run
    assert result["returncode"] != 0 and "NonFiniteStep: grad_norm is nan" in result["stderr"], result["stderr"]
    assert result["halted"] == PLANT_AT and result["unchanged"]  # the NaN gradient was never applied
    tags = workspace.store().tags(result["run"])
    assert (tags["status"], tags["first_nonfinite_step"], tags["nonfinite_what"]) == ("nonfinite", str(PLANT_AT), "grad_norm")


def test_replays_with_a_disabled_scaler_are_exact(nan_run):
    from replaybisect.replay.restore import logged_losses, replay, restore

    workspace, result = nan_run
    store = workspace.store()
    logged = logged_losses(store, result["run"])
    for step in (0, 5):
        replayed = replay(restore(store, result["run"], step), PLANT_AT, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]
        assert replayed.losses == {s: logged[s] for s in range(step, PLANT_AT)}


def test_replay_nan_names_the_backward_at_the_planted_step(nan_run):
    workspace, result = nan_run
    answer = workspace.replay("nan", "--run-id", result["run"], "--json")
    assert answer.returncode == 0, answer.stderr
    report = answer.json()
    assert report["reproduced"] == "exact"
    assert (report["category"], report["failing_step"]) == ("backward", PLANT_AT), report


def test_a_norm_overflow_of_finite_gradients_trains_as_plain_pytorch(overflow_run):
    from replaybisect.replay.restore import logged_losses, replay, restore

    workspace, result = overflow_run
    assert result["returncode"] == 0, result["stderr"]
    assert result["halted"] is None and result["same_as_plain"]  # bit for bit the plain loop's losses and weights
    store = workspace.store()
    tags = store.tags(result["run"])
    assert "first_nonfinite_step" not in tags and tags["status"] == "ok"
    norms = dict(store.metric_history(result["run"], "grad_norm"))
    assert norms[PLANT_AT] > 1e300 and all(math.isfinite(norms[s]) for s in norms if s != PLANT_AT)  # logged as it was
    logged = logged_losses(store, result["run"])
    replayed = replay(restore(store, result["run"], 5), 12, logged=logged)
    assert replayed.reproduced == "exact", replayed.mismatches[:3]


# ---- Lightning: 16-mixed with a GradScaler(enabled=False) in its precision plugin --------------------------------
LIGHTNING = '''
"""A LightningModule trained under 16-mixed with a GradScaler(enabled=False) given to Lightning's precision plugin;
at batch PLANT_AT the gradient through its hidden layer turns NaN. Run: python guard_lit.py STEPS PLANT_AT"""
import json
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import replaybisect
from replaybisect.lightning import ReplayCallback


class NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, planted):
        ctx.planted = planted
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("nan") if ctx.planted else grad), None


class LitNet(L.LightningModule):
    def __init__(self, plant_at: int = -1):
        super().__init__()
        self.save_hyperparameters()
        self.first, self.second = nn.Linear(4, 16), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = NanGrad.apply(torch.tanh(self.first(x)), batch_idx == self.hparams.plant_at)
        return F.mse_loss(self.second(hidden).squeeze(-1).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Before(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.state = {name: value.clone() for name, value in pl_module.state_dict().items()}


def main(steps, plant_at):
    L.seed_everything(7, verbose=False)
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    before, model = Before(), LitNet(plant_at)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[plugin],
                        callbacks=[ReplayCallback(snapshot_every=5, layer_stats_every=5), before],
                        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    try:
        trainer.fit(model, DataLoader(TensorDataset(x, x.sum(-1)), batch_size=16))
    except replaybisect.NonFiniteStep as stop:
        unchanged = all(torch.equal(before.state[name], value) for name, value in model.state_dict().items())
        print("RESULT", json.dumps({"run": stop.run_id, "halted": stop.step, "unchanged": unchanged}))
        raise


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
'''


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    workspace = Workspace(tmp_path_factory.mktemp("lightning_run"))
    folder = workspace.path / "guard_lightning"
    folder.mkdir()
    (folder / "guard_lit.py").write_text(textwrap.dedent(LIGHTNING))
    done = subprocess.run([sys.executable, "guard_lit.py", "12", str(PLANT_AT)], cwd=folder, env=workspace.env(),
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return workspace, json.loads(lines[-1][len("RESULT "):]), done.stderr


def test_lightning_with_a_disabled_scaler_stops_a_nan_gradient_and_replays_it(lightning_run):
    workspace, result, stderr = lightning_run
    assert "NonFiniteStep: grad_norm is nan" in stderr, stderr
    assert result["halted"] == PLANT_AT and result["unchanged"]
    tags = workspace.store().tags(result["run"])
    assert (tags["status"], tags["first_nonfinite_step"], tags["nonfinite_what"]) == ("nonfinite", str(PLANT_AT), "grad_norm")
    report = workspace.answer_here("find_nan", result["run"])  # rebuilds the scaler disabled, as recorded
    assert report["reproduced"] == "exact"
    assert (report["category"], report["failing_step"]) == ("backward", PLANT_AT), report


# ---- the built-in step and the own-loop step, in process ----------------------------------------------------
class Planted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gain):
        ctx.gain = gain
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.gain is None else grad * ctx.gain), None


class PlantedMLP(nn.Module):
    """The built-in MLP's arguments; `gain` multiplies the gradient through its hidden layer (None: unchanged)."""

    def __init__(self, in_features=64, hidden=16, out_features=10, depth=1, dropout=0.1, activation="relu"):
        super().__init__()
        self.first, self.second = nn.Linear(in_features, hidden), nn.Linear(hidden, out_features)
        self.gain = None

    def forward(self, x):
        return self.second(Planted.apply(torch.tanh(self.first(x.flatten(1))), self.gain))


def _built_in(*overrides: str, scaler: bool = False) -> tuple[loop.TrainState, object]:
    cfg = config_mod.compose(overrides=["model._target_=test_step_guard.PlantedMLP", "model.hidden=16", "train.batch_size=16",
                                        "train.device=cpu", "train.num_threads=1", "optim=sgd", *overrides])
    source, _ = loop.build_data(cfg)
    state = loop.build_state(cfg)
    return (replace(state, scaler=torch.amp.GradScaler("cpu", enabled=False)) if scaler else state), source


def test_built_in_step_with_a_disabled_scaler_halts_on_a_nan_gradient():
    state, source = _built_in(scaler=True)
    loop.run_step(state, 0, source.batch(0))
    before = {name: value.clone() for name, value in state.model.state_dict().items()}
    state.model.gain = float("nan")
    outcome = loop.run_step(state, 1, source.batch(1))
    assert outcome.nonfinite == "grad_norm" and not outcome.updated
    assert all(torch.equal(before[name], value) for name, value in state.model.state_dict().items())


@pytest.mark.parametrize("clip", [None, 1.0])
def test_built_in_step_trains_through_a_norm_overflow_of_finite_gradients_as_plain_pytorch(clip):
    overrides = [f"train.clip_grad_norm={clip}"] if clip else []
    state, source = _built_in(*overrides)
    reference, _ = _built_in(*overrides)
    state.model.gain = reference.model.gain = 1e20
    batch = source.batch(0)
    outcome = loop.run_step(state, 0, batch)
    assert outcome.grad_norm == math.inf and outcome.nonfinite is None and outcome.updated

    x, y = batch
    reference.optimizer.zero_grad(set_to_none=True)
    loss = reference.loss_fn(reference.model(x), y)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in reference.model.parameters())
    if clip:
        torch.nn.utils.clip_grad_norm_(reference.model.parameters(), clip, error_if_nonfinite=False)
    reference.optimizer.step()
    assert outcome.loss == float(loss.detach())
    for mine, theirs in zip(state.model.parameters(), reference.model.parameters()):
        assert torch.equal(mine, theirs)


def test_the_rule():
    finite = [torch.full((64,), 1e19), torch.ones(3)]  # sum of squares 6.4e39: past fp32
    norm = float(guard.total_norm(finite))
    assert norm == math.inf and not guard.nonfinite_gradient(finite, norm, None)
    bad = [torch.ones(3), torch.tensor([1.0, math.nan])]
    norm = float(guard.total_norm(bad))
    assert guard.nonfinite_gradient(bad, norm, None)
    assert guard.nonfinite_gradient(bad, norm, torch.amp.GradScaler("cpu", enabled=False))
    assert not guard.nonfinite_gradient(bad, norm, torch.amp.GradScaler("cpu"))  # it skips the step itself
