"""What survives SIGTERM and SIGKILL during `replay train` (and what a stop says).

SIGTERM (SLURM, Kubernetes, `kill`) is handled like Ctrl-C: metrics flushed, the snapshot in flight finished,
the run KILLED with status `killed`, no temp file left, one line, exit 143. SIGKILL cannot be handled: the
metrics are in the store up to the last few seconds (flushed by time, not only by step count), and the next
start removes the temp files the dead writer left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, REPLAY, Workspace, outcome_lines, train_in_process, wait_until

SLOW_RUN = ("train.steps=1000000", "train.batch_size=32", "train.val_every=0", "model.hidden=32", "snapshot.layer_stats_every=0")
NO_COUNT_FLUSH = "snapshot.metrics_flush_every=1000000"  # only the time rule (or the stop) can flush metrics


def _start(workspace: Workspace, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [REPLAY, "train", *SLOW_RUN, *overrides], cwd=workspace.path, env=workspace.env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 90):
    def met():
        value = condition()
        if not value and process.poll() is not None:
            pytest.fail(f"replay train ended (exit {process.returncode}) before {what}:\n{process.stderr.read()}")
        return value

    value = wait_until(met, timeout=timeout, interval=0.1)
    if not value:
        process.kill()
        pytest.fail(f"no {what} within {timeout} s")
    return value


def _only_run(store):
    (run,) = store.search_runs("")
    return run


def _snapshot_steps_tag(store) -> list[int]:
    runs = store.search_runs("")
    tag = runs[0].data.tags.get("replaybisect.snapshot_steps", "") if runs else ""
    return [int(step) for step in tag.split(",") if step]


def _temp_files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob(".*.tmp-*")]


def test_sigterm_flushes_metrics_finishes_the_snapshot_and_marks_the_run_killed(workspace):
    from replaybisect.core import snapshot as fmt

    store = workspace.store()
    # a snapshot every step: the writer is always busy, so the signal lands with a write in flight
    process = _start(workspace, "snapshot.every=1", NO_COUNT_FLUSH, "snapshot.metrics_flush_seconds=0")
    seen = _wait_for(lambda: len(_snapshot_steps_tag(store)) >= 3 and _snapshot_steps_tag(store), process, "three snapshots")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 143, stderr
    lines = outcome_lines(stderr)
    assert len(lines) == 1 and "terminated" in lines[0] and "Traceback" not in stderr, stderr
    run = _only_run(store)
    assert run.info.status == "KILLED" and run.data.tags["replaybisect.status"] == "killed"
    # every loss up to the kill: neither the step count nor the clock flushed them, the stop did
    losses = store.metric_history(run.info.run_id, "loss")
    assert [step for step, _ in losses] == list(range(len(losses))) and len(losses) > max(seen)
    # the snapshot in flight was finished: every folder has its manifest and verifies, none is left half-written
    root = store.local_artifact_dir(run.info.run_id) / fmt.SNAPSHOTS
    folders = sorted(root.iterdir())
    assert {fmt.step_of(folder.name) for folder in folders} == set(_snapshot_steps_tag(store))
    for folder in folders:
        fmt.verify(folder)
    assert _temp_files(workspace.path) == []


@pytest.fixture(scope="module")
def sigkilled(tmp_path_factory):
    """A run killed with SIGKILL after a few seconds: (workspace, store, run, time of the kill)."""
    workspace = Workspace(tmp_path_factory.mktemp("sigkill"))
    store = workspace.store()
    process = _start(workspace, "snapshot.every=5", NO_COUNT_FLUSH, "snapshot.metrics_flush_seconds=1")

    def losses():
        runs = store.search_runs("")
        return runs and store.metric_history(runs[0].info.run_id, "loss")

    _wait_for(losses, process, "a loss in the store (flushed by time)")
    time.sleep(2.5)  # train on: the last flush before the kill must be recent, not the first one
    killed_at = time.time()
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    return workspace, store, _only_run(store), killed_at


def test_sigkill_leaves_the_loss_curve_up_to_the_last_seconds(sigkilled):
    _, store, run, killed_at = sigkilled
    history = store.client.get_metric_history(run.info.run_id, "loss")
    steps = sorted(metric.step for metric in history)
    assert steps == list(range(len(steps))) and len(steps) > 10
    newest = max(metric.timestamp for metric in history) / 1000
    # flushed every second: the newest point is at most a flush period (plus a loaded CI's slack) old
    assert killed_at - newest < 3.0, f"newest loss logged {killed_at - newest:.1f} s before the kill"
    assert run.info.status == "RUNNING"  # SIGKILL cannot be handled: nobody marked it


def test_next_start_removes_only_dead_writers_temp_files(sigkilled):
    from replaybisect.core import snapshot as fmt

    workspace, store, run, _ = sigkilled
    root = store.local_artifact_dir(run.info.run_id) / fmt.SNAPSHOTS
    folder = sorted(root.iterdir())[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    planted = {
        "dead writer here": folder / f".tensors.safetensors.tmp-{fmt.WRITER}-{dead}",
        "dead writer, old name": folder / f".state.json.tmp-{dead}",  # the name before the writer was recorded: age decides
        "live writer here": folder / f".state.json.tmp-{fmt.WRITER}-{os.getpid()}",
        "other host, fresh": folder / f".batches.safetensors.tmp-otherhost_1-{dead}",
        "other host, old": folder / f".MANIFEST.json.tmp-otherhost_1-{dead}",
    }
    for path in planted.values():
        path.write_bytes(b"partial")
    hours_ago = time.time() - 2 * 3600
    os.utime(planted["other host, old"], (hours_ago, hours_ago))

    train_in_process(store, "train.steps=2", "snapshot.every=0", "train.val_every=0", "model.hidden=16")

    left = {name for name, path in planted.items() if path.exists()}
    assert left == {"live writer here", "other host, fresh", "dead writer, old name"}
    # whatever the SIGKILLed writer itself left behind is gone too
    assert [path for path in _temp_files(root) if path not in planted.values()] == []


def test_sigterm_stops_other_verbs_with_one_line_and_exit_143(workspace):
    process = subprocess.Popen(
        [REPLAY, "check", "--overfit-steps", "100000", "--only", "overfit", "train.val_every=0"],
        cwd=workspace.path, env=workspace.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # stop it once it is working (torch loaded), not while Python is still starting
    maps = Path(f"/proc/{process.pid}/maps")
    _wait_for(lambda: "libtorch" in maps.read_text(), process, "torch loaded")
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    lines = outcome_lines(stderr)
    assert len(lines) == 1 and "terminated" in lines[0], stderr


def test_a_stop_without_the_recorder_does_not_claim_a_snapshot(workspace):
    result = workspace.replay("train", "--config-dir", str(EXAMPLES / "nan_loss"), "snapshot.enabled=false")
    assert result.returncode == 3, result.stderr
    lines = outcome_lines(result.stderr)
    assert len(lines) == 1 and "non-finite" in lines[0], result.stderr
    assert "saved)" not in lines[0] and "snapshot.enabled=false" in lines[0]
    assert "state before it is saved" not in result.stdout and "replay nan --run-id" not in result.stdout


def test_ctrl_c_with_dataloader_workers_stops_in_one_line_and_leaves_no_worker(workspace):
    """Ctrl-C reaches the whole process group, workers included: they leave the stop to the main process, which
    ends the run KILLED with one line (no worker traceback), and no worker outlives it."""
    store = workspace.store()
    name = f"workers-{os.getpid()}-{time.time_ns()}"  # in every worker's command line too (they are forks)
    process = subprocess.Popen([REPLAY, "train", "--run-name", name, *SLOW_RUN, "train.num_workers=2", "snapshot.every=5"],
                               cwd=workspace.path, env=workspace.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    _wait_for(lambda: len(_snapshot_steps_tag(store)) >= 2, process, "two snapshots")
    os.killpg(process.pid, signal.SIGINT)  # as a terminal sends it: to the whole group
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 130, stderr
    lines = outcome_lines(stderr)
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in stderr, stderr
    run = _only_run(store)
    assert run.info.run_name == name and run.info.status == "KILLED"

    def survivors():
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and name in _cmdline(pid)]

    # the workers end with the run: gone within 0.5 s of it (no longer, or an orphan's own watchdog would end it)
    wait_until(lambda: not survivors(), timeout=0.5)
    left = survivors()
    assert left == [], left


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---- a SIGTERM at any moment ends the run -------------------------------------------------------------------------
def _run_rows(store_path: Path) -> int:
    """Runs in the store, read with sqlite3 itself (fast: the moment the row appears is what counts)."""
    import sqlite3

    if not store_path.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(store_path, timeout=0.05)) as db:
            return db.execute("select count(*) from runs").fetchone()[0]
    except sqlite3.Error:  # being created, or locked by the trainer for a moment
        return 0


def _assert_killed_in_one_line(process: subprocess.Popen, store, stderr: str) -> None:
    assert process.returncode == 143, stderr
    assert outcome_lines(stderr) == ["replay: terminated (SIGTERM)"], stderr
    run = _only_run(store)
    assert run.info.status == "KILLED" and run.data.tags["replaybisect.status"] == "killed", run.info.status


MOMENTS = {  # after the run row appears: at once (its config being written), the first steps, the first metrics
    "the run row": lambda store: True,
    "0.5 s later": lambda store: time.sleep(0.5) or True,
    "its first loss": lambda store: store.metric_history(_only_run(store).info.run_id, "loss"),
}


def test_sigterm_at_any_moment_of_replay_train_ends_it_killed(tmp_path):
    """The trainers run side by side (each mostly imports); each gets its SIGTERM at its moment."""
    started = {}
    for moment in MOMENTS:
        workspace = Workspace(tmp_path / moment.replace(" ", "_"))
        workspace.path.mkdir()
        started[moment] = workspace, _start(workspace, "snapshot.every=20")
    for moment, (workspace, process) in started.items():
        _wait_for(lambda: _run_rows(workspace.path / "mlflow.db"), process, "the run row", timeout=180)
        store = workspace.store()
        _wait_for(lambda: MOMENTS[moment](store), process, moment, timeout=120)
        process.send_signal(signal.SIGTERM)
    for moment, (workspace, process) in started.items():
        _, stderr = process.communicate(timeout=90)
        _assert_killed_in_one_line(process, workspace.store(), stderr)


FINALIZING_MODEL = '''
import contextlib
import os
import signal

from torch import nn


class SignalledInItsFinalizer:
    def __del__(self):  # the SIGTERM's handler runs in here, where Python ignores what it raises
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(100))


class FinalizingMLP(nn.Module):
    def __init__(self, term_at: int = 30):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        self.term_at, self.calls = term_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.term_at:
            SignalledInItsFinalizer()  # made and dropped at once: its __del__ runs now
        return self.net(x)
'''


def test_sigterm_that_lands_in_a_finalizer_still_ends_the_run(workspace):
    """A signal's handler runs wherever the main thread is running Python code, also in a finalizer (SQLAlchemy's
    weakref callbacks, run in the middle of every store write and of any garbage collection), where Python prints
    what it raised and goes on: the run trained on and stayed RUNNING. The stop is taken up at the next step."""
    conf = workspace.path / "conf"
    conf.mkdir()
    (conf / "finalizing.py").write_text(FINALIZING_MODEL)
    (conf / "config.yaml").write_text(
        "defaults:\n  - data: digits\n  - _self_\nmodel:\n  _target_: finalizing.FinalizingMLP\n"
        "optim:\n  _target_: torch.optim.AdamW\n  _partial_: true\n  lr: 1e-3\n"
        "train:\n  steps: 3000\n  batch_size: 32\n  val_every: 0\nsnapshot:\n  every: 20\n"
    )
    result = workspace.replay("train", "--config-dir", str(conf), timeout=180)
    assert result.returncode == 143, result.stderr
    assert outcome_lines(result.stderr) == ["replay: terminated (SIGTERM)"], result.stderr
    run = _only_run(workspace.store())
    assert run.info.status == "KILLED" and run.data.tags["replaybisect.status"] == "killed"
    # stopped at the step after the one whose forward took the signal: not trained on
    assert len(workspace.store().metric_history(run.info.run_id, "loss")) <= 31
