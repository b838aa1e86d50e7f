"""The result runs' names lead with the answer: MLflow's default runs view always shows the Run Name column (190 px),
and cuts a nested run's name after ~13 characters (the Description column is off by default)."""

from __future__ import annotations

from replaybisect.verbs.check.engine import Check, CheckOptions, CheckReport
from replaybisect.verbs.check.report import _run_name

VISIBLE = 13  # characters of a nested run's name the default view shows (docs/screenshots/runs.png)


def _report(*statuses: tuple[str, str], run_id: str | None = "3f2a9c0d11112222", step: int | None = 15) -> CheckReport:
    checks = [Check(name, status, None, "") for name, status in statuses]
    return CheckReport(run_id=None, checked_run_id=run_id, source="run" if run_id else "config", snapshot_step=step,
                       checks=checks, options=CheckOptions())


def test_a_check_runs_name_says_what_failed_first():
    failing = _run_name(_report(("data.finite", "pass"), ("grad.nonfinite", "fail"), ("overfit.one_batch", "fail"), ("lr.range_test", "warn")))
    assert failing == "2 fail: grad.nonfinite, overfit.one_batch · check @ run 3f2a9c0d step 15"
    assert _run_name(_report(("data.finite", "pass"), ("lr.range_test", "warn"), run_id=None, step=None)) == \
        "1 warn: lr.range_test · check @ config"
    assert _run_name(_report(("data.finite", "pass"), step=None)) == "all pass · check @ run 3f2a9c0d"
    assert failing[:VISIBLE].startswith("2 fail")  # it used to be cut to `check @ run 3…`


def test_a_diagnosis_runs_name_says_the_verdict_first(workspace):
    from replaybisect.verbs.diagnose.engine import analyse, load_curves
    from replaybisect.verbs.diagnose.report import publish

    store = workspace.store()
    run_id = store.create_run("train")  # a crashed run's record: its loss curve is all diagnose reads
    store.log_metrics(run_id, [("loss", 2.0 - step * 0.01, step) for step in range(30)])
    store.finish_run(run_id, "crashed", "FAILED")
    curves = load_curves(store, run_id)
    result = analyse(curves)
    name = store.get_run(publish(store, result, curves)).info.run_name
    verdict = "healthy" if result.healthy else ", ".join(dict.fromkeys(f.pattern for f in result.findings)) or "not-enough-data"
    assert name == f"{verdict} · diagnose" and not name.startswith("diagnose")
