"""`replay check` as a library: it leaves the model, optimizer, scheduler and every RNG stream exactly as
they were; the planted cases the CLI tests do not cover; the LR range test's rules."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch

from replaybisect.core import config as config_mod
from replaybisect.core import loop
from replaybisect.verbs.check import engine as K
from replaybisect.core.thresholds import IMBALANCE_WARN
from replaybisect.verbs.check import lr_finder
from tests.helpers import EXAMPLES

PLANTS = EXAMPLES / "check_pathologies"
SMALL = K.CheckOptions(overfit_steps=60, lr_steps=40)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def context(config_dir=None, config_name=None, overrides=(), options=SMALL):
    cfg = config_mod.compose(config_dir, config_name, list(overrides))
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    return K.CheckContext(
        state, source.batch, dataset=source.dataset, steps_per_epoch=source.steps_per_epoch, options=options, seed=int(cfg.seed)
    )



def test_the_engine_checks_a_config_without_a_store_and_records_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default SQLite store would land here if anything opened one
    cfg = config_mod.compose(None, None, [])
    report = K.check(cfg=cfg, options=K.CheckOptions(only=["data"]))
    assert report.run_id is None and report.tracking_uri == "" and report.artifacts == []
    assert report.checks and {c.name.split(".")[0] for c in report.checks} == {"data"}
    assert list(tmp_path.iterdir()) == []

def rng_streams():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_rng(before, after):
    assert before[0] == after[0]  # python, including gauss_next
    assert before[1][0] == after[1][0] and np.array_equal(before[1][1], after[1][1]) and before[1][2:] == after[1][2:]
    assert torch.equal(before[2], after[2])


def assert_same_tensors(before: dict, after: dict):
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
        elif isinstance(a, dict):
            assert_same_tensors(a, b)
        else:
            assert a == b, key


def test_checks_leave_model_optimizer_scheduler_and_rng_streams_exactly_as_they_were():
    from replaybisect.core.rng import capture_raw, restore_raw

    overrides = ["scheduler=cosine", "model.hidden=32"]
    ctx = context(overrides=overrides)
    state = ctx.state
    # a few real steps first, so the optimizer has moments, the scheduler has moved and grads exist
    for step in range(3):
        loop.run_step(state, step, ctx.batch(step))
    random.gauss(0, 1)  # leaves a gauss_next in the python stream
    params = {name: p.detach().clone() for name, p in state.model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in state.model.named_parameters()}
    buffers = {name: b.clone() for name, b in state.model.state_dict().items()}
    optimizer = copy.deepcopy(state.optimizer.state_dict())
    scheduler = copy.deepcopy(state.scheduler.state_dict())
    lr_before = [g["lr"] for g in state.optimizer.param_groups]
    streams = rng_streams()
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in state.model.modules())

    results = K.run_checks(ctx)

    assert {r.name for r in results} == set(K.ORDER)
    assert_same_rng(streams, rng_streams())
    for name, p in state.model.named_parameters():
        assert torch.equal(p, params[name]), name
        assert torch.equal(p.grad, grads[name]), name
        assert p.requires_grad
    assert_same_tensors(buffers, state.model.state_dict())
    assert_same_tensors(optimizer["state"], state.optimizer.state_dict()["state"])
    assert optimizer["param_groups"] == state.optimizer.state_dict()["param_groups"]
    assert scheduler == state.scheduler.state_dict()
    assert [g["lr"] for g in state.optimizer.param_groups] == lr_before
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in state.model.modules()) == hooks_before
    assert state.model.training

    # the user's next step is the one it would have been without the check, bit for bit
    rng_after_check = capture_raw()
    checked_next = loop.run_step(state, 3, ctx.batch(3))
    untouched = context(overrides=overrides)
    for step in range(3):
        loop.run_step(untouched.state, step, untouched.batch(step))
    restore_raw(rng_after_check)
    untouched_next = loop.run_step(untouched.state, 3, untouched.batch(3))
    assert (checked_next.loss, checked_next.grad_norm) == (untouched_next.loss, untouched_next.grad_norm)
    for (name, p), q in zip(state.model.named_parameters(), untouched.state.model.parameters()):
        assert torch.equal(p, q), name


def test_checks_leave_user_gradients_alone():
    ctx = context(overrides=["model.hidden=16"])
    loss = ctx.state.step_fn(ctx.state.model, ctx.batch(0), ctx.state.loss_fn)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ctx.state.model.named_parameters()}
    K.run_checks(replace_options(ctx, only=["grad", "overfit"]))
    for name, p in ctx.state.model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name


def replace_options(ctx, **changes):
    ctx.options = K.CheckOptions(**{**SMALL.__dict__, **changes})
    return ctx


def test_results_do_not_depend_on_which_checks_ran_before():
    alone = K.run_checks(replace_options(context(overrides=["model.hidden=16"]), only=["lr.range_test"]))[0]
    together = {r.name: r for r in K.run_checks(context(overrides=["model.hidden=16"]))}["lr.range_test"]
    assert alone.value == together.value and alone.detail == together.detail


# ---- planted cases not covered through the CLI ---------------------------------------------------------------
LIBRARY_PLANTED = [
    # (config, overrides, check, status, layer, fragment)
    ("imbalanced", (), "data.class_balance", "warn", "target", "ratio 143"),
    ("unscaled", (), "data.input_scale", "warn", "input", "not normalized"),
    ("vanishing", (), "grad.vanishing", "fail", "net.0", "vanishing gradient at `net.0`"),
    ("loud_head", (), "init.loss", "warn", "net.4", "vs ln(10)"),
    ("lr_too_high", (), "lr.range_test", "fail", None, "your lr 3 is at or past the point where the loss blows up"),
    ("lr_too_high", (), "grad.update_ratio", "warn", "net.0", "lr is probably too high"),
    # one constant layer: identical at init, but the updates separate the rows -> a warning, not a trap
    ("identical_init", ("model._target_=check_plants.OneConstantLayerMLP",), "init.symmetry", "warn", "net.0", "the updates separate them within 3 steps"),
    # a step function that trains on its own class-sorted stream: the batches look shuffled, the loss sees sorted ones
    ("sorted_step_fn", (), "data.batch_diversity", "fail", "target", "the step function trains on other data than the batch"),
    # a softmax inside forward() (no Softmax module): still caught, and said where to look
    ("softmax_ce", ("model._target_=check_plants.FunctionalSoftmaxMLP",), "loss.output_mismatch", "fail", "net.4", "a softmax in forward()?"),
]


@pytest.mark.parametrize(
    "config_name, overrides, name, status, layer, fragment", LIBRARY_PLANTED, ids=[f"{p[0]}-{p[2]}-{len(p[1])}" for p in LIBRARY_PLANTED]
)
def test_planted_pathology_is_flagged_in_process(config_name, overrides, name, status, layer, fragment):
    ctx = context(PLANTS, config_name, overrides, options=K.CheckOptions(overfit_steps=60, lr_steps=40, only=[name]))
    (found,) = K.run_checks(ctx)
    assert found.status == status, found
    assert found.layer == layer, found
    assert fragment in found.detail, found


def test_class_balance_is_no_sampling_noise_and_no_vocabulary():
    """Labels drawn uniformly (40 classes, 6 samples a class): 11x between the most common and the rarest by chance
    alone, past the 10x cut-off, but no imbalance (chi-square). Per-token targets of a language model are no class labels."""
    overrides = ["data._target_=check_plants.UniformLabels", "~data.split", "val_data=null", "model.out_features=40"]
    ctx = context(PLANTS, "base", overrides, options=K.CheckOptions(only=["data.class_balance"]))
    (found,) = K.run_checks(ctx)
    assert found.status == "pass" and found.value > IMBALANCE_WARN and "chi-square p=0.56" in found.detail, found
    ctx = context(overrides=["+experiment=char", "model.n_layers=1", "train.batch_size=16"], options=K.CheckOptions(only=["data.class_balance"]))
    (found,) = K.run_checks(ctx)
    assert found.status == "skip" and "per token" in found.detail, found


def test_a_large_update_ratio_at_a_good_lr_is_no_alarm():
    """AdamW's steps are about lr per weight: at lr 1e-2 the built-in MLP's update/weight ratio is 0.11, past SGD's
    healthy band, yet that lr trains it (500 steps: loss 7e-4, against 0.06 at the default 1e-3) and the LR range
    test suggests 0.09. The lr is judged by the range test, not by the ratio's absolute number (AdamW at lr 3, in
    LIBRARY_PLANTED, still warns)."""
    ctx = context(overrides=["optim.lr=1e-2"], options=K.CheckOptions(lr_steps=40, only=["grad.update_ratio"]))
    (found,) = K.run_checks(ctx)
    assert found.status == "pass" and found.value > 0.1, found
    assert "the LR range test finds 0.01 a good lr" in found.detail, found


def test_healthy_builtins_raise_no_false_alarm_in_the_cheap_checks():
    # the CLI test covers the default MLP end to end; the CNN and the transformer (cheap checks only)
    for overrides in (["model=cnn"], ["+experiment=char", "model.n_layers=1", "train.batch_size=16"]):
        ctx = context(overrides=overrides, options=K.CheckOptions(only=["data", "loss", "init", "act", "grad"]))
        flagged = {r.name: r.detail for r in K.run_checks(ctx) if r.status in ("warn", "fail")}
        assert not flagged, (overrides, flagged)


def test_unknown_check_name_is_bad_input():
    from replaybisect.errors import ReplayError

    with pytest.raises(ReplayError, match="unknown check typo; choose from the groups act, data"):
        K.select(["data", "typo"])
    assert K.select(["data", "lr.range_test"]) == [n for n in K.ORDER if n.startswith("data.")] + ["lr.range_test"]


# ---- rules ------------------------------------------------------------------------------------------------------------
def test_lr_suggestion_is_the_steepest_descent_before_the_lowest_point():
    lrs = lr_finder.lr_schedule(1e-7, 10, 60)
    assert lrs[0] == pytest.approx(1e-7) and lrs[-1] == pytest.approx(10)
    assert all(b / a == pytest.approx(lrs[1] / lrs[0]) for a, b in zip(lrs, lrs[1:]))
    # flat, a steep drop around index 30, a bottom at 40, a spike, then a steeper "recovery" at 50
    curve = [2.0] * 25 + [2.0 - 0.3 * i for i in range(1, 6)] + [0.5 - 0.01 * i for i in range(10)] + [3.0] * 8 + [3.0 - 0.6 * i for i in range(1, 5)] + [0.7] * 8
    index = lr_finder.suggest(lrs, curve)
    assert 25 <= index <= 30
    assert lr_finder.suggest(lrs[:14], curve[:14]) is None  # too few points after skipping 10 + 5


def test_lr_range_test_stops_when_the_loss_passes_4x_its_best():
    ctx = context(overrides=["optim=sgd"])
    state = loop.clone_state(ctx.state)
    result = lr_finder.lr_range_test(state, ctx.batch, steps=100)
    assert result.stop_reason in ("diverged", "nonfinite") and len(result.lrs) < 100
    best = min(result.smoothed[:-1])
    assert result.stop_reason == "nonfinite" or result.smoothed[-1] > 4 * best
    assert all(s <= 4 * best for s in result.smoothed[:-1])
    for i in range(1, len(result.smoothed) - 1):  # smoothing 0.05
        assert result.smoothed[i] == pytest.approx(0.05 * result.losses[i] + 0.95 * result.smoothed[i - 1])


def test_loss_floor():
    ce = torch.nn.CrossEntropyLoss()
    x = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    floor, how = K.loss_floor(ce, x, torch.tensor([0, 1, 1]), 2)  # the first two inputs are identical, labels differ
    assert floor == pytest.approx(2 / 3 * math.log(2)) and "identical inputs" in how
    assert K.loss_floor(ce, x, torch.tensor([0, 0, 1]), 2)[0] == 0.0
    smoothed, _ = K.loss_floor(torch.nn.CrossEntropyLoss(label_smoothing=0.1), None, torch.tensor([0, 1]), 10)
    top, rest = 0.9 + 0.01, 0.01
    assert smoothed == pytest.approx(-(top * math.log(top)) - 9 * rest * math.log(rest))
