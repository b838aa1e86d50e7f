"""User code owns stdout: a model that prints (from Python and straight to fd 1) never corrupts `--json`."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import TESTS, Workspace

EXAMPLE = TESTS / "printing_model"


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    workspace = Workspace(tmp_path_factory.mktemp("noisy"))
    shutil.copytree(EXAMPLE, workspace.path / "proj")
    result = workspace.replay("train", "--json", "--config-dir", "proj")
    assert result.returncode == 3, result.stderr
    trained = json.loads(result.stdout)  # the whole stdout is one JSON object
    assert "number of parameters" in result.stderr and "not json" in result.stderr  # user output kept, on stderr
    return workspace, trained


def one_json_object(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_train_json_survives_a_printing_model(noisy):
    _, trained = noisy
    assert trained["status"] == "nonfinite" and trained["first_nonfinite_step"] == 15


@pytest.mark.parametrize("verb", ["nan", "diagnose", "runs"])
def test_every_verb_json_survives_a_printing_model(noisy, verb):
    workspace, trained = noisy
    args = [verb, "--json"] + ([] if verb == "runs" else ["--run-id", trained["run_id"]])
    data = one_json_object(workspace.replay(*args))
    if verb == "nan":
        assert (data["failing_step"], data["reproduced"], data["category"]) == (15, "exact", "forward")


def test_human_output_stays_on_stdout(noisy):
    workspace, trained = noisy
    result = workspace.replay("diagnose", "--run-id", trained["run_id"])
    assert result.returncode == 0, result.stderr
    assert "non-finite" in result.stdout.lower() or "nan" in result.stdout.lower()
    assert "forward (" not in result.stdout  # the model's prints went to stderr
