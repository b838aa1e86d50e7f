"""Two `replay train` starting at once on a fresh SQLite store: both runs are recorded.

MLflow creates a new store's schema on first use; two processes doing that on one new file collided
("table experiments already exists") until open_store serialized creation with a lock beside the database.
"""

from __future__ import annotations

import subprocess

import pytest

from conftest import REPLAY, Workspace

TINY = ("train.steps=2", "train.batch_size=8", "snapshot.every=0", "snapshot.layer_stats_every=0", "train.val_every=0", "model.hidden=16")
ROUNDS = 2  # without the lock the race was lost in 3 rounds of 3


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_trainers_on_a_fresh_store_are_both_recorded(tmp_path, round_):
    workspace = Workspace(tmp_path)
    assert not (tmp_path / "mlflow.db").exists()
    trainers = [
        subprocess.Popen([REPLAY, "train", "--json", f"--run-name=racer-{index}", *TINY], cwd=tmp_path, env=workspace.env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for index in range(2)
    ]
    outputs = [trainer.communicate(timeout=120) for trainer in trainers]
    for trainer, (stdout, stderr) in zip(trainers, outputs):
        assert trainer.returncode == 0, f"exit {trainer.returncode}\n{stderr}"
    runs = workspace.store().search_runs("")
    assert sorted(run.info.run_name for run in runs) == ["racer-0", "racer-1"]
    assert all(run.info.status == "FINISHED" for run in runs)
