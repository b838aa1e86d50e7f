"""recorder.py in-process: the Recorder on a tiny TrainState, the real training loop and a real SQLite store."""

from __future__ import annotations

import math
import time

import pytest
import torch

from replaybisect.core import config as config_mod
from replaybisect.core import loop
from replaybisect.core import snapshot as fmt
from replaybisect.core.state import live_tensors
from replaybisect.record.hooks import RecordingHooks as Recorder
from replaybisect.store import open_store

NAN_STEP = 3


def tiny_cfg(*overrides: str):
    return config_mod.compose(overrides=[
        "model.hidden=8", "model.dropout=0.0", "train.device=cpu", "train.val_every=0", "train.batch_size=4",
        "snapshot.layer_stats_every=0", *overrides,
    ])


def batch_of(step: int, nan_step: int | None = None):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 64, generator=generator)
    if step == nan_step:
        x[1, 5] = math.nan
    return x, torch.randint(0, 10, (4,), generator=generator)


@pytest.fixture
def store(tmp_path):
    return open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


def start(store, *overrides: str):
    cfg = tiny_cfg(*overrides)
    state = loop.build_state(cfg)
    run_id = store.create_run("train")
    return state, run_id, Recorder(store, run_id, cfg, state, {})


def wait_for_writes(recorder: Recorder) -> None:
    for job in list(recorder._jobs):
        job.result()


def logged_steps(store, run_id, key="loss") -> list[int]:
    return [step for step, _ in store.metric_history(run_id, key)]


def test_metrics_are_flushed_every_n_steps(store):
    state, run_id, recorder = start(store, "snapshot.every=0", "snapshot.metrics_flush_every=3", "snapshot.metrics_flush_seconds=0")
    loop.train_loop(state, batch_of, 0, 5, recorder)
    wait_for_writes(recorder)
    assert logged_steps(store, run_id) == [0, 1, 2]  # steps 3 and 4 wait for the next flush
    assert logged_steps(store, run_id, "lr") == [0, 1, 2]
    recorder.close()
    assert logged_steps(store, run_id) == [0, 1, 2, 3, 4]  # close flushes the rest
    assert {"loss", "lr", "grad_norm", "step_time", "data_time"} <= set(store.metric_keys(run_id))


def test_metrics_are_flushed_after_the_flush_interval_however_few_steps_ran(store):
    seconds = 1.5
    state, run_id, recorder = start(store, "snapshot.every=0", "snapshot.metrics_flush_every=1000", f"snapshot.metrics_flush_seconds={seconds}")
    started = time.monotonic()
    loop.train_loop(state, batch_of, 0, 2, recorder)
    wait_for_writes(recorder)
    assert time.monotonic() - started < seconds, "the two steps took longer than the flush interval"
    assert logged_steps(store, run_id) == []  # neither count nor time reached
    time.sleep(seconds - (time.monotonic() - started) + 0.1)
    loop.train_loop(state, batch_of, 2, 3, recorder)
    wait_for_writes(recorder)
    assert logged_steps(store, run_id) == [0, 1, 2]
    recorder.close()


def test_a_periodic_snapshot_verifies_and_reloads_the_tensors_and_batches(store):
    state, run_id, recorder = start(store, "snapshot.every=2", "snapshot.metrics_flush_every=1000")
    loop.train_loop(state, batch_of, 0, 2, recorder)
    expected = {name: tensor.detach().clone() for name, tensor in live_tensors(state).items()}
    assert any(name.startswith("optim/") for name in expected)  # AdamW moments exist after two steps
    loop.train_loop(state, batch_of, 2, 4, recorder)  # the snapshot of step 2 is taken before step 2 runs
    recorder.close()
    assert recorder.snapshot_steps == [0, 2]

    folder = store.local_artifact_dir(run_id) / fmt.SNAPSHOTS / fmt.folder_name(2)
    manifest = fmt.verify(folder)
    assert manifest.step == 2
    loaded = fmt.load(folder)
    assert loaded.step == 2 and loaded.state["reason"] == "periodic"
    assert loaded.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded.tensors[name], tensor), name
    assert sorted(loaded.batches) == [2, 3]  # the interval's batches, for a replay without the data source
    for step in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(loaded.batches[step], batch_of(step)))
    assert store.tags(run_id)["snapshot_steps"] == "0,2"


def test_a_nonfinite_step_writes_the_emergency_snapshot_with_the_failing_batch(store):
    state, run_id, recorder = start(store, "snapshot.every=100", "snapshot.keep_batches=false", "snapshot.on_nonfinite=stop")
    stopped = loop.train_loop(state, lambda step: batch_of(step, NAN_STEP), 0, 10, recorder)
    assert stopped is not None and stopped.step == NAN_STEP and stopped.nonfinite == "loss"
    before_failing_step = {name: tensor.detach().clone() for name, tensor in live_tensors(state).items()}
    recorder.close()
    assert recorder.first_nonfinite_step == NAN_STEP and recorder.snapshot_steps == [0, NAN_STEP]

    folder = store.local_artifact_dir(run_id) / fmt.SNAPSHOTS / fmt.folder_name(NAN_STEP)
    fmt.verify(folder)
    loaded = fmt.load(folder)
    assert loaded.state["reason"] == "nonfinite"
    assert list(loaded.batches) == [NAN_STEP]  # kept although keep_batches=false: it is the evidence
    x, y = loaded.batches[NAN_STEP]
    failing_x, failing_y = batch_of(NAN_STEP, NAN_STEP)
    assert torch.equal(x.isnan(), failing_x.isnan()) and x.isnan().sum() == 1 and torch.equal(y, failing_y)
    for name, tensor in before_failing_step.items():  # the state before the failing step, not after it
        assert torch.equal(loaded.tensors[name], tensor), name
    tags = store.tags(run_id)
    assert tags["status"] == "nonfinite" and tags["first_nonfinite_step"] == str(NAN_STEP) and tags["nonfinite_what"] == "loss"
    assert logged_steps(store, run_id) == [0, 1, 2, 3]
    assert math.isnan(store.metric_history(run_id, "loss")[-1][1])


# ---- a user-loop step's stored RNG states: restored exactly, and checked like a snapshot's ---------------------
def _packed_rng():
    import random

    import numpy as np

    from replaybisect.core import user_step

    random.gauss(0, 1), np.random.randn()  # both generators hold a cached gaussian
    return user_step.pack([torch.ones(2)], torch.device("cpu"))[user_step.RECORD_RNG]


def _draws():
    import random

    import numpy as np

    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), float(torch.rand(()))


def test_a_stored_step_restores_torch_python_and_numpy_streams():
    from replaybisect.core import rng as rng_mod

    rng = _packed_rng()
    first = _draws()
    rng_mod.restore_stored(rng, torch.device("cpu"))
    assert _draws() == first
    rng_mod.restore_stored({"torch": rng["torch"]}, torch.device("cpu"))  # a run recorded before: torch only
    assert _draws()[-1] == first[-1]


@pytest.mark.parametrize("key, value", [
    ("numpy_position", 100_000_000), ("numpy_position", -5), ("python_gauss", "x"), ("numpy_gauss", [1]),
    ("python", torch.zeros(3, dtype=torch.int32)), ("numpy", torch.zeros(624)), ("torch", torch.zeros(3, dtype=torch.uint8)),
])
def test_a_damaged_stored_rng_state_is_a_snapshot_error_not_a_bad_state(key, value):
    from replaybisect.core import rng as rng_mod
    from replaybisect.errors import SnapshotError

    rng = {**_packed_rng(), key: value}
    with pytest.raises(SnapshotError, match="RNG state is damaged"):
        rng_mod.restore_stored(rng, torch.device("cpu"))


def test_each_group_lr_is_stored_with_the_batch_and_set_again_from_it():
    from replaybisect.core import user_step

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.5}, {"params": [model.bias], "lr": 0.25}])
    record = user_step.pack([torch.ones(2)], torch.device("cpu"), optimizer=optimizer)
    assert record[user_step.RECORD_LR] == [0.5, 0.25]
    assert user_step.unpack(record)[0][0].tolist() == [1.0, 1.0]
    for group in optimizer.param_groups:
        group["lr"] = 9.0
    user_step.apply_recorded_lrs(record, optimizer)
    assert [group["lr"] for group in optimizer.param_groups] == [0.5, 0.25]
    user_step.apply_recorded_lrs([torch.ones(2)], optimizer)  # a plain batch (check's probes): groups left alone
    assert [group["lr"] for group in optimizer.param_groups] == [0.5, 0.25]


@pytest.mark.parametrize("carry", [[1.0], {1: torch.ones(1)}, "hidden"])
def test_a_damaged_stored_carry_is_a_snapshot_error(carry):
    from replaybisect.core import user_step
    from replaybisect.errors import SnapshotError

    record = {**user_step.pack([torch.ones(2)], torch.device("cpu")), user_step.RECORD_CARRY: carry}
    with pytest.raises(SnapshotError, match="carry"):
        user_step.recorded_carry(record)


def test_the_carry_is_stored_as_a_copy_and_absent_when_the_step_takes_none():
    from replaybisect.core import user_step
    from replaybisect.errors import ConfigError

    hidden = torch.ones(2)
    record = user_step.pack([torch.ones(2)], torch.device("cpu"), carry={"hidden": hidden})
    hidden.add_(1)  # the step goes on changing its state: the record keeps the step's start
    assert user_step.recorded_carry(record)["hidden"].tolist() == [1.0, 1.0]
    user_step.recorded_carry(record)["hidden"] = torch.zeros(2)  # a step writing its carry: the record keeps its own
    assert user_step.recorded_carry(record)["hidden"].tolist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match="carry has the key 0"):
        user_step.pack([torch.ones(2)], torch.device("cpu"), carry={0: hidden})
    assert user_step.recorded_carry(user_step.pack([torch.ones(2)], torch.device("cpu"))) == {}
    assert user_step.takes_carry(lambda model, optimizer, batch, carry: 0)
    assert not user_step.takes_carry(lambda model, optimizer, batch: 0)


@pytest.mark.parametrize("lrs, said", [("0.1", "not a list of finite"), ([0.1, "x"], "not a list of finite"),
                                       ([True, 0.1], "not a list of finite"), ([float("nan"), 0.1], "not a list of finite"),
                                       ([-0.1, 0.1], "not a list of finite"), ([0.1], "1 learning rates")])
def test_damaged_stored_lrs_are_a_snapshot_error(lrs, said):
    from replaybisect.core import user_step
    from replaybisect.errors import SnapshotError

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    record = {**user_step.pack([torch.ones(2)], torch.device("cpu")), user_step.RECORD_LR: lrs}
    with pytest.raises(SnapshotError, match=said):
        user_step.apply_recorded_lrs(record, optimizer)


# ---- batch containers: namedtuples come back as namedtuples; what cannot is said at record time ------------------
def test_a_namedtuple_batch_round_trips_through_the_snapshot_format():
    from collections import namedtuple

    from replaybisect.core import user_step

    Micro = namedtuple("Micro", ["x", "y"])
    batch = [Micro(torch.ones(2), torch.zeros(2, dtype=torch.long)), Micro(torch.full((2,), 3.0), torch.ones(2, dtype=torch.long))]
    stored = user_step.pack(batch, torch.device("cpu"))
    assert type(stored[user_step.RECORD_BATCH][0]) is Micro  # the copy keeps the user's type
    tensors, structure = fmt.flatten_batch(7, stored)
    assert fmt._batch_tensor_names(7, structure) is not None
    back, _ = user_step.unpack(fmt.unflatten_batch(7, tensors, structure))
    assert [type(m).__name__ for m in back] == ["Micro", "Micro"] and back[1]._fields == ("x", "y")
    assert torch.equal(back[1].x, batch[1].x) and torch.equal(back[0].y, batch[0].y)


@pytest.mark.parametrize("spec", [
    {"name": "Micro", "fields": ["x", "_y"], "items": [{"v": 1}, {"v": 2}]},  # namedtuple refuses _names
    {"name": "Micro", "fields": ["x", "class"], "items": [{"v": 1}, {"v": 2}]},  # a keyword
    {"name": "1Micro", "fields": ["x"], "items": [{"v": 1}]},
    {"name": "Micro", "fields": ["x", "x"], "items": [{"v": 1}, {"v": 2}]},
    {"name": "Micro", "fields": ["x"], "items": [{"v": 1}, {"v": 2}]},  # more items than fields
    {"name": "Micro", "fields": ["x"], "items": [{"v": 1}], "extra": 1},
])
def test_a_malformed_stored_namedtuple_is_not_a_batch(spec):
    assert fmt._batch_tensor_names(3, {"tree": {"namedtuple": spec}}) is None


def test_a_batch_container_a_replay_cannot_rebuild_is_said_once_at_record_time():
    from replaybisect.core import user_step

    class Encoding(dict):  # a dict with attribute access, as tokenizers return
        __getattr__ = dict.__getitem__

    batch = Encoding(input_ids=torch.ones(2, 3))
    with pytest.warns(UserWarning, match="batch's Encoding is stored as a plain dict"):
        user_step.pack(batch, torch.device("cpu"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        user_step.pack(Encoding(input_ids=torch.ones(2, 3)), torch.device("cpu"))  # once per type


def test_a_batch_holding_what_a_snapshot_cannot_store_is_refused_at_its_first_step():
    from dataclasses import dataclass

    from replaybisect.core import user_step
    from replaybisect.errors import ConfigError

    @dataclass
    class Batch:
        x: torch.Tensor

    with pytest.raises(ConfigError, match="holds a Batch, which a snapshot cannot store.*dataclasses.asdict"):
        user_step.pack([Batch(torch.ones(2))], torch.device("cpu"))


def test_a_namedtuple_a_snapshot_cannot_name_is_stored_as_a_tuple_with_a_warning():
    from collections import namedtuple

    from replaybisect.core import user_step

    Row = namedtuple("Row", ["x", "1"], rename=True)  # fields x, _1 (as pandas' itertuples makes)
    with pytest.warns(UserWarning, match="batch's Row is stored as a plain tuple"):
        stored = user_step.pack([Row(torch.ones(2), torch.zeros(2))], torch.device("cpu"))
    tensors, structure = fmt.flatten_batch(4, stored)
    assert fmt._batch_tensor_names(4, structure) is not None  # the batches of the snapshot stay loadable
    back, _ = user_step.unpack(fmt.unflatten_batch(4, tensors, structure))
    assert type(back[0]) is tuple and torch.equal(back[0][0], torch.ones(2))


def test_namedtuple_names_python_would_read_as_one_are_not_a_batch():
    spec = {"name": "Micro", "fields": ["\ufb01", "fi"], "items": [{"v": 1}, {"v": 2}]}  # the ligature normalises to "fi"
    assert fmt._batch_tensor_names(3, {"tree": {"namedtuple": spec}}) is None


def test_a_namedtuple_of_tensors_from_replay_train_keeps_its_type_and_values():
    from collections import namedtuple

    class Pair(namedtuple("Pair", ["x", "y"])):
        def __new__(cls, x, y):  # a constructor that transforms: copies must not run it again
            return super().__new__(cls, x * 2, y)

    pair = Pair(torch.ones(2), torch.zeros(2))
    tensors, structure = fmt.flatten_batch(5, pair)
    assert "tree" in structure  # not the flat tuple layout, which would lose the type
    back = fmt.unflatten_batch(5, tensors, structure)
    assert back._fields == ("x", "y") and torch.equal(back.x, pair.x)
    moved = loop.to_device(pair, torch.device("cpu"))
    assert type(moved) is Pair and torch.equal(moved.x, pair.x)  # _make, not Pair(...) again


def test_own_sources_hashes_the_module_of_each_function_and_class(tmp_path, monkeypatch):
    """The tag a run's replays compare their imports with: keyed by the name a replay imports the module by."""
    import hashlib
    import importlib
    import json

    from replaybisect.record.recorder import own_sources

    (tmp_path / "rb_own_step.py").write_text("def train_step(model, optimizer, batch): ...\n\nclass Net: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("rb_own_step")
    tag = own_sources(module.train_step, module.Net)
    digest = hashlib.sha256((tmp_path / "rb_own_step.py").read_bytes()).hexdigest()
    assert json.loads(tag["replaybisect.source_sha256"]) == {"rb_own_step": digest}


def test_the_snapshot_steps_tag_keeps_the_newest_that_fit_a_tag_every_server_keeps():
    """A run with thousands of snapshots (a long run, snapshot.every=100): the tag holds the newest steps within the
    limit older MLflow servers accept, the newest one last; a short run's holds them all."""
    from replaybisect.record.hooks import steps_tag
    from replaybisect.store import OLD_SERVER_TAG_VALUE

    many = list(range(0, 5_000_000, 100))
    tag = steps_tag(many)
    assert len(tag) <= OLD_SERVER_TAG_VALUE and tag.endswith(",4999900")
    kept = [int(step) for step in tag.split(",")]
    assert kept == many[-len(kept):] and len(kept) > 400
    assert steps_tag([0, 100, 200]) == "0,100,200" and steps_tag([]) == ""


def test_a_step_functions_arguments_are_read_for_functions_and_unhashable_callables_alike():
    from replaybisect.core import user_step
    from replaybisect.errors import ConfigError

    class Step:  # a callable object with __eq__ and no __hash__: unhashable, read each time
        __hash__ = None

        def __eq__(self, other):
            return isinstance(other, Step)

        def __call__(self, model, batch, carry=None):
            return batch

    def step(model, optimizer, batch, *, scale=1.0):
        return batch

    def bad(model, batch, learning_rate):
        return batch

    assert user_step.step_arguments(Step()) == ["model", "batch", "carry"] == user_step.step_arguments(Step())
    assert user_step.step_arguments(step) == ["model", "optimizer", "batch"] and user_step.takes_carry(Step())
    for _ in range(2):  # a refusal is not cached away
        with pytest.raises(ConfigError, match="'learning_rate' is not one replaybisect can pass"):
            user_step.step_arguments(bad)
