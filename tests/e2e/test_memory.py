"""Memory recorded with the metrics, read by diagnose: the process's resident memory (on a GPU the allocator's
counters) is sampled at each metrics flush with the recorder's own share (the batches its open snapshot keeps), and a
loop that keeps every step's features in a list is named a leak, with its bytes per step; the same loop keeping
numbers is not. `replay memory` then names what holds it, from a replay: the list and the line that appends to it,
or a running sum whose autograd graph grows; nothing for a healthy loop."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import Workspace

LOOP = """\
import sys, torch, replaybisect
torch.manual_seed(0)
encoder, head = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU()), torch.nn.Linear(512, 1)
optimizer = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=1e-3)
leak = sys.argv[1:] == ["leak"]
rec = replaybisect.Recorder({"encoder": encoder, "head": head}, optimizer, snapshot_every=50)
features = []
for step in range(600):
    x = torch.randn(64, 256)
    hidden = encoder(x)
    loss = torch.nn.functional.mse_loss(head(hidden), x[:, :1])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    features.append(hidden.detach() if leak else hidden.mean().item())  # the leak: 128 KB of features a step
rec.close()
"""


def _diagnosis(workspace: Workspace, *args: str) -> dict:
    (workspace.path / "loop.py").write_text(LOOP)
    done = subprocess.run([sys.executable, "loop.py", *args], cwd=workspace.path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    assert len(workspace.store().metric_history(run_id, "memory/rss")) >= 12  # one sample per flush (every 50 steps)
    return workspace.answer_here("diagnose", run_id)  # what `replay diagnose --json` prints, in this process


def test_a_loop_keeping_every_steps_features_is_named_a_leak(tmp_path):
    leak = next(f for f in _diagnosis(Workspace(tmp_path), "leak")["findings"] if f["pattern"] == "memory-leak")
    # 128 KB of features a step, and the allocator's own rounding: between 100 and 400 KB a step
    assert 100_000 < leak["evidence"]["bytes_per_step"] < 400_000 and leak["evidence"]["r2"] >= 0.9
    assert leak["summary"].startswith("memory grows ") and "per step along a straight line" in leak["summary"]
    assert leak["next"].startswith("replay memory --run-id ")  # what holds it


def test_the_same_loop_keeping_numbers_is_not(tmp_path):
    assert "memory-leak" not in {f["pattern"] for f in _diagnosis(Workspace(tmp_path))["findings"]}


HOLDING = """\
import sys, torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=10)
losses = []
total_loss = 0
for step in range(30):
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if "list" in sys.argv:
        losses.append(loss)
    if "sum" in sys.argv:
        total_loss += loss
rec.close()
"""


@pytest.mark.parametrize("modes, holders", [
    (("list", "sum"), {"losses": ("list", "loop.py:15  losses.append(loss)"), "total_loss": ("tensor", "loop.py:17  total_loss += loss")}),
    (("healthy",), {}),
])
def test_replay_memory_names_what_the_loop_keeps_and_the_line_that_adds_to_it(tmp_path, modes, holders):
    """A list that keeps each step's loss and a running sum of the losses (each holding every step's graph) are named,
    with the line that adds to each; a healthy loop, nothing."""
    workspace = Workspace(tmp_path)
    (tmp_path / "loop.py").write_text(HOLDING)
    done = subprocess.run([sys.executable, "loop.py", *modes], cwd=tmp_path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    if holders:  # the command as a user runs it
        result = workspace.replay("memory", "--run-id", run_id, "--json")
        assert result.returncode == 0, result.stderr
        report = result.json()
    else:  # the same request through the API, in this process (no `replay` process's seconds of imports)
        report = workspace.answer_here("memory", run_id, publish=True)
    assert (report["losses"], report["snapshot_step"], report["steps"]) == ("exact", 20, 4)
    found = {holder["name"]: (holder["kind"], holder["line"]) for holder in report["holders"]}
    assert found == holders, report["holders"]
    assert all(holder["keeps_graph"] and holder["per_step"] >= 1 and "loss.item()" in holder["fix"] for holder in report["holders"])
    answer = workspace.store().tags(run_id)["answer.memory"]
    assert answer.startswith("`losses` grows") if holders else answer.startswith("nothing the loop names grows")


def test_too_few_steps_to_tell_growth_is_one_line_exit_2(tmp_path):
    """Growth is told over three steps at least: --steps 2 is refused by the command's parser, nothing recorded."""
    workspace = Workspace(tmp_path)
    result = workspace.replay("memory", "--run-id", "0123456789abcdef0123456789abcdef", "--steps", "2")
    assert result.returncode == 2 and "Invalid value for '--steps'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists()
