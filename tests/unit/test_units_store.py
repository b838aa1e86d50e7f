"""store.py in-process on a real SQLite MLflow store in tmp_path: runs, tags, batched metrics, errors."""

from __future__ import annotations

import math

import pytest

from replaybisect.errors import RunNotFound, StoreUnreachable
from replaybisect.store import MAX_BATCH, TAG, Store, open_store


@pytest.fixture
def store(tmp_path):
    return open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_create_run_sets_kind_status_and_given_tags(store):
    run_id = store.create_run("train", run_name="first", tags={TAG + "git_sha": "abc"})
    assert store.tags(run_id) == {"kind": "train", "status": "running", "git_sha": "abc"}
    assert store.get_run(run_id).info.run_name == "first"


def test_set_tags_prefixes_and_finish_run_marks_status(store):
    run_id = store.create_run("train")
    store.set_tags(run_id, {"snapshot_steps": "5,10", "first_nonfinite_step": 7})
    store.finish_run(run_id, "ok")
    run = store.get_run(run_id)
    assert run.data.tags[TAG + "snapshot_steps"] == "5,10"
    assert store.tags(run_id)["first_nonfinite_step"] == "7"  # values stored as strings
    assert store.tags(run_id)["status"] == "ok" and run.info.status == "FINISHED"


class CountingClient:
    """The real MlflowClient, with the size of each log_batch call noted on the way through."""

    def __init__(self, client):
        self.client = client
        self.metric_batches: list[int] = []

    def log_batch(self, run_id, metrics=(), **kwargs):
        self.metric_batches.append(len(metrics))
        return self.client.log_batch(run_id, metrics=metrics, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_log_metrics_sends_batches_of_at_most_1000_points_and_all_arrive(store):
    run_id = store.create_run("train")
    counting = Store(uri=store.uri, client=CountingClient(store.client))
    count = 2 * MAX_BATCH + 500
    counting.log_metrics(run_id, [("loss", float(step), step) for step in range(count)])
    assert MAX_BATCH == 1000 and counting.client.metric_batches == [1000, 1000, 500]  # never one call per value
    history = store.metric_history(run_id, "loss")
    assert len(history) == count
    assert history[0] == (0, 0.0) and history[-1] == (count - 1, float(count - 1))


def test_metric_history_sorts_by_step_and_the_last_value_of_a_step_wins(store):
    run_id = store.create_run("train")
    store.log_metrics(run_id, [("loss", 3.0, 2), ("loss", 1.0, 0)])
    store.log_metrics(run_id, [("loss", 5.0, 2)])
    assert store.metric_history(run_id, "loss") == [(0, 1.0), (2, 5.0)]
    assert store.metric_keys(run_id) == ["loss"]


def test_metric_history_gives_infinities_back_not_float_max(store):
    run_id = store.create_run("train")
    store.log_metrics(run_id, [("grad_norm", math.inf, 0), ("grad_norm", -math.inf, 1), ("grad_norm", 2.5, 2)])
    values = [value for _, value in store.metric_history(run_id, "grad_norm")]
    assert values == [math.inf, -math.inf, 2.5]


def test_json_artifacts_and_output_are_strict_json(store):
    """Non-finite numbers (floats, numpy's, a tensor's) as "nan"/"inf"/"-inf", which every JSON parser reads."""
    import json

    import numpy as np
    import torch

    from replaybisect.core.jsonutil import strict_json

    def refuse(literal):
        raise ValueError(f"{literal} is not JSON")

    data = {"loss": float("nan"), "norm": np.float64("inf"), "lows": [np.float32("-inf"), 1.5], "t": torch.tensor(float("nan"))}
    expected = {"loss": "nan", "norm": "inf", "lows": ["-inf", 1.5], "t": "nan"}
    assert json.loads(strict_json(data), parse_constant=refuse) == expected
    run_id = store.create_run("nan")
    store.log_dict(run_id, data, "report.json")
    assert json.loads(store.read_artifact_text(run_id, "report.json"), parse_constant=refuse) == expected


def test_child_runs_filters_by_parent_and_kind(store):
    parent = store.create_run("ablate")
    other_parent = store.create_run("ablate")
    arms = {store.create_run("arm", parent_run_id=parent) for _ in range(2)}
    baseline = store.create_run("baseline", parent_run_id=parent)
    store.create_run("arm", parent_run_id=other_parent)
    assert {run.info.run_id for run in store.child_runs(parent)} == arms | {baseline}
    assert {run.info.run_id for run in store.child_runs(parent, kind="arm")} == arms
    assert store.get_run(baseline).info.experiment_id == store.get_run(parent).info.experiment_id


def test_an_unknown_run_is_one_line_naming_it(store):
    with pytest.raises(RunNotFound) as caught:
        store.get_run("0123456789abcdef0123456789abcdef")
    message = str(caught.value)
    assert "\n" not in message and "0123456789abcdef0123456789abcdef" in message and "replay runs" in message


def test_a_store_in_a_missing_folder_is_unreachable(tmp_path):
    missing = tmp_path / "no" / "such" / "folder"
    with pytest.raises(StoreUnreachable) as caught:
        open_store(f"sqlite:///{missing / 'mlflow.db'}")
    message = str(caught.value)
    assert "\n" not in message and str(missing) in message and "does not exist" in message
    assert not missing.exists()  # nothing created on the way


def test_artifacts_of_a_sqlite_store_live_beside_the_database(store, tmp_path):
    run_id = store.create_run("train")
    folder = store.local_artifact_dir(run_id)
    assert folder is not None and folder.is_relative_to(tmp_path / "mlruns")


def test_a_new_store_made_from_the_kept_template_is_the_store_mlflow_migrates(tmp_path, monkeypatch):
    """The first new store runs MLflow's migrations and keeps the result; the next is a copy of it (seconds
    faster), with the same schema and version and its Default experiment's artifact folder beside it."""
    import sqlite3

    from replaybisect.store import sqlite as sqlite_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    template = sqlite_store._template_path()
    assert template is not None and not template.exists()

    def schema(database):
        connection = sqlite3.connect(database)
        try:
            tables = sorted(connection.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
            version = connection.execute("SELECT version_num FROM alembic_version").fetchall()
            default = connection.execute("SELECT name, artifact_location FROM experiments WHERE experiment_id = 0").fetchall()
            return tables, version, default
        finally:
            connection.close()

    migrated, copied = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    for database in (migrated, copied):
        database.parent.mkdir()
        open_store(f"sqlite:///{database}")
        assert template.is_file()
    tables_a, version_a, default_a = schema(migrated)
    tables_b, version_b, default_b = schema(copied)
    assert tables_a == tables_b and version_a == version_b
    assert default_a == [("Default", str(migrated.parent / "mlruns" / "0"))]
    assert default_b == [("Default", str(copied.parent / "mlruns" / "0"))]
    assert sqlite_store.inspect_sqlite(copied).kind == "current"
    run_id = open_store(f"sqlite:///{copied}").create_run("train")
    assert open_store(f"sqlite:///{copied}").tags(run_id)["kind"] == "train"


def test_a_store_that_reads_once_asks_the_server_for_a_run_once_until_it_writes_to_it(store, monkeypatch):
    """`replay nan` read the examined run's tags five times, each a round trip to a server (issue 48); a command's
    store now reads each run once, and again only after this process wrote to it."""
    run_id = store.create_run("train")
    reading = open_store(store.uri, create=False, read_once=True)
    asked = []
    original = reading.client.get_run
    monkeypatch.setattr(reading.client, "get_run", lambda rid: asked.append(rid) or original(rid))
    assert reading.tags(run_id)["kind"] == "train" and reading.tags(run_id)["status"] == "running"
    assert asked == [run_id]
    reading.set_tags(run_id, {"status": "ok"})  # our own write: read again
    assert reading.tags(run_id)["status"] == "ok" and asked == [run_id, run_id]
    asked_fresh = []
    fresh_original = store.client.get_run
    monkeypatch.setattr(store.client, "get_run", lambda rid: asked_fresh.append(rid) or fresh_original(rid))
    store.get_run(run_id), store.get_run(run_id)
    assert asked_fresh == [run_id, run_id]  # a store that does not read once (the watcher's) always asks

