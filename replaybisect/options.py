"""Options and output shared by the verbs (light imports only)."""

from __future__ import annotations

import json
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


def print_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=json_default) + "\n")
    sys.stdout.flush()


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    from rich.console import Console

    return Console()


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
