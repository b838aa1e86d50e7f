"""What a loop recorded as written takes from outside its model's arguments (core/outside_model.py): the targets its
loss meets, recorded and put back; the floats its code reads."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from replaybisect.core import outside_model
from replaybisect.core.outside_model import LossInputs


def _stack() -> list[str]:
    return [type(torch._C._get_function_stack_at(i)).__name__ for i in range(torch._C._len_torch_function_stack())]


def test_a_target_is_recorded_and_a_replay_puts_the_stored_one_in_its_place():
    torch.manual_seed(0)
    model, frozen = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    stored: list = []
    recording = LossInputs(outside_model.model_tensor_ids(model), scaler, replaying=False)
    out = model(x)
    recording.follow(out, stored)
    loss = scaler.scale(F.mse_loss(out * frozen, y))  # the scale and a frozen parameter are no targets
    recording.pause()
    assert len(stored) == 1 and torch.equal(stored[0], y) and _stack() == []

    replaying = LossInputs(outside_model.model_tensor_ids(model), scaler, replaying=True)
    out = model(x)
    replaying.follow(out, stored)
    replayed = scaler.scale(F.mse_loss(out * frozen, torch.zeros(4, 2)))  # the script holds another target now
    replaying.pause()
    assert torch.equal(replayed, loss) and _stack() == []


def test_every_call_of_a_step_is_followed_and_a_target_of_another_shape_is_left_live():
    model = torch.nn.Linear(3, 2)
    xs, ys = [torch.randn(4, 3) for _ in range(2)], [torch.randn(4, 2) for _ in range(2)]
    lists: list[list] = [[], []]
    recording = LossInputs(outside_model.model_tensor_ids(model), None, replaying=False)
    outs = []
    for x, stored in zip(xs, lists):
        recording.pause()
        outs.append(model(x))
        recording.follow(outs[-1], stored)
    sum(F.mse_loss(out, y) for out, y in zip(outs, ys))  # the losses after all the calls (micro-batches)
    recording.pause()
    assert torch.equal(lists[1][0], ys[0]) and torch.equal(lists[1][1], ys[1])  # met after the second call

    replaying = LossInputs(outside_model.model_tensor_ids(model), None, replaying=True)
    out = model(xs[0])
    replaying.follow(out, [torch.zeros(2, 2)])
    wider = torch.randn(4, 2)
    assert torch.equal(F.mse_loss(out, wider), F.mse_loss(out.detach(), wider))  # no stored target of its shape: its own
    replaying.pause()


def test_a_stored_target_with_the_rows_of_the_models_outputs_stands_for_the_live_batchs():
    """The stored inputs hold other rows than the script's live batch (an arm dropped rows, or the live loader's last
    batch is ragged): the stored target that fits the model's outputs is taken, not the live one."""
    model = torch.nn.Linear(3, 2)
    stored = [torch.randn(3, 2)]
    replaying = LossInputs(outside_model.model_tensor_ids(model), None, replaying=True)
    out = model(torch.randn(3, 3))
    replaying.follow(out, stored)
    replayed = F.mse_loss(out, torch.randn(4, 2))  # the live target has the live batch's 4 rows
    replaying.pause()
    assert torch.equal(replayed, F.mse_loss(out, stored[0])) and _stack() == []


def test_a_mode_the_loop_holds_around_the_models_call_is_left_alone():
    model = torch.nn.Linear(3, 2)
    stored: list = []
    targets = LossInputs(outside_model.model_tensor_ids(model), None, replaying=False)
    with torch.device("cpu"):
        out = model(torch.randn(4, 3))
        targets.follow(out, stored)  # a mode is open: ours is not entered (its exit would pop ours)
    F.mse_loss(out, torch.randn(4, 2))
    targets.pause()
    assert stored == [] and _stack() == []


def test_the_floats_a_loop_reads_through_its_own_functions_are_found_and_set_again():
    namespace: dict = {"lr": 0.5, "steps": 3, "scale": 2.0}
    exec("def update():\n    return lr * 2\n\ndef loop():\n    return update() + steps\n", namespace)
    frame = types.SimpleNamespace(f_globals=namespace, f_code=namespace["loop"].__code__)
    assert outside_model.loop_numbers(frame) == {"global:lr": 0.5}  # ints are counters; `scale` is not read
    outside_model.set_loop_numbers(frame, {"global:lr": 0.125, "global:steps": 9, "global:scale": 4.0})
    assert (namespace["lr"], namespace["steps"], namespace["scale"]) == (0.125, 3, 2.0)
