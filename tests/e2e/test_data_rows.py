"""A fault keyed on the data: pytorch/examples vae/main.py recorded as written (tests/user_loop/vae_script.py), whose
loss divides each image's error by the image's brightness, trained on data with one blank image. `replay nan` names
the op, its line and the one row of the batch it made the non-finite value in, and its next step is to drop that row
(never `ablate lr,clip`: no learning rate fixes a division by a blank image); `replay ablate skip-rows=R` proves it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TESTS, Workspace

SCRIPT = TESTS / "user_loop" / "vae_script.py"
BLANK = 100  # the data set index of the all-zero image: with --seed 1 it is row 8 of step 7's batch


@pytest.fixture(scope="module")
def blank_image(tmp_path_factory) -> tuple[Workspace, Path, str]:
    workspace = Workspace(tmp_path_factory.mktemp("data-rows"))
    folder = workspace.path / "vae"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "main.py")
    done = subprocess.run([sys.executable, "main.py", "--blank", str(BLANK), "--plant", "loss"], cwd=folder, env=workspace.env(),
                          capture_output=True, text=True, timeout=300)
    assert "replaybisect.NonFiniteStep: loss is inf at step 7" in done.stderr, done.stderr[-2000:]
    return workspace, folder, re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)


def test_replay_nan_names_the_row_and_proposes_dropping_it(blank_image):
    workspace, folder, run_id = blank_image
    report = workspace.answer_here("find_nan", run_id, folder=folder)  # `replay nan --json --no-child-run`, in this process
    assert (report["reproduced"], report["category"], report["op"]) == ("exact", "loss", "Tensor.div")
    assert report["source"].startswith(f"{folder / 'main.py'}:") and "in loss_function: BCE = BCE / x.sum(1)" in report["source"]
    assert report["rows"] == {"rows": [8], "of": 16, "dataset_rows": None}
    assert any("row 8 of the batch's 16 only" in line for line in report["evidence"])
    assert report["arms"] == ["skip-rows=8"] and report["ablate_command"] == f"replay ablate skip-rows=8 --run-id {run_id}"
    assert "add an eps to the divisor" in report["suggestion"]  # the fix for a division, not "subtract the max before exp"


def test_dropping_the_row_fixes_the_failure_and_dropping_another_does_not(blank_image):
    """Past the recorded steps the replay serves the recorded batches again, in turn: the row (skip-rows) and the batch
    (skip-batch) an arm drops are dropped wherever their batch comes again, or the arm would only delay the failure."""
    workspace, folder, run_id = blank_image
    data = workspace.answer_here("ablate", run_id, folder=folder, arms="skip-rows=8,skip-rows=3,skip-batch")  # as `replay ablate --json`
    assert data["baseline"]["verdict"] == "fails-again"
    assert any("reuse the recorded batches" in warning for warning in data["warnings"]), data["warnings"]
    assert {arm["name"]: arm["verdict"] for arm in data["arms"]} == {"skip-rows=8": "fixes", "skip-rows=3": "no-effect",
                                                                     "skip-batch": "fixes"}


@pytest.mark.parametrize("arm, message", [
    ("skip-rows=a", "'a' must be row numbers of the failing step's batch joined by + (e.g. skip-rows=3+17)"),
    ("skip-rows=99", "skip-rows=99: step 7's batch has 16 rows (0..15); pass the rows replay nan named"),
])
def test_rows_no_batch_has_are_one_line_exit_2_and_nothing_recorded(blank_image, arm, message):
    """The first as the command prints it; the second through the API, which raises the same one-line error (exit 2)
    that `replay ablate` prints (the two doors build one request: tests/unit/test_requests.py)."""
    workspace, folder, run_id = blank_image
    runs_before = len(workspace.store().search_runs())
    if arm == "skip-rows=a":
        result = Workspace(folder).replay("ablate", arm, "--run-id", run_id, env=workspace.env())
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) <= 2  # (the store line, then the one error line)
    else:
        from replaybisect.errors import ReplayError

        with pytest.raises(ReplayError) as refused:
            workspace.answer_here("ablate", run_id, folder=folder, arms=arm)
        assert refused.value.exit_code == 2 and message in str(refused.value) and "\n" not in str(refused.value)
    assert len(workspace.store().search_runs()) == runs_before


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> tuple[Workspace, Path, str]:
    """--plant forward: a NaN made in the forward that binary_cross_entropy refuses; the step raises (no NaN loss)."""
    workspace = Workspace(tmp_path_factory.mktemp("data-rows-crash"))
    folder = workspace.path / "vae"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "main.py")
    done = subprocess.run([sys.executable, "main.py", "--blank", str(BLANK), "--plant", "forward"], cwd=folder,
                          env=workspace.env(), capture_output=True, text=True, timeout=300)
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"replaybisect: step 7 raised RuntimeError; run {run_id} ended as crashed (FAILED) with the state before step 7 "
        f"and its batch kept; replay it with: replay nan --run-id {run_id}"), done.stderr[-2000:]
    return workspace, folder, run_id


def test_a_script_as_written_whose_loss_raises_on_a_nan_is_replayed_to_the_op_and_row(crashed):
    """The step raised in the script's own code (its loss, outside the model): the replay runs the script again,
    gets the same error from the same step, and names the division before it, its line and the row."""
    workspace, folder, run_id = crashed
    tags = workspace.store().tags(run_id)
    assert (tags["failure"], tags["failing_step"], tags["error_type"]) == ("exception", "7", "RuntimeError")
    report = workspace.answer_here("find_nan", run_id, folder=folder)  # `replay nan --json --no-child-run`, in this process
    assert (report["reproduced"], report["category"], report["op"]) == ("exact", "exception", "Tensor.div")
    assert report["exception"]["replayed"] == "RuntimeError: all elements of input should be between 0 and 1"
    assert report["exception"]["as_recorded"] and report["exception"]["op"] == "torch.nn.functional.binary_cross_entropy"
    assert "x = x / x.amax(dim=1, keepdim=True)" in report["source"]
    assert report["rows"]["rows"] == [8] and report["arms"] == ["skip-rows=8"]
    assert "add an eps to the divisor" in report["suggestion"]


def test_ablate_takes_the_crash_as_the_failure(crashed):
    workspace, folder, run_id = crashed
    data = workspace.answer_here("ablate", run_id, folder=folder, arms="skip-rows=8,lr")  # as `replay ablate --json`
    assert (data["baseline"]["verdict"], data["baseline"]["reason"]) == ("fails-again", "raised an exception at step 7, as recorded")
    assert {arm["name"]: arm["verdict"] for arm in data["arms"]} == {"skip-rows=8": "fixes", "lr": "no-effect"}


CRASH_AFTER_UPDATE = """\
import signal, sys, torch, replaybisect
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=2)
for step in range(6):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    if step == 3 and sys.argv[1] == "interrupt":
        signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of step 3, before its update
    optimizer.step()
    optimizer.zero_grad()
    if step == 3 and sys.argv[1] == "after-update":
        raise ValueError("the loop's own check, after the update")
rec.close()
"""


@pytest.mark.parametrize("how, status", [("after-update", "FAILED"), ("interrupt", "KILLED")])
def test_an_exception_after_the_update_or_a_ctrl_c_is_no_failing_step(tmp_path, how, status):
    """Only an exception inside a step, before its update, is the step's failure: one after it (the loop's logging,
    its evaluation) ends the run as a crash, and Ctrl-C ends it KILLED, neither naming a failing step."""
    workspace = Workspace(tmp_path)
    (tmp_path / "loop.py").write_text(CRASH_AFTER_UPDATE)
    done = subprocess.run([sys.executable, "loop.py", how], cwd=tmp_path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    store = workspace.store()
    assert done.returncode != 0 and store.get_run(run_id).info.status == status, done.stderr[-2000:]
    tags = store.tags(run_id)
    assert "failing_step" not in tags and "failure" not in tags
    assert "replay nan" not in done.stderr.strip().splitlines()[-1]


def test_when_no_arm_fixes_it_the_report_says_what_next_in_100_columns(blank_image):
    """lr and clip (and the suggested clip) cannot fix a division by a blank image: the conclusion names the next
    step, the table fits 100 columns, and the clip arms' shared note is said once."""
    workspace, folder, run_id = blank_image
    result = Workspace(folder).replay("ablate", "lr,clip", "--run-id", run_id, env=workspace.env())
    assert result.returncode == 0, result.stderr
    out = result.stdout
    conclusion = next(line for line in out.splitlines() if line.startswith("conclusion"))
    assert "no single change fixes the failure" in conclusion
    assert f"next: replay nan --run-id {run_id} names the op" in conclusion and "skip-rows=R" in conclusion
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 100
    shared = [line for line in out.splitlines() if "clipped before your step's own clip_grad_norm_" in line]
    assert len(shared) == 1 and shared[0].strip().startswith("clip=1, clip=")
