"""Options and output shared by the verbs (light imports only)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from typing import Any, Optional

import typer

from replaybisect.core.jsonutil import strict_json

TrackingUri = typer.Option(None, "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the nearest mlflow.db in this folder or above, else ./mlflow.db).")
JsonFlag = typer.Option(False, "--json", help="Print one JSON object on stdout (progress and logs go to stderr).")

# where a verb's work runs (ablate's arms, bisect's trials, watch's triage steps): replaybisect/core/jobs.py
Executor = typer.Option("local", "--executor", help="local (processes here) | submitit (jobs: SLURM when sbatch exists, else submitit's local executor).")
Cluster = typer.Option(None, "--cluster", help="submitit cluster: slurm | local | debug (default: slurm when sbatch exists, else local).")
Partition = typer.Option(None, "--partition", help="SLURM partition (submitit).")
TimeMin = typer.Option(60, "--time", min=1, help="Job time limit in minutes (submitit).")
Gpus = typer.Option(0, "--gpus", min=0, help="GPUs per job (submitit).")
Cpus = typer.Option(None, "--cpus", min=1, help="CPUs per job (submitit).")
MemGb = typer.Option(None, "--mem-gb", min=0.001, help="Memory per job in GB (submitit).")
Account = typer.Option(None, "--account", help="SLURM account to charge (submitit).")
Slurm = typer.Option(None, "--slurm", help="Another SLURM parameter as KEY=VALUE, by submitit's name (qos=high, constraint=a100); repeat it.")
ExecutorFolder = typer.Option(".replaybisect/submitit", "--executor-folder", help="submitit's job folder (a shared file system on SLURM).")


def job_settings(*, cluster, partition, time_min, gpus, cpus, mem_gb, account, slurm, folder):
    """The job options of a command as core/jobs.py's JobSettings (checked by the request that takes them)."""
    from replaybisect.core.jobs import JobSettings, parse_slurm

    return JobSettings(cluster=cluster, folder=folder, partition=partition, time_min=time_min, gpus=gpus, cpus=cpus,
                       mem_gb=mem_gb, account=account, slurm=parse_slurm(slurm or ()))
# The trust boundary (replaybisect/trust.py): where a stored run's `_target_`s may come from.
CodeDirs = typer.Option(None, "--code-dir", help="A folder of your own code the run's `_target_`s may import from (repeatable; the working folder always counts).")
AllowUnsigned = typer.Option(None, "--allow-unsigned", metavar="RUN_ID", help="Replay this run (its id again) although "
                             "its signature does not verify, e.g. one recorded before runs were signed: you vouch that its "
                             "config.yaml and tags are as recorded.")
TrustPrefixes = typer.Option(None, "--trust", help="Trust `_target_`s under this module prefix, e.g. mypkg (repeatable; also $REPLAYBISECT_TRUST=a,b).")
HYDRA_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


# ---- the store line: "store: /abs/mlflow.db (why)" on stderr before whatever the command prints first ------
_store_line: Optional[str] = None  # announced, not printed yet: bad input found before any output stays one line


def announce_store(location, creating: bool = False) -> None:
    """Print `location.line()` on stderr before the command's first output (report, JSON, progress)."""
    global _store_line
    _store_line = location.line(creating)


def _print_store_line() -> None:
    global _store_line
    if _store_line is not None:
        line, _store_line = _store_line, None
        print(line, file=sys.stderr, flush=True)


def run_store(tracking_uri: Optional[str], run_id: str):
    """The store holding `run_id`, opened for a command that examines it: the run is looked up first (fast, before
    MLflow or torch is imported), and a store that does not exist is never created."""
    from replaybisect.store import locate_store, open_store, require_run

    location = locate_store(tracking_uri)
    require_run(location, run_id)
    announce_store(location)
    return open_store(location.uri, create=False)


def recording_store(tracking_uri: Optional[str], later: bool = False):
    """The store a recording command writes to (train, check with a config, bisect): created when new.
    `later=True`: what can be checked without creating it is checked now (an unreachable server, a missing folder,
    a file that is not a store), and a function that opens (or creates) it is returned, for the command to call once
    its input has been validated and built: bad input never creates a store."""
    import functools

    from replaybisect.store import check_store, locate_store, open_store

    location = locate_store(tracking_uri)
    announce_store(location, creating=True)
    if later:
        check_store(location.uri)
        return functools.partial(open_store, location.uri)
    return open_store(location.uri)


# ---- stdout belongs to the user's code while a command runs; ours is a saved copy ------------------------
_ours: Optional[io.TextIOBase] = None  # the command's real stdout while user output is sent to stderr


class _OurStdout:
    """A stream that always writes to the command's real stdout (the JSON, the report), wherever sys.stdout
    and file descriptor 1 point while user code runs."""

    def _target(self):
        return _ours if _ours is not None else sys.stdout

    def write(self, text: str) -> int:
        _print_store_line()
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


class _Stderr(_OurStdout):
    """stderr for progress and logs, the store line first."""

    def _target(self):
        return sys.stderr


OUR_STDERR = _Stderr()


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
        global _store_line
        _store_line = None
        with user_output_to_stderr():
            result = command(*args, **kwargs)
        _print_store_line()  # a command that printed nothing still says where it recorded
        return result

    return wrapped


def print_json(data: dict[str, Any]) -> None:
    """`--json` output: strict JSON (a NaN loss is "nan", as in every file we write), so jq reads it too."""
    OUR_STDOUT.write(strict_json(data, indent=2) + "\n")
    OUR_STDOUT.flush()


def stderr_console():
    """Progress and log lines on stderr; piped, a long line stays one line (no wrap at 80 columns)."""
    from rich.console import Console

    return Console(file=OUR_STDERR, soft_wrap=not _is_terminal(OUR_STDERR))


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def say(text: str) -> None:
    """One progress line on stderr (the store line first): also when stderr is piped, so long steps are not silent."""
    print(text, file=OUR_STDERR, flush=True)


class StepProgress:
    """Progress of a long step on stderr: a rich bar on a terminal, else a line at the start and about every
    LINE_SECONDS (`training: step 120/500`), so piped or logged output is never silent for minutes."""

    LINE_SECONDS = 10.0
    STARTING_SECONDS = 2.0  # a slow start says what it is doing; a config that fails at once stays one error line

    def __init__(self, description: str, enabled: Optional[bool] = None, starting: Optional[str] = None):
        self.description = description
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = None
        self._task = None
        self._next_line = 0.0  # monotonic time of the next plain line
        self._starting = None
        if starting and not self.enabled:
            import threading

            self._starting = threading.Timer(self.STARTING_SECONDS, say, [f"{description}: {starting}"])
            self._starting.daemon = True

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                console=stderr_console(), transient=True,
            )
            self._progress.__enter__()
        if self._starting is not None:
            self._starting.start()
        return self

    def update(self, completed: int, total: int) -> None:
        if self._starting is not None:
            self._starting.cancel()
        if self._progress is None:
            import time

            now = time.monotonic()
            if now >= self._next_line or completed >= total:
                if self._next_line == 0.0:
                    say(f"{self.description}: {total} step{'' if total == 1 else 's'}")
                elif completed < total:
                    say(f"{self.description}: step {completed}/{total}")
                self._next_line = now + self.LINE_SECONDS
            return
        if self._task is None:
            self._task = self._progress.add_task(self.description, total=total)
        self._progress.update(self._task, completed=completed)

    def __exit__(self, *exc):
        if self._starting is not None:
            self._starting.cancel()
        if self._progress is not None:
            self._progress.__exit__(*exc)
        return False
