"""Gradients a loop carries from one step into the next: the Stack Overflow bug (a loop that never calls
`optimizer.zero_grad()`, so every update applies the sum of all gradients so far) and gradient accumulation over
several `rec.step` calls on purpose. A snapshot keeps the gradients its step began with, so a replay from any
snapshot is exact; `diagnose` names the missing zero_grad, `nan` proposes the zero-grad arm, and `ablate zero-grad`
proves it (an lr arm only delays the failure)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import Workspace

NEVER_ZEROED = """\
import torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
data = torch.randn(400, 8)
target = data @ torch.randn(8, 1)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=5)
for step in range(100):
    x, y = data[step * 10 % 400:][:10], target[step * 10 % 400:][:10]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()          # the bug: no optimizer.zero_grad() anywhere
    optimizer.step()
rec.close()
"""


def _record(workspace: Workspace, script: str, *args: str) -> str:
    (workspace.path / "main.py").write_text(script)
    done = subprocess.run([sys.executable, "main.py", *args], cwd=workspace.path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert "NonFiniteStep" in done.stderr, done.stderr[-2000:]
    return re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)


@pytest.fixture(scope="module")
def never_zeroed(tmp_path_factory) -> tuple[Workspace, str]:
    workspace = Workspace(tmp_path_factory.mktemp("never-zeroed"))
    return workspace, _record(workspace, NEVER_ZEROED)


def test_a_loop_that_never_zeroes_replays_exact_from_a_snapshot(never_zeroed):
    """Before: from snapshot 40 the replay started the gradients from zero, 'diverged', and called the overflow
    transient. Now the snapshot holds the gradients step 40 began with."""
    workspace, run_id = never_zeroed
    assert workspace.store().tags(run_id)["first_nonfinite_step"] == "44"
    report = workspace.answer_here("find_nan", run_id)  # `replay nan --json --no-child-run`, in this process
    assert (report["snapshot_step"], report["reproduced"], report["category"]) == (40, "exact", "divergence")
    # 4 parameters and the 4 gradients they carried into step 44, bit for bit
    assert report["state_match"] == "bit-identical (8 tensors and the RNG streams)"
    assert report["gradients_never_cleared"] and report["arms"][0] == "zero-grad"
    assert report["ablate_command"].startswith("replay ablate zero-grad,")


def test_diagnose_names_the_missing_zero_grad(never_zeroed):
    workspace, run_id = never_zeroed
    first = workspace.answer_here("diagnose", run_id)["findings"][0]  # `replay diagnose --json`, in this process
    assert first["pattern"] == "gradients-not-zeroed" and first["evidence"]["carried_steps"] == 44
    assert "no optimizer.zero_grad()" in first["summary"] and first["evidence"]["grad_norm_late"] > 100 * first["evidence"]["grad_norm_early"]
    assert first["next"] == f"replay ablate zero-grad --run-id {run_id}"
    # the line: the loop's first training call (`loss = ...mse_loss(model(x), y)`, line 10 of main.py)
    assert first["evidence"]["loop"] == "main.py:10 in <module>"
    assert first["summary"].endswith("add optimizer.zero_grad() before the backward in the loop at main.py:10 in <module>")


def test_ablate_zero_grad_fixes_it_and_a_lower_lr_does_not(never_zeroed):
    workspace, run_id = never_zeroed
    result = workspace.replay("ablate", "zero-grad,lr", "--run-id", run_id, "--json")
    assert result.returncode == 0, result.stderr
    data = result.json()
    assert data["baseline"]["verdict"] == "fails-again"  # the baseline replay fails where the run did: exact
    verdicts = {arm["name"]: arm["verdict"] for arm in data["arms"]}
    assert verdicts == {"zero-grad": "fixes", "lr": "delays"}
    # the report says that a lower lr hides the cause rather than fixing it
    assert "lr=x0.1 only masks it: the loop never clears its gradients (add optimizer.zero_grad())" in data["conclusion"]


ACCUMULATES = """\
import sys, torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(batch, step):
    x, y = batch
    (torch.nn.functional.mse_loss(model(x), y) / 3).backward()
    if step % 3 == 2:        # one update every three rec.step calls: the gradients carried on purpose
        optimizer.step()
        optimizer.zero_grad()
    return torch.nn.functional.mse_loss(model(x), y).detach()


plain = sys.argv[1:] == ["plain"]  # the same loop without the recorder
rec = None if plain else replaybisect.Recorder(model, optimizer, step_fn=train_step, snapshot_every=4)
for step in range(12):
    x = torch.randn(6, 8)
    if step == 10 and not plain:
        x[3, 2] = float("nan")   # a NaN feature in row 3 of step 10's batch
    loss = train_step((x, x.sum(1, keepdim=True)), step) if plain else rec.step((x, x.sum(1, keepdim=True)))
    print(f"{float(loss):.10g}")
"""


def test_gradient_accumulation_over_steps_replays_exact_and_is_no_bug(tmp_path):
    """Snapshot 8 is taken inside an accumulation cycle (steps 6, 7, 8): it holds the gradients of 6 and 7, and the
    replay from it reproduces step 10 exactly. Diagnose does not call accumulation on purpose a missing zero_grad."""
    workspace = Workspace(tmp_path)
    run_id = _record(workspace, ACCUMULATES)
    recorded = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=workspace.env(), capture_output=True, text=True)
    plain = subprocess.run([sys.executable, "main.py", "plain"], cwd=tmp_path, env=workspace.env(), capture_output=True, text=True)
    # recording changes nothing it trains: the gradients carry over rec.step calls as they do without it
    assert recorded.stdout.splitlines() == plain.stdout.splitlines()[:10] and len(plain.stdout.splitlines()) == 12
    report = workspace.answer_here("find_nan", run_id)  # `replay nan --json --no-child-run`, in this process
    assert (report["snapshot_step"], report["reproduced"], report["failing_step"]) == (8, "exact", 10)
    assert not report["gradients_never_cleared"] and "zero-grad" not in report["arms"]
    diagnosis = workspace.answer_here("diagnose", run_id)
    assert "gradients-not-zeroed" not in {finding["pattern"] for finding in diagnosis["findings"]}
