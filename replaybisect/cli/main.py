"""The `replay` command. Each verb lives in its own module under replaybisect.cli.

Keep imports here and in the verb modules light: `replay --help` must not import torch or mlflow.
Verb modules import the library inside their command function.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

app = typer.Typer(
    name="replay",
    help="Replay, ablate and bisect failing PyTorch training runs recorded to MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: rendering it with rich costs ~0.3 s of imports
)



@app.callback()
def _root() -> None:
    """Replay, ablate and bisect failing PyTorch training runs recorded to MLflow."""


# verb -> module under replaybisect.cli; each module defines `register(app)`.
VERBS = ["train", "runs", "nan", "ablate", "bisect", "check", "diagnose", "watch"]


def _register_verbs() -> None:
    for verb in VERBS:
        try:
            module = importlib.import_module(f"replaybisect.cli.{verb}")
        except ModuleNotFoundError as missing:
            if missing.name == f"replaybisect.cli.{verb}":
                continue  # verb not built yet
            raise
        module.register(app)


_register_verbs()


def main() -> None:
    from replaybisect.errors import NonFiniteStop, ReplayError, interruption, sigterm_raises

    try:
        with sigterm_raises():  # SIGTERM stops a verb like Ctrl-C, exit 143
            exit_code = app(standalone_mode=False)
        if exit_code == 130:  # typer turns Ctrl-C (and SIGTERM) into exit code 130, silently
            line, exit_code = interruption()
            print(line, file=sys.stderr)
        if isinstance(exit_code, int) and exit_code:
            sys.exit(exit_code)
    except ReplayError as error:
        if os.environ.get("REPLAYBISECT_FULL_ERROR") == "1":
            raise
        print(f"replay: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except NonFiniteStop as stop:
        print(f"replay: {stop}", file=sys.stderr)
        sys.exit(stop.exit_code)
    except KeyboardInterrupt as stop:
        line, code = interruption(stop)
        print(line, file=sys.stderr)
        sys.exit(code)
    except SystemExit:
        raise
    except Exception as error:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(error, click.exceptions.ClickException):
            if os.environ.get("REPLAYBISECT_FULL_ERROR") == "1":
                raise
            print(f"replay: error: {error.format_message()}", file=sys.stderr)
            sys.exit(2)
        if isinstance(error, click.exceptions.Abort):
            print("replay: interrupted", file=sys.stderr)
            sys.exit(130)
        raise
