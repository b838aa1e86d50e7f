"""How a recorded loop ends and what it logged, as the plain script ran: a crash in the script's test pass after its
last step keeps that step; a step-function Recorder the script never closes ends FINISHED with its snapshots whole;
an fp64 loss is logged as the step made it, not rounded to fp32."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import Workspace

HEAD = """\
import torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Linear(4, 1){double}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""

CRASH_IN_EVAL = HEAD.format(double="") + """\
rec = replaybisect.Recorder(model, optimizer, snapshot_every=2)
for step in range(5):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    print(repr(loss.item()))
model.eval()
with torch.no_grad():
    model(torch.randn(3, 5))  # the test pass crashes: the wrong width
"""

NEVER_CLOSED = HEAD.format(double="") + """\
def step(batch):
    optimizer.zero_grad(); loss = model(batch).pow(2).mean(); loss.backward(); optimizer.step(); return loss
rec = replaybisect.Recorder(model, optimizer, step_fn=step, snapshot_every=2)
for i in range(5):
    print(repr(rec.step(torch.randn(8, 4)).item()))
"""

FP64 = HEAD.format(double=".double()") + """\
rec = replaybisect.Recorder(model, optimizer)
for step in range(3):
    loss = model(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean() + 1e-9
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    print(repr(loss.item()))
rec.close()
"""


CRASH_IN_UPDATE = HEAD.format(double="") + """\
class Guarded(torch.optim.SGD):  # refuses an update that would move a weight by more than 1
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if any(float(p.grad.abs().max()) * group["lr"] > 1 for p in group["params"] if p.grad is not None):
                raise RuntimeError("update too large to apply")
        return super().step(closure)
optimizer = Guarded(model.parameters(), lr=0.1)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=4)
for step in range(10):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    if step == 6:
        x[2] = 1e4  # one outlier row
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
rec.close()
"""


def _run(workspace: Workspace, script: str) -> tuple[subprocess.CompletedProcess, str, list[float]]:
    (workspace.path / "loop.py").write_text(script)
    done = subprocess.run([sys.executable, "loop.py"], cwd=workspace.path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    store = workspace.store()
    run_id = store.search_runs()[0].info.run_id
    return done, run_id, [value for _, value in store.metric_history(run_id, "loss")]


def test_a_crash_after_the_last_step_keeps_that_step(tmp_path):
    workspace = Workspace(tmp_path)
    done, run_id, losses = _run(workspace, CRASH_IN_EVAL)
    assert done.returncode == 1 and "mat1 and mat2 shapes cannot be multiplied" in done.stderr
    printed = [float(line) for line in done.stdout.split()]
    assert len(printed) == 5 and losses == printed  # (it logged 4: the last step was closed only by a next forward)
    assert workspace.store().get_run(run_id).info.status == "FAILED"


def test_a_step_that_raises_inside_its_optimizers_step_is_the_failing_step(tmp_path):
    """An exception raised inside the loop's own optimizer.step() (the update had begun, the state may be part-way
    through it): the step is the run's failing step with its batch, the run's last line names it and `replay nan`;
    the replay from snapshot 4 raises it again and names the line and the outlier the loop passed the model. The
    optimizer subclasses SGD and calls its step after an SGD was made (HEAD), so torch runs the step hooks twice,
    nested: the recorder's take it as one update (its layer statistics at step 0 crashed the run before)."""
    workspace = Workspace(tmp_path)
    done, run_id, _ = _run(workspace, CRASH_IN_UPDATE)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("replaybisect: step 6 raised RuntimeError") and f"replay nan --run-id {run_id}" in last, done.stderr
    assert "step 6's batch (its update had begun" in last
    report = workspace.answer_here("find_nan", run_id)  # `replay nan --json --no-child-run`, in this process
    assert (report["failing_step"], report["snapshot_step"], report["reproduced"], report["category"]) == (6, 4, "exact", "exception")
    assert "update too large to apply" in report["headline"] and "loop.py:" in report["headline"]
    assert any("model(arg 0): float32[8, 4]" in line for line in report["evidence"]), report["evidence"]


def test_a_step_function_recorder_never_closed_ends_finished_with_whole_snapshots(tmp_path):
    workspace = Workspace(tmp_path)
    done, run_id, losses = _run(workspace, NEVER_CLOSED)
    assert done.returncode == 0, done.stderr
    store = workspace.store()
    assert store.get_run(run_id).info.status == "FINISHED" and len(losses) == 5
    assert store.tags(run_id)["snapshot_steps"] == "0,2,4"  # each with its manifest: written whole before exit
    check = workspace.answer_here("check", run_id, only="grad.missing")  # `replay check --json`, in this process
    assert check["checks"][0]["status"] == "pass", check


def test_an_fp64_loss_is_logged_as_the_step_made_it(tmp_path):
    workspace = Workspace(tmp_path)
    done, _, losses = _run(workspace, FP64)
    assert done.returncode == 0, done.stderr
    assert losses == [float(line) for line in done.stdout.split()]  # bit for bit (fp32 rounding lost ~8 digits)


OUT_OF_MEMORY = """\
import torch, replaybisect
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, lengths):
        return self.fc(x).repeat(1, int(lengths.max()))  # padded to the batch's longest


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=4)
for step in range(10):
    x, lengths = torch.randn(16, 8), torch.randint(1, 5, (16,))
    if step == 6:
        lengths[3] = 10**11  # one absurdly long sequence: the step runs out of memory in the model
    loss = model(x, lengths).pow(2).mean()
    optimizer.zero_grad(); loss.backward(); optimizer.step()
rec.close()
"""


def test_a_step_out_of_memory_in_the_model_is_replayed_to_its_op_and_batch(tmp_path):
    """An out-of-memory error raised inside the model's forward of a loop recorded as written: the step is the run's
    failing step, and `replay nan` reproduces it from snapshot 4 (the script's loop cannot go on past it, so the
    probes run it once) and names the op, its line and the batch's 1e11 length (the replay used to end with the
    script stopping 'while its loop ran the replay's steps')."""
    workspace = Workspace(tmp_path)
    done, run_id, _ = _run(workspace, OUT_OF_MEMORY)
    assert "step 6 ran out of memory (RuntimeError)" in done.stderr and "can't allocate memory" in done.stderr
    memory = workspace.replay("memory", "--run-id", run_id, "--json", "--no-child-run")  # no batch size fits: nan's case
    assert memory.returncode == 0, memory.stderr
    failed = memory.json()["out_of_memory"]
    assert "runs out of memory here too, with no cap" in failed["detail"] and failed["fits"] is None
    assert failed["suggestion"].startswith(f"replay nan --run-id {run_id}")
    report = workspace.answer_here("find_nan", run_id)  # `replay nan --json --no-child-run`, in this process
    assert (report["snapshot_step"], report["reproduced"], report["category"], report["phase"], report["op"]) == (
        4, "exact", "exception", "forward", "Tensor.repeat")
    assert report["exception"]["as_recorded"] and "return self.fc(x).repeat(1, int(lengths.max()))" in report["source"]
    assert "range [1, 100000000000]" in " ".join(report["exception"]["batch"])
    assert not report["warnings"]  # (one run of the step: no isolation check to fail)
