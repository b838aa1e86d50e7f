"""`replay watch` end to end on real parts: PostgreSQL behind `mlflow server`, artifacts proxied by the server to an
S3-compatible store (moto), runs recorded by the installed `replay train`, watchers run as the installed command.

One server for the module; each test has its own experiment, so tests do not see each other's runs."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, REPLAY, CliResult, in_folder, wait_until
import watch_servers

pytestmark = pytest.mark.slow

TINY = ("train.steps=30",)  # nan_forward fails at step 20, nan_optimizer at step 1
FORWARD_FOUND = "forward at step 20: torch.exp in gate"  # the start of replay nan's headline on nan_forward
JSON_LINE = re.compile(r'^\s*[{\[]\s*$|^\s*"[^"]+": ', re.M)  # a line of indented JSON (triage.md was ~400 of them)
CRASHING_MODEL = '''
import torch


class CrashingMLP(torch.nn.Module):
    """Raises in forward after `crash_after` calls: the run ends FAILED (crashed), not non-finite."""

    def __init__(self, in_features: int = 64, out_features: int = 10, crash_after: int = 24):
        super().__init__()
        self.net = torch.nn.Linear(in_features, out_features)
        self.crash_after = crash_after
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.crash_after:
            raise RuntimeError("simulated crash in forward")
        return self.net(x)
'''
CRASHING_CONFIG = """
defaults:
  - data: digits
  - _self_
model: {_target_: crashing.CrashingMLP, crash_after: 24}
loss: {_target_: torch.nn.CrossEntropyLoss}
optim: {_target_: torch.optim.AdamW, _partial_: true, lr: 1e-3}
train: {steps: 40, batch_size: 32, val_every: 0}
snapshot: {every: 5, layer_stats_every: 5}
"""


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    folder = tmp_path_factory.mktemp("team-server")
    try:
        with watch_servers.team_server(folder) as server:
            yield server
    except watch_servers.Unavailable as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The user's folder: a crashing model's config beside the examples (both trusted by conftest)."""
    folder = tmp_path_factory.mktemp("watch-project")
    (folder / "crash").mkdir()
    (folder / "crash" / "crashing.py").write_text(CRASHING_MODEL)
    (folder / "crash" / "config.yaml").write_text(CRASHING_CONFIG)
    return folder


def env_for(team, experiment: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MLFLOW_TRACKING_URI=team.tracking_uri, MLFLOW_EXPERIMENT_NAME=experiment, PYTHONUNBUFFERED="1")
    env.pop("REPLAYBISECT_FULL_ERROR", None)
    env.update(extra)
    return env


def train_runs(team, project: Path, experiment: str, config_dirs: list[Path | None]) -> list[str]:
    """Each config folder trained into `experiment` on the team server (None: the built-in config, a healthy run), in
    this process with `rb.train` (as `replay train` trains; the watchers and their triage steps are the installed
    commands): the run ids, None for a run that crashed (its id is in the store)."""
    from unittest import mock

    import replaybisect as rb

    run_ids = []
    for config_dir in config_dirs:
        # in the user's folder (the healthy run's code folder), into the test's experiment
        with in_folder(project), mock.patch.dict(os.environ, {"MLFLOW_EXPERIMENT_NAME": experiment}):
            try:
                result = rb.train(TINY, config_dir=config_dir, tracking_uri=team.tracking_uri)
            except RuntimeError as crash:  # the crashing model: the run ends FAILED, status crashed
                assert "simulated crash" in str(crash)
                run_ids.append(None)
                continue
        assert result.status in ("ok", "nonfinite"), result
        run_ids.append(result.run_id)
    return run_ids


def crashed_run_ids(team, experiment: str) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(team.tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], "tags.`replaybisect.status` = 'crashed'")
    return sorted(run.info.run_id for run in runs)


def watch_args(team, experiment: str, *extra: str) -> list[str]:
    return [REPLAY, "watch", *watch_servers.ALLOW_ROOT, "--tracking-uri", team.tracking_uri, "--experiment", experiment, "--json", "--horizon", "5",
            "--settle", "0.5", *extra]


def run_watch(team, project: Path, experiment: str, *extra: str, env: dict | None = None) -> CliResult:
    done = subprocess.run(watch_args(team, experiment, *extra), cwd=project, env=env or env_for(team, experiment),
                          capture_output=True, text=True, timeout=600)
    return CliResult(done.returncode, done.stdout, done.stderr)


def events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def run_of(team, run_id: str):
    from mlflow import MlflowClient

    return MlflowClient(team.tracking_uri).get_run(run_id)


def tags_of(team, run_id: str) -> dict[str, str]:
    from mlflow import MlflowClient

    return MlflowClient(team.tracking_uri).get_run(run_id).data.tags


def artifacts_here_and_below(team, run_id: str) -> set[str]:
    """The run's artifact paths and its child runs' (the verbs' reports), walked through the server."""
    from mlflow import MlflowClient

    client = MlflowClient(team.tracking_uri)

    def walk(rid: str, path: str | None = None) -> set[str]:
        found = set()
        for item in client.list_artifacts(rid, path):
            found |= walk(rid, item.path) if item.is_dir else {item.path.rsplit("/", 1)[-1]}
        return found

    run = client.get_run(run_id)
    found = walk(run_id)
    for child in client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'"):
        found |= walk(child.info.run_id) - {"config.yaml"}
        for grandchild in client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{child.info.run_id}'"):
            found |= walk(grandchild.info.run_id) - {"config.yaml"}
    return found


class Receiver:
    """A local webhook: collects the JSON bodies POSTed to it."""

    def __init__(self):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/triage"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_once_triages_the_failed_runs_and_leaves_the_healthy_one_alone(team, project, tmp_path):
    experiment = "watch-once"
    forward, optimizer, crashed_slot, healthy = train_runs(
        team, project, experiment, [EXAMPLES / "nan_forward", EXAMPLES / "nan_optimizer", project / "crash", None])
    assert crashed_slot is None
    (crashed,) = crashed_run_ids(team, experiment)
    receiver = Receiver()
    try:
        result = run_watch(team, project, experiment, "--once", "--workers", "2", "--notify-url", receiver.url)
    finally:
        receiver.close()
    assert result.returncode == 0, result.stderr
    log = events(result.stdout)
    done = {event["run_id"]: event["result"] for event in log if event["event"] == "done"}
    assert set(done) == {forward, optimizer, crashed}, log

    # right categories, tags set
    assert done[forward]["verdict"] == "forward" and done[optimizer]["verdict"] == "optimizer"
    assert done[forward]["steps"] == ["nan", "ablate"] and done[crashed]["steps"] == ["diagnose"]
    for run_id in (forward, optimizer, crashed):
        tags = tags_of(team, run_id)
        assert tags["replaybisect.triage"] == "done"
        assert tags["replaybisect.triage.summary"] == done[run_id]["summary"] and "\n" not in done[run_id]["summary"]
        assert tags["replaybisect.triage.attempts"] == "1"
    found = tags_of(team, forward)["replaybisect.triage.nan"]  # in replay nan's own words (its headline)
    assert found.startswith(FORWARD_FOUND) and tags_of(team, forward)["replaybisect.triage.summary"].startswith(f"{found}; ablate: ")
    assert tags_of(team, crashed)["replaybisect.triage.summary"].startswith("failed run: ")
    assert not any(key.startswith("replaybisect.triage") for key in tags_of(team, healthy))

    # reports attached (through the server to the object store)
    forward_files = artifacts_here_and_below(team, forward)
    assert {"report.md", "ablation.md", "triage.md", "triage.json"} <= forward_files, forward_files
    assert {"diagnosis.md", "triage.json"} <= artifacts_here_and_below(team, crashed)

    # triage.md reads as a report (the verbs' JSON stays in triage.json); the next step is no verb the triage ran
    from mlflow import MlflowClient

    reports = {}
    for run_id in (forward, optimizer, crashed):
        folder = tmp_path / run_id
        folder.mkdir()
        report = reports[run_id] = Path(MlflowClient(team.tracking_uri).download_artifacts(run_id, "triage/triage.md", str(folder))).read_text()
        assert not JSON_LINE.search(report) and "```" not in report and len(report.splitlines()) < 40, report
        assert f"**{done[run_id]['summary']}**" in report and done[run_id]["next_command"] in report
        assert done[run_id]["next_command"].split()[:2] not in (["replay", step] for step in done[run_id]["steps"])
        assert {link["step"] for link in done[run_id]["links"]} >= set(done[run_id]["steps"]), done[run_id]["links"]
        assert all(f"run {link['run_id']}, {link['url']}" in report for link in done[run_id]["links"]), report
    assert any(line.startswith("- replay nan: `") and "nan @ step 20" in line for line in reports[forward].splitlines()), reports[forward]
    # the answer first in the name of the triage's own run under each triaged run (MLflow's default view shows names)
    client = MlflowClient(team.tracking_uri)
    for run_id in (forward, optimizer, crashed):
        triage_run = client.get_run(done[run_id]["triage_run_id"])
        assert triage_run.data.tags["mlflow.parentRunId"] == run_id and triage_run.data.tags["replaybisect.kind"] == "triage"
        assert triage_run.info.run_name == done[run_id]["headline"]
        assert triage_run.data.tags["mlflow.note.content"].startswith(done[run_id]["summary"])
    assert f" · triage: {FORWARD_FOUND}" in done[forward]["headline"]
    assert done[crashed]["headline"] == f"{done[crashed]['verdict']} · triage"
    assert tags_of(team, forward)["replaybisect.overrides"] == '["train.steps=30"]'  # how to train it again, with a fix
    assert tags_of(team, forward)["replaybisect.config_dir"] == str(EXAMPLES / "nan_forward")
    if team.s3_endpoint:  # and they are objects in the bucket, not files beside the server
        import boto3

        experiment_id = run_of(team, forward).info.experiment_id
        listing = boto3.client("s3", endpoint_url=team.s3_endpoint, **watch_servers.boto_credentials()).list_objects_v2(
            Bucket=watch_servers.BUCKET, Prefix=f"{experiment_id}/{forward}/artifacts/")
        keys = {item["Key"].split("/artifacts/", 1)[1] for item in listing.get("Contents", [])}
        assert {"triage/triage.json", "config.yaml"} <= keys and any(k.startswith("snapshots/") for k in keys), keys

    # one notification per triage, Slack/Mattermost-shaped
    by_run = {message["run_id"]: message for message in receiver.received}
    assert set(by_run) == {forward, optimizer, crashed} and len(receiver.received) == 3
    message = by_run[forward]
    assert message["triage"] == "done" and message["verdict"] == "forward" and message["failure"] == "nonfinite"
    assert forward in message["text"] and message["summary"] in message["text"]
    assert message["next_command"] and message["next_command"] in message["text"]
    assert message["run_url"].startswith(f"{team.tracking_uri}/#/experiments/") and message["run_url"].endswith(f"/runs/{forward}")

    # a second --once finds nothing to do (a watcher in this process: nothing between its start and its stop)
    assert _watch_once_here(team, experiment, lease=120) == []
    status = subprocess.run([REPLAY, "watch", "--status", "--json", "--tracking-uri", team.tracking_uri, "--experiment", experiment],
                            cwd=project, env=env_for(team, experiment), capture_output=True, text=True, timeout=120)
    assert json.loads(status.stdout) | {"tracking_uri": None} == {"tracking_uri": None, "waiting": 0, "running": [], "done": 3, "failed": 0, "untrusted": 0}


def test_two_watchers_triage_each_run_once_and_a_failed_triage_is_not_retried(team, project):
    experiment = "watch-race"
    train_runs(team, project, experiment, [project / "crash", project / "crash"])
    (untrusted,) = train_runs(team, project, experiment, [EXAMPLES / "nan_forward"])
    crashed = crashed_run_ids(team, experiment)
    # the watchers trust only their working folder: the nan_forward run's model is not code they may build
    untrusting = env_for(team, experiment, REPLAYBISECT_CODE_DIR="")
    watchers = [subprocess.Popen(watch_args(team, experiment, "--once"), cwd=project, env=untrusting,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [watcher.communicate(timeout=300) for watcher in watchers]
    assert [watcher.returncode for watcher in watchers] == [0, 0], [err for _, err in outputs]
    finished = [event for stdout, _ in outputs for event in events(stdout) if event["event"] in ("done", "failed")]
    assert sorted(event["run_id"] for event in finished) == sorted([*crashed, untrusted]), finished
    for run_id in crashed:
        assert tags_of(team, run_id)["replaybisect.triage"] == "done"

    tags = tags_of(team, untrusted)
    assert tags["replaybisect.triage"] == "failed"
    reason = tags["replaybisect.triage.reason"]
    assert reason.startswith("nan: exit 2: ") and "planted_forward" in reason and "\n" not in reason

    from unittest import mock

    with mock.patch.dict(os.environ, {"REPLAYBISECT_CODE_DIR": ""}):  # as untrusting, a watcher in this process
        assert _watch_once_here(team, experiment, lease=120) == []  # failed stays failed: nothing between start and stop
    assert tags_of(team, untrusted)["replaybisect.triage.attempts"] == "1"


def _wait_for_tag(team, run_id: str, key: str, value: str, process: subprocess.Popen, timeout: float = 120) -> None:
    def tagged() -> bool:
        if tags_of(team, run_id).get(key) == value:
            return True
        assert process.poll() is None, process.communicate()
        return False

    if not wait_until(tagged, timeout=timeout, interval=0.2):
        pytest.fail(f"{key} never became {value!r}: {tags_of(team, run_id)}")


def _processes_working_in(folders: list[Path]) -> list[int]:
    """The processes whose working folder is inside one of `folders` (a triage step runs in its scratch folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(Path(os.readlink(entry / "cwd")).is_relative_to(folder) for folder in folders):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def _watch_once_here(team, experiment: str, lease: float, **fields) -> list[tuple[str, str]]:
    """`replay watch --once` in this process (WatchOptions `fields` beside these): the events it logged between its
    start and its stop."""
    from replaybisect.store import open_store
    from replaybisect.verbs.watch.engine import Watcher, WatchOptions

    logged = []
    options = WatchOptions(tracking_uri=team.tracking_uri, experiments=[experiment], settle=0.5, lease=lease, horizon=5,
                           allow_root=bool(watch_servers.ALLOW_ROOT), **fields)
    Watcher(open_store(team.tracking_uri), options, on_event=lambda event: logged.append((event.kind, event.message))).run(once=True)
    return [entry for entry in logged if entry[0] not in ("start", "stop")]


def test_sigterm_releases_sigkill_leaves_a_lease_and_the_next_watcher_resumes(team, project):
    experiment = "watch-kill"
    (run_id,) = train_runs(team, project, experiment, [EXAMPLES / "nan_forward"])
    lease = "4"

    # 1. SIGTERM mid-nan with no grace: the claim is released at once (exit 143)
    first = subprocess.Popen(watch_args(team, experiment, "--lease", lease, "--grace", "0"), cwd=project,
                             env=env_for(team, experiment), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_tag(team, run_id, "replaybisect.triage.step", "nan", first)
    first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr
    assert "released" in [event["event"] for event in events(stdout)], stdout + stderr
    assert tags_of(team, run_id)["replaybisect.triage.claim"].endswith(" until 0.0")

    # 2. the next watcher takes it at once; SIGKILLed once nan is done, it leaves a live claim and no child behind
    # a lease that outlasts the checks below on a loaded 2-core machine (renewed every third of it: at least 6.7 s
    # left at the kill); the check that nobody takes it runs in this process, so it needs no process start-up
    second = subprocess.Popen(watch_args(team, experiment, "--lease", "10"), cwd=project, env=env_for(team, experiment),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_tag(team, run_id, "replaybisect.triage.step", "ablate", second)
    second.kill()
    second.communicate(timeout=60)
    left = list(Path(tempfile.gettempdir()).glob(f"replay-triage-{socket.gethostname()}-{second.pid}-*"))
    assert left, "the killed watcher's scratch folder"
    tags = tags_of(team, run_id)
    assert tags["replaybisect.triage"] == "running" and tags["replaybisect.triage.attempts"] == "1"  # a release is no attempt
    assert tags["replaybisect.triage.nan"].startswith(FORWARD_FOUND)
    wait_until(lambda: _processes_working_in(left) == [], timeout=1)  # until the child is gone: within 1 s
    assert _processes_working_in(left) == []  # the triage child died with its watcher

    # 3. while the lease lasts nobody takes it (a watcher in this process: no seconds of start-up that could outlast
    # the lease on a loaded machine); after it, a watcher resumes after the finished nan step
    expires = float(tags["replaybisect.triage.claim"].rsplit(" until ", 1)[1])
    assert _watch_once_here(team, experiment, lease=float(lease)) == []  # nothing claimed, nothing triaged
    assert time.time() < expires, "the check came too late to see a live lease"
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    last = run_watch(team, project, experiment, "--once", "--lease", lease)
    assert last.returncode == 0, last.stderr
    steps = [event["message"] for event in events(last.stdout) if event["event"] == "step"]
    assert steps[0] == "ablate started" and not any(message.startswith("nan") for message in steps), steps
    (done,) = [event["result"] for event in events(last.stdout) if event["event"] == "done"]
    assert done["steps"] == ["ablate"] and done["verdict"] == "forward"
    assert not any(folder.exists() for folder in left)  # removed by the next watcher
    tags = tags_of(team, run_id)
    assert tags["replaybisect.triage"] == "done" and tags["replaybisect.triage.attempts"] == "2"
    assert tags["replaybisect.triage.summary"].startswith(tags["replaybisect.triage.nan"] + "; ablate: ")


def test_an_outage_mid_triage_is_waited_out_not_a_verdict(team, monkeypatch):
    """PostgreSQL stops as the triage's child starts: the child cannot open the store and the watcher's own reads
    fail. The watcher waits for the server (backoff), runs the step again and finishes: done, one attempt, nothing
    released or given up (it used to log RunNotFound, release, and the run ended 'given up after 3 attempts')."""
    from replaybisect.store import open_store
    from replaybisect.verbs.watch.engine import Watcher, WatchOptions

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast while the database is down (children too)
    experiment = "watch-outage"
    store = open_store(team.tracking_uri)
    run_id = store.create_run("train", experiment=experiment)  # a crashed run's record: metrics, all diagnose reads
    store.log_metrics(run_id, [("loss", 2.0 - step * 0.01, step) for step in range(30)])
    store.finish_run(run_id, "crashed", "FAILED")

    events, down, restarted = [], threading.Event(), threading.Event()

    def restart() -> None:
        if down.is_set() and not restarted.is_set():
            restarted.set()
            team.database.start()

    def on_event(event) -> None:
        events.append(event)
        if event.kind == "step" and event.message == "diagnose started" and not down.is_set():
            down.set()
            team.database.stop()
        elif event.kind == "outage" and down.is_set() and not restarted.is_set():
            threading.Timer(2.0, restart).start()  # back a little later: the watcher keeps trying meanwhile

    options = WatchOptions(tracking_uri=store.uri, experiments=[experiment], settle=1.0, lease=60, allow_root=True)
    fallback = threading.Timer(120, restart)  # so that the server comes back whatever the watcher does
    fallback.start()
    try:
        counts = Watcher(store, options, on_event=on_event).run(once=True)
    finally:
        fallback.cancel()
        restart()
    log = [(event.kind, event.message) for event in events]
    assert down.is_set() and any(kind == "outage" for kind, _ in log), log
    assert counts["done"] == 1 and counts["errors"] == 0 and not any(kind == "released" for kind, _ in log), log
    tags = tags_of(team, run_id)
    assert tags["replaybisect.triage"] == "done" and tags["replaybisect.triage.attempts"] == "1", tags
    assert tags["replaybisect.triage.summary"].startswith("failed run: ")


def test_audit_verifies_finished_runs_once_and_tags_the_one_a_replay_does_not_reproduce(team, project):
    """--audit: each finished run has a sample of its steps replayed (here all of them); a run whose step 7 loss had a
    bit flipped while it was recorded is found transient there, and said; the clean run is exact, tagged, not notified."""
    from unittest import mock

    experiment = "watch-audit"
    (clean,) = train_runs(team, project, experiment, [None])
    with mock.patch.dict(os.environ, {"REPLAYBISECT_INJECT_FAULT": "step=7,what=loss,bit=20"}):
        (flipped,) = train_runs(team, project, experiment, [None])
    receiver = Receiver()
    try:
        result = run_watch(team, project, experiment, "--once", "--audit", "1000", "--notify-url", receiver.url)
    finally:
        receiver.close()
    assert result.returncode == 0, result.stderr
    done = {event["run_id"]: event["result"] for event in events(result.stdout) if event["event"] == "done"}
    assert set(done) == {clean, flipped} and done[clean]["steps"] == ["verify"]
    assert done[clean]["verdict"] == "exact" and done[clean]["summary"].startswith("audit: exact over ")
    assert (done[flipped]["verdict"], done[flipped]["summary"]) == ("transient", "audit: transient at step 7")
    assert done[flipped]["next_command"] == f"replay verify --run-id {flipped} --cross-check"
    assert tags_of(team, flipped)["replaybisect.triage.verify"] == "transient"
    assert [posted["run_id"] for posted in receiver.received] == [flipped]  # an exact audit is no news
    again = _watch_once_here(team, experiment, lease=120, audit=1000)  # audited once (a watcher in this process)
    assert not [kind for kind, _ in again if kind == "done"], again
