"""`replay check` end to end: the installed CLI on real SQLite MLflow stores, planted pathologies from
examples/check_pathologies, the healthy built-in config, a recorded run, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, Workspace, as_printed, assert_one_line_error

PLANTS = EXAMPLES / "check_pathologies"
# Small sweeps keep each check to a few seconds; one intra-op thread because the tests share 2 cores.
SMALL = ("--overfit-steps", "80", "--lr-steps", "40", "train.num_threads=1")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Workspace:
    """One store for the module: creating a fresh SQLite store (migrations) costs seconds per test."""
    return Workspace(tmp_path_factory.mktemp("check"))


def run_check(workspace, *args: str) -> dict:
    result = workspace.replay("check", "--json", *args)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.json()


def check_here(workspace, config_name: str) -> dict:
    """What `replay check --json --config-dir PLANTS --config-name NAME SMALL` prints, computed in this process through the
    Python API (`rb.check` shares the command's request and engine; a `replay` start-up imports MLflow and torch: seconds
    a test). The healthy config and the recorded run below go through the installed CLI."""
    import replaybisect as rb

    report = rb.check(["train.num_threads=1"], config_dir=PLANTS, config_name=config_name, overfit_steps=80, lr_steps=40,
                      tracking_uri=workspace.tracking_uri)
    return as_printed(report)


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


# (config in examples/check_pathologies, check that must flag it, status, the layer or field it must name,
#  a fragment of the detail)
PLANTED = [
    ("nan_data", "data.finite", "fail", "input", "dataset items 0, 50, 100"),
    ("label_range", "data.label_range", "fail", "net.4", "labels span 5..14 but the loss input has 10 classes"),
    ("sorted_data", "data.batch_diversity", "fail", "target", "sorted or grouped by class"),
    ("softmax_ce", "loss.output_mismatch", "fail", "net.5", "CrossEntropyLoss is fed probabilities"),
    ("identical_init", "init.symmetry", "fail", "net.0", "`net.0.weight`: 64 of 64 rows identical; `net.2.weight`: 64 of 64 rows identical"),
    ("dead_relu", "act.relu_zero", "fail", "net.1", "raise the bias of `net.0`"),
    ("saturated_tanh", "act.saturation", "fail", "net.1", "shrink the init of `net.0`"),
    ("frozen_unused", "grad.missing", "fail", "projection.weight", "frozen (requires_grad=False): `net.0.weight`"),
    ("cannot_overfit", "overfit.one_batch", "fail", None, "cannot fit a handful of samples"),
]


@pytest.mark.parametrize("config_name, name, status, layer, fragment", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_pathology_is_flagged(shared, config_name, name, status, layer, fragment):
    report = check_here(shared, config_name)
    found = by_name(report)[name]
    assert found["status"] == status, found
    if layer is not None:
        assert found["layer"] == layer, found
    assert fragment in found["detail"], found
    assert report["status"] == "fail"
    # a finding is a result: the check run is recorded, standalone, with its report
    run = shared.store().get_run(report["run_id"])
    assert run.data.tags["replaybisect.kind"] == "check"
    assert "mlflow.parentRunId" not in run.data.tags
    if config_name == "dead_relu":  # the per-unit view names the same layer and what feeds it
        dead = by_name(report)["init.dead_units"]
        assert dead["status"] == "fail" and dead["layer"] == "net.1" and "fed by `net.0`" in dead["detail"]
    if config_name == "identical_init":  # a trap, not a slow start: the updates never separate the rows
        assert "still identical after 3 updates" in found["detail"]
    if config_name == "cannot_overfit":  # and the gradient-flow check names why
        missing = by_name(report)["grad.missing"]
        assert missing["status"] == "fail" and "`net.0.weight`" in missing["detail"] and "detached" in missing["detail"]


def test_healthy_builtin_config_passes_every_check(shared):
    report = run_check(shared, *SMALL)
    checks = by_name(report)
    failing = {n: c["detail"] for n, c in checks.items() if c["status"] in ("fail", "warn")}
    assert not failing, failing
    # every check ran; the only skip is the one that cannot apply (no tanh/sigmoid in the MLP)
    assert {n for n, c in checks.items() if c["status"] == "skip"} == {"act.saturation"}
    assert report["status"] == "pass" and report["source"] == "config" and report["checked_run_id"] is None
    assert checks["overfit.one_batch"]["value"] < 0.1
    lr = report["lr_range"]
    assert lr["suggested_lr"] is not None and 1e-4 < lr["suggested_lr"] < lr["diverged_lr"]
    assert lr["configured_lr"] == pytest.approx(1e-3)

    # the check run: kind=check, report and plots as artifacts, per-check values as metrics
    store = shared.store()
    run = store.get_run(report["run_id"])
    assert run.data.tags["replaybisect.kind"] == "check"
    assert run.data.tags["replaybisect.status"] == "ok"
    assert run.info.status == "FINISHED"
    artifacts = {Path(a.path).name for a in store.list_artifacts(report["run_id"])}
    assert {"check.md", "check.json", "lr_range.png", "overfit.png", "config.yaml"} <= artifacts
    assert "data.batch_diversity" in store.read_artifact_text(report["run_id"], "check.md")
    assert len(store.metric_history(report["run_id"], "lr_range/lr")) == lr["steps_run"]
    assert run.data.metrics["check/overfit.one_batch"] == pytest.approx(checks["overfit.one_batch"]["value"])


def test_recorded_run_is_checked_at_its_newest_snapshot(shared):
    trained = shared.train_here("train.steps=30", "train.batch_size=32", "snapshot.every=10", "train.val_every=0", "model.hidden=32", "train.num_threads=1")
    result = shared.replay("check", "--run-id", trained["run_id"], "--overfit-steps", "80", "--lr-steps", "40")
    assert result.returncode == 0, result.stderr

    # the human report: the table of checks, the verdict, where the check run is
    for fragment in ("replay check run " + trained["run_id"] + " at snapshot step 20", "overfit.one_batch", "lr.range_test", "PASS", "check run "):
        assert fragment in " ".join(result.stdout.split()), fragment

    # the facts, from the check run's check.json
    store = shared.store()
    (check_run,) = store.child_runs(trained["run_id"], kind="check")
    import json

    report = json.loads(store.read_artifact_text(check_run.info.run_id, "check.json"))
    assert report["source"] == "run" and report["checked_run_id"] == trained["run_id"]
    assert report["snapshot_step"] == 20
    checks = by_name(report)
    assert checks["init.loss"]["status"] == "skip"  # not at initialization
    assert not [c for c in report["checks"] if c["status"] == "fail"], report["checks"]
    assert "at step 20" in checks["act.relu_zero"]["detail"]
    assert check_run.data.tags["replaybisect.checked_run_id"] == trained["run_id"]
    # a check run is not itself checkable
    again = shared.replay("check", "--run-id", check_run.info.run_id)
    assert_one_line_error(again, "is a check run", trained["run_id"])


def test_bad_input_is_one_line_exit_2(shared):
    store = shared.store()
    bare = store.create_run("train")  # a run that `replay train` did not record: no config, no metrics
    before = {r.info.run_id for r in store.search_runs(max_results=1000)}
    assert_one_line_error(shared.replay("check", "--run-id", "0123456789abcdef"), "no run", "0123456789abcdef")
    assert_one_line_error(shared.replay("check", "model._target_=nowhere.Model"), "cannot build `model`", "nowhere.Model")
    assert_one_line_error(shared.replay("check", "--run-id", bare), bare, "no config.yaml and no metrics", "replay check --config-dir")
    assert_one_line_error(shared.replay("check", "--run-id", bare, "model=cnn"), "either --run-id or a config")
    # nothing was recorded for any of them
    assert {r.info.run_id for r in store.search_runs(max_results=1000)} == before


def test_a_loss_that_turns_non_finite_whatever_the_lr_is_not_blamed_on_the_lr(shared):
    """examples/nan_forward overflows in its forward after ~20 steps at any lr: the range test's sweep stops there,
    the same steps at its lowest lr stop too, so it suggests no lr and points at `replay nan` instead."""
    import replaybisect as rb

    from tests.helpers import EXAMPLES

    report = rb.check(["train.num_threads=1"], config_dir=EXAMPLES / "nan_forward", lr_steps=40,
                      tracking_uri=shared.tracking_uri)
    found = {c.name: c for c in report.checks}["lr.range_test"]
    assert found.status == "fail" and "not the learning rate" in found.detail, found.detail
    assert report.lr_range.stop_reason == "fault" and report.lr_range.suggested_lr is None
    assert found.extra["lr_judgement"] is None
