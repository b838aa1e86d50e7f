"""Snapshot safety: SIGKILL while writing, corrupt files, pickles; and the `mlflow server` path."""

from __future__ import annotations

import hashlib
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

from conftest import FAST, REPLAY, Workspace
from replaybisect.errors import SnapshotError
from replaybisect.core import snapshot as fmt
from replaybisect.restore import logged_losses, newest_good_snapshot, replay, restore

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
    manifest["files"][name] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
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
