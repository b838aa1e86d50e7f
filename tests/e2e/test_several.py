"""Several models and optimizers in one step: pytorch/examples dcgan/main.py recorded as written
(tests/user_loop/gan_script.py: `Recorder({"G": netG, "D": netD}, {"G": optimizerG, "D": optimizerD})`, no code moved),
whose discriminator scales each image by its max, on data with one blank image: 0/0 in D's forward, which BCELoss
refuses by raising. Every verb answers it: `nan` replays the crash from a snapshot after step 0 (both optimizers'
moments restored) and names D, the division and the row; `ablate` proves the row and changes one optimizer's lr;
`diagnose` and `runs` name the crash. The step-function form records the same two optimizers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import TESTS, Workspace

SCRIPT = TESTS / "user_loop" / "gan_script.py"
BLANK = 70  # the data set index of the all-zero image: with --manualSeed 1 it is row 6 of step 8's batch


def _run(folder: Path, workspace: Workspace, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "main.py", *args], cwd=folder, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def gan(tmp_path_factory) -> tuple[Workspace, Path, str]:
    workspace = Workspace(tmp_path_factory.mktemp("gan"))
    folder = workspace.path / "dcgan"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "main.py")
    done = _run(folder, workspace, "--blank", str(BLANK))
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(
        f"replaybisect: step 8 raised RuntimeError; run {run_id} ended as crashed (FAILED)"), done.stderr[-2000:]
    return workspace, folder, run_id


def test_recording_the_gan_changes_nothing_it_trains(gan, tmp_path):
    """The three added lines (marked # 1..3) taken out again: the plain script prints the same losses, bit for bit."""
    workspace, folder, _ = gan
    plain = tmp_path / "plain"
    plain.mkdir()
    lines = (folder / "main.py").read_text().splitlines()
    kept = [line for line in lines if not re.search(r"#\s*[123]$", line) and "config=vars(opt), snapshot_every" not in line]
    (plain / "main.py").write_text("\n".join(kept) + "\n")
    recorded, unrecorded = _run(folder, workspace, "--niter", "1"), _run(plain, workspace, "--niter", "1")
    assert unrecorded.returncode == 0 and recorded.returncode == 0, (unrecorded.stderr[-1000:], recorded.stderr[-1000:])
    assert recorded.stdout == unrecorded.stdout and recorded.stdout.count("Loss_D") == 20


def test_nan_replays_the_crash_from_a_snapshot_and_names_the_discriminator(gan):
    workspace, folder, run_id = gan
    tags = workspace.store().tags(run_id)
    assert (tags["failure"], tags["failing_step"], tags["optimizers"]) == ("exception", "8", "G,D")
    report = workspace.answer_here("find_nan", run_id, folder=folder)  # `replay nan --json --no-child-run`, in this process
    # replayed from snapshot 4 through steps 4..7 with both Adams' moments: exact, and the state at step 8 bit-identical
    assert (report["snapshot_step"], report["reproduced"]) == (4, "exact")
    assert (report["category"], report["phase"], report["module"], report["op"]) == ("exception", "forward", "D", "Tensor.div")
    assert "input = input / input.abs().amax(dim=(1, 2, 3), keepdim=True)" in report["source"]
    assert report["exception"]["replayed"] == "RuntimeError: all elements of input should be between 0 and 1"
    assert report["rows"]["rows"] == [6] and report["arms"] == ["skip-rows=6"]
    assert any("bit-identical" in line for line in report["evidence"])


def test_ablate_proves_the_row_and_changes_one_optimizer(gan):
    workspace, folder, run_id = gan
    data = workspace.answer_here("ablate", run_id, folder=folder, arms="skip-rows=6,lr[D],lr[G]=x0.5")  # as `replay ablate --json`
    assert data["baseline"]["verdict"] == "fails-again"
    arms = {arm["name"]: arm for arm in data["arms"]}
    assert {name: arm["verdict"] for name, arm in arms.items()} == {"skip-rows=6": "fixes", "lr[D]": "no-effect",
                                                                    "lr[G]=x0.5": "no-effect"}
    assert arms["lr[D]"]["change"].endswith("for optimizer D only")
    # each optimizer's change is its own: the replayed losses before the failure differ from each other and the baseline
    finals = {data["baseline"]["final_loss"], arms["lr[D]"]["final_loss"], arms["lr[G]=x0.5"]["final_loss"]}
    assert len(finals) == 3


@pytest.mark.parametrize("arm, message", [
    ("lr[E]", "arm lr[E]: run {run} has no optimizer named 'E' (its optimizers are G, D); pass lr[NAME] with one of its names, or lr for all"),
    ("clip[D]", "arm 'clip[D]': only lr and warmup change one optimizer of several ([name]); pass clip without [D]"),
    ("lr[D", "arm 'lr[D': name one optimizer in brackets, as the run was recorded with it (lr[D]=x0.1)"),
])
def test_an_optimizer_the_run_has_not_is_one_line_exit_2(gan, arm, message):
    """The first as `replay ablate` prints it; the others through the API, which raises the same one-line error (exit
    2) the command prints (the two doors build one request: tests/unit/test_requests.py)."""
    workspace, folder, run_id = gan
    runs_before = len(workspace.store().search_runs())
    if arm == "lr[E]":
        result = Workspace(folder).replay("ablate", arm, "--run-id", run_id, env=workspace.env())
        assert result.returncode == 2 and message.format(run=run_id) in result.stderr and "Traceback" not in result.stderr
    else:
        from replaybisect.errors import ReplayError

        with pytest.raises(ReplayError) as refused:
            workspace.answer_here("ablate", run_id, folder=folder, arms=arm)
        line = str(refused.value)
        assert refused.value.exit_code == 2 and message.format(run=run_id) in line and "\n" not in line
    assert len(workspace.store().search_runs()) == runs_before


def test_diagnose_and_runs_name_the_crash(gan):
    workspace, folder, run_id = gan
    findings = workspace.answer_here("diagnose", run_id, folder=folder)["findings"]  # `replay diagnose --json`, in this process
    exception = next(f for f in findings if f["pattern"] == "exception")
    assert exception["summary"].startswith("step 8 raised RuntimeError: all elements of input should be between 0 and 1")
    assert exception["next"] == f"replay nan --run-id {run_id}"
    # the user's frame: the loss that raised, in the loop (not torch's, nor the recorder's mode around the op)
    assert re.search(r"main\.py:\d+ in main: errD_real = criterion\(output, label\)", exception["evidence"]["frame"])
    runs = Workspace(folder).replay("runs", "--json", env=workspace.env())
    row = next(run for run in runs.json()["runs"] if run["run_id"] == run_id)
    assert row["status"] == "crashed" and row["crash"].startswith("step 8: RuntimeError: all elements of input")


STEP_FN = """\
import sys, torch, replaybisect
torch.manual_seed(0)
G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
D = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Sigmoid())
optG, optD = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)
criterion = torch.nn.BCELoss()
blank = int(sys.argv[1])


def step(batch):
    real, noise = batch
    D.zero_grad()
    scaled = real / real.abs().amax(dim=1, keepdim=True)  # 0 / 0 for a blank row
    loss_d = criterion(D(scaled).squeeze(1), torch.ones(len(real)))
    fake = G(noise)
    loss_d = loss_d + criterion(D(fake.detach()).squeeze(1), torch.zeros(len(real)))
    loss_d.backward()
    optD.step()
    G.zero_grad()
    loss_g = criterion(D(fake).squeeze(1), torch.ones(len(real)))
    loss_g.backward()
    optG.step()
    return loss_d.detach() + loss_g.detach()


rec = replaybisect.Recorder({"G": G, "D": D}, {"G": optG, "D": optD}, step_fn=step, snapshot_every=3)
for index in range(10):
    real = torch.randn(6, 8)
    if index == blank:
        real[2] = 0.0
    rec.step((real, torch.randn(6, 4)))
rec.close()
"""


def test_the_step_function_form_records_both_optimizers(tmp_path):
    """rec.step with a step function over two models and two optimizers: the replay from snapshot 6 restores both
    Adams and reproduces the raised step exactly, naming D's input row."""
    workspace = Workspace(tmp_path)
    (tmp_path / "gan.py").write_text(STEP_FN)
    done = subprocess.run([sys.executable, "gan.py", "7"], cwd=tmp_path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    assert "step 7 raised RuntimeError" in done.stderr, done.stderr[-2000:]
    report = workspace.answer_here("find_nan", run_id)  # `replay nan --json --no-child-run`, in this process
    assert (report["snapshot_step"], report["reproduced"], report["op"]) == (6, "exact", "Tensor.div")
    assert report["rows"]["rows"] == [2]


def test_several_optimizers_keep_their_state_in_one_state_dict():
    """The joined state dict is one optimizer's layout (what a snapshot stores) and loads back into each optimizer."""
    from replaybisect.core import several

    torch.manual_seed(0)
    G, D = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    optimizers = several.Optimizers({"G": torch.optim.Adam(G.parameters(), lr=0.1), "D": torch.optim.SGD(D.parameters(), lr=0.2, momentum=0.9)})
    (G(torch.randn(4, 3)).sum() + D(torch.randn(4, 2)).sum()).backward()
    optimizers.step()
    saved = optimizers.state_dict()
    assert [group["params"] for group in saved["param_groups"]] == [[0, 1], [2, 3]] and sorted(saved["state"]) == [0, 1, 2, 3]
    fresh = several.Optimizers({"G": torch.optim.Adam(G.parameters(), lr=0.1), "D": torch.optim.SGD(D.parameters(), lr=0.2, momentum=0.9)})
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.named["G"].state[G.weight]["exp_avg"], optimizers.named["G"].state[G.weight]["exp_avg"])
    assert torch.equal(fresh.named["D"].state[D.bias]["momentum_buffer"], optimizers.named["D"].state[D.bias]["momentum_buffer"])
    fresh.param_groups[1]["lr"] = 0.5  # a group of the joined optimizer is the member's own
    assert fresh.named["D"].param_groups[0]["lr"] == 0.5 and D.weight in fresh.state


def test_check_reads_the_gan_through_its_own_loop(gan):
    """`replay check --run-id` on a script recorded as written: the probes run through the re-entered script's loop
    (the modules named by model, G.* and D.*); the checks that need hundreds of steps more than the loop runs say so."""
    workspace, folder, run_id = gan
    result = Workspace(folder).replay("check", "--run-id", run_id, "--json", env=workspace.env())
    assert result.returncode == 0, result.stderr
    checks = {check["name"]: check for check in result.json()["checks"]}
    assert {checks[name]["status"] for name in ("grad.nonfinite", "grad.missing", "grad.vanishing", "grad.update_ratio")} == {"pass"}
    assert "all 12 parameters got non-zero gradients" in checks["grad.missing"]["detail"]
    assert "D.main.6" in checks["act.saturation"]["detail"] and "G.main" in checks["act.relu_zero"]["detail"]
    for name in ("overfit.one_batch", "lr.range_test"):
        assert checks[name]["status"] == "skip" and "the script's own loop ended before this check's steps" in checks[name]["detail"]
    assert result.json()["status"] == "pass" and result.json()["checked_run_id"] == run_id


def test_several_schedulers_step_and_keep_their_state_as_one():
    from replaybisect.core import several

    G, D = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optG, optD = torch.optim.SGD(G.parameters(), lr=1.0), torch.optim.SGD(D.parameters(), lr=1.0)
    schedulers = several.Schedulers({"G": torch.optim.lr_scheduler.StepLR(optG, 1, gamma=0.5),
                                     "D": torch.optim.lr_scheduler.StepLR(optD, 1, gamma=0.1)})
    optG.step(), optD.step(), schedulers.step()
    assert schedulers.get_last_lr() == [0.5, 0.1]
    fresh = several.Schedulers({"G": torch.optim.lr_scheduler.StepLR(torch.optim.SGD(G.parameters(), lr=1.0), 1, gamma=0.5),
                                "D": torch.optim.lr_scheduler.StepLR(torch.optim.SGD(D.parameters(), lr=1.0), 1, gamma=0.1)})
    fresh.load_state_dict(schedulers.state_dict())
    assert fresh.state_dict() == schedulers.state_dict()


@pytest.mark.parametrize("models, optimizers, message", [
    ({"my model": torch.nn.Linear(2, 2)}, None, "model name 'my model' is not a Python identifier"),
    ({}, None, "the models dict is empty"),
    ({"G": "not a module"}, None, "model 'G' is a str; pass a torch.nn.Module for each name"),
])
def test_several_models_by_bad_names_are_refused_in_one_line(tmp_path, monkeypatch, models, optimizers, message):
    """Refused before any run is recorded (nothing is created in the store's folder)."""
    import replaybisect
    from replaybisect.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        replaybisect.Recorder(models, optimizers or torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    assert list(tmp_path.iterdir()) == []
