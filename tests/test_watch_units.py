"""`replay watch` without a server: bad input, the claim format, failure reasons, the notification shape, and the
child limits (memory, time) and signals on a real SQLite store with the installed command."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from conftest import REPLAY, assert_one_line_error, train_example
from replaybisect.verbs.watch.engine import Claim, TriageResult, _conclude, _failure_reason, _fix_override
from replaybisect.verbs.watch.report import notification


@pytest.mark.parametrize("args, fragment", [
    (["--interval", "0"], "--interval"),
    (["--lease", "4", "--settle", "3"], "--settle"),
    (["--workers", "0"], "--workers"),
    (["--memory-mb", "100"], "--memory-mb"),
    (["--notify-url", "ftp://hooks.example/x"], "--notify-url"),
])
def test_bad_options_are_one_line_and_exit_2(workspace, args, fragment):
    assert_one_line_error(workspace.replay("watch", "--once", *args), fragment)
    assert not (workspace.path / "mlflow.db").exists()


def test_no_store_and_an_unreachable_server_are_bad_input(workspace):
    env = workspace.env()
    env.pop("MLFLOW_TRACKING_URI")
    assert_one_line_error(workspace.replay("watch", "--once", env=env), "no tracking store")
    assert not (workspace.path / "mlflow.db").exists()
    assert_one_line_error(workspace.replay("watch", "--once", "--tracking-uri", "http://127.0.0.1:9"), "unreachable")


def test_claim_round_trip_and_expiry():
    claim = Claim("host-12-abc123", time.time() + 60)
    parsed = Claim.parse(claim.render())
    assert parsed.watcher_id == "host-12-abc123" and parsed.live()
    assert not Claim.parse(Claim("w until x", 0.0).render()).live()  # a watcher id may contain the separator
    assert Claim.parse("garbage") is None and Claim.parse(None) is None and Claim.parse("w until soon") is None


def test_failure_reasons_are_one_line():
    assert _failure_reason(-9, "", 8192) == "killed by SIGKILL"
    assert _failure_reason(1, "Traceback...\nMemoryError\n", 2048) == "ran out of memory (limit 2048 MiB, --memory-mb)"
    assert _failure_reason(2, "store: x\nreplay: error: no snapshot before step 3; record with snapshot.every\n", 0) == \
        "exit 2: no snapshot before step 3; record with snapshot.every"
    assert _failure_reason(1, "", 0) == "exit 1: no output"


def test_next_command_from_the_first_fixing_arm():
    ablation = {"arms": [{"name": "precision", "change": "train.precision is already fp32", "verdict": "not-applicable"},
                         {"name": "lr", "change": "optim.lr 0.001 -> 0.0001", "verdict": "fixes"}]}
    assert _fix_override(ablation) == "optim.lr=0.0001"
    lines = {"triage.nan": "forward in gate (torch.exp) at step 20", "triage.nan.category": "forward",
             "triage.nan.next": "replay ablate lr,clip --run-id R", "triage.ablate": "fixed by: lr", "triage.ablate.fix": "optim.lr=0.0001"}
    assert _conclude("nonfinite", "R", lines) == ("forward", "forward in gate (torch.exp) at step 20; ablate: fixed by: lr",
                                                 "replay train optim.lr=0.0001")
    lines["triage.ablate.fix"] = ""
    assert _conclude("nonfinite", "R", lines)[2] == "replay nan --run-id R"  # ablate already ran: not suggested again


def test_notification_is_webhook_shaped():
    result = TriageResult(run_id="abc", run_name="brave-owl", experiment_id="1", failure="nonfinite", state="done",
                          verdict="forward", summary="forward in gate at step 20", next_command="replay nan --run-id abc",
                          run_url="http://mlflow:5000/#/experiments/1/runs/abc")
    message = notification(result)
    assert json.loads(json.dumps(message)) == message
    assert message["text"].splitlines() == ["replay watch: nonfinite run brave-owl (abc): forward in gate at step 20",
                                            "next: `replay nan --run-id abc`", "http://mlflow:5000/#/experiments/1/runs/abc"]
    assert {message[key] for key in ("run_id", "verdict", "next_command", "run_url")} == \
        {"abc", "forward", "replay nan --run-id abc", "http://mlflow:5000/#/experiments/1/runs/abc"}


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_memory_and_time_limits_fail_the_triage_once_with_the_reason(workspace):
    store = workspace.store()
    run_id = train_example(store, "nan_optimizer", "train.steps=5").run_id
    low_memory = workspace.replay("watch", "--once", "--json", "--memory-mb", "1024", "--settle", "0.2")
    assert low_memory.returncode == 0, low_memory.stderr
    tags = store.tags(run_id)
    assert tags["triage"] == "failed" and tags["triage.reason"] == "nan: ran out of memory (limit 1024 MiB, --memory-mb)"

    other = train_example(store, "nan_optimizer", "train.steps=5").run_id
    slow = workspace.replay("watch", "--once", "--json", "--time-limit", "1", "--settle", "0.2")
    assert [e["run_id"] for e in _events(slow.stdout) if e["event"] == "failed"] == [other]  # the first is not retried
    assert store.tags(other)["triage.reason"] == "nan: stopped at the time limit (1 s)"


def test_sigusr1_logs_a_health_line_and_sigterm_stops_an_idle_watcher(workspace):
    workspace.store()  # an empty store: nothing to triage
    watcher = subprocess.Popen([REPLAY, "watch", "--json", "--interval", "60"], cwd=workspace.path, env=workspace.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = json.loads(watcher.stdout.readline())
    assert first["event"] == "start"
    time.sleep(1)
    watcher.send_signal(signal.SIGUSR1)
    health = json.loads(watcher.stdout.readline())
    assert health["event"] == "health" and health["watcher_id"] == first["watcher_id"] and health["polls"] == 1
    watcher.send_signal(signal.SIGTERM)
    stdout, stderr = watcher.communicate(timeout=60)
    assert watcher.returncode == 143, stderr
    assert _events(stdout)[-1]["event"] == "stop"


def _crashed_run(store) -> str:
    """A crashed run's record: metrics only, which is all diagnose reads."""
    run_id = store.create_run("train")
    store.log_metrics(run_id, [("loss", 2.0 - step * 0.01, step) for step in range(30)])
    store.finish_run(run_id, "crashed", "FAILED")
    return run_id


def _watcher_diagnosing(workspace, *args: str) -> subprocess.Popen:
    """`replay watch --json ARGS`, returned once it has started diagnosing a run."""
    watcher = subprocess.Popen([REPLAY, "watch", "--json", "--settle", "0.2", *args], cwd=workspace.path,
                               env=workspace.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in watcher.stdout:
        if json.loads(line)["message"] == "diagnose started":
            break
    return watcher


def test_sigterm_lets_a_running_triage_finish_within_the_grace(workspace):
    store = workspace.store()
    run_id = _crashed_run(store)
    watcher = _watcher_diagnosing(workspace, "--grace", "120")
    watcher.send_signal(signal.SIGTERM)
    stdout, stderr = watcher.communicate(timeout=120)
    assert watcher.returncode == 143, stderr
    assert [e["event"] for e in _events(stdout)][-3:] == ["step", "done", "stop"]
    assert store.tags(run_id)["triage"] == "done"


def test_a_watcher_frozen_past_its_lease_loses_the_run_and_writes_nothing(workspace):
    store = workspace.store()
    run_id = _crashed_run(store)
    frozen = _watcher_diagnosing(workspace, "--lease", "2")
    frozen.send_signal(signal.SIGSTOP)  # a stalled VM or a long GC pause: the lease lapses
    try:
        time.sleep(2.5)
        other = workspace.replay("watch", "--once", "--json", "--settle", "0.2", "--lease", "2")
        assert [e["event"] for e in _events(other.stdout)].count("done") == 1, other.stdout
        summary = store.tags(run_id)["triage.summary"]
    finally:
        frozen.send_signal(signal.SIGCONT)
    time.sleep(3)  # it wakes: its diagnose child's answer or its next lease renewal finds the claim taken
    frozen.send_signal(signal.SIGTERM)
    stdout, _ = frozen.communicate(timeout=60)
    woken = [e["event"] for e in _events(stdout)]
    assert "lost" in woken and "done" not in woken, woken
    assert store.tags(run_id)["triage.summary"] == summary and store.tags(run_id)["triage.attempts"] == "2"
