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

from tests.helpers import TESTS, Workspace



@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> tuple[Workspace, Path, str, subprocess.CompletedProcess]:
    """`python crash_loop.py 12 6`: an own loop (Recorder with step_fn and build) whose step 6 raises IndexError."""
    workspace = Workspace(tmp_path_factory.mktemp("crash"))
    folder = workspace.path / "project"
    folder.mkdir()
    shutil.copy(TESTS / "user_loop" / "crash_loop.py", folder)
    done = subprocess.run([sys.executable, "crash_loop.py", "12", "6"], cwd=folder, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    found = re.search(r"recording run ([0-9a-f]{32})", done.stderr)
    assert found, done.stdout + done.stderr
    return workspace, folder, found.group(1), done



def test_a_step_that_raises_is_recorded_as_the_failing_step(crashed):
    from replaybisect.core import snapshot as fmt
    from replaybisect.core.tags import failing_step
    from replaybisect.replay.restore import load_snapshot

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
    assert crash["batch"][1] == "batch[1] (targets): int64[16] range [0, 4]" and crash["batch"][0].startswith("batch[0] (inputs): float32[16, 8]")
    assert crash["nonfinite_before"] is None
    assert report["headline"].startswith("exception at step 6: IndexError: index 4 is out of bounds") and "crash_loop.py:23" in report["headline"]
    assert all(report["isolation"].values())


BUCKET_CONFIG = """\
defaults:
  - data: digits
  - _self_
model:
  _target_: bucket.BucketMLP
  raise_at: 8
optim:
  _target_: torch.optim.AdamW
  _partial_: true
  lr: 1e-3
train:
  steps: 20
  batch_size: 32
  val_every: 0
snapshot:
  every: 5
  layer_stats_every: 5
"""

CHECKED_CONFIG = BUCKET_CONFIG.replace("bucket.BucketMLP", "checked.ScaledD").replace("raise_at", "blank_at").replace(
    "optim:", "loss:\n  _target_: checked.BinaryBCE\noptim:")


def _train_crashing(workspace: Workspace, module: str, config: str) -> tuple[str, list[str]]:
    """`replay train --config-dir project` of tests/crash_models/MODULE.py: the run id and the stderr lines."""
    project = workspace.path / module
    project.mkdir()
    shutil.copy(TESTS / "crash_models" / f"{module}.py", project)
    (project / "config.yaml").write_text(config)
    result = workspace.replay("train", "--config-dir", str(project))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    return re.search(r"run ([0-9a-f]{32})", lines[-1]).group(1), lines


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("crash-train"))


def test_replay_train_crash_is_replayed_and_named_by_runs_and_diagnose(trained):
    """replay train: the forward raises IndexError at step 7 (no NaN): the run keeps it, its last line names replay
    nan; replay nan reproduces it exactly; replay runs and replay diagnose say what the crash was."""
    import replaybisect as rb
    from replaybisect.verbs.runs.engine import recent_runs

    run_id, lines = _train_crashing(trained, "bucket", BUCKET_CONFIG)
    assert lines[-1].startswith("replay: error: your code raised IndexError: index 4 is out of bounds for dimension 0 "
                                "with size 4 (bucket.py:17 in forward) at step 7;")
    assert lines[-1].endswith(f"replay nan --run-id {run_id}")
    tags = trained.store().tags(run_id)
    assert (tags["status"], tags["failure"], tags["failing_step"], tags["error_type"]) == ("crashed", "exception", "7", "IndexError")
    assert tags["snapshot_steps"] == "0,5,7"

    report = trained.answer_here("find_nan", run_id)
    assert (report["category"], report["failing_step"], report["snapshot_step"], report["reproduced"]) == ("exception", 7, 5, "exact")
    assert report["state_match"].startswith("bit-identical")  # the forward's buffer update (calls) was undone first
    assert report["exception"]["as_recorded"] and report["exception"]["frame"].endswith(
        "bucket.py:17 in forward: return self.net(x) * self.scale[bucket]")
    assert report["exception"]["op"] == "Tensor.__getitem__" and report["exception"]["module"] == ""
    assert "batch[0] (inputs): float32[32, 64]" in report["exception"]["batch"][0]

    (summary,) = [run for run in recent_runs(trained.store()) if run.run_id == run_id]
    assert summary.status == "crashed"
    assert summary.crash == "step 7: IndexError: index 4 is out of bounds for dimension 0 with size 4 (bucket.py:17)"
    diagnosis = rb.diagnose(run_id=run_id, tracking_uri=trained.tracking_uri, publish=False)
    assert diagnosis.verdict.startswith("exception")
    (finding,) = [f for f in diagnosis.findings if f.pattern == "exception"]
    assert finding.summary.startswith("step 7 raised IndexError: index 4 is out of bounds") and "bucket.py" in finding.summary
    assert finding.next == f"replay nan --run-id {run_id}"


def test_a_nan_before_the_exception_is_traced_to_its_op(trained):
    """0/0 on a blank image in the forward, which binary_cross_entropy then refuses (RuntimeError): no non-finite loss
    is ever logged; replay nan names the exception and, before it, the division that made the NaN."""
    run_id, lines = _train_crashing(trained, "checked", CHECKED_CONFIG)
    assert "raised RuntimeError: all elements of input should be between 0 and 1" in lines[-1]
    report = trained.answer_here("find_nan", run_id)
    assert (report["category"], report["failing_step"], report["reproduced"]) == ("exception", 7, "exact")
    crash = report["exception"]
    assert crash["op"] == "torch.nn.functional.binary_cross_entropy" and crash["module"] == "loss"
    assert crash["nonfinite_before"]["op"] == "Tensor.div" and crash["nonfinite_before"]["module"] == ""
    assert report["op"] == "Tensor.div" and "checked.py:16 in forward" in report["source"]
    assert "made a non-finite value" in report["headline"]
