"""`replay bisect` training each tried commit: real 40-commit git histories of a tiny regression model whose
config points `_target_`s into the repository's own code, the real `replay` CLI, a real SQLite MLflow store.

Each trial is a `replay train` subprocess of 40 steps (a few seconds, mostly imports), so the histories are
built once per module and the tests share their bisects."""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from tests.helpers import REPLAY, Workspace
from test_bisect import _error_line, _make_it_a_used_repository, _worktrees_left, demo, repo_fingerprint

pytestmark = pytest.mark.slow

# Two workers: round 1 probes positions 13 and 26 of 0..39, so the commit that breaks the import is tried.
BROKEN_AT = 13
REGRESSION_AT = 27


def _trial_count(store, parent_run_id: str) -> int:
    return len(store.child_runs(parent_run_id, "bisect-trial"))


def _all_trial_runs(store) -> int:
    return len(store.search_runs("tags.`replaybisect.kind` = 'bisect-trial'", max_results=1000))


@pytest.fixture(scope="module")
def clear(tmp_path_factory):
    """A clear regression (learning rate 10x smaller) at commit 27, the import broken at commit 13."""
    workspace = Workspace(tmp_path_factory.mktemp("bisect-clear"))
    repo, shas = demo.linear_history(workspace.path / "repo", kind="clear", regression_at=REGRESSION_AT, broken_at=BROKEN_AT)
    _make_it_a_used_repository(repo.path)
    before = repo_fingerprint(repo.path)
    result = workspace.replay("bisect", "--repo", str(repo.path), "--json", "demo-good", "demo-bad", "--workers", "2")
    assert result.returncode == 0, result.stderr
    return workspace, repo, shas, before, result.json()


def test_clear_regression_is_found_with_the_broken_commit_skipped(clear):
    workspace, repo, shas, before, report = clear
    assert report["first_bad"] == shas[REGRESSION_AT]
    assert report["subject"] == "refactor the model"
    assert "conf/config.yaml" in report["diffstat"] and report["author"].startswith("Demo Author")
    by_sha = {trial["sha"]: trial for trial in report["trials"]}
    assert by_sha[shas[BROKEN_AT]]["verdict"] == "skip"
    assert "cannot build `model`" in by_sha[shas[BROKEN_AT]]["note"]  # `replay train` exit 2: the import fails
    assert report["n_trials"] <= math.ceil(math.log2(40)) + 3
    for trial in report["trials"]:
        if trial["sha"] != shas[BROKEN_AT]:
            assert trial["verdict"] == ("bad" if trial["position"] >= REGRESSION_AT else "good"), trial
    # the endpoints were measured over 3 seeds; a commit that reproduces one of them needs one seed
    assert by_sha[shas[0]]["seeds"] == [0, 1, 2] and by_sha[shas[-1]]["seeds"] == [0, 1, 2]
    assert all(len(trial["seeds"]) == 1 for trial in report["trials"][1:-1])
    # what the commit changed in the numbers: the first step's forward is the same, its update (a 10x smaller lr) not
    numerics = report["numerics"]
    assert numerics["same_op"] and numerics["index"] > 0 and numerics["bad"]["at"].startswith("torch/optim/"), numerics
    assert numerics["commits"] == [shas[REGRESSION_AT - 1], shas[REGRESSION_AT]]
    differing = [row for row in numerics["rows"] if not row["same"]]  # the two steps side by side, around that op
    assert differing[0]["good"] == numerics["good"] and differing[0]["bad"] == numerics["bad"]


def test_clear_bisect_leaves_the_repository_untouched_and_records_runs(clear):
    workspace, repo, shas, before, report = clear
    assert repo_fingerprint(repo.path) == before
    assert _worktrees_left(workspace) == []
    store = workspace.store()
    parent = store.get_run(report["run_id"])
    assert parent.data.tags["replaybisect.kind"] == "bisect"
    assert parent.data.tags["replaybisect.bisect_first_bad"] == shas[REGRESSION_AT]
    page = store.read_artifact_text(report["run_id"], "ops.html")  # the ops side by side, in the MLflow UI
    assert "(last good)" in page and page.count("<tr class=differs>") >= 1 and report["numerics"]["bad"]["op"] in page
    # every trial is a child run: the `replay train` runs, and a record of the commit that could not build
    assert _trial_count(store, report["run_id"]) == report["n_runs"]
    trained = store.get_run(report["trials"][0]["run_id"])
    assert trained.data.tags["mlflow.parentRunId"] == report["run_id"]
    assert trained.data.tags["replaybisect.bisect_sha"] == shas[0]
    assert {"bisect.md", "bisect.png", "bisect.json"} <= {item.path for item in store.list_artifacts(report["run_id"])}


def test_second_bisect_trains_nothing_and_its_summary_wraps_in_its_box(clear, monkeypatch):
    """Through the API, with the first bisect's cache; printed as `replay bisect` prints it, piped and narrow: the
    summary box wraps its long lines (the test it ran) instead of cutting them."""
    import io

    from rich.console import Console

    import replaybisect as rb
    from replaybisect.verbs.bisect.report import render

    workspace, repo, shas, before, report = clear
    store = workspace.store()
    runs_before = _all_trial_runs(store)
    monkeypatch.chdir(workspace.path)
    monkeypatch.setenv("REPLAYBISECT_CACHE", workspace.env()["REPLAYBISECT_CACHE"])
    again = rb.bisect(shas[0], shas[-1], repo=repo.path, workers=2, tracking_uri=workspace.tracking_uri)
    assert again.first_bad == shas[REGRESSION_AT]
    assert again.n_runs == 0 and again.n_cached == report["n_runs"]
    assert _all_trial_runs(store) == runs_before
    assert repo_fingerprint(repo.path) == before
    printed = io.StringIO()
    render(again, Console(file=printed, width=100, soft_wrap=True))  # as report.console is, piped
    assert "else one more seed" in printed.getvalue(), printed.getvalue()


def test_bad_that_passes_is_reported_with_the_measured_numbers(clear):
    workspace, repo, shas, before, report = clear
    result = workspace.replay("bisect", "--repo", str(repo.path), shas[0], shas[20], "--workers", "2")
    line = _error_line(result)
    assert f"BAD {shas[20][:10]} does not fail" in line
    good = [run for run in report["trials"][0]["metrics"]]
    assert f"{statistics.mean(good):.5g}" in line  # GOOD's measured mean over its seeds
    assert "seeds [0, 1, 2]" in line and "p=1" in line
    assert repo_fingerprint(repo.path) == before and _worktrees_left(workspace) == []


def test_good_that_fails_is_reported(clear, monkeypatch):
    """Through the API (`replay bisect` prints the same error as its one line, exit 2: the test above)."""
    import replaybisect as rb
    from replaybisect.errors import ReplayError

    workspace, repo, shas, before, report = clear
    monkeypatch.chdir(workspace.path)
    monkeypatch.setenv("REPLAYBISECT_CACHE", workspace.env()["REPLAYBISECT_CACHE"])
    # a Hydra override for every trial: a learning rate at which even GOOD overflows
    with pytest.raises(ReplayError) as failed:
        rb.bisect(shas[0], shas[-1], repo=repo.path, overrides=["optim.lr=1e6"], workers=2, tracking_uri=workspace.tracking_uri)
    line = str(failed.value)
    assert failed.value.exit_code == 2 and "\n" not in line
    assert f"GOOD {shas[0][:10]} fails: non-finite at seed 0 (step" in line
    assert repo_fingerprint(repo.path) == before and _worktrees_left(workspace) == []


def test_subtle_regression_needs_more_seeds_and_is_found(tmp_path):
    workspace = Workspace(tmp_path)
    repo, shas = demo.linear_history(tmp_path / "repo", kind="subtle", regression_at=REGRESSION_AT, broken_at=None)
    result = workspace.replay("bisect", "--repo", str(repo.path), "--json", "demo-good", "demo-bad", "--workers", "2")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["first_bad"] == shas[REGRESSION_AT], report
    good, bad = report["trials"][0], report["trials"][-1]
    # subtle: one seed cannot tell the endpoints apart (their seed ranges overlap) ...
    assert max(good["metrics"]) > min(bad["metrics"])
    gap = statistics.mean(bad["metrics"]) - statistics.mean(good["metrics"])
    assert 0 < gap < 2 * statistics.stdev(good["metrics"])
    # ... three seeds were not clear enough (paired t-test), so both endpoints got three more
    assert len(good["seeds"]) == len(bad["seeds"]) == 6, (good, bad)
    assert report["endpoints"]["p"] <= 0.01
    assert report["n_trials"] <= math.ceil(math.log2(40)) + 3
    for trial in report["trials"]:
        assert trial["verdict"] == ("bad" if trial["position"] >= REGRESSION_AT else "good"), trial


def _processes_in(folder, but_not: tuple[str, ...] = ()) -> list[int]:
    """Processes whose working folder is under `folder` (trials run in the cache's worktrees), leaving out those whose
    program name is in `but_not` (the short git commands that make worktrees run there too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (str(Path(os.readlink(entry / "cwd"))).startswith(str(folder))
                        and (entry / "comm").read_text().strip() not in but_not):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_sigint_while_trials_train_stops_them_and_leaves_everything_clean(clear):
    workspace, repo, shas, before, report = clear
    # long trials (a config the cache has not seen), interrupted while the endpoints train
    process = subprocess.Popen([REPLAY, "bisect", "--repo", str(repo.path), shas[0], shas[-1], "--workers", "2",
                                "train.steps=5000"], cwd=workspace.path, env=workspace.env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    cache = workspace.path / ".cache"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_processes_in(cache, but_not=("git",))) < 2 and process.poll() is None:
        time.sleep(0.2)
    if len(_processes_in(cache, but_not=("git",))) < 2:
        process.kill()
        pytest.fail("the trials never started:\n" + process.communicate()[1][-3000:])
    time.sleep(2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("replay: interrupted")
    assert _processes_in(cache) == []
    assert _worktrees_left(workspace) == []
    assert repo_fingerprint(repo.path) == before
    store = workspace.store()
    assert store.search_runs("tags.`replaybisect.kind` = 'bisect' and attributes.status = 'KILLED'")
