"""Snapshot safety: SIGKILL while writing, corrupt files, pickles; and the `mlflow server` path."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import EXAMPLES, FAST, REPLAY, Workspace
from replaybisect.errors import SnapshotError
from replaybisect.core import snapshot as fmt
from replaybisect.replay.restore import logged_losses, newest_good_snapshot, replay, restore

MAX_KILL_TRIALS = 30  # kills until one lands mid-write (in practice one of the first few does)
MIN_KILL_TRIALS = 3  # each trial is a `replay train` start-up (seconds of CPU); 3 random moments and one mid-write


def _wait_for_first_snapshot(store, known_runs: set[str], process) -> str:
    deadline = time.time() + 120
    while time.time() < deadline:
        assert process.poll() is None, "training exited early"
        for run in store.search_runs("", max_results=3):
            if run.info.run_id not in known_runs and run.data.tags.get("replaybisect.snapshot_steps"):
                return run.info.run_id
        time.sleep(0.05)
    raise AssertionError("no snapshot written within 120 s")


def _snapshot_root(store, run_id: str) -> Path:
    return store.local_artifact_dir(run_id) / "snapshots"


def test_sigkill_during_snapshot_writes_never_yields_a_partial_snapshot(workspace):
    """At least 3 trials: kill -9 at random moments of a run snapshotting every 2 steps, until at least one
    kill has landed mid-write (a snapshot folder without its manifest): otherwise the test proves nothing."""
    rng = random.Random(1234)
    store = workspace.store()
    incomplete_seen = 0
    known_runs: set[str] = set()
    for trial in range(MAX_KILL_TRIALS):
        if trial >= MIN_KILL_TRIALS and incomplete_seen:
            break
        process = subprocess.Popen(
            [REPLAY, "train", "train.steps=100000", "snapshot.every=2", "model.hidden=512", "model.depth=3", "train.val_every=0"],
            cwd=workspace.path, env=workspace.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        run_id = _wait_for_first_snapshot(store, known_runs, process)
        known_runs.add(run_id)
        time.sleep(rng.uniform(0.0, 1.0))
        process.send_signal(signal.SIGKILL)
        process.wait()
        root = _snapshot_root(store, run_id)
        folders = sorted(p for p in root.iterdir() if fmt.step_of(p.name) is not None)
        assert folders, "the run was killed before its first snapshot"
        complete = []
        for folder in folders:
            if (folder / fmt.MANIFEST).is_file():
                fmt.verify(folder)  # every snapshot with a manifest verifies
                complete.append(fmt.step_of(folder.name))
            else:
                incomplete_seen += 1
                with pytest.raises(SnapshotError, match="incomplete"):
                    fmt.load(folder)  # a partial snapshot is never loaded
        warnings: list[str] = []
        chosen = newest_good_snapshot(store, run_id, None, warnings)
        assert chosen.step == max(complete)

        # a flipped byte is reported naming the file, and the previous good snapshot is used
        if len(complete) >= 2:
            target = root / fmt.folder_name(max(complete)) / fmt.TENSORS
            payload = bytearray(target.read_bytes())
            payload[len(payload) // 2] ^= 0xFF
            target.write_bytes(bytes(payload))
            warnings = []
            fallback = newest_good_snapshot(store, run_id, None, warnings)
            assert fallback.step == sorted(complete)[-2]
            flagged = [w for w in warnings if fmt.folder_name(max(complete)) in w]
            assert len(flagged) == 1 and fmt.TENSORS in flagged[0] and "checksum" in flagged[0]
    assert incomplete_seen, f"no kill landed during a snapshot write in {MAX_KILL_TRIALS} trials"


class _Payload:
    """Unpickling this would create a file: the proof that a payload ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    workspace = Workspace(tmp_path_factory.mktemp("small"))
    return workspace, workspace.train_here("train.steps=12", "snapshot.every=5", "model.hidden=16")


def test_a_pickle_in_a_snapshot_folder_is_refused_never_runs_and_the_previous_snapshot_is_used(small_run):
    workspace, result = small_run
    store = workspace.store()
    folder = _snapshot_root(store, result["run_id"]) / "step-000010"
    marker = workspace.path / "PAYLOAD_RAN"
    (folder / "optimizer.pt").write_bytes(pickle.dumps(_Payload(marker)))
    try:
        with pytest.raises(SnapshotError, match="optimizer.pt.*never unpickles"):
            fmt.load(folder)
        warnings: list[str] = []
        assert newest_good_snapshot(store, result["run_id"], None, warnings).step == 5  # reported, then the previous one
        assert len(warnings) == 1 and "step-000010" in warnings[0] and "optimizer.pt" in warnings[0]
        assert not marker.exists()
    finally:
        (folder / "optimizer.pt").unlink()


def _rewrite_with_manifest(folder: Path, name: str, payload: bytes) -> None:
    """Replace one file and re-sign the manifest, as an attacker with write access could."""
    (folder / name).write_bytes(payload)
    manifest = json.loads((folder / fmt.MANIFEST).read_text())
    manifest["files"][name] = fmt.file_entry(payload)
    (folder / fmt.MANIFEST).write_text(json.dumps(manifest))


def test_a_pickle_posing_as_safetensors_is_refused(small_run, tmp_path):
    workspace, result = small_run
    folder = tmp_path / "step-000005"
    shutil.copytree(_snapshot_root(workspace.store(), result["run_id"]) / "step-000005", folder)
    marker = workspace.path / "PAYLOAD_RAN_2"
    for protocol in (2, 4, 5):  # even with a manifest that "verifies"
        _rewrite_with_manifest(folder, fmt.TENSORS, pickle.dumps(_Payload(marker), protocol=protocol))
        with pytest.raises(SnapshotError, match="tensors.safetensors is not a valid safetensors file.*never unpickles"):
            fmt.load(folder)
    assert not marker.exists()


def test_a_valid_safetensors_file_whose_header_length_looks_like_a_pickle_opcode_loads(small_run, tmp_path):
    """Header lengths 640, 896, 1152, 1408 begin with the bytes 80 02..80 05, the opening of pickle protocols 2..5."""
    workspace, result = small_run
    folder = tmp_path / "step-000005"
    shutil.copytree(_snapshot_root(workspace.store(), result["run_id"]) / "step-000005", folder)
    tensors = dict(sorted(fmt.load(folder).tensors.items())[:2])  # a header short enough to pad up to 640 bytes
    for header_size in (640, 896, 1152, 1408):
        tensors_file = tmp_path / "tensors.tmp"
        for pad in range(header_size):  # metadata of the right length makes a header of exactly `header_size` bytes
            fmt.write_tensors_atomic(tensors_file, tensors, {"pad": "x" * pad})
            payload = tensors_file.read_bytes()
            if int.from_bytes(payload[:8], "little") >= header_size:
                break
        assert int.from_bytes(payload[:8], "little") == header_size and payload[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
        _rewrite_with_manifest(folder, fmt.TENSORS, payload)
        loaded = fmt.load(folder)
        assert sorted(loaded.tensors) == sorted(tensors)
        assert all(torch.equal(loaded.tensors[name], tensors[name]) for name in tensors)


@pytest.fixture
def mlflow_server(tmp_path):
    from watch_servers import MlflowServer

    server = MlflowServer(tmp_path, f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "server-artifacts"), None)
    try:
        server.start()
        yield server.uri
    finally:
        server.stop()


def test_train_against_a_real_mlflow_server_and_replay_from_it(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    workspace = Workspace(tmp_path / "user")
    workspace.path.mkdir()
    result = workspace.train("--tracking-uri", mlflow_server, *FAST)
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(result["run_id"])
    assert run.data.tags["replaybisect.status"] == "ok"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 40
    listed = sorted(f.path for f in client.list_artifacts(run.info.run_id, "snapshots/step-000020"))
    assert listed == [f"snapshots/step-000020/{name}" for name in sorted([fmt.BATCHES, fmt.MANIFEST, fmt.STATE, fmt.TENSORS])]

    from replaybisect.store import open_store

    os.environ["REPLAYBISECT_CACHE"] = str(tmp_path / "cache")
    store = open_store(mlflow_server)
    restored = restore(store, result["run_id"], 20)
    replayed = replay(restored, 40, logged=logged_losses(store, result["run_id"]))
    assert replayed.reproduced == "exact"
    assert not (workspace.path / "mlflow.db").exists()  # nothing went to the local default


# ---- a damaged snapshot is said: which, why, and the one used instead ------------------------------------------
@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """examples/nan_forward recorded once (snapshots at 0, 5, ..., 20; non-finite at step 20): (workspace, run id)."""
    from tests.helpers import train_example

    workspace = Workspace(tmp_path_factory.mktemp("damaged"))
    result = train_example(workspace.store(), "nan_forward")
    assert result.first_nonfinite_step == 20 and 15 in result.snapshot_steps
    return workspace, result.run_id


@pytest.fixture
def damage(failed_run):
    """damage(step, how): the snapshot of `step` damaged as a disk or a hand would; put back after the test."""
    workspace, run_id = failed_run
    root = _snapshot_root(workspace.store(), run_id)
    kept = []

    def damage_it(step: int, how: str) -> None:
        folder = root / fmt.folder_name(step)
        kept.append((folder, {path.name: path.read_bytes() for path in folder.iterdir()}))
        if how == "truncated":
            (folder / fmt.TENSORS).write_bytes((folder / fmt.TENSORS).read_bytes()[:1000])
        elif how == "flipped":
            data = bytearray((folder / fmt.TENSORS).read_bytes())
            data[-10] ^= 0xFF
            (folder / fmt.TENSORS).write_bytes(bytes(data))
        elif how == "missing":
            (folder / fmt.STATE).unlink()
        elif how == "garbage-manifest":
            (folder / fmt.MANIFEST).write_bytes(random.Random(7).randbytes(300))

    yield damage_it
    for folder, files in kept:
        shutil.rmtree(folder)
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)


DAMAGES = {"truncated": "size 1000, manifest says", "flipped": "checksum mismatch", "missing": "state.json is missing",
           "garbage-manifest": "MANIFEST.json is not valid JSON"}


@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_replay_nan_says_which_snapshot_was_damaged_why_and_which_it_used_instead(failed_run, damage, how):
    """Was: "...; using an earlier snapshot", not saying which."""
    workspace, run_id = failed_run
    damage(15, how)
    report = workspace.answer_here("find_nan", run_id)
    assert report["snapshot_step"] == 10 and report["category"] == "forward"
    (said,) = [warning for warning in report["warnings"] if "step-000015" in warning]
    assert DAMAGES[how] in said and "using the earlier snapshot step-000010 instead" in said, said


def test_a_damaged_snapshot_whose_batches_a_replay_needs_is_said(failed_run, damage):
    """The failing step's snapshot holds its batch: damaged, the arms take that batch from the data source (was:
    skipped without a word; replay nan already says it cannot compare with it, and says so once)."""
    workspace, run_id = failed_run
    damage(20, "flipped")
    result = workspace.answer_here("ablate", run_id, arms="lr", horizon=3)
    assert result["snapshot_step"] == 15, result
    (said,) = [warning for warning in result["warnings"] if "step-000020" in warning]
    assert "checksum mismatch" in said and "its stored batches are not used" in said and "data source" in said, said
    nan = workspace.answer_here("find_nan", run_id)
    assert [warning for warning in nan["warnings"] if "step-000020" in warning] == [
        "snapshot step-000020: tensors.safetensors fails verification (checksum mismatch: the file is corrupt); "
        "the replayed state cannot be compared with it"]


def test_replay_ablate_prints_the_damaged_snapshot_and_the_one_it_used(failed_run, damage):
    workspace, run_id = failed_run
    damage(15, "garbage-manifest")
    result = workspace.replay("ablate", "lr", "--run-id", run_id, "--horizon", "3", "--code-dir", str(EXAMPLES / "nan_forward"))
    assert result.returncode == 0, result.stderr
    assert "arms replayed from step 10" in result.stdout
    (line,) = [line for line in result.stdout.splitlines() if "warning" in line and "step-000015" in line]
    assert "MANIFEST.json is not valid JSON" in line and "using the earlier snapshot step-000010 instead" in line, line


def test_a_stored_config_of_random_bytes_is_said_to_be_no_config_replaybisect_wrote(failed_run):
    """Was: "has no config.yaml artifact", although it has one."""
    import replaybisect

    workspace, run_id = failed_run
    stored = workspace.store().local_artifact_dir(run_id) / "config.yaml"
    text = stored.read_bytes()
    stored.write_bytes(random.Random(3).randbytes(500))
    try:
        with pytest.raises(replaybisect.ReplayError) as refused:
            workspace.answer_here("find_nan", run_id)
    finally:
        stored.write_bytes(text)
    said = str(refused.value)
    assert "config.yaml" in said and "not a config replaybisect wrote" in said and "no config.yaml artifact" not in said, said
