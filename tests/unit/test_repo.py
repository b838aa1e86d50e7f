"""core.repo.code_version: the commit and dirty state of the user's code, read through GitPython without writing
anything in the user's repository (no index refresh, no index.lock), on real repositories in tmp_path. And the
hashes of a run's own files, which a replay compares with the files it finds."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from replaybisect.core.repo import GIT_LOCATION_VARS, clean_git_env, code_version


def git(cwd: Path, *args: str) -> str:
    env = clean_git_env() | {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                             "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    (path / "src").mkdir()
    (path / "train.py").write_text("print('hi')\n")
    (path / "src" / "model.py").write_text("x = 1\n")
    git(path, "add", ".")
    git(path, "commit", "-qm", "one")
    return path


def index_state(repo: Path) -> tuple[int, bytes]:
    index = repo / ".git" / "index"
    return index.stat().st_mtime_ns, index.read_bytes()


def test_clean_repository(repo):
    assert code_version(repo) == {"git_sha": git(repo, "rev-parse", "HEAD"), "git_dirty": "false"}
    assert code_version(repo / "src") == code_version(repo)  # a folder inside the repository: the same answer


def test_modified_and_staged_changes_are_dirty(repo):
    (repo / "train.py").write_text("print('changed')\n")
    assert code_version(repo)["git_dirty"] == "true"
    git(repo, "add", "train.py")  # staged, the working tree now equal to the index
    assert code_version(repo)["git_dirty"] == "true"
    git(repo, "commit", "-qm", "two")
    assert code_version(repo) == {"git_sha": git(repo, "rev-parse", "HEAD"), "git_dirty": "false"}


def test_untracked_files_are_not_dirty(repo):
    (repo / "notes.txt").write_text("scratch\n")
    (repo / "outputs").mkdir()
    (repo / "outputs" / "log.txt").write_text("step 1\n")
    assert code_version(repo)["git_dirty"] == "false"


def test_no_answer_outside_a_repository_or_without_a_commit(tmp_path):
    assert code_version(tmp_path) == {}
    assert code_version(tmp_path / "missing") == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert code_version(empty) == {}  # HEAD names no commit yet


def test_no_answer_without_git_on_path(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert code_version(repo) == {}


def test_the_index_is_not_refreshed_or_written(repo):
    """A tracked file whose stat data changed but whose content did not: `git diff` (GitPython's is_dirty) would
    refresh and rewrite the index here; code_version must leave it byte for byte, mtime included."""
    target = repo / "src" / "model.py"
    stat = target.stat()
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**11))  # 100 s older: stat-dirty, not racy
    assert git(repo, "--no-optional-locks", "diff-files", "--name-only") == "src/model.py"  # the index is stale
    before = index_state(repo)
    assert code_version(repo)["git_dirty"] == "false"
    assert index_state(repo) == before
    assert not (repo / ".git" / "index.lock").exists()


def test_answers_while_another_git_holds_the_index_lock(repo):
    lock = repo / ".git" / "index.lock"
    lock.write_bytes(b"")  # what a running `git add` / `git commit` leaves while it works
    before = index_state(repo)
    assert code_version(repo) == {"git_sha": git(repo, "rev-parse", "HEAD"), "git_dirty": "false"}
    (repo / "train.py").write_text("print('changed')\n")
    assert code_version(repo)["git_dirty"] == "true"
    assert lock.exists() and lock.read_bytes() == b""
    assert index_state(repo) == before


def test_git_location_variables_do_not_redirect_it(repo, tmp_path, monkeypatch):
    """Inside a git hook GIT_DIR & co point at the hook's repository; the folder asked about decides."""
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "a").write_text("a\n")
    git(other, "add", "a")
    git(other, "commit", "-qm", "other")
    (repo / "train.py").write_text("print('changed')\n")
    hook_env = {"GIT_DIR": str(other / ".git"), "GIT_WORK_TREE": str(other), "GIT_INDEX_FILE": str(other / ".git" / "index"),
                "GIT_OBJECT_DIRECTORY": str(other / ".git" / "objects"), "GIT_COMMON_DIR": str(other / ".git")}
    for name, value in hook_env.items():
        monkeypatch.setenv(name, value)
    assert code_version(repo) == {"git_sha": git(repo, "rev-parse", "HEAD"), "git_dirty": "true"}
    assert {name: os.environ[name] for name in hook_env} == hook_env  # put back as they were
    assert set(hook_env) <= set(GIT_LOCATION_VARS)


def test_a_replay_says_which_of_the_runs_own_modules_changed(tmp_path, monkeypatch):
    from replaybisect.core.repo import changed_sources, file_sha256

    monkeypatch.syspath_prepend(str(tmp_path))
    step, model = tmp_path / "rb_src_step.py", tmp_path / "rb_src_model.py"
    step.write_text("def train_step(batch): ...\n")
    model.write_text("class Model: ...\n")
    tag = json.dumps({"rb_src_step": file_sha256(step), "rb_src_model": file_sha256(model)})  # as own_sources records
    assert file_sha256(tmp_path / "never_existed.py") is None and file_sha256(tmp_path) is None
    modules = ["rb_src_step", "rb_src_model"]
    assert changed_sources(tag, modules) == []
    step.write_text("def train_step(batch): ...  # tuned\n")
    model.unlink()
    gone, changed = changed_sources(tag, modules)  # in module order
    assert gone == "module rb_src_model (recorded with the run) cannot be read here; the replay builds from what it finds"
    assert changed.startswith(f"{step} changed since the run was recorded (sha256 ") and "today's code" in changed
    assert changed_sources(tag, ["rb_src_model"]) == [gone]  # only the modules the replay imports are looked up
    assert changed_sources("not json", modules) == changed_sources('["a list"]', modules) == changed_sources(None, modules) == []
