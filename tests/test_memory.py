"""Memory recorded with the metrics, read by diagnose: the process's resident memory (on a GPU the allocator's
counters) is sampled at each metrics flush with the recorder's own share (the batches its open snapshot keeps), and a
loop that keeps every step's features in a list is named a leak, with its bytes per step; the same loop keeping
numbers is not."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import Workspace

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
    result = workspace.replay("diagnose", "--run-id", run_id, "--json")
    assert result.returncode == 0, result.stderr
    return result.json()


def test_a_loop_keeping_every_steps_features_is_named_a_leak(tmp_path):
    leak = next(f for f in _diagnosis(Workspace(tmp_path), "leak")["findings"] if f["pattern"] == "memory-leak")
    # 128 KB of features a step, and the allocator's own rounding: between 100 and 400 KB a step
    assert 100_000 < leak["evidence"]["bytes_per_step"] < 400_000 and leak["evidence"]["r2"] >= 0.9
    assert leak["summary"].startswith("memory grows ") and "per step along a straight line" in leak["summary"]


def test_the_same_loop_keeping_numbers_is_not(tmp_path):
    assert "memory-leak" not in {f["pattern"] for f in _diagnosis(Workspace(tmp_path))["findings"]}
