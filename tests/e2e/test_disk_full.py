"""A full disk while `replay train` writes snapshots: one line, the run FAILED, nothing partial left, earlier
snapshots still load.

The SQLite database stays on the normal disk; its artifact folder (`mlruns/` beside it, where snapshots go) is a
real small file system: a 2 MiB tmpfs, else a loop-mounted ext4 image; skipped only when neither can be mounted.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import Workspace, outcome_lines


def _mount_small_fs(folder: Path, scratch: Path, size: str = "2M") -> str | None:
    """Mount a small file system (`size`, as tmpfs and truncate spell it) on `folder`; None if it worked, else why not."""
    folder.mkdir()
    tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True)
    if tmpfs.returncode == 0:
        return None
    image = scratch / "small.img"
    steps = [["truncate", "-s", size, str(image)], ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", str(image)], ["mount", "-o", "loop", str(image), str(folder)]]
    for command in steps:
        if shutil.which(command[0]) is None:
            return f"tmpfs: {tmpfs.stderr.strip()}; no {command[0]} for a loop-mounted image"
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"tmpfs: {tmpfs.stderr.strip()}; {command[0]}: {done.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory):
    """`replay train` whose snapshots fill a 2 MiB file system: (workspace, store, CliResult)."""
    workspace = Workspace(tmp_path_factory.mktemp("diskfull"))
    artifacts = workspace.path / "mlruns"  # where a SQLite store keeps its artifacts (beside the database)
    why_not = _mount_small_fs(artifacts, workspace.path)
    if why_not:
        pytest.skip(f"no small file system can be mounted here (needs root): {why_not}")
    try:
        # each snapshot ~0.4 MiB (an MLP of width 128 with AdamW moments, 4 batches): the 5th or 6th does not fit
        result = workspace.replay(
            "train", "train.steps=100000", "snapshot.every=4", "snapshot.layer_stats_every=0", "train.val_every=0",
            "snapshot.metrics_flush_every=1000000", timeout=300,
        )
        yield workspace, workspace.store(), result, artifacts
    finally:
        subprocess.run(["umount", "-l", str(artifacts)], capture_output=True)


def test_a_full_disk_is_one_line_naming_what_and_where(full_disk_run):
    _, _, result, artifacts = full_disk_run
    assert result.returncode == 1, result.stderr
    lines = outcome_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "no space left on device writing snapshot step-" in lines[0] and str(artifacts) in lines[0]
    assert "snapshot.every" in lines[0]  # what to do


def test_the_run_is_marked_failed_with_its_losses(full_disk_run):
    _, store, _, _ = full_disk_run
    (run,) = store.search_runs("")
    assert run.info.status == "FAILED"
    assert run.data.tags["replaybisect.status"] == "crashed" and run.data.tags["replaybisect.failure"] == "disk-full"
    # training stopped at the failed write, not 100000 steps later, and its losses were flushed on the way out
    losses = store.metric_history(run.info.run_id, "loss")
    assert [step for step, _ in losses] == list(range(len(losses))) and 4 < len(losses) < 200


def test_nothing_partial_is_left_and_earlier_snapshots_still_load(full_disk_run):
    from replaybisect.core import snapshot as fmt
    from replaybisect.replay.restore import newest_good_snapshot

    _, store, result, artifacts = full_disk_run
    (run,) = store.search_runs("")
    assert list(artifacts.rglob(".*.tmp-*")) == []
    root = store.local_artifact_dir(run.info.run_id) / fmt.SNAPSHOTS
    folders = sorted(root.iterdir())
    assert len(folders) >= 2, "the disk filled before two snapshots fit: nothing earlier to keep"
    for folder in folders:  # the snapshot that did not fit is gone, not left without its manifest
        assert (folder / fmt.MANIFEST).is_file(), folder.name
        fmt.verify(folder)
    failed_step = int(result.stderr.split("snapshot step-")[1][:6])
    assert all(fmt.step_of(folder.name) < failed_step for folder in folders)
    assert newest_good_snapshot(store, run.info.run_id, None, []).step == fmt.step_of(folders[-1].name)


def test_a_full_tracking_store_is_one_line_too(tmp_path):
    """The whole store (database and artifacts) on a small file system that the metrics fill."""
    workspace = Workspace(tmp_path / "store")
    why_not = _mount_small_fs(workspace.path, tmp_path, size="1200K")  # a new store's database takes ~0.9 MiB
    if why_not:
        pytest.skip(f"no small file system can be mounted here (needs root): {why_not}")
    try:
        result = workspace.replay(
            "train", "train.steps=1000000", "snapshot.every=0", "snapshot.layer_stats_every=0", "train.val_every=0",
            "model.hidden=16", "snapshot.metrics_flush_every=1000000", "snapshot.metrics_flush_seconds=1", timeout=300,
        )
        assert result.returncode == 1, result.stderr
        lines = outcome_lines(result.stderr)
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert "no space left on device writing metrics to the tracking store" in lines[0] and "mlflow.db" in lines[0]
        (run,) = workspace.store().search_runs("")
        assert run.info.status == "FAILED" and run.data.tags["replaybisect.failure"] == "disk-full"
    finally:
        subprocess.run(["umount", "-l", str(workspace.path)], capture_output=True)


def test_a_full_tracking_store_met_by_the_metrics_logger_process_is_the_same_line(tmp_path, monkeypatch):
    """A long run's points are logged by a process of its own (record/metrics_process.py): its full disk is the
    recorder's one line, and the run is marked failed as above."""
    import replaybisect as rb
    from replaybisect.errors import DiskFull
    from replaybisect.record import metrics_process

    monkeypatch.setattr(metrics_process, "HANDOFF_SECONDS", 0.0)  # the logger process takes over after the first flush
    workspace = Workspace(tmp_path / "store")
    why_not = _mount_small_fs(workspace.path, tmp_path, size="1200K")
    if why_not:
        pytest.skip(f"no small file system can be mounted here (needs root): {why_not}")
    try:
        with pytest.raises(DiskFull) as raised:
            rb.train(overrides=["train.steps=1000000", "snapshot.every=0", "snapshot.layer_stats_every=0", "train.val_every=0",
                                "model.hidden=16", "snapshot.metrics_flush_every=20"],
                     tracking_uri=workspace.tracking_uri)
        assert str(raised.value).startswith("no space left on device writing metrics to the tracking store ")
        assert "mlflow.db" in str(raised.value) and "\n" not in str(raised.value)
        (run,) = workspace.store().search_runs("")
        assert run.info.status == "FAILED" and run.data.tags["replaybisect.failure"] == "disk-full"
    finally:
        subprocess.run(["umount", "-l", str(workspace.path)], capture_output=True)
