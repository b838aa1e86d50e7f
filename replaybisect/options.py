"""Options and output shared by the verbs (light imports only)."""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import inspect
import io
import os
import sys
from typing import Any, Callable, Optional, Sequence

import typer

from replaybisect.core.jsonutil import strict_json

# --json, as request_command's extras take it
JSON_OUTPUT = inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
    False, "--json", help="Print one JSON object on stdout (progress and logs go to stderr)."))

HYDRA_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


# ---- a verb's command made from its request's fields (replaybisect/request.py: option, argument) -------------
def request_command(request_type: type, run: Callable[..., None], *, extras: Sequence[inspect.Parameter] = (),
                    answered: Optional[Callable[..., bool]] = None) -> Callable[..., None]:
    """A typer command whose options are `request_type`'s fields declared with `option`/`argument`, then `extras`
    (the command's own flags: --json, --list). Called, it builds the request from what was given (a --no-X flag
    negated, a repeatable option given none as ()) and calls `run(request, **extras)`; `answered(**extras)` first,
    where a flag answers without a request (--list), when it returns True."""
    fields = _cli_fields(request_type)
    parameters = []
    if any(cli.extra_args for _, cli, _ in fields):
        parameters.append(inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context))
    for f, cli, hint in fields:
        if cli.group is not None:  # its own options, in its order
            parameters += [_parameter(member, member_cli, member_hint) for member, member_cli, member_hint in _cli_fields(cli.group)]
        elif not cli.extra_args:
            parameters.append(_parameter(f, cli, hint))
    extras = list(extras)
    parameters += [extra.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for extra in extras]

    def command(**given: Any) -> None:
        context = given.pop("ctx", None)
        own = {extra.name: given.pop(extra.name) for extra in extras}
        if answered is not None and answered(**own):
            return
        values = {}
        for f, cli, _ in fields:
            if cli.extra_args:
                values[f.name] = list(context.args)
            elif cli.group is not None:
                values[f.name] = cli.group(**{member.name: _given(member, member_cli, given) for member, member_cli, _ in _cli_fields(cli.group)})
            else:
                values[f.name] = _given(f, cli, given)
        run(request_type(**values), **own)

    command.__signature__ = inspect.Signature(parameters)
    command.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    command.__doc__ = run.__doc__
    command.__name__ = command.__qualname__ = run.__name__
    return command


def _cli_fields(kind: type) -> list:
    """(field, Cli, type) of each field of the dataclass `kind` that the command line gives."""
    import typing

    from replaybisect.request import cli_of

    hints = typing.get_type_hints(kind)
    return [(f, cli_of(f), hints[f.name]) for f in dataclasses.fields(kind) if f.init and cli_of(f) is not None]


def _parameter(request_field, cli, hint) -> inspect.Parameter:
    """The typer parameter of one field: its flags, help and bounds, its default, the type the command line parses."""
    default = ... if request_field.default is dataclasses.MISSING else request_field.default
    if cli.negated:
        default = False
    elif default == ():
        default = None  # a repeatable option given none
    if not cli.flags:
        info = typer.Argument(default, help=cli.help)
    else:
        limits = cli.bound.limits if cli.bound is not None else {}
        info = typer.Option(default, *cli.flags, help=cli.help, hidden=cli.hidden, metavar=cli.metavar, envvar=cli.envvar, **limits)
    kind = bool if cli.negated else cli.kind or _cli_type(hint, request_field.default)
    return inspect.Parameter(cli.parameter_name(request_field.name), inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info,
                             annotation=kind)


def _given(request_field, cli, given: dict) -> Any:
    """The field's value from what the command line gave its parameter."""
    value = given[cli.parameter_name(request_field.name)]
    if cli.negated:
        return not value
    if cli.parse is not None:
        return cli.parse(value)
    return () if value is None and request_field.default == () else value


def _cli_type(hint: Any, default: Any) -> Any:
    """The type typer parses for a request field's type: a sequence is a repeatable option (a list of str), a path or a
    closed choice (Literal) a str, `Optional` kept where the field may be None."""
    import typing
    from pathlib import Path as PathType

    arguments = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    optional = type(None) in arguments or default is None
    kinds = [kind for kind in arguments if kind is not type(None)]
    origins = {typing.get_origin(kind) or kind for kind in kinds}
    if origins & {collections.abc.Sequence, list, tuple}:
        return Optional[list[str]]
    if origins & {str, PathType, typing.Literal}:
        base = str
    elif kinds == [bool]:
        return bool
    elif kinds and all(kind in (int, float) for kind in kinds):
        base = kinds[0]
    else:
        raise TypeError(f"no command-line type for {hint!r}: declare option(..., kind=...)")
    return Optional[base] if optional else base


def finish(report, *, store, publishing: bool, publish: Callable, render: Callable[[Any], None], as_json: bool) -> None:
    """A replaying verb's ending: its report recorded as a child run (`publish(store, report)`) unless --no-child-run,
    then printed: one JSON object, or `render(report)`."""
    if publishing:
        publish(store, report)
    if as_json:
        print_json(report.to_json())
    else:
        render(report)


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
    return open_store(location.uri, create=False, read_once=True)


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
