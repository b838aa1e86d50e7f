"""`replay runs`: the triage column (what `replay watch` concluded about each run), on a real SQLite store with the
installed command."""

from __future__ import annotations

import json

from tests.helpers import REPLAY  # noqa: F401  (the installed command, run by workspace.replay)
from watch_servers import ALLOW_ROOT
from replaybisect.verbs.runs.engine import triage_answer


def _crashed_run(store) -> str:
    """A crashed run's record: metrics only, which is all a triage's diagnose reads."""
    run_id = store.create_run("train", run_name="train crashing")
    store.log_metrics(run_id, [("loss", 2.0 - step * 0.01, step) for step in range(30)])
    store.finish_run(run_id, "crashed", "FAILED")
    return run_id


def _not_json(literal: str):
    raise ValueError(f"{literal} is not JSON")


def test_runs_shows_the_triage_answer_and_a_dash_for_untriaged_runs(workspace):
    store = workspace.store()
    triaged = _crashed_run(store)
    watched = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--settle", "0.2")
    assert watched.returncode == 0, watched.stderr
    summary = store.tags(triaged)["triage.summary"]
    assert summary.startswith("failed run: ")
    untriaged = _crashed_run(store)
    store.log_metrics(untriaged, [("loss", float("inf"), 30)])  # MLflow keeps it as the largest float

    listed = workspace.replay("runs", "--json")
    assert listed.returncode == 0, listed.stderr
    by_id = {run["run_id"]: run for run in json.loads(listed.stdout, parse_constant=_not_json)["runs"]}
    assert by_id[triaged]["triage"] == summary and by_id[untriaged]["triage"] is None
    assert by_id[untriaged]["last_loss"] == "inf"  # an infinity again, in strict JSON for jq: no Infinity literal

    table = workspace.replay("runs", env=workspace.env(COLUMNS="400"))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = [cell.strip() for cell in next(line for line in lines if "run id" in line).split("┃")]
    rows = {cells[1]: cells for cells in ([cell.strip() for cell in line.split("│")] for line in lines) if len(cells) > 2}
    column = header.index("triage")
    assert rows[triaged][column] == summary and rows[untriaged][column] == "-", table.stdout


def test_a_triage_in_progress_or_failed_reads_as_such():
    assert triage_answer({}) is None
    assert triage_answer({"replaybisect.triage": "running", "replaybisect.triage.step": "ablate"}) == "triaging (ablate)"
    assert triage_answer({"replaybisect.triage": "failed", "replaybisect.triage.reason": "nan: exit 2: no snapshot"}) == \
        "triage failed: nan: exit 2: no snapshot"
