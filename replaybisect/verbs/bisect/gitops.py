"""Git for `replay bisect`: read-only questions to the user's repository, everything else in a private clone.

The user's repository is only ever *read*; nothing in it is written, not its working tree, index, HEAD, refs,
stashes or `.git/worktrees`. Trials check commits out in worktrees of a `git clone --shared --no-checkout` that
lives in a cache folder (git-worktree(1): `git worktree add` in the user's repository would write under its
`.git/worktrees`).

Reads (which repository, is a commit an ancestor, does it hold a file, its first-parent history, subjects, authors,
dates, trees) go through GitPython (`core.repo.open_repo`). What changes files stays on the git CLI, which GitPython
only wraps: `clone --shared`, `worktree add/remove/prune`, `checkout`, `clean`. So do two reads whose answer is
git's own: a revision is resolved by `git rev-parse --verify` (GitPython's own parser lacks `@{upstream}` and
`@{<date>}`), and the diffstat is `git diff --stat`'s text.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from itertools import dropwhile, takewhile
from pathlib import Path

from replaybisect.core.repo import clean_git_env, open_repo
from replaybisect.errors import GitError

def git(cwd: Path | str, *args: str, check: bool = True) -> str:
    """Run one git command in `cwd` and return its stdout (stripped)."""
    done = subprocess.run(["git", *args], cwd=cwd, env=clean_git_env(), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["git", *args], done.stdout, done.stderr)
    return done.stdout.strip()


def subject(message: str) -> str:
    """A commit message's subject as git prints it (`%s`): its first paragraph, lines joined by a space."""
    lines = list(dropwhile(lambda line: not line.strip(), message.split("\n")))
    return " ".join(line.rstrip() for line in takewhile(lambda line: line.strip(), lines))


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
        try:
            from git.exc import InvalidGitRepositoryError, NoSuchPathError
        except ImportError:  # GitPython does not import without a git executable
            raise GitError("replay bisect needs git: install it, or put it on PATH") from None

        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise GitError(f"{folder} is not a folder; pass --repo PATH of a git repository")
        try:
            with open_repo(folder) as repo:
                git_dir = Path(repo.common_dir)
                top = git_dir if repo.bare else Path(repo.working_tree_dir)
        except (InvalidGitRepositoryError, NoSuchPathError):
            raise GitError(f"{folder.resolve()} is not a git repository; pass --repo PATH of one") from None
        return cls(path=top.resolve(), git_dir=git_dir.resolve())

    def resolve(self, rev: str, what: str) -> str:
        """The full SHA of commit `rev` (a SHA, branch, tag, `HEAD~3`, `main@{upstream}`: git's own syntax)."""
        from git.exc import GitCommandError

        if not rev or rev.startswith("-"):
            raise GitError(f"{what} {rev!r} is not a commit; pass a SHA, branch or tag of {self.path}")
        try:
            with open_repo(self.path) as repo:
                return repo.git.rev_parse("--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
        except GitCommandError:
            raise GitError(f"{what} {rev!r} is not a commit in {self.path}; check it with `git log --oneline`") from None

    def has_file(self, sha: str, path: str) -> bool:
        """Whether commit `sha` holds `path` (relative to the repository root, a file or a folder); read-only."""
        with open_repo(self.path) as repo:
            try:
                repo.commit(sha).tree.join(path)
            except KeyError:
                return False
        return True

    def is_ancestor(self, older: str, newer: str) -> bool:
        from git.exc import GitCommandError

        with open_repo(self.path) as repo:
            try:
                return repo.is_ancestor(older, newer)
            except GitCommandError:  # not a commit either: no ancestry to speak of
                return False

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
        with open_repo(self.clone) as repo:
            return [commit.hexsha for commit in repo.iter_commits(f"{good}..{bad}", first_parent=True, reverse=True)]

    def tree(self, sha: str) -> str:
        return self.trees([sha])[sha]

    def trees(self, shas: list[str]) -> dict[str, str]:
        if not shas:
            return {}
        with open_repo(self.clone) as repo:
            return {sha: repo.commit(sha).tree.hexsha for sha in shas}

    def subjects(self, shas: list[str]) -> dict[str, str]:
        if not shas:
            return {}
        with open_repo(self.clone) as repo:
            return {commit.hexsha: subject(commit.message) for commit in map(repo.commit, shas)}

    def commit_info(self, sha: str) -> CommitInfo:
        from git.exc import GitCommandError

        with open_repo(self.clone) as repo:
            commit = repo.commit(sha)
            try:  # git's own text; a root commit has no first parent to compare with
                diffstat = repo.git.diff("--stat", "--no-color", f"{sha}^1", sha)
            except GitCommandError:
                diffstat = ""
            return CommitInfo(sha=sha, subject=subject(commit.message).strip(),
                              author=f"{commit.author.name} <{commit.author.email}>",
                              date=commit.authored_datetime.isoformat(), diffstat=diffstat.strip())


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
