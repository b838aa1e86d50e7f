"""`replay ablate` end to end: planted failures trained into a real SQLite MLflow store, then the installed
`replay ablate` command run as a user would (on worker processes and submitit's executor), or `rb.ablate` in this
process where the arms run here one after another anyway. Training runs in this process through the library (the
command under test is `ablate`); each plant is trained once per module."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import helpers
from tests.helpers import Workspace, as_printed, assert_one_line_error

ALL_ARMS = ["lr", "clip", "precision", "warmup", "eps", "skip-batch", "skip-rows", "zero-grad", "seed"]


def train_example(ws: Workspace, name: str, *overrides: str, env: dict[str, str] | None = None):
    """Train examples/NAME/config.yaml recorded to the workspace's store; returns the TrainResult."""
    return helpers.train_example(ws.store(), name, *overrides, env=env)


def ablate(ws: Workspace, run_id: str, arms: str, *extra: str) -> dict:
    result = ws.replay("ablate", arms, "--run-id", run_id, "--json", *extra)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.json()


def ablate_here(ws: Workspace, run_id: str, arms: str, horizon: int, from_step: int | None = None, workers: int = 1) -> dict:
    """`replay ablate ARMS --run-id RUN_ID --horizon H --workers W --json` computed in this process (`rb.ablate`: the
    command's request, engine and report; a `replay` start-up costs seconds). With one worker the arms run here one
    after another; with more, in processes forked from this process's preloaded server."""
    import replaybisect as rb

    return as_printed(rb.ablate(run_id, arms.split(","), from_step=from_step, horizon=horizon, workers=workers,
                                tracking_uri=ws.tracking_uri))


def verdicts(data: dict) -> dict[str, str]:
    return {arm["name"]: arm["verdict"] for arm in data["arms"]}


def fixes(data: dict) -> set[str]:
    """The arms asked for that fix (not those the report added to prove a value it suggests)."""
    return {arm["name"] for arm in data["arms"] if arm["verdict"] == "fixes" and not arm.get("suggested")}


def _workspace(tmp_path_factory, name: str) -> Workspace:
    return Workspace(tmp_path_factory.mktemp(name))


# ---- planted failures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_row(tmp_path_factory):
    ws = _workspace(tmp_path_factory, "bad_row")
    run = train_example(ws, "ablate_bad_row", "train.steps=40")
    assert run.status == "nonfinite" and run.first_nonfinite_step == 25
    return ws, run


def test_lr_explosion_is_fixed_by_lr_and_clip_not_by_precision(tmp_path_factory):
    ws = _workspace(tmp_path_factory, "lr")
    run = train_example(ws, "ablate_lr_explosion")  # bf16, SGD warming up to a too-high LR
    assert run.status == "nonfinite"
    data = ablate(ws, run.run_id, "lr,clip,precision", "--horizon", "20", "--workers", "2")
    assert data["status"] == "conclusive"
    assert data["baseline"]["first_nonfinite_step"] == run.first_nonfinite_step
    assert data["baseline"]["reproduced"] == "exact"
    # the loss had been climbing: the arms start at a snapshot before the climb, not just before the NaN
    assert data["divergence_onset"] is not None and data["start_step"] <= data["divergence_onset"] < run.first_nonfinite_step
    assert fixes(data) == {"lr", "clip"}, data["arms"]
    assert verdicts(data)["precision"] in ("delays", "no-effect", "worse")
    assert data["conclusion"].startswith("fixed by: lr=x0.1, clip=1")
    # the threshold it suggests is an arm that ran, printed with its verdict (was: suggested, never run)
    suggested = next(arm for arm in data["arms"] if arm.get("suggested"))
    assert data["suggested_clip"] > 0 and "95th percentile" in suggested["suggested"] and suggested["run_id"]
    assert f"run as arm {suggested['name']}: {suggested['verdict']}" in data["conclusion"]


def test_fp16_overflow_is_fixed_by_precision_alone(tmp_path_factory):
    ws = _workspace(tmp_path_factory, "fp16")
    run = train_example(ws, "ablate_fp16_overflow", "train.steps=40")
    assert run.status == "nonfinite"
    data = ablate_here(ws, run.run_id, "precision,lr,clip", 15)
    assert data["baseline"]["first_nonfinite_step"] == run.first_nonfinite_step
    assert fixes(data) == {"precision"}, data["arms"]
    assert verdicts(data)["lr"] == "no-effect" and verdicts(data)["clip"] == "no-effect"


def test_nan_row_is_fixed_by_skip_batch_alone_same_verdicts_on_every_executor(bad_row):
    ws, run = bad_row
    one = ablate_here(ws, run.run_id, "lr,clip,eps,warmup,skip-batch", 15)
    assert one["status"] == "conclusive" and one["baseline"]["verdict"] == "fails-again"
    assert fixes(one) == {"skip-batch"}, one["arms"]
    asked = [arm for arm in one["arms"] if not arm.get("suggested")]
    assert {arm["name"] for arm in asked if arm["verdict"] == "no-effect"} == {"lr", "clip", "eps", "warmup"}
    # the same arms on two local processes, and on submitit's local executor (the SLURM code path, from the CLI)
    two = ablate_here(ws, run.run_id, "lr,skip-batch", 15, workers=2)
    submitit = ablate(ws, run.run_id, "lr,skip-batch", "--horizon", "15", "--workers", "2", "--executor", "submitit",
                      "--cluster", "local", "--executor-folder", str(ws.path / "submitit"))
    assert submitit["executor"] == "submitit"
    by_name = {arm["name"]: arm for arm in one["arms"]}
    for other in (two, submitit):
        assert other["baseline"]["first_nonfinite_step"] == 25
        for arm in other["arms"]:
            assert arm["verdict"] == by_name[arm["name"]]["verdict"]
            # CPU replays are bitwise deterministic: the numbers match too, not only the verdicts
            assert (arm["first_nonfinite_step"], arm["final_loss"]) == (by_name[arm["name"]]["first_nonfinite_step"], by_name[arm["name"]]["final_loss"])

    # each ablation is one run under the failed run (`ablate @ step 25`), holding its arms as child runs with
    # their change as params and their loss curve, and its own report: a second ablation overwrites nothing
    store = ws.store()
    ablations = store.child_runs(run.run_id, "ablation")
    assert {a.info.run_id for a in ablations} == {one["report_run_id"], two["report_run_id"], submitit["report_run_id"]}
    assert {a.info.run_name for a in ablations} == {f"✓ skip-batch · ablate @ step 25 ({', '.join(arm['name'] for arm in one['arms'])})",
                                                    "✓ skip-batch · ablate @ step 25 (lr, skip-batch)"}
    assert store.child_runs(run.run_id, "ablation-arm") == []
    children = store.child_runs(one["report_run_id"], "ablation-arm")
    assert len(children) == 1 + len(one["arms"]) == 7  # the baseline, 5 arms and the suggested clip threshold
    skip = next(c for c in children if c.data.params.get("arm") == "skip-batch")
    assert skip.info.run_name == "✓ skip-batch: fixes · ablate @ step 25"  # the answer first: MLflow cuts nested names
    assert skip.data.params["change.skip_step"] == "25" and "dropped" in skip.data.params["change"]
    losses = store.metric_history(skip.info.run_id, "loss")
    assert [s for s, _ in losses] == [s for s in range(20, 40) if s != 25]
    for result in (one, submitit):
        names = {info.path for info in store.list_artifacts(result["report_run_id"])}
        assert {"ablation.md", "ablation.json", "ablation.png"} <= names
        report = json.loads(store.read_artifact_text(result["report_run_id"], "ablation.json"))
        assert report["conclusion"] == result["conclusion"]
    # the one-line answer is the ablation run's description and a line of the failed run's
    assert store.get_run(submitit["report_run_id"]).data.tags["mlflow.note.content"].startswith(submitit["conclusion"] + "\n\n# Ablation")
    assert f"ablate: {submitit['conclusion'].rstrip('.')}." in store.get_run(run.run_id).data.tags["mlflow.note.content"]


def test_the_engine_alone_records_nothing(bad_row):
    """`ablate()` replays and judges without writing: no child run, no artifact, until the report publishes."""
    from replaybisect.verbs.ablate.engine import ablate as ablate_engine

    ws, run = bad_row
    store = ws.store()
    children_before = {c.info.run_id for c in store.child_runs(run.run_id)}
    artifacts_before = {info.path for info in store.list_artifacts(run.run_id)}
    result = ablate_engine(store, run.run_id, "skip-batch", horizon=5, workers=1)
    assert result.verdicts() == {"skip-batch": "fixes"} and result.baseline.verdict == "fails-again"
    assert result.artifacts == [] and result.baseline.run_id is None and result.arms[0].run_id is None
    assert {c.info.run_id for c in store.child_runs(run.run_id)} == children_before
    assert {info.path for info in store.list_artifacts(run.run_id)} == artifacts_before


def test_exploding_gradients_in_a_deep_net_are_fixed_by_clip(tmp_path_factory):
    ws = _workspace(tmp_path_factory, "deep")
    run = train_example(ws, "ablate_deep_gradients", "train.steps=20")
    assert run.status == "nonfinite"
    result = ws.replay("ablate", "clip,lr", "--run-id", run.run_id, "--horizon", "15", env=ws.env(COLUMNS="200"))  # --workers auto
    assert result.returncode == 0, result.stderr
    out = result.stdout
    clip_row = next(line for line in out.splitlines() if line.startswith("│ clip"))
    assert "fixes" in clip_row
    assert "conclusion fixed by: clip" in " ".join(out.split())
    assert "on local x1" in out  # auto: replays this short run in-process rather than paying for worker start-up


def test_a_baseline_that_does_not_fail_again_is_inconclusive(tmp_path_factory):
    ws = _workspace(tmp_path_factory, "transient")
    # the fault exists only in the training process (its environment), like a flaky device
    run = train_example(ws, "ablate_transient", "train.steps=30", env={"PLANTED_FAULT_AT_CALL": "16"})
    assert run.status == "nonfinite" and run.first_nonfinite_step == 15
    data = ablate_here(ws, run.run_id, "lr,clip", 10)
    assert data["status"] == "inconclusive"
    assert data["baseline"]["verdict"] == "inconclusive" and data["baseline"]["first_nonfinite_step"] is None
    assert data["conclusion"].startswith("inconclusive: the baseline replay stayed finite")
    assert set(verdicts(data).values()) == {"inconclusive"}


# ---- bad input -----------------------------------------------------------------------------------------
def test_unknown_arm_lists_the_valid_ones(workspace):
    result = workspace.replay("ablate", "lr,bogus", "--run-id", "0123")
    assert_one_line_error(result, "unknown arm 'bogus'", "valid arms: " + ", ".join(ALL_ARMS))


def test_horizon_must_be_positive_and_from_step_before_the_failure(bad_row):
    ws, run = bad_row
    assert_one_line_error(ws.replay("ablate", "lr", "--run-id", run.run_id, "--horizon", "0"), "--horizon 0 must be a positive")
    assert_one_line_error(ws.replay("ablate", "lr", "--run-id", run.run_id, "--horizon", "-5"), "--horizon -5")
    assert_one_line_error(ws.replay("ablate", "lr", "--run-id", run.run_id, "--from-step", "30"), "after the failing step 25")
    assert_one_line_error(ws.replay("ablate", "lr"), "pass --run-id")


def test_a_run_that_never_failed_needs_from_step(tmp_path_factory):
    ws = _workspace(tmp_path_factory, "healthy")
    run = train_example(ws, "ablate_transient", "train.steps=12")  # no planted fault: a healthy run
    assert run.status == "ok"
    assert_one_line_error(ws.replay("ablate", "lr", "--run-id", run.run_id), "never failed", "--from-step")
    data = ablate_here(ws, run.run_id, "lr,skip-batch", 4, from_step=5)
    assert data["failing_step"] is None and data["start_step"] == 5 and data["snapshot_step"] == 0
    assert verdicts(data) == {"lr": "no-effect", "skip-batch": "not-applicable"}
    assert data["conclusion"].startswith("the run did not fail")


def test_list_shows_every_intervention_without_importing_torch(workspace):
    listed = workspace.replay("ablate", "--list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [item["name"] for item in listed.json()["interventions"]] == ALL_ARMS
    assert all(item["description"] for item in listed.json()["interventions"])
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, replaybisect.verbs.ablate.command, replaybisect.verbs.ablate.interventions, replaybisect.verbs.ablate.report; print('torch' in sys.modules, 'mlflow' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert probe.stdout.strip() == "False False"
