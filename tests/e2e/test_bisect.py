"""`replay bisect`: the search and the verdict as pure functions, then the real CLI in `--cmd` mode on real git
repositories (fast: the oracle is a script), including the user's repository left byte-for-byte untouched."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers import REPLAY, ROOT, Workspace

from replaybisect.verbs.bisect.engine import (
    SeedRun,
    Search,
    absolute_tracking_uri,
    endpoint_baseline,
    judge,
    tail_mean,
)



def _load_demo():
    spec = importlib.util.spec_from_file_location("make_demo", ROOT / "examples" / "bisect_demo" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


# ---------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------
def _simulate(n_commits: int, first_bad: int, skipped: set[int], width: int) -> tuple[list[int], Search]:
    """Run the search against a perfect oracle; positions 0..n_commits-1, GOOD = 0, BAD = n_commits-1."""
    search = Search(n_commits - 1)
    tried = []
    while not search.done:
        for position in search.next_round(width):
            tried.append(position)
            search.record(position, "skip" if position in skipped else ("bad" if position >= first_bad else "good"))
    return tried, search


@pytest.mark.parametrize("width", [1, 2, 3, 7])
def test_search_finds_every_first_bad_within_log_bound(width):
    n = 40
    for first_bad in range(1, n):
        tried, search = _simulate(n, first_bad, set(), width)
        assert search.candidates() == [first_bad]
        # ceil(log_{W+1} N) rounds (FIELD-NOTES), + the endpoints = ceil(log2 N) + 2 commits for one worker
        assert search.rounds <= math.ceil(math.log(n - 1, width + 1)) + (1 if width > 1 else 0)
        if width == 1:
            assert len(tried) + 2 <= math.ceil(math.log2(n)) + 2


def test_search_with_a_skipped_commit_stays_within_log2_plus_3():
    n = 40
    for broken in range(1, n - 1):
        for first_bad in range(1, n):
            if first_bad == broken:
                continue
            tried, search = _simulate(n, first_bad, {broken}, 1)
            assert len(tried) + 2 <= math.ceil(math.log2(n)) + 3, (broken, first_bad, tried)
            if broken == first_bad - 1:  # git's answer too: the skipped commit or the one after it
                assert search.candidates() in ([first_bad], [broken, first_bad])
            else:
                assert search.candidates() == [first_bad]


def test_only_skipped_commits_left_gives_the_candidates_like_git():
    tried, search = _simulate(10, first_bad=6, skipped={3, 4, 5}, width=1)
    assert search.candidates() == [3, 4, 5, 6]


def test_more_workers_need_fewer_rounds():
    rounds = {w: max(_simulate(64, b, set(), w)[1].rounds for b in range(1, 64)) for w in (1, 3, 7)}
    assert rounds == {1: 6, 3: 3, 7: 2}


def test_a_good_verdict_above_a_bad_one_is_ignored():
    search = Search(10)
    search.record(3, "bad")
    search.record(7, "good")  # a noisy oracle: inconsistent with 3 being bad
    assert (search.lo, search.hi) == (0, 3)


# ---------------------------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------------------------
def _runs(values, outcome="ok"):
    return [SeedRun(seed, outcome, metric=value) for seed, value in enumerate(values)]


def _baseline(good, bad):
    baseline, error = endpoint_baseline("loss", _runs(good), _runs(bad), None, "a" * 40, "b" * 40)
    assert error is None and baseline is not None
    return baseline


def test_endpoints_with_a_constant_shift_pass_and_commits_reproducing_them_decide_on_one_seed():
    baseline = _baseline([1.0, 1.2, 0.9], [1.1, 1.3, 1.0])
    assert baseline.mode == "paired" and baseline.p_endpoints == 0.0
    assert judge(baseline, _runs([1.0]), 9)[0] == "good"
    assert judge(baseline, _runs([1.1]), 9)[0] == "bad"
    assert "reproduces" in judge(baseline, _runs([1.1]), 9)[3]


def test_a_commit_between_the_endpoints_gets_more_seeds_then_a_z_test():
    baseline = _baseline([1.0, 1.2, 0.9, 1.1], [1.1, 1.32, 0.98, 1.2])  # paired differences .1 .12 .08 .1
    # 30% of the way from GOOD to BAD at every seed: neither endpoint reproduced, one seed is not enough
    between = [1.03, 1.236, 0.924, 1.13]
    one = judge(baseline, _runs(between[:1]), 9)
    assert one[0] is None and -2.576 < one[1] < 0
    verdict, z, p, note = judge(baseline, _runs(between), 9)
    assert verdict == "good" and z <= -2.576 and p <= 0.01 and "over 4 seeds" in note
    # with no more seeds allowed, the nearer side wins and says so
    verdict, _, _, note = judge(baseline, _runs(between[:2]), 2)
    assert verdict == "good" and "undecided" in note


def test_nonfinite_is_bad_at_once_and_a_skip_is_a_skip():
    baseline = _baseline([1.0, 1.2, 0.9], [2.0, 2.2, 1.9])
    assert judge(baseline, [SeedRun(0, "nonfinite", detail="step 5")], 9)[0] == "bad"
    assert judge(baseline, [SeedRun(0, "skip", detail="cannot import")], 9) == ("skip", None, None, "cannot import")


def test_endpoint_errors_carry_the_measured_numbers():
    baseline, error = endpoint_baseline("loss", _runs([1.0, 1.2, 0.9]), _runs([1.0, 1.2, 0.9]), None, "a" * 40, "b" * 40)
    assert baseline is None and "BAD bbbbbbbbbb does not fail" in error and "1.0333" in error and "p=1" in error
    baseline, error = endpoint_baseline("loss", [SeedRun(0, "nonfinite", detail="step 3")], _runs([1.0]), None, "a" * 40, "b" * 40)
    assert "GOOD aaaaaaaaaa fails: non-finite at seed 0 (step 3)" in error
    # unclear (0.01 < p <= 0.2): more seeds, no error yet
    assert endpoint_baseline("loss", _runs([1.0, 1.2, 0.9]), _runs([1.05, 1.3, 0.91]), None, "a" * 40, "b" * 40) == (None, None)


def test_bad_endpoint_that_diverges_judges_by_finiteness():
    baseline, error = endpoint_baseline("loss", _runs([1.0, 1.1, 0.9]), [SeedRun(0, "nonfinite", detail="step 4")], None,
                                        "a" * 40, "b" * 40)
    assert error is None and baseline.mode == "nonfinite" and baseline.bad_nonfinite_seeds == [0]
    assert judge(baseline, _runs([5.0]), 9)[0] == "good"
    assert judge(baseline, [SeedRun(0, "nonfinite")], 9)[0] == "bad"


def test_threshold_mode():
    baseline, error = endpoint_baseline("loss", _runs([1.0, 1.1, 0.9]), _runs([2.0, 2.1, 1.9]), 1.5, "a" * 40, "b" * 40)
    assert error is None and baseline.mode == "threshold"
    assert judge(baseline, _runs([1.0]), 9)[0] == "good"
    assert judge(baseline, _runs([2.0]), 9)[0] == "bad"
    _, error = endpoint_baseline("loss", _runs([1.0, 1.1, 0.9]), _runs([1.2, 1.3, 1.1]), 1.5, "a" * 40, "b" * 40)
    assert "BAD bbbbbbbbbb passes" in error and "threshold 1.5" in error


def test_tail_mean_and_tracking_uri(tmp_path, monkeypatch):
    history = [(step, float(step)) for step in range(40)]
    assert tail_mean(history) == (36 + 37 + 38 + 39) / 4
    assert tail_mean([(0, 2.0)]) == 2.0 and tail_mean([]) is None
    monkeypatch.chdir(tmp_path)
    assert absolute_tracking_uri("sqlite:///m.db") == f"sqlite:///{tmp_path / 'm.db'}"
    assert absolute_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert absolute_tracking_uri("http://host:5000") == "http://host:5000"


# ---------------------------------------------------------------------------------------------
# end to end, --cmd mode
# ---------------------------------------------------------------------------------------------
# The oracle reads STATE in the tried commit: ok -> 0, broken -> 125 (skip), slow -> sleeps, anything else -> 1.
ORACLE = """import os, pathlib, sys, time
state = pathlib.Path("STATE").read_text().strip()
log = os.environ.get("ORACLE_LOG")
if log:
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {os.environ['REPLAYBISECT_SHA']} {os.getcwd()}\\n")
if state == "slow":
    time.sleep(60)
sys.exit({"ok": 0, "broken": 125, "abort": 200}.get(state, 1))
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Workspace:
    """One workspace (and one SQLite store: creating one costs seconds) for the --cmd tests of this module."""
    workspace = Workspace(tmp_path_factory.mktemp("bisect-cmd"))
    (workspace.path / "oracle.py").write_text(ORACLE)
    return workspace


def _state_history(path: Path, states: list[str]) -> list[str]:
    repo = demo.DemoRepo(path)
    shas = []
    for index, state in enumerate(states):
        repo.write("STATE", state + "\n")
        repo.write("NOTES.md", f"commit {index}\n")
        shas.append(repo.commit(f"commit {index}: {state}"))
    return shas


def _oracle(workspace: Workspace) -> str:
    return f"{sys.executable} {workspace.path / 'oracle.py'}"


def repo_fingerprint(path: Path) -> dict:
    """Every byte under the repository (working tree and .git), plus what git itself says about it."""
    files = {}
    for file in sorted(path.rglob("*")):
        if file.is_file() or file.is_symlink():
            files[str(file.relative_to(path))] = hashlib.sha256(file.read_bytes()).hexdigest() + oct(file.stat().st_mode)
    def git(*args):
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=path, capture_output=True, text=True).stdout
    return {"files": files, "head": git("symbolic-ref", "HEAD"), "refs": git("show-ref"), "stash": git("stash", "list"),
            "worktrees": git("worktree", "list", "--porcelain")}


def _make_it_a_used_repository(path: Path) -> None:
    """A branch checked out, a stash, a staged change, an unstaged change and an untracked file."""
    def git(*args):
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True)
    git("checkout", "-q", "-b", "work")
    (path / "NOTES.md").write_text("stashed edit\n")
    git("stash", "-q")
    (path / "STATE").write_text("staged edit\n")
    git("add", "STATE")
    (path / "NOTES.md").write_text("unstaged edit\n")
    (path / "scratch.txt").write_text("untracked\n")


def _bisect(workspace: Workspace, repo: Path, *args: str, timeout: float = 300):
    return workspace.replay("bisect", "--repo", str(repo), "--json", *args, timeout=timeout)


def _worktrees_left(workspace: Workspace) -> list[str]:
    folders = list((workspace.path / ".cache" / "repos").glob("*/worktrees/*"))
    clones = list((workspace.path / ".cache" / "repos").glob("*/clone"))
    listed = []
    for clone in clones:
        out = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
        listed += [line for line in out.splitlines() if line.startswith("worktree ")][1:]
    return [str(folder) for folder in folders] + listed


# 40 commits, first bad at 27; one worker's first probe is position 19 (the middle of 0..39): that one cannot be built
STATES_40 = ["ok"] * 19 + ["broken"] + ["ok"] * 7 + ["bad"] * 13


def test_cmd_mode_finds_the_first_bad_commit_skips_like_git_and_leaves_the_repo_untouched(shared):
    repo_path = shared.path / "repo40"
    shas = _state_history(repo_path, STATES_40)
    _make_it_a_used_repository(repo_path)
    before = repo_fingerprint(repo_path)
    log = shared.path / "oracle40.log"

    result = shared.replay(
        "bisect", "--repo", str(repo_path), "--json", shas[0], shas[-1], "--cmd", _oracle(shared),
        env=shared.env(ORACLE_LOG=str(log)))
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["first_bad"] == shas[27]
    assert report["subject"] == "commit 27: bad"
    assert report["author"].startswith("Demo Author") and report["date"] and "STATE" in report["diffstat"]
    verdicts = {trial["sha"]: trial["verdict"] for trial in report["trials"]}
    assert verdicts[shas[0]] == "good" and verdicts[shas[-1]] == "bad"
    assert verdicts[shas[19]] == "skip"  # handled like `git bisect skip`: a neighbour is tried instead
    assert all(verdicts[sha] == ("bad" if index >= 27 else "good") for index, sha in enumerate(shas) if sha in verdicts
               and index != 19)
    assert n_commits_ok(report, 40)
    # the oracle ran in the cache's worktrees, never in the user's repository
    cwds = {line.split()[2] for line in log.read_text().splitlines()}
    assert cwds and all(str(shared.path / ".cache") in cwd for cwd in cwds)
    assert repo_fingerprint(repo_path) == before
    assert _worktrees_left(shared) == []

    # the parent run and its children in MLflow, with the report artifacts
    store = shared.store()
    parent = store.get_run(report["run_id"])
    assert parent.data.tags["replaybisect.kind"] == "bisect" and parent.info.status == "FINISHED"
    children = store.child_runs(report["run_id"], "bisect-trial")
    assert len(children) == report["n_runs"] == report["n_trials"]
    artifacts = {item.path for item in store.list_artifacts(report["run_id"])}
    assert {"bisect.md", "bisect.png", "bisect.json"} <= artifacts
    assert shas[27][:10] in store.read_artifact_text(report["run_id"], "bisect.md")

    # the same bisect again runs nothing: every result comes from the first one's runs
    again = shared.replay("bisect", "--repo", str(repo_path), "--json", shas[0], shas[-1], "--cmd", _oracle(shared),
                          env=shared.env(ORACLE_LOG=str(log)))
    assert again.returncode == 0, again.stderr
    assert again.json()["first_bad"] == shas[27] and again.json()["n_runs"] == 0
    assert again.json()["n_cached"] == report["n_runs"]
    assert len(log.read_text().splitlines()) == report["n_runs"]  # the oracle did not run again

    # three workers: three commits per round, fewer rounds (ceil(log_4 39) = 3, + 1 for the skipped commit)
    three = _bisect(shared, repo_path, shas[0], shas[-1], "--cmd", _oracle(shared), "--workers", "3", "--no-cache")
    assert three.returncode == 0, three.stderr
    assert three.json()["first_bad"] == shas[27]
    assert three.json()["n_rounds"] <= math.ceil(math.log(39, 4)) + 1 < report["n_rounds"]
    assert repo_fingerprint(repo_path) == before
    assert _worktrees_left(shared) == []


def n_commits_ok(report: dict, n: int) -> bool:
    """At most ceil(log2 N) + 3 commits tried, endpoints and skips included (the issue's bar)."""
    return report["n_trials"] <= math.ceil(math.log2(n)) + 3


def test_first_parent_search_names_the_merge_that_brings_the_regression(shared):
    path = shared.path / "repo-merge"
    repo = demo.DemoRepo(path)
    main = []
    repo.write("STATE", "ok\n")
    main.append(repo.commit("good"))
    for index in range(3):
        repo.write("NOTES.md", f"main {index}\n")
        main.append(repo.commit(f"main {index}"))
    repo.git("checkout", "-q", "-b", "feature", main[1])
    feature = []
    for index, state in enumerate(["ok", "bad", "bad"]):
        repo.write("STATE", state + "\n")
        repo.write("FEATURE.md", f"feature {index}\n")
        feature.append(repo.commit(f"feature {index}: {state}"))
    repo.git("checkout", "-q", "main")
    repo.git("merge", "-q", "--no-ff", "-m", "merge feature", "feature")
    merge = repo.git("rev-parse", "HEAD")
    for index in range(4):
        repo.write("NOTES.md", f"after {index}\n")
        main.append(repo.commit(f"after {index}"))
    result = _bisect(shared, path, main[0], "main", "--cmd", _oracle(shared))
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["first_bad"] == merge and report["subject"] == "merge feature"
    assert report["history_length"] == 1 + 3 + 1 + 4  # first-parent: GOOD, 3 main commits, the merge, 4 after
    tried = {trial["sha"] for trial in report["trials"]}
    assert not tried & set(feature)  # never descends into the merged branch
    assert "FEATURE.md" in report["diffstat"]  # the merge's diff against its first parent


def test_abort_status_stops_the_bisect_with_one_line(shared):
    shas = _state_history(shared.path / "repo-abort", ["ok"] * 7 + ["abort"] + ["ok"] * 2 + ["bad"] * 6)
    result = shared.replay("bisect", "--repo", str(shared.path / "repo-abort"), shas[0], shas[-1], "--cmd", _oracle(shared))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("replay: error: --cmd exited with status 200 (>= 128 means abort")
    assert "Traceback" not in result.stderr
    assert _worktrees_left(shared) == []


def _error_line(result) -> str:
    """Bad input: exit 2, no traceback, the error on one line (the last; progress lines may precede it)."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr and result.stdout == ""
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("replay: error: ")
    return line


@pytest.fixture(scope="module")
def small_repo(shared) -> tuple[Path, list[str]]:
    path = shared.path / "repo-small"
    return path, _state_history(path, ["ok", "ok", "ok", "bad", "bad"])


def test_bad_input_is_one_line_exit_2(shared, small_repo):
    path, shas = small_repo
    before = repo_fingerprint(path)
    cmd = ("--cmd", _oracle(shared))
    unknown = shared.replay("bisect", "--repo", str(path), "deadbeef", shas[-1], *cmd)
    assert "GOOD 'deadbeef' is not a commit" in _error_line(unknown) and len(unknown.stderr.strip().splitlines()) == 1
    assert "BAD 'nope' is not a commit" in _error_line(shared.replay("bisect", "--repo", str(path), shas[0], "nope", *cmd))
    assert "same commit" in _error_line(shared.replay("bisect", "--repo", str(path), shas[1], shas[1], *cmd))
    assert "is not an ancestor of BAD" in _error_line(shared.replay("bisect", "--repo", str(path), shas[3], shas[1], *cmd))
    assert "must be relative to the repository root" in _error_line(
        shared.replay("bisect", "--repo", str(path), shas[0], shas[-1], "--config-dir", str(path / "conf")))
    not_repo = shared.path / "not-a-repo"
    not_repo.mkdir(exist_ok=True)
    assert "is not a git repository" in _error_line(shared.replay("bisect", "--repo", str(not_repo), "a", "b", *cmd))
    unwritable = shared.replay("bisect", "--repo", str(path), shas[0], shas[-1], *cmd,
                               env=shared.env(REPLAYBISECT_CACHE="/proc/no-such-cache"))
    assert "set REPLAYBISECT_CACHE to a writable folder" in _error_line(unwritable)
    # endpoints that do not behave: measured, reported, nothing left behind
    good_fails = _error_line(shared.replay("bisect", "--repo", str(path), shas[3], shas[4], *cmd))
    assert f"GOOD {shas[3][:10]} does not pass --cmd (exit 1)" in good_fails
    bad_passes = _error_line(shared.replay("bisect", "--repo", str(path), shas[0], shas[2], *cmd))
    assert f"BAD {shas[2][:10]} does not fail --cmd (exit 0)" in bad_passes
    assert repo_fingerprint(path) == before
    assert _worktrees_left(shared) == []
    # the failed bisect is recorded as such
    failed = shared.store().search_runs("tags.`replaybisect.kind` = 'bisect' and attributes.status = 'FAILED'")
    assert any("does not fail" in run.data.tags.get("replaybisect.error", "") for run in failed)


def test_sigint_mid_bisect_stops_trials_cleans_worktrees_and_leaves_the_repo_untouched(shared):
    path = shared.path / "repo-sigint"
    shas = _state_history(path, ["ok"] + ["slow"] * 10 + ["bad"])
    _make_it_a_used_repository(path)
    before = repo_fingerprint(path)
    log = shared.path / "oracle-sigint.log"
    process = subprocess.Popen([REPLAY, "bisect", "--repo", str(path), shas[0], shas[-1], "--cmd", _oracle(shared),
                                "--workers", "2", "--no-cache"], cwd=shared.path, env=shared.env(ORACLE_LOG=str(log)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until both slow trials of round 1 are running
        if log.exists() and len(log.read_text().splitlines()) >= 4:
            break
        time.sleep(0.1)
    else:
        process.kill()
        pytest.fail("the slow trials never started:\n" + process.communicate()[1])
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("replay: interrupted")
    # the oracle processes were stopped, not left sleeping
    pids = [int(line.split()[0]) for line in log.read_text().splitlines()]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert repo_fingerprint(path) == before
    assert _worktrees_left(shared) == []
    killed = shared.store().search_runs("tags.`replaybisect.kind` = 'bisect' and attributes.status = 'KILLED'")
    assert killed


def test_demo_script_builds_a_repository_to_bisect(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "bisect_demo" / "make_demo.py"), str(tmp_path / "demo"),
                           "--commits", "12", "--regression-at", "8", "--broken-at", "3"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "replay bisect --repo" in done.stdout
    log = subprocess.run(["git", "log", "--format=%s", "demo-good..demo-bad"], cwd=tmp_path / "demo", capture_output=True,
                         text=True).stdout.splitlines()
    assert len(log) == 11 and "refactor the model" in log and "import a helper that is not there" in log
    shas = subprocess.run(["git", "log", "--format=%H", "demo-good..demo-bad"], cwd=tmp_path / "demo", capture_output=True,
                          text=True).stdout.split()
    assert not any(sha[:7] in done.stdout for sha in shas)  # the answer is for `replay bisect` to find
    config = (tmp_path / "demo" / "conf" / "config.yaml").read_text()
    assert "_target_: model.Regressor" in config and "lr: 0.005" in config


def test_trials_fork_from_the_preloaded_server_unless_the_worktree_shadows_a_preloaded_library(tmp_path):
    from replaybisect.verbs.bisect.trial_process import Launcher, PlainProcess

    argv = [sys.executable, "-m", "replaybisect", "--help"]
    (tmp_path / "torch").mkdir()  # a worktree with its own `torch` package: the fork's preloaded torch would hide it
    process = Launcher(fork=True).start(argv, tmp_path, dict(os.environ))
    assert isinstance(process, PlainProcess)
    returncode, stdout, _ = process.communicate()
    assert returncode == 0 and "bisect" in stdout
    # --cmd (any other command) is always a plain subprocess
    command = Launcher(fork=True).start(["/bin/sh", "-c", "exit 3"], tmp_path, dict(os.environ))
    assert isinstance(command, PlainProcess) and command.communicate()[0] == 3


def test_a_forked_process_takes_the_callers_temp_folder_not_the_servers(tmp_path, monkeypatch):
    """The preloaded server read its own TMPDIR while importing (tempfile caches it): a trial or an ablation worker
    forked from it uses the TMPDIR of the process that asked for it (a triage's scratch folder, say)."""
    import tempfile

    from replaybisect.core.processes import adopt_environment

    monkeypatch.setattr(tempfile, "tempdir", "/where/the/server/started")
    saved = dict(os.environ)
    try:
        adopt_environment({**saved, "TMPDIR": str(tmp_path)})
        assert tempfile.gettempdir() == str(tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_run_from_inside_the_repository_keeps_the_default_store_out_of_it(shared, tmp_path):
    """With no --tracking-uri and no MLFLOW_TRACKING_URI, the default ./mlflow.db would land in the working tree."""
    path = tmp_path / "inside"
    shas = _state_history(path, ["ok", "ok", "bad", "bad"])
    before = repo_fingerprint(path)
    env = shared.env()
    env.pop("MLFLOW_TRACKING_URI")
    done = subprocess.run(
        [REPLAY, "bisect", shas[0], shas[-1], "--cmd", _oracle(shared), "--json"],
        cwd=path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["first_bad"] == shas[2]
    assert "inside the repository being bisected" in done.stderr
    assert repo_fingerprint(path) == before
    assert (shared.path / ".cache" / "mlflow.db").is_file()


def test_submitit_jobs_find_the_same_commit_in_as_many_trials_and_a_second_bisect_reuses_them(shared):
    """--executor submitit through submitit's local executor (real subprocess jobs): each trial a job, said with its id."""
    repo_path = shared.path / "repo40-jobs"
    shas = _state_history(repo_path, STATES_40)
    oracle = ("--cmd", _oracle(shared))
    local = _bisect(shared, repo_path, shas[0], shas[-1], *oracle, "--workers", "2", "--no-cache")
    assert local.returncode == 0, local.stderr
    jobs = ("--executor", "submitit", "--cluster", "local", "--executor-folder", str(shared.path / "jobs"))
    submitted = _bisect(shared, repo_path, shas[0], shas[-1], *oracle, "--workers", "2", "--no-cache", *jobs)
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.json()["first_bad"] == local.json()["first_bad"] == shas[27]
    assert submitted.json()["n_trials"] == local.json()["n_trials"] and submitted.json()["n_runs"] == local.json()["n_runs"]
    said = re.findall(r"seed 0: job (\d+) (running|done)", submitted.stderr)
    assert {state for _, state in said} == {"running", "done"}
    assert len({job for job, _ in said}) == submitted.json()["n_runs"]  # one job per trial
    again = _bisect(shared, repo_path, shas[0], shas[-1], *oracle, "--workers", "2", *jobs)
    assert again.returncode == 0 and again.json()["n_runs"] == 0 and again.json()["n_cached"] > 0
    assert "job" not in again.stderr.replace("jobs", "")
    assert _worktrees_left(shared) == []


@pytest.mark.parametrize("option, said", [(("--gpus", "-1"), "--gpus"), (("--slurm", "qoz=high"), "--slurm 'qoz' is not a SLURM parameter"),
                                           (("--slurm", "qos"), "is not KEY=VALUE"), (("--cluster", "moon"), "not a submitit cluster")])
def test_bad_job_settings_are_one_line_and_nothing_is_submitted(shared, small_repo, option, said):
    repo_path, shas = small_repo
    folder = shared.path / "jobs-refused"
    result = _bisect(shared, repo_path, shas[0], shas[-1], "--cmd", _oracle(shared), "--executor", "submitit",
                     "--executor-folder", str(folder), *option)
    assert result.returncode == 2 and said in _error_line(result) and "Traceback" not in result.stderr
    assert not folder.exists()
