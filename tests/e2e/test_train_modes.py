"""A step's train/eval modes are the loop's, recorded and replayed: a model left in eval mode after an evaluation
pass trains as the plain script does (the recorder used to switch it back to train mode) and `diagnose` names it;
a fine-tuning loop that keeps its batch norm frozen (in eval mode inside a training model) replays exact."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import Workspace

LEFT_IN_EVAL = """\
import sys, torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
plain = sys.argv[1:] == ["plain"]


def train_step(batch):
    x, y = batch
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


rec = None if plain else replaybisect.Recorder(model, optimizer, step_fn=train_step, snapshot_every=4)
model.train()
for step in range(12):
    x = torch.randn(16, 8)
    loss = train_step((x, x.sum(1, keepdim=True))) if plain else rec.step((x, x.sum(1, keepdim=True)))
    print(f"{float(loss):.10g}")
    if step == 5:
        model.eval()  # an evaluation pass, and the bug: no model.train() after it
        with torch.no_grad():
            model(torch.randn(4, 8))
if rec is not None:
    rec.close()
"""

FROZEN_BN = """\
import torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=4)
for step in range(12):
    model.train()
    model[1].eval()          # fine-tuning: the batch norm keeps its running statistics
    x = torch.randn(16, 8)
    if step == 9:
        x[5] = float("nan")  # a NaN row at step 9
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
rec.close()
"""


def _run(workspace: Workspace, script: str, *args: str) -> subprocess.CompletedProcess:
    (workspace.path / "main.py").write_text(script)
    return subprocess.run([sys.executable, "main.py", *args], cwd=workspace.path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)


def test_a_model_left_in_eval_mode_trains_as_without_the_recorder_and_is_named(tmp_path):
    workspace = Workspace(tmp_path)
    recorded, plain = _run(workspace, LEFT_IN_EVAL), _run(workspace, LEFT_IN_EVAL, "plain")
    assert recorded.returncode == 0 and recorded.stdout == plain.stdout, (recorded.stderr[-2000:], plain.stdout)
    run_id = re.search(r"recording run ([0-9a-f]{32})", recorded.stderr).group(1)
    assert workspace.store().tags(run_id)["eval_mode_step"] == "6"
    findings = workspace.answer_here("diagnose", run_id)["findings"]  # what `replay diagnose --json` prints, in this process
    finding = next(f for f in findings if f["pattern"] == "model-in-eval")
    assert finding["step"] == 6 and "dropout is off" in finding["summary"] and "model.train()" in finding["next"]
    # the replay sets the recorded modes: from snapshot 8 (eval mode) the checks' steps see dropout off, as the run did
    # (`replay check --only grad.missing` through the API: it raises where the command would exit 2)
    check = workspace.answer_here("check", run_id, only="grad.missing")
    assert [item["name"] for item in check["checks"]] == ["grad.missing"], check


def test_a_frozen_batch_norm_replays_exact(tmp_path):
    """Before: a replay put every module in train mode, so the frozen batch norm normalised with the batch's
    statistics and updated its running ones: the replay from snapshot 8 'diverged'."""
    workspace = Workspace(tmp_path)
    done = _run(workspace, FROZEN_BN)
    assert "NonFiniteStep: loss is nan at step 9" in done.stderr, done.stderr[-2000:]
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    report = workspace.answer_here("find_nan", run_id)  # `replay nan --json --no-child-run`, in this process
    assert (report["snapshot_step"], report["reproduced"], report["category"]) == (8, "exact", "data")


NOT_OPTIMIZED = """\
import torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model.append(torch.nn.Linear(1, 1))  # the bug: a head added after the optimizer was built
rec = replaybisect.Recorder(model, optimizer)
for step in range(20):
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
rec.close()
"""


def test_parameters_in_no_optimizer_are_named(tmp_path):
    workspace = Workspace(tmp_path)
    done = _run(workspace, NOT_OPTIMIZED)
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    findings = workspace.answer_here("diagnose", run_id)["findings"]  # what `replay diagnose --json` prints, in this process
    finding = next(f for f in findings if f["pattern"] == "not-optimized")
    assert finding["evidence"]["parameters"] == ["3.weight", "3.bias"] and finding["layer"] == "3"
    assert finding["summary"].startswith("3.weight, 3.bias get gradients but are in no optimizer")
    # a healthy loop of the same shape is not flagged (nor trained in eval mode)
    done = _run(workspace, NOT_OPTIMIZED.replace("model.append(torch.nn.Linear(1, 1))", "pass"))
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    patterns = {f["pattern"] for f in workspace.answer_here("diagnose", run_id)["findings"]}
    assert not patterns & {"not-optimized", "model-in-eval", "gradients-not-zeroed"}
