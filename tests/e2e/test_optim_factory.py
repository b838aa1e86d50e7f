"""Optimizer factories that take the model (nanoGPT's configure_optimizers) build, record and replay exactly."""

from __future__ import annotations

import json
import shutil

from tests.helpers import TESTS, Workspace

EXAMPLE = TESTS / "printing_model"


def test_a_factory_that_takes_the_model_builds_its_groups(monkeypatch):
    from replaybisect.core import config as config_mod
    from replaybisect.core import loop

    monkeypatch.syspath_prepend(str(EXAMPLE))
    state = loop.build_state(config_mod.compose(EXAMPLE, "factory"))
    decays = sorted(group["weight_decay"] for group in state.optimizer.param_groups)
    assert decays == [0.0, 0.1]
    assert sum(len(group["params"]) for group in state.optimizer.param_groups) == len(list(state.model.parameters()))


def test_a_run_with_a_model_factory_replays_exactly(tmp_path):
    workspace = Workspace(tmp_path)
    shutil.copytree(EXAMPLE, tmp_path / "proj")
    trained = workspace.replay("train", "--json", "--config-dir", "proj", "--config-name", "factory")
    assert trained.returncode == 3, trained.stderr
    run_id = json.loads(trained.stdout)["run_id"]
    report = workspace.replay("nan", "--json", "--run-id", run_id, "--code-dir", "proj")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["reproduced"] == "exact"
