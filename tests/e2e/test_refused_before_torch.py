"""`replay nan` and `replay ablate` refuse a run that never failed before torch is imported: the command run as a
process (`python -X importtime -m replaybisect`), its imports read back (unit/test_units_store.py: the store itself)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replaybisect.store import open_store


@pytest.fixture
def store(tmp_path):
    return open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.mark.parametrize("verb, said", [("nan", "never went non-finite"), ("ablate", "never failed")])
def test_a_run_that_never_failed_is_refused_before_torch_is_imported(store, verb, said):
    """`replay nan` and `replay ablate` on a run that never failed: one line from the run's tags and metrics alone,
    seconds sooner (torch and the verb's engine are not imported)."""
    run_id = store.create_run("train")
    store.log_metrics(run_id, [("loss", 2.0, 0), ("loss", 1.5, 1), ("grad_norm", 0.5, 0)])
    store.finish_run(run_id, "ok")
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "replaybisect", verb, "--run-id", run_id, "--tracking-uri",
                           store.uri], capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    said_lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and "torch" not in imported, done.stderr[-2000:]
    assert any(said in line for line in said_lines) and len(said_lines) <= 2, said_lines  # (the store line, the refusal)
