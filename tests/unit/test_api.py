"""The public Python API, as a notebook uses it: train a run that fails, ask why, read the curves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import replaybisect as rb
from tests.helpers import EXAMPLES

EXAMPLE = EXAMPLES / "nan_forward"


def test_import_is_light_and_exports_what_it_documents():
    code = "import sys, replaybisect as rb; print(sorted(rb.__all__)); print('torch' in sys.modules, 'mlflow' in sys.modules)"
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[1] == "False False"
    for name in rb.__all__:
        assert getattr(rb, name).__doc__, f"{name} has no docstring"


def test_train_find_nan_diagnose_from_python(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = rb.train(["train.steps=40"], config_dir=EXAMPLE, tracking_uri=uri)
    assert isinstance(run, rb.TrainResult)
    assert run.status == "nonfinite" and run.first_nonfinite_step is not None

    report = rb.find_nan(run.run_id, tracking_uri=uri, code_dirs=[EXAMPLE])
    assert isinstance(report, rb.NanReport)
    assert (report.category, report.module, report.reproduced) == ("forward", "gate", "exact")
    assert report.op and "exp" in report.op
    assert report.replay_run_id  # published as a child run

    diagnosis = rb.diagnose(run.run_id, tracking_uri=uri, publish=False)
    assert isinstance(diagnosis, rb.Diagnosis)
    assert any("nan" in finding.pattern.lower() for finding in diagnosis.findings)


def test_untrusted_stored_config_is_a_replay_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's module is neither here nor named by code_dirs
    monkeypatch.delenv("REPLAYBISECT_CODE_DIR", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = rb.train(["train.steps=40"], config_dir=EXAMPLE, tracking_uri=uri)
    with pytest.raises(rb.ReplayError, match="planted_forward"):
        rb.find_nan(run.run_id, tracking_uri=uri)
