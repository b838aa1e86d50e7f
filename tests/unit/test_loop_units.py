"""Unit tests for the one code path (`replaybisect.core.loop`), in-process on the built-in config with a tiny model.

- a probed step (every probe of `replay nan`: module hooks, op finder, gradient and autograd-node hooks, the
  update watch; detect_anomaly) leaves parameters, optimizer, scheduler, scaler and RNG streams bit-identical
  to a plain step, in fp32, bf16 and fp16 (GradScaler), with clipping and a scheduler;
- `clone_state` is an independent copy that trains exactly as the original;
- the batch of step t is a pure function of (seed, t);
- a halted non-finite step leaves the state as before it (BatchNorm running stats included);
- continue mode takes the failed step again from the RNG state it started from.
"""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from replaybisect.core import config as config_mod
from replaybisect.core import loop
from replaybisect.core.rng import capture_raw, restore_raw
from replaybisect.verbs.nan import anomaly as anomaly_probe, step_probe
from replaybisect.replay.restore import ReplayHooks

TINY = ["model.hidden=16", "train.batch_size=16", "train.steps=20", "train.device=cpu", "train.num_threads=1"]


def compose(*overrides: str):
    return config_mod.compose(overrides=TINY + list(overrides))


class BatchNormMLP(nn.Module):
    """The built-in MLP's arguments, with a BatchNorm whose running stats the forward updates in place."""

    def __init__(self, in_features=64, hidden=16, out_features=10, depth=1, dropout=0.1, activation="relu"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, out_features))

    def forward(self, x):
        return self.net(x.flatten(1))


# ---- comparing states bit for bit ---------------------------------------------------------------------
def same_bits(a, b) -> bool:
    """Equal as stored bits (NaN == NaN), recursively through state dicts."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and bool(
            (a.detach().reshape(-1).view(torch.uint8) == b.detach().reshape(-1).view(torch.uint8)).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b or (a != a and b != b)


def differences(a: loop.TrainState, b: loop.TrainState) -> list[str]:
    parts = {
        "model": (a.model.state_dict(), b.model.state_dict()),
        "optimizer": (a.optimizer.state_dict(), b.optimizer.state_dict()),
        "scheduler": (a.scheduler.state_dict() if a.scheduler else None, b.scheduler.state_dict() if b.scheduler else None),
        "scaler": (a.scaler.state_dict() if a.scaler else None, b.scaler.state_dict() if b.scaler else None),
    }
    return [name for name, (x, y) in parts.items() if not same_bits(x, y)]


def rng_differences(a: dict, b: dict) -> list[str]:
    return [name for name in ("python", "numpy", "torch") if not same_bits(a[name], b[name])]


def mix_python_and_numpy_streams(step: int) -> None:
    """Put the python and numpy streams somewhere unusual, so 'unchanged' is not a vacuous default."""
    random.seed(1000 + step)
    np.random.seed(2000 + step)
    random.random()


# ---- a probed step is the plain step -------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_probed_steps_are_bit_identical_to_plain_steps(precision):
    cfg = compose(f"train.precision={precision}", "train.clip_grad_norm=0.05", "scheduler=cosine", "model.dropout=0.2")
    plain, probed, anomaly = loop.build_state(cfg), loop.build_state(cfg), loop.build_state(cfg)
    assert not differences(plain, probed)
    source, _ = loop.build_data(cfg)
    clipped = 0
    for step in range(4):
        batch = source.batch(step)
        mix_python_and_numpy_streams(step)
        rng_at_start = capture_raw()
        expected = loop.run_step(plain, step, batch)
        rng_after_plain = capture_raw()
        clipped += expected.grad_norm > cfg.train.clip_grad_norm

        restore_raw(rng_at_start)
        result = step_probe.StepProbe(probed).run(step, batch)
        assert not rng_differences(capture_raw(), rng_after_plain), step
        restore_raw(rng_at_start)
        finding = anomaly_probe.anomaly_pass(anomaly, step, batch)
        assert not rng_differences(capture_raw(), rng_after_plain), step

        assert result.loss == expected.loss and result.grad_norm == expected.grad_norm, step
        assert result.forward_calls and result.grad_events and result.update is not None  # the probes ran
        assert finding.op is None and finding.message is None
        assert differences(plain, probed) == [], step
        assert differences(plain, anomaly) == [], step
    assert clipped == 4  # clipping did its work on every step
    assert plain.optimizer.param_groups[0]["lr"] < cfg.optim.lr  # the scheduler moved the lr
    if precision == "fp16":
        assert plain.scaler is not None and probed.scaler._scale is not None


def test_clone_state_is_independent_and_trains_exactly_like_the_original():
    cfg = compose("train.precision=fp16", "train.clip_grad_norm=1.0", "scheduler=cosine")
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    for step in range(2):
        loop.run_step(state, step, source.batch(step))
    rng_before = capture_raw()
    threads = torch.get_num_threads()
    clone = loop.clone_state(state)
    assert not rng_differences(capture_raw(), rng_before) and torch.get_num_threads() == threads
    assert not differences(state, clone)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(state.params, clone.params))

    for step in range(2, 5):
        rng_at_start = capture_raw()
        loop.run_step(clone, step, source.batch(step))
        restore_raw(rng_at_start)
        loop.run_step(state, step, source.batch(step))
        assert not differences(state, clone), step
    original = copy.deepcopy((state.model.state_dict(), state.optimizer.state_dict(), state.scaler.state_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a scheduler that lost track of its optimizer's step
        loop.run_step(clone, 5, source.batch(5))
    training_left = (state.model.state_dict(), state.optimizer.state_dict(), state.scaler.state_dict())
    assert same_bits(training_left, original)  # training the copy leaves the original as it was


def test_clone_state_into_another_config_carries_weights_moments_and_schedule():
    cfg = compose("scheduler=cosine")
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    for step in range(3):
        loop.run_step(state, step, source.batch(step))
    arm_cfg = compose("scheduler=cosine", "train.clip_grad_norm=0.01", "train.precision=fp16")
    mix_python_and_numpy_streams(0)
    rng_before = capture_raw()
    arm = loop.clone_state(state, arm_cfg)  # builds a model (random init) from the arm's config
    assert not rng_differences(capture_raw(), rng_before)
    assert arm.clip_grad_norm == 0.01 and arm.precision == "fp16" and arm.scaler is not None
    assert differences(state, arm) == ["scaler"]


# ---- data order ----------------------------------------------------------------------------------------------
def test_the_batch_of_a_step_is_a_pure_function_of_seed_and_step():
    dataset = list(range(50))  # 6 steps per epoch at batch size 8: steps 0..19 cross three epochs
    walked = loop.BatchSource(dataset, 8, seed=3)
    in_order = {step: walked.batch(step) for step in range(20)}
    for step in (17, 0, 13, 5, 17, 6):
        torch.manual_seed(step)  # the global stream plays no part
        assert torch.equal(loop.BatchSource(dataset, 8, seed=3).batch(step), in_order[step]), step
        assert torch.equal(walked.batch(step), in_order[step]), step
    epochs = [torch.cat([in_order[s] for s in range(e * 6, e * 6 + 6)]) for e in range(3)]
    assert all(len(set(epoch.tolist())) == 48 for epoch in epochs)  # no sample twice within an epoch
    assert not torch.equal(epochs[0], epochs[1])  # each epoch has its own order
    assert not torch.equal(loop.BatchSource(dataset, 8, seed=4).batch(0), in_order[0])


# ---- non-finite steps in the loop ------------------------------------------------------------------------------
def _poisoned(source: loop.BatchSource, bad_step: int):
    def batches(step):
        inputs, targets = source.batch(step)
        if step == bad_step:
            inputs = inputs.clone()
            inputs[0, 0] = float("nan")
        return inputs, targets

    return batches


def test_a_halted_nonfinite_step_leaves_the_state_as_before_it():
    cfg = compose("model._target_=test_loop_units.BatchNormMLP", "scheduler=cosine")
    source, _ = loop.build_data(cfg)
    reference = loop.build_state(cfg)  # (building seeds the RNG streams: each loop starts from the same)
    loop.train_loop(reference, source.batch, 0, 3, ReplayHooks())
    state = loop.build_state(cfg)
    hooks = ReplayHooks(stop_on_nonfinite=True)
    stopped = loop.train_loop(state, _poisoned(source, 3), 0, 6, hooks)
    assert stopped is not None and stopped.step == 3 and hooks.first_nonfinite == (3, "loss")
    assert not stopped.updated
    assert differences(reference, state) == []  # running mean/var and num_batches_tracked included
    assert torch.isfinite(state.model.net[1].running_mean).all()


def test_continue_mode_takes_the_failed_step_again_from_the_same_rng():
    cfg = compose("model.dropout=0.5")
    source, _ = loop.build_data(cfg)
    batches = _poisoned(source, 2)
    state = loop.build_state(cfg)  # (building seeds the RNG streams: each loop starts from the same)
    hooks = ReplayHooks(stop_on_nonfinite=False)
    assert loop.train_loop(state, batches, 0, 3, hooks) is None
    rng_after_loop = capture_raw()

    reference = loop.build_state(cfg)
    loop.train_loop(reference, batches, 0, 2, ReplayHooks())
    retried = loop.run_step(reference, 2, batches(2), halt_on_nonfinite=False)  # one attempt, same RNG
    assert hooks.first_nonfinite == (2, "loss") and retried.updated
    assert not rng_differences(capture_raw(), rng_after_loop)  # dropout drew once, from the step's start
    assert differences(reference, state) == []


@pytest.mark.parametrize("keep_going", [True, False])
def test_a_frameworks_halted_step_is_shown_as_before_it_and_goes_on_from_its_forward(keep_going):
    """Lightning's and the Trainer's callbacks cannot take a step again: their hooks see the BatchNorm statistics
    from before the step, then the forward's updates are put back if they go on (else the state before it stays)."""
    model = BatchNormMLP()
    buffers = loop.BufferGuard(model)
    buffers.save()
    before = copy.deepcopy(model.state_dict())
    model(torch.randn(8, 64))  # a training forward moves the running statistics
    after_forward = copy.deepcopy(model.state_dict())
    assert not same_bits(before, after_forward)
    seen = []
    assert buffers.ask_as_before_step(lambda: seen.append(copy.deepcopy(model.state_dict())) or keep_going) is keep_going
    assert same_bits(seen[0], before)
    assert same_bits(model.state_dict(), after_forward if keep_going else before)
