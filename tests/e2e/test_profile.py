"""`replay profile`: a recorded step replayed under torch.profiler, offline. The replay up to the step and the profiled
steps' losses match the recording bit for bit; the ops and the modules are named; the trace is an MLflow artifact that
Perfetto and chrome://tracing open (Chrome trace JSON, each module's forward marked). A loop recorded as written is
profiled in its own thread (the script's), where its steps run."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import Workspace, in_folder

SCRIPT = """\
import torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=5)
for step in range(12):
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
rec.close()
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workspace = Workspace(tmp_path_factory.mktemp("profile"))
    return workspace, workspace.train_here("train.steps=12", "snapshot.every=5")["run_id"]


def test_a_recorded_step_is_profiled_exact_with_its_ops_modules_and_trace(trained):
    import replaybisect as rb

    workspace, run_id = trained
    with in_folder(workspace.path):
        report = rb.profile(run_id, 7, steps=2, tracking_uri=workspace.tracking_uri)
    assert (report.step, report.steps, report.snapshot_step) == (7, 2, 5)
    assert (report.reproduced, report.losses) == ("exact", "exact")
    assert len(report.step_seconds) == 2 and all(seconds > 0 for seconds in report.step_seconds)
    assert any(row["name"] in ("aten::addmm", "aten::mm") for row in report.top_ops), report.top_ops
    assert {row["name"] for row in report.top_modules} >= {"net.0", "net.3"}, report.top_modules
    store = workspace.store()
    child = store.child_runs(run_id, kind="profile")
    assert [run.info.run_id for run in child] == [report.report_run_id]
    folder = store.download_artifacts(report.report_run_id, "", workspace.path / "downloaded")
    trace = json.loads((folder / "trace.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert "module: net.0 (Linear)" in names and any(name.startswith("aten::") for name in names)
    assert "Ops by self time" in (folder / "profile.md").read_text()


def test_without_a_step_the_slowest_recorded_step_is_profiled(trained):
    import replaybisect as rb

    workspace, run_id = trained
    times = dict(workspace.store().metric_history(run_id, "step_time"))
    slowest = max((step for step in times if step >= 2), key=times.get)
    with in_folder(workspace.path):
        report = rb.profile(run_id, steps=1, tracking_uri=workspace.tracking_uri, publish=False)
    assert report.step == slowest and "slowest recorded step" in report.why and report.losses == "exact"


def test_a_loop_recorded_as_written_is_profiled_in_the_scripts_thread(tmp_path):
    workspace = Workspace(tmp_path)
    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=workspace.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    result = workspace.replay("profile", "--run-id", run_id, "--step", "8", "--steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert (report["reproduced"], report["losses"], report["snapshot_step"]) == ("exact", "exact", 5)
    # the forward and backward ran in the script's thread: seen there, not only our own calls around them
    assert any(row["name"] == "aten::addmm" for row in report["top_ops"]), report["top_ops"]
    assert {row["name"] for row in report["top_modules"]} >= {"0", "2"}, report["top_modules"]


@pytest.mark.parametrize("args, said", [
    (("--step", "500"), "past the end of run"),
    (("--steps", "0"), "Invalid value for '--steps'"),
])
def test_bad_steps_are_one_line_exit_2_and_record_nothing(trained, args, said):
    workspace, run_id = trained
    before = len(workspace.store().child_runs(run_id))
    result = workspace.replay("profile", "--run-id", run_id, *args)
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(workspace.store().child_runs(run_id)) == before
