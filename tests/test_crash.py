"""A crash is a failure, replayed like a NaN: a step that raises (here an IndexError on one batch, no NaN anywhere)
is recorded as the run's failing step, with the state before it and its batch kept and the exception in the run's
tags; `replay nan` replays up to it exactly and reproduces the exception, naming the user's frame and the batch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Workspace

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> tuple[Workspace, Path, str, subprocess.CompletedProcess]:
    """`python crash_loop.py 12 6`: an own loop (Recorder with step_fn and build) whose step 6 raises IndexError."""
    workspace = Workspace(tmp_path_factory.mktemp("crash"))
    folder = workspace.path / "project"
    folder.mkdir()
    shutil.copy(HERE / "user_loop" / "crash_loop.py", folder)
    done = subprocess.run([sys.executable, "crash_loop.py", "12", "6"], cwd=folder, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    found = re.search(r"recording run ([0-9a-f]{32})", done.stderr)
    assert found, done.stdout + done.stderr
    return workspace, folder, found.group(1), done



def test_a_step_that_raises_is_recorded_as_the_failing_step(crashed):
    from replaybisect.core import snapshot as fmt
    from replaybisect.restore import failing_step, load_snapshot

    workspace, folder, run_id, done = crashed
    assert done.returncode == 1 and "IndexError: index 4 is out of bounds" in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # the line the user reads last names the next command
    assert last.startswith("replaybisect: step 6 raised IndexError") and last.endswith(f"replay nan --run-id {run_id}")
    store = workspace.store()
    assert store.get_run(run_id).info.status == "FAILED"
    tags = store.tags(run_id)
    assert tags["status"] == "crashed" and tags["failure"] == "exception" and tags["failing_step"] == "6"
    assert tags["error_type"] == "IndexError" and tags["error"] == "index 4 is out of bounds for dimension 0 with size 4"
    assert tags["error_frame"].startswith(f"{folder / 'crash_loop.py'}:23 in train_step: weights = CLASS_WEIGHTS[y]")
    assert "first_nonfinite_step" not in tags
    assert failing_step(store, run_id) == 6
    snapshot = load_snapshot(store, run_id, 6)  # the state before step 6, with its batch, as for a non-finite step
    assert snapshot.state["reason"] == "exception" and 6 in snapshot.batches
    assert [int(s) for s in tags["snapshot_steps"].split(",")] == [0, 4, 6]
    assert fmt.folder_name(6) in {p.name for p in (store.local_artifact_dir(run_id) / fmt.SNAPSHOTS).iterdir()}


def test_replay_nan_reproduces_the_exception_at_the_users_frame(crashed):
    workspace, folder, run_id, _ = crashed
    result = Workspace(folder).replay("nan", "--run-id", run_id, "--json", "--no-child-run", env=workspace.env())
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["failing_step"] == 6 and report["snapshot_step"] == 4
    assert report["reproduced"] == "exact"  # steps 4..5 replayed bit for bit against the logged losses
    assert report["state_match"].startswith("bit-identical")  # ... onto the state the run saved before step 6
    assert report["category"] == "exception"
    crash = report["exception"]
    assert crash["replayed"] == "IndexError: index 4 is out of bounds for dimension 0 with size 4" and crash["as_recorded"]
    assert crash["frame"].startswith(f"{folder / 'crash_loop.py'}:23 in train_step")
    assert crash["op"] == "Tensor.__getitem__" and "int64[16] range [0, 4]" in " ".join(crash["op_inputs"])
    assert crash["batch"][1] == "batch[1]: int64[16] range [0, 4]" and crash["batch"][0].startswith("batch[0]: float32[16, 8]")
    assert crash["nonfinite_before"] is None
    assert report["headline"].startswith("exception at step 6: IndexError: index 4 is out of bounds") and "crash_loop.py:23" in report["headline"]
    assert all(report["isolation"].values())
