"""`replay check --run-id` on real recorded runs: which state it examines (a diverged run's last snapshot before its
growth began, `--step N`), a non-finite gradient reported as such, and healthy runs of your own loop that it must not
flag (a sequence-first language model, nanoGPT's cosine schedule, Adadelta at lr 1)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import EXAMPLES, Workspace, as_printed, assert_one_line_error, train_example

PLANTS = EXAMPLES / "check_pathologies"
SMALL = ("--overfit-steps", "80", "--lr-steps", "40")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("check_state"))


@pytest.fixture(scope="module")
def diverged(ws) -> str:
    """SGD warmed up to an lr too high for a small regressor (fp32): the loss climbs by orders of magnitude, then inf."""
    trained = train_lr_explosion(ws)
    assert trained["status"] == "nonfinite"
    return trained["run_id"]


def train_lr_explosion(ws: Workspace, *overrides: str) -> dict:
    """examples/ablate_lr_explosion trained in this process (as `replay train --json` would)."""
    return as_printed(train_example(ws.store(), "ablate_lr_explosion", "train.precision=fp32", "train.num_threads=1", *overrides))


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def checked(ws: Workspace, run_id: str, *args: str) -> tuple[dict, str]:
    """`replay check --run-id` as a user runs it (the table); the facts from the check run's check.json, and its check.md."""
    result = ws.replay("check", "--run-id", run_id, *SMALL, *args)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return _published(ws, run_id, " ".join(result.stdout.split()))


def checked_here(ws: Workspace, run_id: str, step: int | None = None, only: str | None = None) -> tuple[dict, str]:
    """The same check through `rb.check` in this process (the command's request and engine, published as the command
    does; a `replay` start-up costs seconds): check.json's facts and check.md."""
    import replaybisect as rb

    rb.check(run_id=run_id, step=step, only=only, overfit_steps=80, lr_steps=40, tracking_uri=ws.tracking_uri)
    return _published(ws, run_id, "")


def _published(ws: Workspace, run_id: str, table: str) -> tuple[dict, str]:
    store = ws.store()
    check_run = max(store.child_runs(run_id, kind="check"), key=lambda r: r.info.start_time)
    report = json.loads(store.read_artifact_text(check_run.info.run_id, "check.json"))
    return report, table + "\n" + store.read_artifact_text(check_run.info.run_id, "check.md")


def test_a_diverged_run_is_checked_at_its_last_snapshot_before_the_growth(ws, diverged):
    from replaybisect.core.growth import growth_onset
    from replaybisect.replay.restore import snapshot_steps

    store = ws.store()
    losses = store.metric_history(diverged, "loss")
    onset = growth_onset(losses, store.metric_history(diverged, "grad_norm"))
    failing = int(store.tags(diverged)["first_nonfinite_step"])
    assert onset is not None and onset < failing
    report, shown = checked(ws, diverged)

    expected = max(s for s in snapshot_steps(store, diverged) if s <= onset)
    assert report["snapshot_step"] == expected < failing
    assert dict(losses)[expected] < 1e3  # a healthy state: the loss there is still small
    reason = f"the last snapshot before the growth that began at step {onset} and ended in the failure at step {failing}"
    assert report["snapshot_reason"] == reason
    assert f"at snapshot step {expected}: {reason}" in shown  # the table's heading and check.md say which and why

    checks = by_name(report)
    assert checks["grad.missing"]["status"] == "pass" and checks["grad.nonfinite"]["status"] == "pass"
    assert "no gradient" not in shown
    # the checks train at the lr the run reached (the top of its warmup), and say so
    assert report["lr"] == {"value": pytest.approx(0.6), "source": "the run's peak lr, step 30"}
    # at that lr even the overfit probe climbs to inf: a divergence, and the advice is the lr, not the wiring
    assert checks["overfit.one_batch"]["status"] == "fail" and "a divergence" in checks["overfit.one_batch"]["detail"]
    assert checks["lr.range_test"]["status"] == "warn" and "from the run's initialization" in checks["lr.range_test"]["detail"]
    assert "try a learning rate of about" in shown and "optim.lr=" in shown and "wiring" not in shown


def test_step_picks_a_snapshot_and_a_nonfinite_gradient_is_no_missing_one(ws, diverged):
    failing = int(ws.store().tags(diverged)["first_nonfinite_step"])
    report, shown = checked_here(ws, diverged, step=failing, only="grad")  # the table from the CLI: the test above
    assert report["snapshot_step"] == failing and report["snapshot_reason"] == f"the snapshot at --step {failing}"
    checks = by_name(report)
    assert checks["grad.nonfinite"]["status"] == "fail" and "non-finite" in checks["grad.nonfinite"]["detail"]
    assert checks["grad.missing"]["status"] != "fail" and "no gradient" not in checks["grad.missing"]["detail"]
    assert "check an earlier snapshot (--step N)" in shown and "wiring" not in shown

    report, _ = checked_here(ws, diverged, step=47, only="grad.nonfinite")
    assert report["snapshot_step"] == 40 and report["snapshot_reason"] == "the newest snapshot at or before --step 47"


def test_bad_step_is_one_line_exit_2_and_records_nothing(ws, diverged):
    store = ws.store()
    before = {r.info.run_id for r in store.search_runs(max_results=1000)}
    assert_one_line_error(ws.replay("check", "--run-id", diverged, "--step", "-1"), "Invalid value for '--step'", "greater than or equal to 0")
    assert_one_line_error(ws.replay("check", "--run-id", diverged, "--step", "100000"), "--step 100000 is past the end", "its last step is")
    assert_one_line_error(ws.replay("check", "--step", "3"), "--step picks a snapshot of a recorded run", "--run-id")
    assert {r.info.run_id for r in store.search_runs(max_results=1000)} == before


def test_a_run_with_no_snapshot_before_its_failure(ws):
    """Snapshots off: the failed run kept only the failing step's, which is never the default."""
    trained = train_lr_explosion(ws, "snapshot.every=0")
    run_id, failing = trained["run_id"], trained["first_nonfinite_step"]
    assert trained["snapshot_steps"] == [failing]
    assert_one_line_error(ws.replay("check", "--run-id", run_id, "--step", "10"),
                          "no snapshot at or before step 10", f"its snapshots are at steps {failing}")
    report, shown = checked_here(ws, run_id, only="grad.nonfinite")
    assert report["snapshot_step"] is None
    assert report["snapshot_reason"] == f"every snapshot is at or after the failing step {failing}: the run's config at initialization"
    assert by_name(report)["grad.nonfinite"]["status"] == "pass"


# ---- healthy runs of your own loop: nothing to flag ----------------------------------------------------------------
@pytest.fixture(scope="module")
def healthy(ws) -> dict[str, str]:
    """Each loop of examples/check_pathologies/healthy_loops.py recorded for 60 steps (snapshots every 10)."""
    folder = ws.path / "healthy"
    folder.mkdir()
    shutil.copy(PLANTS / "healthy_loops.py", folder)
    kinds = ("lm", "cosine", "mnist")  # one process records them in turn, a run each
    done = subprocess.run([sys.executable, "healthy_loops.py", ",".join(kinds), "60"], cwd=folder, env=ws.env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    run_ids = re.findall(r"^([0-9a-f]{32})$", done.stdout, re.MULTILINE)  # each loop prints its run id
    assert len(run_ids) == len(kinds), done.stdout[-2000:]
    return dict(zip(kinds, run_ids))


def assert_nothing_flagged(report: dict, shown: str) -> None:
    flagged = {c["name"]: c["detail"] for c in report["checks"] if c["status"] in ("warn", "fail")}
    assert not flagged, flagged
    assert report["snapshot_step"] == 50 and report["snapshot_reason"] == "the newest snapshot (the run did not fail)"
    assert "try a learning rate" not in shown and "could not run" not in shown


def test_a_sequence_first_language_model_is_checked_through_its_own_step(ws, healthy):
    """word_language_model's shapes: (T, B) tokens in, T*B flattened targets. A slice of 16 "samples" fed its loss 16
    targets for 128 outputs (a crash), and Zipf-distributed words read as imbalanced classes."""
    report, shown = checked_here(ws, healthy["lm"])
    assert_nothing_flagged(report, shown)
    checks = by_name(report)
    assert "the whole first batch" in checks["overfit.one_batch"]["detail"]
    assert checks["data.class_balance"]["status"] == "skip" and "128 targets for 8 input rows" in checks["data.class_balance"]["detail"]
    # SGD at lr 20 with clip 0.25 is the recipe; a sweep to 10 never blew up, so nothing says it is too high
    assert report["lr"]["value"] == 20.0 and report["lr_range"]["diverged_lr"] is None


def test_a_schedule_set_by_the_loop_is_checked_at_its_peak_lr(ws, healthy):
    """nanoGPT sets each step's lr itself (no scheduler, so no initial_lr): the newest snapshot holds the schedule's
    floor, 1e-4, where the overfit probe ran and called the model unable to learn."""
    store = ws.store()
    assert dict(store.metric_history(healthy["cosine"], "lr"))[50] == pytest.approx(1e-4)
    report, shown = checked_here(ws, healthy["cosine"])
    assert_nothing_flagged(report, shown)
    assert report["lr"] == {"value": pytest.approx(1e-3), "source": "the run's peak lr, step 5"}
    assert "at lr 0.001 (the run's peak lr, step 5)" in by_name(report)["overfit.one_batch"]["detail"]


def test_adadelta_at_lr_1_is_judged_by_the_range_test_from_initialization(ws, healthy):
    """PyTorch's MNIST recipe: at a trained snapshot the loss has nowhere to fall, so a sweep from there suggested
    an lr 100x lower; the sweep runs from the run's initialization."""
    report, shown = checked_here(ws, healthy["mnist"])
    assert_nothing_flagged(report, shown)
    lr_check = by_name(report)["lr.range_test"]
    assert "from the run's initialization" in lr_check["detail"] and report["lr_range"]["judgement"] == "ok"
    # its loss still fell at the sweep's end: no steepest descent is offered as a suggestion (issue 47: 2.8e-06 was)
    assert report["lr_range"]["suggested_lr"] is None and "the range is too short to suggest an lr" in lr_check["detail"]
    assert report["lr"]["value"] == 1.0 and math.isfinite(by_name(report)["grad.update_ratio"]["value"])
