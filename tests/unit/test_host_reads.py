"""Host reads in a recorded step: on a GPU each read of a tensor's value on the host (`.item()`, `float(t)`,
`bool(t)`, `.tolist()`) makes the host wait for the device. `replay train`'s recorded step reads once, the non-finite
guard's flag, and its loss and gradient norm at each metrics flush (snapshot.metrics_flush_every). Counted on CPU:
every `aten::_local_scalar_dense` and `Tensor.tolist` whose nearest caller outside torch is replaybisect's own
code (torch's optimizer counters and the data's indices are CPU values on any device)."""

from __future__ import annotations

import math
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import EXAMPLES, ROOT

OURS = str(ROOT / "replaybisect")


PLUMBING = ("torch/_tensor.py", "torch/utils/_python_dispatch.py", "torch/_ops.py", "torch/overrides.py", "torch/_jit_internal.py",
            "torch/_compile.py")


def _ours() -> bool:
    """Whether the read's caller (the first frame past torch's tensor and dispatch plumbing and this module) is
    replaybisect's: a read inside a library's own code (an optimizer's step counter) is the library's."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename == __file__ or frame.filename.endswith(PLUMBING) or "/torch/_dynamo/" in frame.filename:
            continue
        return frame.filename.startswith(OURS)
    return False


class HostReads(TorchDispatchMode):
    """Counts replaybisect's own reads of tensor values on the host while it is entered."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter = self

        def tolist(tensor, *args, **kwargs):
            if _ours():
                counter.count += 1
            return counter._tolist(tensor, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _ours():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _recorded_builtin(tmp_path, *overrides: str):
    from replaybisect.core import config as config_mod
    from replaybisect.core import loop
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    cfg = config_mod.compose(None, "config", ["snapshot.every=1000", "snapshot.layer_stats_every=0", "train.val_every=0",
                                              "snapshot.metrics_flush_seconds=0", *overrides])
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    session = RunSession.open(open_store(f"sqlite:///{tmp_path / 'mlflow.db'}"), code_folder=tmp_path)
    session.write_config(cfg)
    hooks = session.start_recording(cfg, state, {"seed": 0, "batch_size": cfg.train.batch_size, "dataset_len": len(source.dataset)})
    return cfg, state, source, session, hooks


def _count_steps(state, source, hooks, steps: range) -> tuple[int, list]:
    """Reads in `steps` recorded steps (each batch read before counting: the data's own reads are not the step's)."""
    from replaybisect.core import loop

    buffers, outcomes, reads = loop.BufferGuard(state.model), [], HostReads()
    for step in steps:
        batch = source.batch(step)
        with reads:
            rng = loop.open_step(step, state, hooks, buffers)
            outcome, keep_going = loop.take_step(state, step, batch, hooks, buffers, rng, 0.0)
        outcomes.append(outcome)
        if not keep_going:
            break
    return reads.count, outcomes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_recorded_builtin_step_reads_the_guard_once_and_its_metrics_at_each_flush(tmp_path, precision):
    cfg, state, source, session, hooks = _recorded_builtin(tmp_path, f"train.precision={precision}", "snapshot.metrics_flush_every=10")
    _count_steps(state, source, hooks, range(0, 5))  # past the first steps' one-off work
    reads, _ = _count_steps(state, source, hooks, range(5, 25))
    session.close_hooks()
    session.finish()
    assert reads <= 20 + 2, reads  # the guard's each step, one per flush (at steps 9 and 19); it was 3 a step
    history = dict(session.store.metric_history(session.run_id, "loss"))
    norms = dict(session.store.metric_history(session.run_id, "grad_norm"))
    assert sorted(history) == list(range(25)) and all(math.isfinite(v) for v in history.values())
    assert sorted(norms) == list(range(25))


def test_with_reads_deferred_a_nan_loss_still_stops_before_its_update_and_is_named_a_loss(tmp_path):
    """examples/nan_forward (NaN in the forward at step 20): the guard's one read stops the step before the update."""
    from replaybisect.core import config as config_mod
    from replaybisect.core import loop
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    config_mod.add_code_paths(EXAMPLES / "nan_forward")
    cfg = config_mod.compose(EXAMPLES / "nan_forward", "config", ["train.steps=30"])
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    session = RunSession.open(open_store(f"sqlite:///{tmp_path / 'mlflow.db'}"), code_folder=tmp_path)
    session.write_config(cfg)
    hooks = session.start_recording(cfg, state, {"seed": cfg.seed, "batch_size": cfg.train.batch_size, "dataset_len": len(source.dataset)})
    _, outcomes = _count_steps(state, source, hooks, range(30))
    session.close_hooks()
    last = outcomes[-1]
    assert last.step == 20 and last.nonfinite == "loss" and not last.updated and not math.isfinite(last.loss)
    assert hooks.first_nonfinite_step == 20 and hooks.nonfinite_what == "loss"


def test_an_fp16_run_that_goes_on_past_a_nan_loss_takes_the_step_again(tmp_path):
    """The guard's read comes before the GradScaler unscales: the halted step leaves the scaler as it was, so with
    on_nonfinite=continue the step is taken again (a second unscale_ in one step would raise)."""
    import replaybisect as rb
    from tests.helpers import in_folder

    with in_folder(tmp_path):
        result = rb.train(["train.steps=14", "train.precision=fp16", "snapshot.on_nonfinite=continue"],
                          config_dir=EXAMPLES / "nan_forward", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.status == "nonfinite" and result.first_nonfinite_step == 11 and result.nonfinite_what == "loss"
    assert result.steps_completed == 14 and not result.stopped


# ---- a fused optimizer: the guard's verdict stays on the device ---------------------------------------------------
def test_a_recorded_builtin_step_with_a_fused_optimizer_reads_nothing_but_its_flushes(tmp_path):
    cfg, state, source, session, hooks = _recorded_builtin(tmp_path, "+optim.fused=true", "snapshot.metrics_flush_every=10")
    assert hooks.device_guard is not None
    _count_steps(state, source, hooks, range(0, 5))
    reads, _ = _count_steps(state, source, hooks, range(5, 25))
    session.close_hooks()
    session.finish()
    assert reads <= 2, reads  # one a flush (steps 9 and 19), none in a step: the optimizer skips on the device
    history = dict(session.store.metric_history(session.run_id, "loss"))
    assert sorted(history) == list(range(25)) and all(math.isfinite(v) for v in history.values())


def _nan_forward_run(tmp_path, name: str, on_device: bool, monkeypatch, steps: int = 40) -> tuple:
    """examples/nan_forward (NaN at step 20) with a fused AdamW and a cosine schedule, snapshots every 6 steps and
    metrics flushed every 8: the failure is found at the flush after step 23, three skipped steps later, inside the
    interval of the snapshot at step 18."""
    import replaybisect as rb
    from tests.helpers import in_folder
    from replaybisect.record.device_guard import DeviceGuard

    if not on_device:
        monkeypatch.setattr(DeviceGuard, "applies", staticmethod(lambda cfg, state: False))
    uri = f"sqlite:///{tmp_path / name}.db"
    with in_folder(tmp_path):
        result = rb.train([f"train.steps={steps}", "+optim.fused=true", "+scheduler=cosine", "snapshot.every=6",
                           "snapshot.metrics_flush_every=8", "snapshot.metrics_flush_seconds=0"],
                          config_dir=EXAMPLES / "nan_forward", tracking_uri=uri)
    monkeypatch.undo()
    return result, uri


def test_a_fused_run_found_at_a_flush_stops_at_the_failing_steps_state_as_one_halted_at_once(tmp_path, monkeypatch):
    """The verdict read steps later: the run records what a run that halted at the failing step records (the
    same losses, the same snapshot before step 20 bit for bit: parameters, moments, step counts, the lr and the
    schedule put back), and it replays exactly."""
    import replaybisect as rb
    from replaybisect.replay.restore import load_snapshot, snapshot_steps
    from replaybisect.store import open_store

    at_once, uri_at_once = _nan_forward_run(tmp_path, "at_once", False, monkeypatch)
    later, uri_later = _nan_forward_run(tmp_path, "later", True, monkeypatch)
    for result in (at_once, later):
        assert (result.status, result.first_nonfinite_step, result.nonfinite_what, result.stopped) == ("nonfinite", 20, "loss", True)
    assert later.steps_completed == at_once.steps_completed == 20 and later.snapshot_steps == at_once.snapshot_steps
    stores = open_store(uri_at_once, create=False), open_store(uri_later, create=False)
    for key in ("loss", "grad_norm", "lr"):
        histories = [dict(store.metric_history(result.run_id, key)) for store, result in zip(stores, (at_once, later))]
        assert histories[0] == histories[1] or all(math.isnan(a) == math.isnan(b) for a, b in zip(histories[0].values(), histories[1].values())), key
        assert max(histories[1]) <= 20, key  # nothing after the failing step
    assert snapshot_steps(stores[1], later.run_id) == snapshot_steps(stores[0], at_once.run_id)
    expected, got = load_snapshot(stores[0], at_once.run_id, 20), load_snapshot(stores[1], later.run_id, 20)
    assert expected.tensors.keys() == got.tensors.keys()
    assert all(torch.equal(expected.tensors[name], got.tensors[name]) for name in expected.tensors)
    assert expected.state == got.state and sorted(got.batches) == sorted(expected.batches)
    report = rb.find_nan(later.run_id, tracking_uri=uri_later, publish=False)
    assert report.reproduced == "exact" and report.failing_step == 20, (report.reproduced, report.failing_step)


def test_a_fused_runs_failure_found_only_when_training_ends_still_stops_the_run(tmp_path, monkeypatch):
    """23 steps: the failure at step 20 is in the last, unflushed interval and is found as the recording closes."""
    result, _ = _nan_forward_run(tmp_path, "at_close", True, monkeypatch, steps=23)
    assert (result.status, result.first_nonfinite_step, result.stopped, result.steps_completed) == ("nonfinite", 20, True, 20)


def test_a_step_interrupted_before_its_end_is_not_taken_for_the_failure():
    """Ctrl-C between a failing step's update and its end: that step has a verdict but no outcome; the read finds
    no recorded failure in it (the run ends KILLED with what was recorded before)."""
    from types import SimpleNamespace

    from replaybisect.record.device_guard import DeviceGuard

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    guard = DeviceGuard(SimpleNamespace(model=model, optimizer=optimizer, scheduler=None))
    for step, failed in enumerate((False, True)):
        guard.opened(step, {})
        model(torch.randn(2, 4)).sum().backward()
        guard.step_with(optimizer, torch.tensor([failed, False]))
        if not failed:
            guard.ran(f"outcome of step {step}", f"batch {step}")  # (step 1 is interrupted before it ends)
    read = {(name, at): float(value) for name, value, at in guard.verdict_points()}
    assert read[("verdict/loss", 1)] == 1.0 and guard.first_failure(read) is None and guard.pending == []


def test_the_device_guard_puts_back_what_skipped_steps_changed_around_the_update():
    """A fused SGD with momentum skipping its very first update still creates its momentum buffer (uninitialised
    memory); a one-cycle schedule moves momentum with the lr; a BatchNorm forward moves its running statistics:
    all put back as they were before the failing step."""
    from types import SimpleNamespace

    from replaybisect.record.device_guard import DeviceGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=10)
    guard = DeviceGuard(SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler))
    before = ({k: v.clone() for k, v in model.state_dict().items()}, [dict(g, params=None) for g in optimizer.param_groups],
              scheduler.state_dict())
    for step in range(3):  # the first step fails; the two after it are skipped too (the flag is sticky)
        guard.opened(step, {})
        model(torch.randn(8, 4)).sum().backward()
        guard.step_with(optimizer, torch.tensor([step == 0, False]))
        scheduler.step()
    assert optimizer.state and optimizer.param_groups[0]["momentum"] != before[1][0]["momentum"]
    guard.put_back(guard.pending[0])
    assert not optimizer.state  # no momentum buffer from a skipped first update
    assert [dict(g, params=None) for g in optimizer.param_groups] == before[1] and scheduler.state_dict() == before[2]
    assert all(torch.equal(before[0][k], v) for k, v in model.state_dict().items())


# ---- the Recorder's step: the guard's one read -----------------------------------------------------------------
def build(config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    scaler = torch.amp.GradScaler("cpu") if config["precision"] == "fp16" else None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=config.get("fused", False)), None, scaler


def train_step(model, optimizer, scaler, batch, config):
    """Four micro-batches, each loss backpropagated (scaled in fp16), a clip, the update: a common loop's shape."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config["precision"])
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in zip(batch[0].chunk(4), batch[1].chunk(4)):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y) / 4
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = total + loss.detach()
    if scaler is not None and not config.get("fused"):
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif scaler is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    (scaler.step(optimizer), scaler.update()) if scaler is not None else optimizer.step()
    return total


def _batches(count: int, nan_at: int | None = None) -> list:
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator)) for _ in range(count)]
    if nan_at is not None:
        batches[nan_at][0][5] = math.nan
    return batches


def _recorder(tmp_path, config, **extra):
    import replaybisect

    model, optimizer, _, scaler = build(config)
    return replaybisect.Recorder(model, optimizer, scaler=scaler, step_fn=train_step, build=build, config=config,
                                 precision=config["precision"], tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                 snapshot_every=1000, layer_stats_every=0, **extra)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_recorder_step_reads_the_guard_once_and_returns_its_loss_unread(tmp_path, precision):
    rec = _recorder(tmp_path, {"precision": precision})  # (metrics flushed every 50 steps or 5 s, the defaults)
    batches = _batches(25)
    for batch in batches[:5]:
        rec.step(batch)
    reads = HostReads()
    with reads:
        losses = [rec.step(batch) for batch in batches[5:]]
    rec.close()
    # the guard's one read a step, one a flush (it was 4 loss checks + the norm + the returned loss: 6)
    assert reads.count <= 20 + 2, reads.count
    assert all(isinstance(loss, torch.Tensor) and loss.dim() == 0 and math.isfinite(loss) for loss in losses)
    history = dict(rec.store.metric_history(rec.run_id, "loss"))
    assert [history[step] for step in range(5, 25)] == [float(loss) for loss in losses]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_recorder_fp16_step_halts_before_its_grad_scaler_touches_anything_and_goes_on_when_asked(tmp_path, fused):
    """A NaN loss at step 7: the deferred guard reads before the GradScaler unscales or steps (a fused optimizer's
    step takes the scale from the scaler before any pre-hook runs), so the halted step leaves the model, optimizer
    and scaler as they were, and with on_nonfinite=continue the same step is taken again."""
    import replaybisect

    config = {"precision": "fp16", "fused": fused}
    batches = _batches(10, nan_at=7)
    rec = _recorder(tmp_path, config)
    for batch in batches[:7]:
        rec.step(batch)
    model, optimizer, scaler = rec.state.model, rec.state.optimizer, rec.state.scaler
    before = ({k: v.clone() for k, v in model.state_dict().items()}, scaler.state_dict(), optimizer.state_dict()["state"][0]["step"].clone())
    with pytest.raises(replaybisect.NonFiniteStep) as stopped:
        rec.step(batches[7])
    assert stopped.value.what == "loss" and stopped.value.step == 7
    assert all(torch.equal(before[0][k], v) for k, v in model.state_dict().items())
    assert scaler.state_dict() == before[1] and torch.equal(optimizer.state_dict()["state"][0]["step"], before[2])
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")

    going_on = _recorder(tmp_path, config, on_nonfinite="continue")
    with going_on:
        losses = [going_on.step(batch) for batch in batches]
    assert going_on.first_nonfinite_step == 7 and math.isnan(losses[7]) and math.isfinite(losses[9])
    # the gradient norm is the unscaled one on both paths (a fused optimizer unscales inside its step)
    norms = dict(rec.store.metric_history(rec.run_id, "grad_norm"))
    assert 0 < norms[0] < 100, norms[0]


def _fused_recorder_run(tmp_path, name: str, on_device: bool, monkeypatch) -> tuple:
    """A Recorder step with a fused AdamW (fp32: no GradScaler), a NaN in batch 20, snapshots every 6 steps; returns
    the Recorder, the rec.step call that raised, the NonFiniteStep, and the host reads of steps 5..19."""
    import replaybisect
    from replaybisect.record.device_guard import DeviceGuard

    if not on_device:
        monkeypatch.setattr(DeviceGuard, "applies", staticmethod(lambda cfg, state: False))
    config = {"precision": "fp32", "fused": True}
    model, optimizer, _, _ = build(config)
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config=config, precision="fp32",
                                tracking_uri=f"sqlite:///{tmp_path / name}.db", snapshot_every=6, layer_stats_every=0)
    reads, raised_at, stop = HostReads(), None, None
    for step, batch in enumerate(_batches(30, nan_at=20)):
        try:
            if 5 <= step < 20:
                with reads:
                    rec.step(batch)
            else:
                rec.step(batch)
        except replaybisect.NonFiniteStep as error:
            raised_at, stop = step, error
            break
    monkeypatch.undo()
    return rec, raised_at, stop, reads.count


def test_a_recorder_step_with_a_fused_optimizer_reads_nothing_and_stops_at_the_failing_steps_state(tmp_path, monkeypatch):
    from replaybisect.replay.restore import load_snapshot

    at_once, raised_at_once, stop_at_once, _ = _fused_recorder_run(tmp_path, "at_once", False, monkeypatch)
    later, raised_later, stop_later, reads = _fused_recorder_run(tmp_path, "later", True, monkeypatch)
    assert raised_at_once == 20 and stop_at_once.step == 20 and stop_at_once.what == "loss"
    assert raised_later >= 20 and stop_later.step == 20 and stop_later.what == "loss"  # raised at the flush that read it
    assert reads <= 3 + 1, reads  # none in the steps: one a flush, before each snapshot (steps 6, 12, 18) and every 5 s
    expected, got = load_snapshot(at_once.store, at_once.run_id, 20), load_snapshot(later.store, later.run_id, 20)
    assert all(torch.equal(expected.tensors[name], got.tensors[name]) for name in expected.tensors)
    assert expected.tensors.keys() == got.tensors.keys() and expected.state == got.state
    losses = [dict(rec.store.metric_history(rec.run_id, "loss")) for rec in (at_once, later)]
    assert losses[0].keys() == losses[1].keys() and max(losses[1]) == 20


def linear_build(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def skipping_step(model, optimizer, batch):
    """Backpropagates, then skips its own update when the loss is not finite (as a GradScaler would)."""
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch), torch.zeros(len(batch), 4))
    loss.backward()
    if torch.isfinite(loss):
        optimizer.step()
    return loss


def test_a_recorder_step_that_skips_its_own_update_on_a_nan_loss_still_halts_there(tmp_path):
    import replaybisect

    model, optimizer = linear_build({})
    rec, bad_batch = _two_steps_recorded(tmp_path, model, optimizer, skipping_step, linear_build, nan_at=(0, 0))
    with pytest.raises(replaybisect.NonFiniteStep) as stopped:
        rec.step(bad_batch)
    assert stopped.value.what == "loss" and stopped.value.step == 2


def _two_steps_recorded(tmp_path, model, optimizer, step_fn, build, nan_at: tuple[int, int]):
    """A Recorder that recorded two healthy steps of `step_fn`, and the third batch, with a NaN at `nan_at`."""
    import replaybisect

    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    batches[2][nan_at] = math.nan
    rec = replaybisect.Recorder(model, optimizer, step_fn=step_fn, build=build, config={},
                                tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", snapshot_every=1000, layer_stats_every=0)
    rec.step(batches[0])
    rec.step(batches[1])
    return rec, batches[2]


def gan_build(config):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(8, 8), "d": torch.nn.Linear(8, 1)})
    return model, torch.optim.SGD(model["g"].parameters(), lr=0.1), None, None


D_OPTIMIZER = {}


def gan_step(model, optimizer, batch):
    """The discriminator's loss and update first (its own optimizer), then the generator's: a NaN in the
    discriminator's loss must stop the step before the discriminator's update."""
    d_optimizer = D_OPTIMIZER.setdefault("d", torch.optim.SGD(model["d"].parameters(), lr=0.1))
    d_optimizer.zero_grad()
    d_loss = model["d"](batch).mean()
    d_loss.backward()
    d_optimizer.step()
    optimizer.zero_grad()
    g_loss = -model["d"](model["g"](batch)).mean()
    g_loss.backward()
    optimizer.step()
    return g_loss


def test_a_recorder_step_with_a_second_optimizer_halts_before_that_optimizers_update(tmp_path):
    import replaybisect

    model, optimizer, _, _ = gan_build({})
    rec, bad_batch = _two_steps_recorded(tmp_path, model, optimizer, gan_step, gan_build, nan_at=(1, 3))
    discriminator = {k: v.clone() for k, v in model["d"].state_dict().items()}
    with pytest.raises(replaybisect.NonFiniteStep) as stopped:
        rec.step(bad_batch)
    assert stopped.value.what == "loss" and stopped.value.step == 2
    assert all(torch.equal(discriminator[k], v) for k, v in model["d"].state_dict().items())


# ---- the Lightning callback's step ----------------------------------------------------------------------------
try:
    import lightning as L
except ImportError:  # (the test below is skipped)
    L = None

if L is not None:
    class LitNet(L.LightningModule):
        def __init__(self, width: int = 32):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))

        def training_step(self, batch):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class CountingReads(L.Callback):
        """Counts from the 6th step on (past the first steps' one-off work) to the end of training."""

        def __init__(self):
            self.reads = HostReads()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 5:
                self.reads.__enter__()

        def on_train_end(self, trainer, pl_module):
            self.reads.__exit__(None, None, None)


@pytest.mark.skipif(L is None, reason="lightning is not installed")
def test_a_lightning_recorded_step_reads_the_guard_once(tmp_path):
    from replaybisect.lightning import ReplayCallback
    from replaybisect.store import open_store

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(_batches(25), batch_size=None)
    counting = CountingReads()
    recording = ReplayCallback(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", snapshot_every=1000, layer_stats_every=0)
    trainer = L.Trainer(max_steps=25, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[counting, recording])
    trainer.fit(LitNet(), data)
    assert counting.reads.count <= 20 + 2, counting.reads.count  # it was 2 a step: the loss's flag and the norm, and the loss
    history = dict(open_store(f"sqlite:///{tmp_path / 'mlflow.db'}", create=False).metric_history(recording.run_id, "loss"))
    assert sorted(history) == list(range(25)) and all(math.isfinite(value) for value in history.values())
