"""A script recorded as it is written (tests/user_loop/script_loop.py, nanoGPT's shape: trains at import, its step a
closure, no build): `replay nan` runs the script again in its folder, takes its objects over at the first rec.step,
reproduces the logged losses exactly and answers, while the script's own writes into the user's folder are refused
and what it prints stays out of `--json`."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Workspace

SCRIPT = Path(__file__).resolve().parent / "user_loop" / "script_loop.py"
DIVERGING = ("--optim=sgd", "--learning_rate=30", "--max_iters=30", "--eval_interval=4")  # NaN at step 9; snapshots every 5 steps


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Workspace, Path, str]:
    """The workspace (its store), the user's project folder (train.py and what it wrote) and the diverged run."""
    workspace = Workspace(tmp_path_factory.mktemp("script-loop"))
    project = workspace.path / "project"
    project.mkdir()
    shutil.copy(SCRIPT, project / "train.py")
    done = subprocess.run([sys.executable, "train.py", *DIVERGING], cwd=project, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "stopped: loss is nan at step 9" in done.stdout
    return workspace, project, re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)


def _tree(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
            for path in sorted(folder.rglob("*"))}


def test_the_run_names_the_script_and_no_functions(recorded):
    from replaybisect.restore import run_config

    workspace, project, run_id = recorded
    cfg = run_config(workspace.store(), run_id)
    assert cfg.train.script.path == str(project / "train.py") and cfg.train.script.cwd == str(project)
    assert list(cfg.train.script.args) == list(DIVERGING)
    assert cfg.train.step_fn is None and cfg.train.build is None
    assert cfg.user.learning_rate == 30 and cfg.user.optim == "sgd"  # the script's settings, as its config dict held them


def test_replay_nan_runs_the_script_again_exactly_and_writes_nothing_in_its_folder(recorded):
    workspace, project, run_id = recorded
    before = _tree(project)
    assert {"train.py", "out", "out/ckpt.pt", "out/log.txt"} <= set(before)
    result = Workspace(project).replay("nan", "--run-id", run_id, "--json", env=workspace.env())
    assert result.returncode == 0, result.stderr
    report = result.json()  # the script prints at start: none of it reaches our stdout
    assert report["reproduced"] == "exact" and report["snapshot_step"] == 5 and report["failing_step"] == 9
    assert report["category"] == "divergence", report["headline"]
    assert report["isolation"]["state_unchanged"] and report["isolation"]["step_repeatable"]  # in-place copies put back
    assert "running train.py again" in result.stderr
    assert _tree(project) == before  # no checkpoint, log line or __pycache__ from the replay


def test_a_changed_script_is_said_and_an_untrusted_one_is_not_run(recorded, monkeypatch):
    import replaybisect as rb
    from replaybisect.errors import UntrustedConfig

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
    try:
        report = rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
    finally:
        script.write_text(original)
    assert any("train.py changed since the run was recorded" in line for line in report.warnings), report.warnings
    assert report.reproduced == "exact"  # a comment changes no loss


def test_writes_into_protected_folders_are_refused_and_reads_are_not(tmp_path):
    """The guard a re-entered script runs under, in a process of its own (audit hooks cannot be removed)."""
    protected, free = tmp_path / "project", tmp_path / "scratch"
    protected.mkdir()
    free.mkdir()
    (protected / "data.txt").write_text("tokens")
    code = f"""
import os, torch
from pathlib import Path
from replaybisect.core import reentry
from replaybisect.verbs.script_child import _refuse_torch_save_under
reentry.refuse_writes_under([Path({str(protected)!r})])
_refuse_torch_save_under([{str(protected)!r}])
def refused(action):
    try:
        action()
    except PermissionError as error:
        assert "writes nothing in your folders" in str(error), error
        return True
    return False
p = Path({str(protected)!r})
assert (p / "data.txt").read_text() == "tokens"
assert refused(lambda: open(p / "new.txt", "w"))
assert refused(lambda: open(p / "data.txt", "a"))
assert refused(lambda: os.remove(p / "data.txt"))
assert refused(lambda: os.rename(p / "data.txt", {str(free / "moved.txt")!r}))
assert refused(lambda: os.mkdir(p / "out"))
assert refused(lambda: torch.save({{}}, p / "ckpt.pt"))
os.makedirs(p, exist_ok=True)  # an existing folder, as scripts create out_dir: not an error
torch.save({{}}, {str(free / "ckpt.pt")!r})
open({str(free / "log.txt")!r}, "w").write("free")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
    assert sorted(path.name for path in protected.iterdir()) == ["data.txt"]
    assert (free / "ckpt.pt").exists() and (free / "log.txt").read_text() == "free"


def test_ablate_runs_each_arm_in_the_script_and_the_lr_arm_fixes_it(recorded, monkeypatch):
    import replaybisect as rb
    from replaybisect.errors import ReplayError

    workspace, project, run_id = recorded
    monkeypatch.chdir(project)
    before = _tree(project)
    result = rb.ablate(run_id, ["lr", "precision"], horizon=30, workers=2, tracking_uri=workspace.tracking_uri, publish=False)
    verdicts = result.verdicts()
    assert result.baseline.verdict == "fails-again" and result.baseline.first_nonfinite_step == 9
    assert verdicts["lr"] == "fixes", result.conclusion  # as plain PyTorch at lr 3 trains this script
    assert verdicts["precision"] == "not-applicable"  # the run is fp32 already
    assert _tree(project) == before
    with pytest.raises(ReplayError, match="recorded from a script"):
        rb.ablate(run_id, ["lr"], executor="submitit", tracking_uri=workspace.tracking_uri, publish=False)
