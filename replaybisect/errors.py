"""The one exception family for what a user can fix (printed on one line, exit status 2)."""

from __future__ import annotations

import errno
import signal
import sys
import threading
from contextlib import contextmanager


class ReplayError(Exception):
    """Bad input: the message says what is wrong and what to do."""

    exit_code = 2


class ConfigError(ReplayError):
    """The config does not compose, validate or instantiate."""


class UntrustedConfig(ConfigError):
    """A stored config names code that is not trusted here, a code/pickle loader, or an object of the wrong kind."""


class RunNotFound(ReplayError):
    """No such run in the tracking store."""


class StoreUnreachable(ReplayError):
    """The tracking store cannot be reached or opened."""


class SnapshotError(ReplayError):
    """A snapshot is missing, incomplete, fails verification or is unsafe to load."""


class GitError(ReplayError):
    """A git input (repository, SHA, range) is not usable."""


class DiskFull(ReplayError):
    """No space left where a run writes (snapshots, the tracking store): the run is marked failed.
    Exit status 1: the environment failed, not the input."""

    exit_code = 1


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    """An OSError for a full disk or quota, or SQLite's "database or disk is full" (wrapped by SQLAlchemy/MLflow)."""
    if isinstance(error, OSError):
        return error.errno in DISK_FULL_ERRNOS
    return "database or disk is full" in str(error)


@contextmanager
def disk_full_named(what: str, where, in_store: bool = False):
    """A full disk or quota becomes one line: what was being written, where, and what to do."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        if not is_disk_full(error):
            raise
        if in_store:
            message = f"no space left on device writing {what} to the tracking store {where}; free space or point the store elsewhere (--tracking-uri)"
        else:
            message = f"no space left on device writing {what} in {where}; free space, set snapshot.every higher or point the store elsewhere (--tracking-uri)"
        raise DiskFull(message) from error


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient went non-finite and the run stopped before its update; what was recorded, the
    state before that step included, stays (`replay nan --run-id ...`). Raised by `Recorder.step`, the Lightning
    callback's `trainer.fit` and the `replay train` command (exit status 3)."""

    exit_code = 3

    def __init__(self, message: str, run_id: str, step: int, what: str = "loss"):
        super().__init__(message)
        self.run_id = run_id
        self.step = step
        self.what = what

    @classmethod
    def of_command(cls, step: int, what: str, run_id: str, snapshot_saved: bool = True) -> "NonFiniteStep":
        """`replay train`'s line: the step, what went non-finite, and whether a replay can start before it."""
        saved = (
            f"snapshot of the state before step {step} saved" if snapshot_saved
            else "no snapshot saved: the recorder was off (snapshot.enabled=false), so `replay nan` cannot replay it"
        )
        return cls(f"step {step}: non-finite {what}; run {run_id} stopped ({saved})", run_id, step, what)

    @classmethod
    def of_library(cls, step: int, what: str, value: float, run_id: str) -> "NonFiniteStep":
        """The Recorder's and the Lightning callback's: what went non-finite, and the command that finds why."""
        said = f"the {what} went non-finite" if what.startswith("loss on ") else f"{what} is {value}"  # on another rank
        return cls(f"{said} at step {step}; find the cause with: replay nan --run-id {run_id}", run_id, step, what)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM, Kubernetes and `kill` send), raised in the main thread: stops like Ctrl-C
    (a KeyboardInterrupt, so every Ctrl-C cleanup runs), exit status 143."""

    exit_code = 143
    received = False  # set by the first SIGTERM: typer turns a KeyboardInterrupt into a bare exit code 130
    # raised, and not seen leaving a sigterm_raises block yet: a handler that ran in a finalizer (SQLAlchemy's weakref
    # callbacks run in every store write and in any garbage collection) raised where Python ignores it
    pending = False


_deferring = 0  # sigterm_deferred blocks the main thread is in


def _raise_terminated(signum, frame) -> None:
    Terminated.received = Terminated.pending = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup that follows is not cut short by a second one
    if not _deferring:
        raise Terminated()


def raise_if_terminated() -> None:
    """Raise the SIGTERM whose Terminated was swallowed or deferred (a step's start, a run's end are the places)."""
    if Terminated.pending and threading.current_thread() is threading.main_thread():
        raise Terminated()


def _quiet_when_terminated(hook):
    """sys.unraisablehook: a Terminated that a finalizer swallowed is raised again later (raise_if_terminated), not
    printed as a traceback; anything else goes to `hook`."""

    def unraisable(seen) -> None:
        if not (isinstance(seen.exc_type, type) and issubclass(seen.exc_type, Terminated)):
            hook(seen)

    return unraisable


@contextmanager
def sigterm_raises():
    """Inside, SIGTERM raises Terminated in the main thread; the previous handler comes back after. One that a
    finalizer swallowed is raised again at the next step, or as the block ends at the latest.
    Off the main thread (where signals cannot be handled) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, previous_hook = signal.signal(signal.SIGTERM, _raise_terminated), sys.unraisablehook
    sys.unraisablehook = _quiet_when_terminated(previous_hook)
    try:
        yield
        raise_if_terminated()
    except Terminated:
        Terminated.pending = False  # on its way up: every cleanup it passes runs
        raise
    finally:
        sys.unraisablehook = previous_hook
        if previous is not None:  # None: a handler set from C, which Python cannot put back
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def sigterm_deferred():
    """Inside, a SIGTERM is only noted: a store write whose result must not be lost (a run created, its id not
    returned yet) is not cut short. The caller raises it (raise_if_terminated) where it can end what it made."""
    global _deferring
    main = threading.current_thread() is threading.main_thread()
    _deferring += main
    try:
        yield
    finally:
        _deferring -= main


def interruption(error: BaseException | None = None) -> tuple[str, int]:
    """The line to print and the exit status for Ctrl-C (130) or SIGTERM (143): the stop is handled."""
    Terminated.pending = False
    if isinstance(error, Terminated) or Terminated.received:
        return "replay: terminated (SIGTERM)", Terminated.exit_code
    return "replay: interrupted", 130
