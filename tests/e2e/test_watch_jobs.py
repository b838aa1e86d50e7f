"""`replay watch --executor submitit`: each triage step a job, through submitit's local executor (the jobs are real
subprocesses, as on SLURM they are real allocations). One test walks the three cases in turn, sharing its runs. A SQLite store holds the failed runs (the team server's path is
tests/e2e/test_watch.py's); the watchers are the installed command."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers import EXAMPLES, REPLAY, Workspace, in_folder
from watch_servers import ALLOW_ROOT

pytestmark = pytest.mark.slow


def _failed_run(workspace: Workspace, experiment: str = "Model training") -> str:
    """examples/nan_forward for 30 steps (NaN at step 20), trained in this process into `experiment`."""
    from unittest import mock

    import replaybisect as rb

    with in_folder(workspace.path), mock.patch.dict(os.environ, {"MLFLOW_EXPERIMENT_NAME": experiment}):
        result = rb.train(["train.steps=30"], config_dir=EXAMPLES / "nan_forward", tracking_uri=workspace.tracking_uri)
    assert result.status == "nonfinite"
    return result.run_id


def _watch(workspace: Workspace, *extra: str) -> list[str]:
    return [REPLAY, "watch", *ALLOW_ROOT, "--once", "--json", "--horizon", "5", "--settle", "0.5", "--executor", "submitit",
            "--cluster", "local", "--executor-folder", str(workspace.path / "jobs"), *extra]


def _events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip().startswith("{")]


def _messages(output: str, run_id: str) -> list[str]:
    return [event.get("message", "") for event in _events(output) if event.get("run_id") == run_id]


def _job_of(workspace: Workspace, run_id: str, timeout: float = 120) -> str:
    """The id of the nan step's job, once the watcher wrote it on the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job_id = workspace.store().tags(run_id).get("triage.job.nan", "")
        if job_id:
            return job_id
        time.sleep(0.2)
    raise AssertionError("the watcher wrote no job on the run")


def _children(pid: int, timeout: float = 30) -> list[int]:
    """The processes whose parent is `pid` (read from /proc), once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                        if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                            found.append(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"job {pid} started no task")


@pytest.fixture
def jobs_workspace(tmp_path) -> Workspace:
    workspace = Workspace(tmp_path)
    (tmp_path / "jobs").mkdir(mode=0o700)
    return workspace


def test_triage_through_jobs_a_killed_job_fails_once_and_a_killed_watchers_job_is_followed(jobs_workspace):
    workspace = jobs_workspace
    killed_run, followed_run = _failed_run(workspace, "killed job"), _failed_run(workspace, "killed watcher")
    env = workspace.env()

    # 1. a run's nan job killed while it runs: its step fails with the job's reason, once; the triage is not retried
    watcher = subprocess.Popen(_watch(workspace, "--experiment", "killed job"), cwd=workspace.path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = _job_of(workspace, killed_run)
    for task in _children(int(killed)):  # the job's task (its controller's child), as a node failure or an OOM kill ends it
        os.kill(task, signal.SIGKILL)
    stdout, stderr = watcher.communicate(timeout=300)
    assert watcher.returncode == 0, stderr[-3000:]
    tags = workspace.store().tags(killed_run)
    assert tags["triage"] == "failed" and tags["triage.reason"].startswith(f"nan: submitit job {killed} failed"), tags
    assert [event["event"] for event in _events(stdout) if event.get("run_id") == killed_run].count("failed") == 1

    # 2. a watcher killed while its run's nan job runs; a successor, once the lease ran out, follows that job to its
    # end (nothing submitted again) and finishes the triage
    watcher = subprocess.Popen(_watch(workspace, "--experiment", "killed watcher", "--lease", "4"), cwd=workspace.path,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    followed = _job_of(workspace, followed_run)
    watcher.send_signal(signal.SIGKILL)
    watcher.communicate(timeout=60)
    time.sleep(4.5)
    successor = subprocess.run(_watch(workspace, "--experiment", "killed watcher", "--lease", "4"), cwd=workspace.path,
                               env=env, capture_output=True, text=True, timeout=600)
    assert successor.returncode == 0, successor.stderr[-3000:]
    messages = _messages(successor.stdout, followed_run)
    assert any(message.startswith(f"nan: following job {followed}") for message in messages), messages
    assert not any(message.startswith("nan: job") and "submitted" in message for message in messages)
    assert any(re.match(r"^ablate: job \d+ submitted \(local\)$", message) for message in messages), messages
    tags = workspace.store().tags(followed_run)
    assert tags["triage"] == "done" and tags["triage.nan"].startswith("forward at step 20: torch.exp in gate"), tags
    assert tags["triage.job.nan"] == followed and tags["triage.job.ablate"].isdigit()  # where each step ran
    assert list((workspace.path / "jobs" / "running").iterdir()) == []  # consumed: nothing left to follow
    assert workspace.store().tags(killed_run)["triage"] == "failed"  # not triaged again
