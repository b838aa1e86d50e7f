"""A script recorded as it is written (tests/user_loop/script_loop.py, nanoGPT's shape: trains at import, its step a
closure, no build): `replay nan` runs the script again in its folder, takes its objects over at the first rec.step,
reproduces the logged losses exactly and answers, while the script's own writes into the user's folder are refused
and what it prints stays out of `--json`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Workspace, folder_tree, record_script

DIVERGING = ("--optim=sgd", "--learning_rate=30", "--max_iters=30", "--eval_interval=4")  # NaN at step 9; snapshots every 5 steps


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Workspace, Path, str]:
    """The workspace (its store), the user's project folder (train.py and what it wrote) and the diverged run."""
    workspace = Workspace(tmp_path_factory.mktemp("script-loop"))
    project, run_id = record_script(workspace, "project", "script_loop.py", *DIVERGING, expect="stopped: loss is nan at step 9")
    return workspace, project, run_id


def test_the_run_names_the_script_and_no_functions(recorded):
    from replaybisect.replay.restore import run_config

    workspace, project, run_id = recorded
    cfg = run_config(workspace.store(), run_id)
    assert cfg.train.script.path == str(project / "train.py") and cfg.train.script.cwd == str(project)
    assert list(cfg.train.script.args) == list(DIVERGING)
    assert cfg.train.step_fn is None and cfg.train.build is None
    assert cfg.user.learning_rate == 30 and cfg.user.optim == "sgd"  # the script's settings, as its config dict held them


def test_replay_nan_runs_the_script_again_exactly_and_writes_nothing_in_its_folder(recorded):
    workspace, project, run_id = recorded
    before = folder_tree(project)
    assert {"train.py", "out", "out/ckpt.pt", "out/log.txt"} <= set(before)
    result = Workspace(project).replay("nan", "--run-id", run_id, "--json", env=workspace.env())
    assert result.returncode == 0, result.stderr
    report = result.json()  # the script prints at start: none of it reaches our stdout
    assert report["reproduced"] == "exact" and report["snapshot_step"] == 5 and report["failing_step"] == 9
    assert report["category"] == "divergence", report["headline"]
    assert report["isolation"]["state_unchanged"] and report["isolation"]["step_repeatable"]  # in-place copies put back
    assert "running train.py --optim=sgd --learning_rate=30" in result.stderr  # the command line replayed, said first
    from replaybisect.verbs.nan.engine import NanReport

    assert NanReport.from_json(report).to_json() == report  # how a report comes back from the script's process
    assert folder_tree(project) == before  # no checkpoint, log line or __pycache__ from the replay


def test_a_changed_script_is_refused_and_an_untrusted_one_is_not_run(recorded, monkeypatch):
    import replaybisect as rb
    from replaybisect.errors import ReplayError, UntrustedConfig

    workspace, project, run_id = recorded
    elsewhere = workspace.path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.delenv("REPLAYBISECT_CODE_DIR")
    monkeypatch.chdir(elsewhere)  # the project is not this folder's, and no --code-dir names it
    with pytest.raises(UntrustedConfig, match="refused to run .*train.py again"):
        rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
    monkeypatch.chdir(project)
    script = project / "train.py"
    original = script.read_text()
    script.write_text(original + "# edited after the run\n")
    before = folder_tree(project)
    try:  # a replay runs the script only as the run ran it: the file with the sha256 the run recorded
        with pytest.raises(ReplayError, match=r"train.py changed since run .* recorded it .*put it back as it was"):
            rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
        assert folder_tree(project) == before  # nothing ran
    finally:
        script.write_text(original)
    # replay check reads the run through the script run again too, writing nothing in its folder
    before = folder_tree(project)
    report = rb.check(run_id=run_id, tracking_uri=workspace.tracking_uri, publish=False, only="grad")
    assert report.checked_run_id == run_id and report.snapshot_step is not None
    assert {check.name: check.status for check in report.checks}["grad.missing"] == "pass"
    assert folder_tree(project) == before


def test_writes_into_protected_folders_are_refused_and_reads_are_not(tmp_path):
    """The guard a re-entered script runs under, in a process of its own (audit hooks cannot be removed); a checkpoint
    saved with torch.save, or into a file the script opens for writing, goes to the replay's temp folder instead, so
    the script's loop goes on."""
    protected, free = tmp_path / "project", tmp_path / "scratch"
    protected.mkdir()
    free.mkdir()
    (protected / "data.txt").write_text("tokens")
    code = f"""
import os, torch
from pathlib import Path
from replaybisect.core import reentry
from replaybisect.verbs.script_child import _redirect_saves_under
reentry.refuse_writes_under([Path({str(protected)!r})])
_redirect_saves_under([{str(protected)!r}], Path({str(free / "saved")!r}))
def refused(action):
    try:
        action()
    except PermissionError as error:
        assert "writes nothing in your folders" in str(error), error
        return True
    return False
p = Path({str(protected)!r})
assert (p / "data.txt").read_text() == "tokens"
assert refused(lambda: (p / "new.txt").write_text("x"))
assert refused(lambda: os.open(p / "data.txt", os.O_WRONLY))
assert refused(lambda: os.remove(p / "data.txt"))
assert refused(lambda: os.rename(p / "data.txt", {str(free / "moved.txt")!r}))
assert refused(lambda: os.mkdir(p / "out"))
torch.save({{"step": 3}}, p / "out" / "ckpt.pt")  # redirected, its folder made there
with open(p / "model.pt", "wb") as f:  # word_language_model's way: redirected too
    torch.save({{"step": 4}}, f)
with open(p / "model.pt", "rb") as f:  # and read back from where it went
    assert torch.load(f) == {{"step": 4}}
assert torch.load(p / "out" / "ckpt.pt") == {{"step": 3}}
os.makedirs(p, exist_ok=True)  # an existing folder, as scripts create out_dir: not an error
torch.save({{}}, {str(free / "ckpt.pt")!r})
open({str(free / "log.txt")!r}, "w").write("free")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
    assert sorted(path.name for path in protected.iterdir()) == ["data.txt"]
    assert (free / "ckpt.pt").exists() and (free / "log.txt").read_text() == "free"
    import torch

    assert torch.load(free / "saved" / "project" / "out" / "ckpt.pt") == {"step": 3}
    assert torch.load(free / "saved" / "project" / "model.pt") == {"step": 4}


def test_ablate_runs_each_arm_in_the_script_and_the_lr_arm_fixes_it(recorded, monkeypatch):
    import replaybisect as rb
    from replaybisect.errors import ReplayError

    workspace, project, run_id = recorded
    monkeypatch.chdir(project)
    before = folder_tree(project)
    result = rb.ablate(run_id, ["lr", "precision"], horizon=30, workers=2, tracking_uri=workspace.tracking_uri, publish=False)
    verdicts = result.verdicts()
    assert result.baseline.verdict == "fails-again" and result.baseline.first_nonfinite_step == 9
    assert verdicts["lr"] == "fixes", result.conclusion  # as plain PyTorch at lr 3 trains this script
    assert verdicts["precision"] == "not-applicable"  # the run is fp32 already
    assert folder_tree(project) == before
    with pytest.raises(ReplayError, match="recorded from a script"):
        rb.ablate(run_id, ["lr"], executor="submitit", tracking_uri=workspace.tracking_uri, publish=False)


def test_a_hand_written_update_and_an_lr_the_script_changes_replay_exactly_and_ablate(recorded, monkeypatch):
    """word_language_model's shape: no optimizer object (p.data.add_), the hidden state carried, a module-global lr
    the epoch loop grows (the replay takes the objects over at the first step, where lr still holds its first value:
    the recorded value is set again before each replayed step). NaN at step 14, in the second epoch."""
    import replaybisect as rb

    workspace, _, _ = recorded
    project, run_id = record_script(workspace, "rnn-project", "rnn_script.py", "--lr", "2", "--growth", "8", "--epochs", "4",
                                     expect="stopped: loss is nan at step 14")
    monkeypatch.chdir(project)
    report = rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.reproduced, report.category, report.snapshot_step) == ("exact", "divergence", 12), report.headline
    assert report.module == "rnn"
    result = rb.ablate(run_id, ["lr"], horizon=20, workers=1, tracking_uri=workspace.tracking_uri, publish=False)
    assert result.baseline.verdict == "fails-again" and result.verdicts() == {"lr": "fixes"}, result.conclusion


def test_the_manual_update_stands_for_the_step_and_an_lr_factor_scales_it():
    import torch

    from replaybisect.core.user_step import ManualUpdate, unpack_parts

    model = torch.nn.Linear(3, 1)
    parts = unpack_parts({"model": model, "optimizer": None}, "Recorder")
    update = parts["optimizer"]
    assert isinstance(update, ManualUpdate) and update.param_groups[0]["lr"] == 1.0
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 3)).sum().backward()
    update.mark()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.5)  # the user's own update
    after = [p.detach().clone() for p in model.parameters()]
    update.step()  # at lr 1.0: the step's update, bit for bit
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after))
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    update.mark()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.5)
    update.param_groups[0]["lr"] = 0.1  # an lr arm's factor during optimizer.step()
    update.step()
    for p, b, a in zip(model.parameters(), before, after):
        assert torch.allclose(p, b + 0.1 * (a - b))


def test_a_stored_script_that_is_not_the_users_own_is_refused(tmp_path):
    """train.script comes from the store: the file must be the user's (a trusted folder, outside artifact folders),
    run from a trusted folder, and a module must be that file; a damaged entry is one line."""
    from omegaconf import OmegaConf

    from replaybisect.core.trust import Trust
    from replaybisect.errors import ReplayError, UntrustedConfig
    from replaybisect.replay.script import admitted_script

    project, other = tmp_path / "project", tmp_path / "other"
    (project / "pkg").mkdir(parents=True)
    other.mkdir()
    (project / "train.py").write_text("")
    (project / "pkg" / "train.py").write_text("")
    (other / "evil.py").write_text("")
    trust = Trust(roots=(str(project),), prefixes=())

    def entry(**fields):
        script = {"path": str(project / "train.py"), "module": None, "args": ["--lr=1"], "cwd": str(project), **fields}
        return OmegaConf.create({"train": {"script": script}})

    assert admitted_script(entry(), trust, "r")["args"] == ["--lr=1"]
    assert admitted_script(entry(path=str(project / "pkg" / "train.py"), module="pkg.train"), trust, "r")["module"] == "pkg.train"
    refusals = [
        (entry(path=str(other / "evil.py")), UntrustedConfig, "not a .py file of yours"),
        (entry(path="train.py"), UntrustedConfig, "not a .py file of yours"),  # relative: read against another folder
        (entry(cwd=str(other)), UntrustedConfig, "not your working folder"),
        (entry(module="timeit"), UntrustedConfig, "refused to run module 'timeit'"),
        (entry(path=str(project / "mlruns" / "1" / "0" / "artifacts" / "x.py")), UntrustedConfig, "not a .py file of yours"),
        (entry(args="--lr=1"), ReplayError, "train.script is not"),
        (OmegaConf.create({"train": {"script": "train.py"}}), ReplayError, "train.script is not"),
    ]
    for cfg, kind, words in refusals:
        with pytest.raises(kind, match=re.escape(words)):
            admitted_script(cfg, trust, "r", artifact_root=None)


def test_recorded_variables_set_only_the_scalars_the_step_reads():
    import functools

    import torch

    from replaybisect.core import user_step

    namespace = {"torch": torch, "lr": 0.5, "model": torch.nn.Linear(1, 1)}
    exec("def step(batch):\n    return model(batch) * lr + torch.zeros(1)\n", namespace)
    step = namespace["step"]
    assert user_step.step_variables(step) == {"global:lr": 0.5}
    record = user_step.pack(torch.ones(1, 1), torch.device("cpu"), variables={"global:lr": 8.0, "global:model": 1,
                                                                              "global:torch": 2, "global:__builtins__": 3})
    user_step.apply_recorded_variables(record, step)
    assert namespace["lr"] == 8.0 and isinstance(namespace["model"], torch.nn.Module) and namespace["torch"] is torch
    partial = functools.partial(lambda batch, scale: batch * scale, scale=2)  # no code of its own: nothing stored, nothing set
    assert user_step.step_variables(partial) == {}
    user_step.apply_recorded_variables(user_step.pack(torch.ones(1), torch.device("cpu"), variables={}), partial)


def test_a_hydra_app_replays_with_its_outputs_kept_out_of_the_project(recorded, monkeypatch):
    """Its folder holds a hydra/ folder of notes: a name the preloaded server imported, so the script runs again in a
    fresh interpreter (replay/script.py), not forked from the server; the replay is the same."""
    import replaybisect as rb
    from replaybisect.core.processes import shadows_preloaded

    workspace, _, _ = recorded
    project, run_id = record_script(workspace, "hydra-project", "hydra_script.py", "lr=0.3", expect="loss is inf at step 16")
    (project / "hydra").mkdir()
    (project / "hydra" / "notes.md").write_text("the sweeps we tried\n")
    assert shadows_preloaded(project)
    before = folder_tree(project)
    assert any(name.startswith("outputs/") for name in before)  # Hydra's output folder, from the recording
    monkeypatch.chdir(project)
    report = rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.reproduced, report.category, report.failing_step) == ("exact", "divergence", 16), report.headline
    assert folder_tree(project) == before  # the replay's Hydra outputs went to its temp folder


def test_a_lightning_script_that_trains_at_import_replays_in_itself(recorded, monkeypatch):
    """Lightning's README shape: the module and trainer.fit at the top level, the default logger writing
    lightning_logs/ in the working folder. The replay runs the script again with its Trainers quiet (no logger,
    no checkpoints) and takes the module over as training starts."""
    import replaybisect as rb
    from replaybisect.replay.restore import run_config

    workspace, _, _ = recorded
    project, run_id = record_script(workspace, "lightning-project", "lightning_script.py", "0.3", expect="loss is inf at step 17")
    cfg = run_config(workspace.store(), run_id)
    assert cfg.train.script.path == str(project / "train.py") and cfg.user.module == {"class": "LitRegression"}
    before = folder_tree(project)
    assert any(name.startswith("lightning_logs/") for name in before)
    monkeypatch.chdir(project)
    report = rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.reproduced, report.category, report.failing_step) == ("exact", "divergence", 17), report.headline
    assert folder_tree(project) == before  # (ablate's arms take the module over the same way: tested on the scripts above)
