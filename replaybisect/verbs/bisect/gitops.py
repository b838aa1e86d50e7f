"""Git for `replay bisect`: read-only questions to the user's repository, everything else in a private clone.

The user's repository is only ever *read* (`rev-parse`, `merge-base`); nothing in it is written, not its
working tree, index, HEAD, refs, stashes or `.git/worktrees`. Trials check commits out in worktrees of a
`git clone --shared --no-checkout` that lives in a cache folder (git-worktree(1): `git worktree add`
in the user's repository would write under its `.git/worktrees`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from replaybisect.errors import GitError

# Variables that would point our git calls at another repository or index (set inside git hooks, for one).
_GIT_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
                      "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE")


def clean_git_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name in _GIT_LOCATION_VARS:
        env.pop(name, None)
    env["GIT_TERMINAL_PROMPT"] = "0"
    return env


def git(cwd: Path | str, *args: str, check: bool = True) -> str:
    """Run one git command in `cwd` and return its stdout (stripped)."""
    done = subprocess.run(["git", *args], cwd=cwd, env=clean_git_env(), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["git", *args], done.stdout, done.stderr)
    return done.stdout.strip()


def cache_root() -> Path:
    """`$REPLAYBISECT_CACHE`, else `$XDG_CACHE_HOME/replaybisect`, else `~/.cache/replaybisect`."""
    if os.environ.get("REPLAYBISECT_CACHE"):
        return Path(os.environ["REPLAYBISECT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "replaybisect"


@dataclass(frozen=True)
class CommitInfo:
    sha: str
    subject: str
    author: str
    date: str  # ISO 8601, the author date
    diffstat: str  # `git diff --stat` against the first parent


@dataclass
class UserRepo:
    """The user's repository, opened read-only."""

    path: Path  # the working tree's top level, or the git dir of a bare repository
    git_dir: Path  # the common git dir (shared by the repository's own worktrees)

    @classmethod
    def open(cls, path: str | Path) -> "UserRepo":
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise GitError(f"{folder} is not a folder; pass --repo PATH of a git repository")
        try:
            git_dir = Path(git(folder, "rev-parse", "--path-format=absolute", "--git-common-dir"))
            bare = git(folder, "rev-parse", "--is-bare-repository") == "true"
            top = git_dir if bare else Path(git(folder, "rev-parse", "--show-toplevel"))
        except subprocess.CalledProcessError:
            raise GitError(f"{folder.resolve()} is not a git repository; pass --repo PATH of one") from None
        return cls(path=top.resolve(), git_dir=git_dir.resolve())

    def resolve(self, rev: str, what: str) -> str:
        """The full SHA of commit `rev` (a SHA, branch, tag or `HEAD~3`)."""
        if not rev or rev.startswith("-"):
            raise GitError(f"{what} {rev!r} is not a commit; pass a SHA, branch or tag of {self.path}")
        try:
            return git(self.path, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
        except subprocess.CalledProcessError:
            raise GitError(f"{what} {rev!r} is not a commit in {self.path}; check it with `git log --oneline`") from None

    def has_file(self, sha: str, path: str) -> bool:
        """Whether commit `sha` holds the file `path` (relative to the repository root); read-only."""
        done = subprocess.run(["git", "cat-file", "-e", f"{sha}:{path}"], cwd=self.path, env=clean_git_env(),
                              capture_output=True)
        return done.returncode == 0

    def is_ancestor(self, older: str, newer: str) -> bool:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", older, newer], cwd=self.path,
                              env=clean_git_env(), capture_output=True)
        return done.returncode == 0

    @property
    def cache_key(self) -> str:
        return hashlib.sha256(str(self.git_dir).encode()).hexdigest()[:16]


@dataclass
class PrivateClone:
    """A `git clone --shared --no-checkout` of the user's repository in the cache, with one worktree per worker.

    Use as a context manager: the worktrees are removed on exit, also on Ctrl-C. The clone itself stays
    (it costs a few kB: objects are read through `objects/info/alternates` from the user's repository).
    """

    user: UserRepo
    workers: int = 1
    root: Path = field(init=False)
    worktrees: list[Path] = field(default_factory=list, init=False)

    def __post_init__(self):
        self.root = cache_root() / "repos" / self.user.cache_key
        self.clone = self.root / "clone"
        self.worktree_dir = self.root / "worktrees"

    # ---- life cycle --------------------------------------------------------------------
    def __enter__(self) -> "PrivateClone":
        self._ensure_clone()
        self._remove_stale_worktrees()
        try:
            for index in range(self.workers):
                self.worktrees.append(self._add_worktree(index))
        except subprocess.CalledProcessError as error:
            self.close()
            reason = (error.stderr or "").strip().splitlines()[-1:] or ["git worktree add failed"]
            raise GitError(f"cannot add a worktree in the cache {self.root}: {reason[0]}; "
                           "set REPLAYBISECT_CACHE to a writable folder") from None
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for worktree in self.worktrees:
            git(self.clone, "worktree", "remove", "--force", str(worktree), check=False)
            shutil.rmtree(worktree, ignore_errors=True)
        self.worktrees.clear()
        git(self.clone, "worktree", "prune", check=False)

    def _ensure_clone(self) -> None:
        if (self.clone / ".git").is_dir():
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise GitError(f"cannot create the cache folder {self.root} ({error.strerror}); "
                           "set REPLAYBISECT_CACHE to a writable folder") from None
        # Clone into a temporary name and rename, so two bisects starting at once never see half a clone.
        staging = self.root / f"clone-{uuid.uuid4().hex[:8]}"
        try:
            git(self.root, "clone", "--quiet", "--shared", "--no-checkout", str(self.user.path), str(staging))
            git(staging, "config", "gc.auto", "0")  # never let git gc run in the clone behind our back
            staging.rename(self.clone)
        except subprocess.CalledProcessError as error:
            shutil.rmtree(staging, ignore_errors=True)
            reason = (error.stderr or "").strip().splitlines()[-1:] or ["git clone failed"]
            raise GitError(f"cannot clone {self.user.path} into the cache {self.root}: {reason[0]}; "
                           "set REPLAYBISECT_CACHE to a writable folder") from None
        except OSError:  # another process renamed its clone first: use that one
            shutil.rmtree(staging, ignore_errors=True)
            if not (self.clone / ".git").is_dir():
                raise

    def _remove_stale_worktrees(self) -> None:
        """Worktrees left by a bisect that was killed (its process is gone)."""
        if not self.worktree_dir.is_dir():
            return
        for folder in self.worktree_dir.iterdir():
            pid = folder.name.split("-", 1)[0]
            if pid.isdigit() and not _process_alive(int(pid)):
                git(self.clone, "worktree", "remove", "--force", str(folder), check=False)
                shutil.rmtree(folder, ignore_errors=True)
        git(self.clone, "worktree", "prune", check=False)

    def _add_worktree(self, index: int) -> Path:
        self.worktree_dir.mkdir(parents=True, exist_ok=True)
        folder = self.worktree_dir / f"{os.getpid()}-{uuid.uuid4().hex[:6]}-{index}"
        git(self.clone, "worktree", "add", "--quiet", "--detach", "--no-checkout", str(folder))
        return folder

    # ---- per trial ---------------------------------------------------------------------
    def checkout(self, worktree: Path, sha: str) -> None:
        """Put `worktree` at `sha` exactly: tracked files as committed, untracked files (caches) removed."""
        git(worktree, "checkout", "--quiet", "--force", "--detach", sha)
        git(worktree, "clean", "-qfdx")

    # ---- history -----------------------------------------------------------------------
    def first_parent_range(self, good: str, bad: str) -> list[str]:
        """Commits on BAD's first-parent chain that are not reachable from GOOD, oldest first (BAD last)."""
        out = git(self.clone, "rev-list", "--first-parent", "--reverse", f"{good}..{bad}")
        return out.split()

    def tree(self, sha: str) -> str:
        return git(self.clone, "rev-parse", f"{sha}^{{tree}}")

    def trees(self, shas: list[str]) -> dict[str, str]:
        if not shas:
            return {}
        out = git(self.clone, "rev-parse", *[f"{sha}^{{tree}}" for sha in shas]).split()
        return dict(zip(shas, out))

    def subjects(self, shas: list[str]) -> dict[str, str]:
        if not shas:
            return {}
        out = git(self.clone, "show", "--no-patch", "--format=%H %s", *shas)
        return dict(line.split(" ", 1) if " " in line else (line, "") for line in out.splitlines())

    def commit_info(self, sha: str) -> CommitInfo:
        fields = git(self.clone, "show", "--no-patch", "--format=%s%x00%an <%ae>%x00%aI", sha).split("\x00")
        diffstat = git(self.clone, "diff", "--stat", "--no-color", f"{sha}^1", sha, check=False)
        return CommitInfo(sha=sha, subject=fields[0], author=fields[1], date=fields[2], diffstat=diffstat)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
