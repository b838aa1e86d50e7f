"""A learning rate too high, the most common failure there is: `replay nan` calls it a divergence (the climb, the
layer whose norms climbed first, next `replay ablate lr,clip`, no op blamed) on runs from `replay train`, a user's
own loop and Lightning; `replay diagnose` uses the same words. Op-level faults keep their op (tests/e2e/test_nan.py,
tests/e2e/test_zoo.py); here, a climb driven by a buffer that scales itself is not a divergence."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPLAY, TESTS, Workspace, as_printed, train_example

HERE = TESTS / "diverging"
OP_ADVICE = ("eps", "log-space", "op named", "fix the op", "subtract the max", "clamp")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    workspace = Workspace(tmp_path_factory.mktemp("divergence"))
    shutil.copytree(HERE, workspace.path / "project")
    return workspace


def _record(ws: Workspace, script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, script, *args], cwd=ws.path / "project", env=ws.env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "NonFiniteStep" in done.stderr, f"exit {done.returncode}\n{done.stderr[-2000:]}"
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    _assert_one_line_failure(done.stderr, run_id)
    return run_id


def _assert_one_line_failure(stderr: str, run_id: str) -> None:
    """The script ends with the answer and the next command, not a traceback through the framework (a Hydra app:
    between Hydra's own two lines, 'Error executing job ...' and its HYDRA_FULL_ERROR hint)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if lines[-1].startswith("Set the environment variable HYDRA_FULL_ERROR"):
        assert lines[-3].startswith("Error executing job"), stderr[-3000:]
        lines = lines[:-1]
    last = lines[-1]
    assert last.startswith("replaybisect.NonFiniteStep: ") and last.endswith(f"replay nan --run-id {run_id}"), last


def _nan(ws: Workspace, run_id: str, cwd: Path) -> dict:
    done = subprocess.run([REPLAY, "nan", "--run-id", run_id, "--json"], cwd=cwd, env=ws.env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def _nan_here(ws: Workspace, run_id: str) -> dict:
    """What `replay nan --run-id RUN_ID --json` prints, from `rb.find_nan` in this process (the command's request,
    engine and published child run; a `replay` start-up costs seconds). The own loop's answer comes from the CLI."""
    import replaybisect as rb

    return as_printed(rb.find_nan(run_id, tracking_uri=ws.tracking_uri))


def _assert_divergence(report: dict, earliest: str) -> None:
    assert report["category"] == "divergence", (report["category"], report["evidence"])
    assert report["reproduced"] == "exact"
    assert report["module"] == earliest, report["evidence"]  # the earliest layer to climb
    assert report["op"] is None and report["source"] is None
    assert report["ablate_command"] == f"replay ablate lr,clip --run-id {report['run_id']}"
    advice = report["suggestion"].lower()
    assert not any(words in advice for words in OP_ADVICE), advice
    growth = report["divergence"]["growth"]
    assert growth["factor"] >= 100 and growth["last_step"] - growth["onset_step"] >= 2
    assert report["headline"].startswith(f"divergence at step {report['failing_step']}: ")
    assert f"x{growth['factor']:.2g}" in report["headline"] and earliest in report["headline"]
    assert report["overflow"]["phase"] in ("forward", "loss", "backward", "update")  # where it overflowed: a fact, not a culprit
    assert report["layer_history"][earliest]  # the layers x steps picture has the climb


@pytest.fixture(scope="module")
def own_loop_run(ws) -> str:
    return _record(ws, "diverging_loop.py", "0.04", "40")


def test_own_loop_lr_too_high_is_a_divergence(ws, own_loop_run):
    """The issue's own-loop MLP: predictions near 1e22 after a few steps of exponential growth; the MSE overflows.
    Before: `loss in loss (computed in your step function)`, next 'clamp or use a log-space loss'."""
    report = _nan(ws, own_loop_run, ws.path / "project")
    _assert_divergence(report, "0")
    assert report["overflow"]["op"] == "torch.nn.functional.mse_loss"
    store = ws.store()
    child = store.get_run(report["replay_run_id"])
    assert child.info.run_name == f"divergence (lr, clip) · nan @ step {report['failing_step']}"  # shown in MLflow's run list


def test_diagnose_says_divergence_too(ws, own_loop_run):
    """One vocabulary: diagnose reads the same curves and says divergence, next ablate lr,clip."""
    from replaybisect.verbs.diagnose.engine import diagnose

    result = diagnose(ws.store(), own_loop_run)
    finding = next(f for f in result.findings if f.pattern == "nan-after-k")
    assert "a divergence (grad norm x" in finding.summary and finding.next.endswith(f"ablate lr,clip --run-id {own_loop_run}")


def test_lightning_lr_too_high_is_a_divergence(ws):
    """The issue's LightningModule: before, `backward`, module -, op -, and 'fix the op named above'."""
    pytest.importorskip("lightning")
    run_id = _record(ws, "lit_diverging.py", "0.03", "60")
    _assert_divergence(_nan_here(ws, run_id), "body.0")


def test_a_hydra_app_that_diverges_ends_with_one_line(ws):
    """Hydra prints a failing app's traceback (its own frames trimmed); a stopped run is no crash: the app ends with
    the one line. REPLAYBISECT_FULL_ERROR=1 shows the whole story."""
    pytest.importorskip("hydra")
    _record(ws, "hydra_diverging.py", "+lr=0.04", "+steps=40")
    done = subprocess.run([sys.executable, "hydra_diverging.py", "+lr=0.04", "+steps=40"], cwd=ws.path / "project",
                          env={**ws.env(), "REPLAYBISECT_FULL_ERROR": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" in done.stderr and "NonFiniteStep" in done.stderr, done.stderr[-2000:]


def test_replay_train_lr_explosion_is_a_divergence(ws):
    """examples/ablate_lr_explosion (SGD, a warmup to lr 0.6, bf16): before, `backward` with no module and no op."""
    result = train_example(ws.store(), "ablate_lr_explosion")
    assert result.status == "nonfinite"
    report = _nan_here(ws, result.run_id)
    _assert_divergence(report, report["divergence"]["precursor"])
    assert report["module"].startswith("net.")


def test_a_self_scaling_buffer_is_not_a_divergence():
    """The curves climb by orders of magnitude, but a buffer scaled itself x1e6: the model's own state drove it."""
    from replaybisect.verbs.nan.divergence import decide

    grad_norms = [(s, 2.0 * 10 ** s) for s in range(8)]
    verdict = decide([], grad_norms, {}, {}, ("gain", 1e6), None)
    assert not verdict.divergence and "gain" in verdict.reason
    assert decide([], grad_norms, {}, {}, None, None).divergence
    flat = [(s, 2.0 + 0.1 * (s % 3)) for s in range(30)]
    assert not decide([], flat, {}, {}, None, None).divergence


def test_the_grad_norm_trend_is_scipys_linregress():
    """history_fit's line (slope, r, p) is linregress's (bit for bit with the scipy of this writing: the same
    arithmetic), computed without importing scipy.stats (half a second)."""
    import random

    from scipy import stats

    from replaybisect.core.trend import linear_fit

    rng = random.Random(0)
    for _ in range(300):
        steps = sorted(rng.sample(range(500), rng.randint(3, 50)))
        rate, noise = rng.choice([0.0, 1e-3, 0.05, 2.0]), rng.choice([1e-6, 0.01, 1.0, 10.0])
        logs = [rate * step + rng.gauss(0, noise) for step in steps]
        fit = stats.linregress(steps, logs)
        assert linear_fit(steps, logs) == pytest.approx((fit.slope, fit.rvalue, fit.pvalue), rel=1e-12, abs=1e-300)
    assert linear_fit([0, 1, 2, 3], [0.0, 1.0, 2.0, 3.0]) == (1.0, 1.0, stats.linregress([0, 1, 2, 3], [0, 1, 2, 3]).pvalue)
