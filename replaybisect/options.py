"""Options and output shared by the verbs (light imports only)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys
from typing import Any, Optional

import typer

from replaybisect.core.jsonutil import json_default

TrackingUri = typer.Option(None, "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
JsonFlag = typer.Option(False, "--json", help="Print one JSON object on stdout (progress and logs go to stderr).")
MAX_STEPS = 1_000_000  # bound on step-count options: a typo (1e20) is bad input, not hours of work or memory
MAX_WORKERS = 256  # bound on parallel workers (processes, worktrees or SLURM jobs)
# The trust boundary (replaybisect/trust.py): where a stored run's `_target_`s may come from.
CodeDirs = typer.Option(None, "--code-dir", help="A folder of your own code the run's `_target_`s may import from (repeatable; the working folder always counts).")
TrustPrefixes = typer.Option(None, "--trust", help="Trust `_target_`s under this module prefix, e.g. mypkg (repeatable; also $REPLAYBISECT_TRUST=a,b).")
HYDRA_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


# ---- stdout belongs to the user's code while a command runs; ours is a saved copy ------------------------
_ours: Optional[io.TextIOBase] = None  # the command's real stdout while user output is sent to stderr


class _OurStdout:
    """A stream that always writes to the command's real stdout (the JSON, the report), wherever sys.stdout
    and file descriptor 1 point while user code runs."""

    def _target(self):
        return _ours if _ours is not None else sys.stdout

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()

    def fileno(self) -> int:
        return self._target().fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._target(), "encoding", "utf-8")


OUR_STDOUT = _OurStdout()


@contextlib.contextmanager
def user_output_to_stderr():
    """Send whatever user code prints (Python, C extensions, child processes) to stderr, keeping the real stdout
    for our own output (OUR_STDOUT): a model that prints cannot corrupt `--json`."""
    global _ours
    if _ours is not None:
        yield
        return
    sys.stdout.flush()
    saved_fd = os.dup(1)
    saved_stream = sys.stdout
    _ours = io.TextIOWrapper(io.FileIO(saved_fd, "w", closefd=False), encoding=getattr(saved_stream, "encoding", None) or "utf-8",
                             line_buffering=True)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        _ours.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout, _ours = saved_stream, None


def owns_stdout(command):
    """A command wrapped in user_output_to_stderr (the signature is kept for typer)."""

    @functools.wraps(command)
    def wrapped(*args, **kwargs):
        with user_output_to_stderr():
            return command(*args, **kwargs)

    return wrapped


def print_json(data: dict[str, Any]) -> None:
    OUR_STDOUT.write(json.dumps(data, indent=2, default=json_default) + "\n")
    OUR_STDOUT.flush()


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    from rich.console import Console

    return Console(file=OUR_STDOUT)


class StepProgress:
    """A rich progress bar on stderr for long work; silent when stderr is not a terminal."""

    def __init__(self, description: str, enabled: Optional[bool] = None):
        self.description = description
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                console=stderr_console(), transient=True,
            )
            self._progress.__enter__()
        return self

    def update(self, completed: int, total: int) -> None:
        if self._progress is None:
            return
        if self._task is None:
            self._task = self._progress.add_task(self.description, total=total)
        self._progress.update(self._task, completed=completed)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        return False
