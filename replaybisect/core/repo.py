"""Read-only questions to a git repository, through GitPython: which commit the code is at, and whether it is dirty.

GitPython is imported inside the functions (it runs `git version` when imported), so importing replaybisect stays
cheap. Two things GitPython would otherwise do are kept out:

- Variables like GIT_DIR (set inside git hooks, for one) would point GitPython and the git it runs at another
  repository, index or object store; `open_repo` lifts them out of the environment while it works.
- `Repo.is_dirty()` runs `git diff`, which refreshes and *rewrites* the index when a file's stat data changed (git
  2.39, even with GIT_OPTIONAL_LOCKS=0). `code_version` asks `git status` with optional locks off instead, which
  never takes .git/index.lock nor writes the index.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    import git

# Variables that would point git at another repository or index (set inside git hooks, for one).
GIT_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
                     "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE")
GIT_TIMEOUT_S = 10  # one read that takes longer (a hung network filesystem) is answered as "unknown"

_ENVIRON_LOCK = threading.RLock()


def clean_git_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a git subprocess: `base` (default os.environ) without GIT_LOCATION_VARS, never prompting."""
    env = dict(os.environ if base is None else base)
    for name in GIT_LOCATION_VARS:
        env.pop(name, None)
    env["GIT_TERMINAL_PROMPT"] = "0"
    return env


@contextmanager
def _without_location_vars() -> Iterator[None]:
    """GitPython reads GIT_DIR & co from os.environ (when it opens a repository and for every git it runs) and has
    no way to unset one for its subprocesses: lift them out of os.environ while it works. Nothing changes when
    none is set (the usual case); the lock keeps two threads from restoring under each other."""
    with _ENVIRON_LOCK:
        lifted = {name: os.environ.pop(name) for name in GIT_LOCATION_VARS if name in os.environ}
        try:
            yield
        finally:
            for name, value in lifted.items():
                os.environ.setdefault(name, value)


@contextmanager
def open_repo(folder: str | Path) -> Iterator["git.Repo"]:
    """The repository holding `folder` (found the way git finds it, from `folder` upwards), for reading.

    Every git it runs has optional locks off and never prompts; GIT_DIR & co from the environment are ignored. Use
    the repository inside the `with` only (its `git cat-file` helpers are stopped on the way out). Raises
    git.exc.InvalidGitRepositoryError / NoSuchPathError when `folder` is in no repository, ImportError when there is
    no git executable (GitPython refuses to import then).
    """
    import git

    with _without_location_vars():
        repo = git.Repo(folder, search_parent_directories=True)
        try:
            repo.git.update_environment(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0")
            yield repo
        finally:
            repo.close()


def code_version(folder: Path) -> dict[str, str]:
    """{"git_sha": HEAD's SHA, "git_dirty": "true"/"false"} of the repository holding `folder`, or {} when it is in
    none (or git cannot answer: no git, no commit yet, a bare repository). Dirty means a tracked file differs from
    HEAD, staged or not; untracked files do not count. Read-only: the index is neither locked nor written, so it
    also answers while another git holds .git/index.lock."""
    try:
        import git
    except ImportError:  # no git executable
        return {}
    try:
        with open_repo(folder) as repo:
            sha = repo.head.commit.hexsha
            changes = repo.git.status("--porcelain", "--untracked-files=no", kill_after_timeout=GIT_TIMEOUT_S)
    except (git.exc.GitError, ValueError, OSError):  # ValueError: HEAD names no commit yet
        return {}
    return {"git_sha": sha, "git_dirty": str(bool(changes.strip())).lower()}


# ---- the files a run's own code came from (the modules of its step and build functions, its LightningModule) ------
SOURCE_TAG = "source_sha256"  # replaybisect.source_sha256: {"module": sha256 of its file} of the run's own code
LARGEST_SOURCE = 64 * 1024 * 1024  # a module file larger than this is not hashed (it is no source file)


def file_sha256(path: Path) -> Optional[str]:
    """The file's sha256, or None when it cannot be read here (or is too large to be a source file)."""
    import hashlib

    try:
        if not path.is_file() or path.stat().st_size > LARGEST_SOURCE:
            return None
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    except (OSError, ValueError):
        return None


def changed_sources(tag_value: Optional[str], modules: list[str]) -> list[str]:
    """What a replay should say about the run's own modules: each one whose file changed, or that is not found, since
    the run was recorded. `modules`: the modules the replay imports, named by the admitted config (never names read
    from the tag alone: finding a dotted module imports its package). (A re-entered script is never today's code: a
    changed one is refused, replay.script.admitted_script.) A replay runs today's code, so a replay that no longer reproduces the run may be explained by
    one of these."""
    import importlib.util
    import json

    try:
        recorded = json.loads(tag_value) if tag_value else {}
    except ValueError:
        return []
    if not isinstance(recorded, dict):
        return []
    lines = []
    for name in sorted(set(modules) & set(recorded)):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        now = file_sha256(origin) if origin is not None else None
        if now is None:
            lines.append(f"module {name} (recorded with the run) cannot be read here; the replay builds from what it finds")
        elif now != recorded[name]:
            lines.append(f"{origin} changed since the run was recorded (sha256 {str(recorded[name])[:12]} then, {now[:12]} "
                         "now): the replay runs today's code")
    return lines
