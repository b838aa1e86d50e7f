"""False alarms on healthy scripts no one here tuned for us: pytorch/examples' shapes recorded as their pages say,
then `replay diagnose` and `replay check --run-id` read them, and neither may flag anything. A regression updated by
hand, a float64 LSTM trained with LBFGS (the step-function form: its closure is re-evaluated inside step()), a VAE
and an RNN language model updated by hand (word_language_model's main.py). The logged losses are the script's own,
to the bit (a float64 loss is not rounded to float32 on its way to the store)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TESTS, Workspace, in_folder

HERE = TESTS / "user_loop"

# script: (arguments, how its printed losses read, how many steps it logs)
SCRIPTS = {
    "regression_script.py": (("--max-batches", "300"), None, 300),
    "time_sequence_script.py": (("--steps", "20"), r"^loss: (\S+)$", 20),
    "vae_script.py": (("--epochs", "3"), None, 30),
    "wlm_script.py": (("--lr", "5", "--epochs", "8"), None, 80),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Workspace, Path, dict[str, tuple[str, str]]]:
    workspace = Workspace(tmp_path_factory.mktemp("healthy"))
    folder = workspace.path / "scripts"
    folder.mkdir()
    runs = {}
    for script, (args, _, _) in SCRIPTS.items():
        shutil.copy(HERE / script, folder / script)
        done = subprocess.run([sys.executable, script, *args], cwd=folder, env=workspace.env(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"{script}\n{done.stderr[-2000:]}"
        runs[script] = (re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1), done.stdout)
    return workspace, folder, runs


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_healthy_script_gets_no_finding_from_diagnose_and_no_warning_from_check(recorded, script):
    import replaybisect as rb

    workspace, folder, runs = recorded
    run_id, _ = runs[script]
    assert len(workspace.store().metric_history(run_id, "loss")) == SCRIPTS[script][2]
    diagnosis = rb.diagnose(run_id, tracking_uri=workspace.tracking_uri, publish=False)
    assert diagnosis.healthy, [f.summary for f in diagnosis.findings] or diagnosis.skipped
    with in_folder(folder):
        report = rb.check(run_id=run_id, tracking_uri=workspace.tracking_uri, publish=False)
    flagged = [(c.name, c.status, c.detail) for c in report.checks if c.status not in ("pass", "skip")]
    assert not flagged, flagged
    assert sum(c.status == "pass" for c in report.checks) >= 5, [(c.name, c.status, c.detail) for c in report.checks]


def test_lbfgs_is_observed_at_its_first_evaluation_and_its_float64_loss_is_stored_unrounded(recorded):
    """The gradient norm is the first closure evaluation's (its pre-hook ran before any gradient: the norm was 0),
    the loss the one LBFGS returns, as the script printed it, in float64; check's step-size rules say why they skip."""
    import replaybisect as rb

    workspace, folder, runs = recorded
    run_id, stdout = runs["time_sequence_script.py"]
    printed = [float(value) for value in re.findall(SCRIPTS["time_sequence_script.py"][1], stdout, re.M)]
    logged = [value for _, value in workspace.store().metric_history(run_id, "loss")]
    assert logged[0] == printed[0] and set(logged) <= set(printed)  # each step's first evaluation, to the bit
    assert all(norm > 0 for _, norm in workspace.store().metric_history(run_id, "grad_norm"))
    with in_folder(folder):
        report = rb.check(run_id=run_id, tracking_uri=workspace.tracking_uri, publish=False, only=["grad.update_ratio", "lr.range_test"])
    assert {c.status for c in report.checks} == {"skip"} and all("quasi-Newton" in c.detail for c in report.checks)
