"""One step, three paths: the built-in step (`loop.run_step`), your own loop recorded by `Recorder.step`, and a
Lightning Trainer recorded by `ReplayCallback` (and its replay, `lightning_step`). The step's moments are written
once (core/step_watch.py); here the same step on the same weights, batch and RNG state must come out the same
on every path: the loss, the grad norm, the non-finite verdict, the parameters, the optimizer state and the RNG
state after it. fp32 on the CPU: bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaybisect
from replaybisect.core import loop

pytest.importorskip("lightning")
import lightning as L  # noqa: E402

from replaybisect.lightning import ReplayCallback, lightning_step  # noqa: E402

SEED, STEP_SEED = 0, 123
X = torch.linspace(-2, 2, 16 * 8).reshape(16, 8)
Y = torch.sin(X.sum(dim=1, keepdim=True))
BAD_X = X.clone().index_fill_(0, torch.tensor([3]), float("nan"))  # one row of NaN inputs: a non-finite loss


def inputs(plant: str) -> torch.Tensor:
    return (BAD_X if plant == "loss" else X).clone()


class Net(nn.Module):
    """An MLP with dropout (the step draws random numbers). `plant`: a gate at 0 under a square root, so the loss
    is finite and the gradients are not (d sqrt(u)/du at u=0 is inf)."""

    def __init__(self, plant: bool = False):
        super().__init__()
        self.lin1, self.drop, self.lin2 = nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1)
        self.gate = nn.Parameter(torch.zeros(1)) if plant else None

    def forward(self, x):
        out = self.lin2(self.drop(torch.tanh(self.lin1(x))))
        return torch.sqrt(out.pow(2) * self.gate) if self.gate is not None else out


def build(config):
    torch.manual_seed(SEED)
    model = Net(plant=config.get("plant") == "gradient")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def own_step(model, optimizer, batch):
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss


class LitNet(L.LightningModule):
    def __init__(self, plant: str = "none"):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(SEED)
        self.net = Net(plant == "gradient")

    def training_step(self, batch):
        inputs, targets = batch
        return F.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class StepSeed(L.Callback):
    """Every path starts the step from the same RNG state; the state after it is kept."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.manual_seed(STEP_SEED)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rng_after = torch.get_rng_state()


def after_step(outcome_loss, grad_norm, nonfinite, model, optimizer) -> dict:
    return {
        "loss": outcome_loss, "grad_norm": grad_norm, "nonfinite": nonfinite,
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": [{key: value.clone() for key, value in optimizer.state[p].items()} for p in model.parameters()],
        "rng": torch.get_rng_state(),
    }


def builtin_path(plant: str) -> dict:
    model, optimizer = build({"plant": plant})
    state = loop.TrainState(cfg=None, model=model, optimizer=optimizer, scheduler=None, scaler=None, loss_fn=nn.MSELoss(),
                            step_fn=loop.supervised_step, device=torch.device("cpu"), precision="fp32", clip_grad_norm=None)
    torch.manual_seed(STEP_SEED)
    outcome = loop.run_step(state, 0, (inputs(plant), Y.clone()))
    return after_step(outcome.loss, outcome.grad_norm, outcome.nonfinite, model, optimizer)


def logged(uri: str, run_id: str) -> dict[str, float]:
    from replaybisect.store import open_store

    store = open_store(uri, create=False)
    return {key: dict(store.metric_history(run_id, key)).get(0) for key in ("loss", "grad_norm")}  # no grad norm: halted before backward


def recorder_path(plant: str, uri: str) -> dict:
    model, optimizer = build({"plant": plant})
    recorder = replaybisect.Recorder(model, optimizer, step_fn=own_step, build=build, config={"plant": plant},
                                     tracking_uri=uri, snapshot_every=1, layer_stats_every=1)
    nonfinite = None
    torch.manual_seed(STEP_SEED)
    try:
        recorder.step((inputs(plant), Y.clone()))
        rng_after = torch.get_rng_state()
        recorder.close()
    except replaybisect.NonFiniteStep as stop:
        rng_after = torch.get_rng_state()
        nonfinite = stop.what
    metrics = logged(uri, recorder.run_id)
    result = after_step(metrics["loss"], metrics["grad_norm"], nonfinite, model, optimizer)
    result["rng"] = rng_after
    return result


def lightning_path(plant: str, uri: str) -> dict:
    module = LitNet(plant)
    seeding, recording = StepSeed(), ReplayCallback(tracking_uri=uri, snapshot_every=1, layer_stats_every=1)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[seeding, recording])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs(plant), Y.clone()), batch_size=16)
    nonfinite = None
    try:
        trainer.fit(module, data)
    except replaybisect.NonFiniteStep as stop:
        seeding.rng_after = torch.get_rng_state()
        nonfinite = stop.what
    metrics = logged(uri, recording.run_id)
    result = after_step(metrics["loss"], metrics["grad_norm"], nonfinite, module.net, trainer.optimizers[0])
    result["rng"] = seeding.rng_after
    return result


def lightning_replay_path(plant: str) -> dict:
    """The step a replay of a Lightning run takes: `lightning_step` through `loop.run_step`, no Trainer."""
    from omegaconf import OmegaConf

    from replaybisect.core import user_step

    module = LitNet(plant)
    optimizer = module.configure_optimizers()
    trainer = {"precision": "32-true", "device": "cpu", "gradient_clip_val": None, "gradient_clip_algorithm": None,
               "scheduler": None}
    state = loop.TrainState(cfg=None, model=module, optimizer=optimizer, scheduler=None, scaler=None, loss_fn=None,
                            step_fn=lightning_step, device=torch.device("cpu"), precision="fp32", clip_grad_norm=None,
                            user_loop=True, user_config=OmegaConf.create({"trainer": trainer}))
    torch.manual_seed(STEP_SEED)
    position = {"batch_idx": 0, "takes_batch_idx": False, "rng": None, "accumulate": 1, "scheduler_step": False}
    record = user_step.pack({user_step.LIGHTNING_BATCHES: [[inputs(plant), Y.clone()]], user_step.LIGHTNING_POSITIONS: [position]},
                            state.device)
    outcome = loop.run_step(state, 0, record)
    return after_step(outcome.loss, outcome.grad_norm, outcome.nonfinite, module.net, optimizer)


def assert_same(expected: dict, got: dict, path: str) -> None:
    assert got["nonfinite"] == expected["nonfinite"], path
    for key in ("loss", "grad_norm"):
        same = got[key] == expected[key] or (got[key] != got[key] and expected[key] != expected[key])  # NaN == NaN here
        assert same, f"{path}: {key} {got[key]!r} != {expected[key]!r}"
    for index, (a, b) in enumerate(zip(expected["params"], got["params"])):
        assert torch.equal(a, b), f"{path}: parameter {index} differs"
    assert len(expected["optimizer"]) == len(got["optimizer"]), path
    for a, b in zip(expected["optimizer"], got["optimizer"]):
        assert a.keys() == b.keys(), path
        assert all(torch.equal(a[key], b[key]) for key in a), f"{path}: optimizer state differs"
    assert torch.equal(expected["rng"], got["rng"]), f"{path}: RNG state after the step differs"


@pytest.mark.parametrize("plant", ["none", "gradient", "loss"], ids=["healthy", "nonfinite-gradient", "nonfinite-loss"])
def test_one_step_is_the_same_on_every_path(plant, tmp_path):
    reference = builtin_path(plant)
    if plant == "none":
        assert reference["nonfinite"] is None and all(state for state in reference["optimizer"])
    else:  # halted before the update: nothing applied, the verdict says what went non-finite
        assert reference["nonfinite"] == {"gradient": "grad_norm", "loss": "loss"}[plant]
        assert reference["optimizer"] == [{}] * len(reference["params"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert_same(reference, recorder_path(plant, uri), "Recorder")
    assert_same(reference, lightning_path(plant, uri), "ReplayCallback")
    assert_same(reference, lightning_replay_path(plant), "lightning_step")


CLIPS = {"2-norm": {"max_norm": 0.05}, "2-norm, foreach off": {"max_norm": 0.05, "foreach": False},
         "1-norm": {"max_norm": 0.05, "norm_type": 1.0}, "inf-norm": {"max_norm": 0.05, "norm_type": "inf"},
         "2-norm, parameters reversed": {"max_norm": 0.05}, "2-norm in two parts": {"max_norm": 0.05}}
REUSED = {"2-norm": 2, "2-norm, parameters reversed": 3, "2-norm in two parts": 2}  # aten norms taken in all
NORMS: list[torch.Tensor] = []  # what the step's clip returned


def clipping_step(model, optimizer, batch, config):
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    params = list(model.parameters())[::-1 if config["clip"] == "2-norm, parameters reversed" else 1]
    if config["clip"] == "2-norm in two parts":  # accelerate's and torchtitan's clip
        NORMS.append(torch.nn.utils.get_total_norm([param.grad for param in params]))
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, NORMS[-1])
    else:
        NORMS.append(torch.nn.utils.clip_grad_norm_(params, **CLIPS[config["clip"]]))
    optimizer.step()
    return loss


@pytest.mark.parametrize("clip", list(CLIPS))
def test_a_recorded_step_clips_as_torch_does_and_takes_the_norm_once(clip, tmp_path):
    """The step's own clip: recorded, it returns torch's norm and clips to the same bits; where that norm is the 2-norm
    the recorder took for the step's grad_norm (the same gradients, in any order), no gradient's norm is taken twice:
    of its parameters in another order, only their stacked norms are."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Norms(TorchDispatchMode):
        taken = each = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Norms.taken += func.overloadpacket in (torch.ops.aten._foreach_norm, torch.ops.aten.linalg_vector_norm)
            Norms.each += func.overloadpacket is torch.ops.aten._foreach_norm
            return func(*args, **(kwargs or {}))

    plain_model, plain_optimizer = build({})
    NORMS.clear()
    torch.manual_seed(STEP_SEED)
    clipping_step(plain_model, plain_optimizer, (X.clone(), Y.clone()), {"clip": clip})
    model, optimizer = build({})
    recorder = replaybisect.Recorder(model, optimizer, step_fn=clipping_step, build=build, config={"clip": clip},
                                     tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", layer_stats_every=0)
    torch.manual_seed(STEP_SEED)
    with Norms():
        recorder.step((X.clone(), Y.clone()))
    recorder.close()
    plain_norm, recorded_norm = NORMS
    assert torch.equal(recorded_norm, plain_norm)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    if clip in REUSED:
        assert (Norms.taken, Norms.each) == (REUSED[clip], 1)


def halve_gradients(params) -> None:
    for param in params:
        param.grad.data.mul_(0.5)  # (through .data: no version counter sees it)


class HalvingLitNet(LitNet):
    """Its on_before_optimizer_step halves the gradients, after the recorder took their norm and before Lightning
    clips them."""

    def on_before_optimizer_step(self, optimizer):
        halve_gradients(self.parameters())


class HalvingCallback(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        halve_gradients(pl_module.parameters())


def counted_norms():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Norms(TorchDispatchMode):
        each = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Norms.each += func.overloadpacket is torch.ops.aten._foreach_norm
            return func(*args, **(kwargs or {}))

    return Norms


@pytest.mark.parametrize("between", ["nothing", "module-hook", "later-callback"])
def test_a_lightning_clip_takes_the_recorders_norm_and_clips_as_lightning_does(between, tmp_path):
    """Lightning clips just after the step's gradients moment: recorded, its clip takes the norm the recorder took
    there (one pass over the gradients, not two) and leaves the parameters Lightning alone leaves; where the user's
    code runs in between (the module's on_before_optimizer_step, a later callback's), the clip takes its own norm."""
    Norms = counted_norms()
    trained = []
    for recorded in (False, True):
        module = HalvingLitNet() if between == "module-hook" else LitNet()
        callbacks = [StepSeed()] + ([ReplayCallback(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", layer_stats_every=0)]
                                    if recorded else [])
        callbacks += [HalvingCallback()] if between == "later-callback" else []

        class Counted(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.mode = Norms()
                self.mode.__enter__()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.mode.__exit__(None, None, None)

        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.05,
                            callbacks=callbacks + [Counted()])
        Norms.each = 0
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X.clone(), Y.clone()), batch_size=8))
        trained.append(([param.detach().clone() for param in module.parameters()], Norms.each))
    (plain, plain_norms), (recorded, recorded_norms) = trained
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert plain_norms == 2  # Lightning's clip, each step
    assert recorded_norms == (2 if between == "nothing" else 4)  # the recorder's, and the clip's own unless reused


def test_the_norm_of_gradients_in_another_order_is_torchs():
    """guard.norms takes torch's total norm bit for bit, and norm_in_order the one torch takes of the same gradients
    in another order (summed in that order: not always the same bits); a list that is not the same tensors gets none."""
    from replaybisect.core import guard

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(*size, generator=generator) * scale for size in ((300,), (7, 5), (1,), (4096,), (33, 2))
             for scale in (1e-3, 1.0, 1e3)]
    total, each = guard.norms(grads)
    assert torch.equal(total, torch.nn.utils.get_total_norm(grads))
    orders_that_differ = 0
    for seed in range(20):
        order = torch.randperm(len(grads), generator=torch.Generator().manual_seed(seed)).tolist()
        theirs = [grads[i] for i in order]
        assert torch.equal(guard.norm_in_order(grads, each, theirs), torch.nn.utils.get_total_norm(theirs))
        orders_that_differ += not torch.equal(total, torch.nn.utils.get_total_norm(theirs))
    assert orders_that_differ  # (the list's own total would not do)
    assert guard.norm_in_order(grads, each, grads[1:]) is None
    assert guard.norm_in_order(grads, each, [grads[0], *grads[:-1]]) is None  # one twice, one left out
    assert guard.norm_in_order(grads, each, [grads[0].clone(), *grads[1:]]) is None
    assert guard.norms([grads[0], grads[1].double()])[1] is None  # two dtypes: torch's groups, not one stack
    assert torch.equal(guard.norms([grads[0], grads[1].double()])[0], torch.nn.utils.get_total_norm([grads[0], grads[1].double()]))


def test_a_step_taken_again_after_a_non_finite_one_replays_exact(tmp_path):
    """on_nonfinite="continue": rec.step's non-finite step 3 is taken again from the RNG state it began with (dropout
    draws again), and the recorded losses replay bit for bit: `rec.step` does not set the RNG streams it just packed,
    but the step taken again does."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model, optimizer = build({})
    recorder = replaybisect.Recorder(model, optimizer, step_fn=own_step, build=build, config={}, tracking_uri=uri,
                                     snapshot_every=2, layer_stats_every=0, on_nonfinite="continue")
    torch.manual_seed(STEP_SEED)
    for step in range(6):
        recorder.step(((BAD_X if step == 3 else X).clone(), Y.clone()))
    recorder.close()
    assert recorder.first_nonfinite_step == 3
    report = replaybisect.verify(recorder.run_id, tracking_uri=uri, publish=False)
    assert (report.verdict, report.steps_compared) == ("exact", 6), report.differences
