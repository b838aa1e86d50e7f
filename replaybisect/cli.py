"""The `replay` command. Each verb's command lives in replaybisect/verbs/<verb>/command.py.

Keep imports here and in the verb modules light: `replay --help` must not import torch or mlflow.
Verb modules import the library inside their command function.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from replaybisect.options import owns_stdout

app = typer.Typer(
    name="replay",
    help="Replay, ablate and bisect failing PyTorch training runs recorded to MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: rendering it with rich costs ~0.3 s of imports
    epilog=(
        "\b\n"  # click's no-rewrap marker: the example prints as written
        "Example, a run that dies with loss=nan (from a clone of the repository):\n"
        "  replay train --config-dir examples/nan_forward   # exit 3; prints the run id\n"
        "  replay nan --run-id RUN_ID                       # -> forward, module `gate`, torch.exp\n"
        "  replay ablate lr,clip --run-id RUN_ID --horizon 40\n"
        "\n"
        "Runs are recorded to the nearest mlflow.db in this folder or above (./mlflow.db is created by the first "
        "command that records), or to $MLFLOW_TRACKING_URI / --tracking-uri. `replay COMMAND --help` for more."
    ),
)



def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("replaybisect")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from replaybisect import __version__

        return __version__


def _print_version(requested: bool) -> None:
    if requested:
        print(f"replay {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Replay, ablate and bisect failing PyTorch training runs recorded to MLflow."""


# verb -> replaybisect/verbs/<verb>/command.py; each defines `register(app)`.
VERBS = ["train", "runs", "nan", "ablate", "bisect", "check", "diagnose", "profile", "memory", "verify", "watch"]


def _register_verbs() -> None:
    for verb in VERBS:
        try:
            module = importlib.import_module(f"replaybisect.verbs.{verb}.command")
        except ModuleNotFoundError as missing:
            if missing.name == f"replaybisect.verbs.{verb}.command":
                continue  # verb not built yet
            raise
        module.register(app)
    for command in app.registered_commands:  # user code owns stdout while a command runs; our output is kept apart
        command.callback = owns_stdout(command.callback)


_register_verbs()


def main() -> None:
    """The command's outcome in one line and its exit status. SIGTERM stops a verb like Ctrl-C (exit 143); once the
    command is over, a SIGTERM during the interpreter's shutdown (threads joined, MLflow's and multiprocessing's exit
    handlers) still says so in one line and exits 143, instead of the default death by signal with no line."""
    import signal

    from replaybisect.core.processes import end_process
    from replaybisect.errors import Terminated, interruption

    # outside the command (from here, and during the shutdown after it): a SIGTERM prints its line and exits 143;
    # inside, sigterm_raises replaces this handler and puts it back when the command is over
    signal.signal(signal.SIGTERM, _terminated_at_exit)
    try:
        exit_code = _run()
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM while an outcome line was being printed
        line, exit_code = interruption(stop)
        print(line, file=sys.stderr)
    if Terminated.received:  # the terminated line is out: a second SIGTERM during the shutdown adds nothing
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_process(exit_code)


def _terminated_at_exit(signum, frame) -> None:
    """SIGTERM after the command's outcome: the line, then exit 143 at once (the outcome is already printed)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: the exit matters more
            pass
    try:
        os.write(2, b"replay: terminated (SIGTERM)\n")
    finally:
        os._exit(143)


def _run():
    """Run the command; its exit status (what sys.exit gets), its outcome printed."""
    from replaybisect.errors import sigterm_raises

    with sigterm_raises():  # SIGTERM stops a verb like Ctrl-C, exit 143 (also while its outcome is printed)
        return _outcome()


def _outcome():
    """The command's exit status, its outcome line printed (an error, a stop, a crash)."""
    from replaybisect.errors import NonFiniteStep, ReplayError, interruption

    try:
        exit_code = app(standalone_mode=False)
        if exit_code == 130:  # typer turns Ctrl-C (and SIGTERM) into exit code 130, silently
            line, exit_code = interruption()
            print(line, file=sys.stderr)
        return exit_code if isinstance(exit_code, int) and exit_code else 0
    except ReplayError as error:
        if os.environ.get("REPLAYBISECT_FULL_ERROR") == "1":
            raise
        print(f"replay: error: {' '.join(str(error).split())}", file=sys.stderr)
        return error.exit_code
    except NonFiniteStep as stop:
        print(f"replay: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt as stop:
        line, code = interruption(stop)
        print(line, file=sys.stderr)
        return code
    except SystemExit as exit:
        return exit.code
    except Exception as error:  # click usage errors arrive here in non-standalone mode
        if isinstance(error, typer.Abort):
            print("replay: interrupted", file=sys.stderr)
            return 130
        if os.environ.get("REPLAYBISECT_FULL_ERROR") == "1":
            raise
        if not _is_usage_error(error):
            _report_crash(error)
            return 1
        if type(error).__name__ == "NoArgsIsHelpError":  # bare `replay`: its message is the help
            print(error.format_message())
            return 0
        print(_usage_line(error), file=sys.stderr)
        return 2


# ---- an exception nobody caught: the traceback from the user's code down, then one line -------------------
def _report_crash(error: BaseException) -> None:
    """An exception nobody caught. Raised in replaybisect's own code: our bug, all of the traceback. Raised below a
    frame of the user's (a model, a dataset, a step): the traceback from that frame on, so the user reads their
    own code first, then one line. Anything else (a library called by our loop, a user package installed in
    site-packages): all of it, and one neutral line naming where it was raised."""
    import traceback

    from replaybisect.frames import is_ours, is_user_code

    frames = traceback.extract_tb(error.__traceback__)
    quoted = _quoted_worker_traceback(error)  # DataLoader re-raises a worker's exception with its traceback as text
    if quoted is not None:
        lines, sites, raised = quoted
    else:
        sites = [(frame.filename, frame.lineno, frame.name) for frame in frames]
        raised = f"{type(error).__name__}: {_first_line(error)}"
    if any(isinstance(cause, MemoryError) for cause in _chain(error)) and not isinstance(error, MemoryError):
        raised += " (caused by MemoryError: out of memory)"  # a library may wrap it (MLflow's session does)
    if not sites or is_ours(sites[-1][0]):
        traceback.print_exception(error)
        print(f"replay: internal error: {raised}; please report it with the traceback above", file=sys.stderr)
        return
    users = [site for site in sites if is_user_code(site[0])]
    if not users:
        traceback.print_exception(error)
        print(f"replay: error: {raised} (raised in {_site(sites[-1])}){_replayable(error)}", file=sys.stderr)
        return
    if quoted is None:
        first = next(i for i, frame in enumerate(frames) if is_user_code(frame.filename))
        shown = traceback.TracebackException.from_exception(error)
        shown.stack = traceback.StackSummary.from_list(frames[first:])
        shown.__cause__ = shown.__context__ = None  # the chain is in REPLAYBISECT_FULL_ERROR=1's traceback
        lines = "".join(list(shown.format())[1:]).rstrip("\n").splitlines()
    print("Traceback (from your code; REPLAYBISECT_FULL_ERROR=1 shows all of it):", file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    next_step = _replayable(error) or "; fix it and run the command again"
    print(f"replay: error: your code raised {raised} ({_site(users[-1])}){next_step}", file=sys.stderr)


def _replayable(error: BaseException) -> str:
    """A step that raised while recording (record/hooks.py on_exception): the run keeps it, and the next command."""
    step, run_id = getattr(error, "replaybisect_failing_step", None), getattr(error, "replaybisect_run_id", None)
    if step is None or run_id is None:
        return ""
    return f" at step {step}; run {run_id} kept the state before it and its batch: replay nan --run-id {run_id}"


def _quoted_worker_traceback(error: BaseException):
    """(lines from the first user frame on, plus the error's notes; its frames as (file, line, function);
    'Type: message') of the traceback quoted in a DataLoader worker error's message, or None."""
    from replaybisect.frames import QUOTED_FRAME, is_user_code

    text = str(error)
    if "Original Traceback (most recent call last):" not in text:
        return None
    quoted = text.split("Original Traceback (most recent call last):", 1)[1].strip("\n").splitlines()
    found = [(i, match.groups()) for i, line in enumerate(quoted) if (match := QUOTED_FRAME.search(line))]
    if not found:
        return None
    start = next((i for i, site in found if is_user_code(site[0])), found[0][0])
    raised = next((line.strip() for line in quoted[found[-1][0] + 1:] if line and not line.startswith(" ")), type(error).__name__)
    return quoted[start:] + list(getattr(error, "__notes__", [])), [site for _, site in found], raised


def _chain(error: BaseException):
    """The exception and what caused it or was being handled, innermost last."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _site(site) -> str:
    filename, lineno, name = site
    return f"{os.path.basename(filename)}:{lineno} in {name}"


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else "(no message)"


def _is_usage_error(error: Exception) -> bool:
    """A click usage error, from click itself or the copy typer >= 0.2x vendors (typer._click): duck-typed."""
    return callable(getattr(error, "format_message", None)) and isinstance(getattr(error, "exit_code", None), int)


def _usage_line(error: Exception) -> str:
    message = " ".join(error.format_message().split()).rstrip(".")
    allowed = _allowed_range(getattr(error, "param", None))
    if allowed and "range" not in message:
        message += f" (allowed: {allowed})"
    ctx = getattr(error, "ctx", None)
    command = ctx.command_path if ctx is not None and ctx.command_path != "-" else _command_from_argv()
    hint = f"see `{command} --help`"
    return f"replay: error: {message} ({hint})" if message.endswith("?") else f"replay: error: {message}; {hint}"


def _allowed_range(param) -> str | None:
    """A numeric option's bounds: typer >= 0.2x keeps them on the option, click on its IntRange/FloatRange type."""
    holder = param if getattr(param, "min", None) is not None or getattr(param, "max", None) is not None else getattr(param, "type", None)
    low, high = getattr(holder, "min", None), getattr(holder, "max", None)
    return f"{low} to {high}" if low is not None and high is not None else None  # one bound: the message names it


def _command_from_argv() -> str:
    verb = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    return f"replay {verb}" if verb in VERBS else "replay"
