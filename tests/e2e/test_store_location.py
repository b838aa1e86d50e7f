"""One store wherever you stand: --tracking-uri, else MLFLOW_TRACKING_URI, else the nearest mlflow.db in the working
folder or above it, else ./mlflow.db, created only by commands that record. Reading never creates a store.
Piped tables keep whole words, and turn into a plain list when too narrow."""

from __future__ import annotations

import json
import os
import re

from tests.helpers import REPLAY, CliResult, assert_one_line_error

import subprocess

TINY = ("train.steps=3", "train.batch_size=16", "snapshot.every=2", "train.val_every=0", "model.hidden=8")


def _replay(cwd, *args: str, **env_extra: str) -> CliResult:
    """The installed `replay` in `cwd` with no MLFLOW_TRACKING_URI: the store is found by the rule."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "REPLAYBISECT_FULL_ERROR")}
    env.update(PYTHONUNBUFFERED="1", **env_extra)
    done = subprocess.run([REPLAY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return CliResult(done.returncode, done.stdout, done.stderr)


def test_runs_from_a_folder_and_its_subfolder_land_in_one_store(tmp_path):
    project, sub = tmp_path / "project", tmp_path / "project" / "examples" / "one"
    sub.mkdir(parents=True)
    first = _replay(project, "train", "--json", *TINY)
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines()[0] == f"store: {project / 'mlflow.db'} (new)"
    assert "training: 3 steps" in first.stderr  # progress on stderr, also when it is piped
    assert first.json()["run_id"] and project.joinpath("mlflow.db").exists()
    second = _replay(sub, "train", "--json", *TINY)
    assert second.returncode == 0, second.stderr
    assert second.stderr.splitlines()[0] == f"store: {project / 'mlflow.db'} (nearest mlflow.db)"
    assert not (sub / "mlflow.db").exists() and not (sub / "mlruns").exists()

    for folder in (project, sub):
        listed = _replay(folder, "runs", "--json")
        assert listed.returncode == 0, listed.stderr
        runs = json.loads(listed.stdout)
        assert runs["store"] == str(project / "mlflow.db")
        assert {run["run_id"] for run in runs["runs"]} == {first.json()["run_id"], second.json()["run_id"]}
        assert {run["name"] for run in runs["runs"]} == {"train mlp/digits"}  # readable in the MLflow UI

    # an unknown run in an existing store: one line naming the store's absolute path, the store unchanged
    before = (project / "mlflow.db").read_bytes()
    bogus = _replay(sub, "nan", "--run-id", "bogus")
    assert_one_line_error(bogus, "no run 'bogus'", str(project / "mlflow.db"))
    assert (project / "mlflow.db").read_bytes() == before

    # MLFLOW_TRACKING_URI (relative, made absolute) wins over the store found upward
    elsewhere = _replay(sub, "runs", "--json", MLFLOW_TRACKING_URI="sqlite:///other.db")
    assert elsewhere.stderr.splitlines()[0] == f"store: {sub / 'other.db'} (from MLFLOW_TRACKING_URI)"
    assert json.loads(elsewhere.stdout)["runs"] == [] and not (sub / "other.db").exists()


def test_runs_in_an_empty_folder_creates_nothing(tmp_path):
    result = _replay(tmp_path, "runs")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == f"store: {tmp_path / 'mlflow.db'} (none here or above yet)"
    assert result.stdout.startswith(f"no runs yet: no mlflow.db in {tmp_path} or a folder above it")
    as_json = _replay(tmp_path, "runs", "--json")
    assert json.loads(as_json.stdout) == {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                          "store": str(tmp_path / "mlflow.db"), "runs": []}
    assert list(tmp_path.iterdir()) == []


def test_a_bad_run_id_creates_no_store(tmp_path):
    for args in (["nan", "--run-id", "bogus"], ["diagnose", "--run-id", "bogus"], ["ablate", "lr", "--run-id", "bogus"],
                 ["check", "--run-id", "bogus"]):
        result = _replay(tmp_path, *args)
        assert_one_line_error(result, "no run 'bogus'", str(tmp_path / "mlflow.db"), "no runs recorded there yet")
    assert list(tmp_path.iterdir()) == []


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z][A-Za-z0-9_\-]{3,}", text))


def test_piped_tables_keep_whole_words(tmp_path):
    wide = _replay(tmp_path, "ablate", "--list", COLUMNS="200")
    assert wide.returncode == 0 and "┃ arm" in wide.stdout  # a table when every word fits
    expected = json.loads(_replay(tmp_path, "ablate", "--list", "--json").stdout)["interventions"]
    for columns in ("100", "60", "30", "20"):
        narrow = _replay(tmp_path, "ablate", "--list", COLUMNS=columns)
        assert narrow.returncode == 0, narrow.stderr
        for entry in expected:  # every word of every description is printed whole
            assert _words(entry["description"]) <= _words(narrow.stdout), (columns, entry, narrow.stdout)
    listed = _replay(tmp_path, "ablate", "--list", COLUMNS="20").stdout
    assert "- arm: lr" in listed and "│" not in listed  # too narrow for whole words: a plain list


def test_no_runs_yet_names_a_long_folder_unbroken(tmp_path):
    """Piped output is 80 columns wide to rich: a path must not be cut by a line break (copy-paste)."""
    deep = tmp_path / ("a_folder_with_a_long_name_" * 3) / "and_another_one_below_it"
    deep.mkdir(parents=True)
    result = _replay(deep, "runs")
    assert result.returncode == 0, result.stderr
    assert f"no mlflow.db in {deep} or a folder above it" in result.stdout.splitlines()[0]
