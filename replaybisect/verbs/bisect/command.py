"""`replay bisect GOOD BAD`: which commit broke convergence."""

from __future__ import annotations

import typer

from replaybisect.options import HYDRA_CONTEXT, JSON_OUTPUT, print_json, request_command
from replaybisect.verbs.bisect.request import BisectRequest


def bisect(request: BisectRequest, as_json: bool) -> None:
    """Find the first commit on BAD's first-parent history that fails, training each tried commit briefly.

    Everything after the options is a Hydra override for the trials. Examples:

    \b
        replay bisect v1.2 main --steps 200 --workers 3 optim.lr=3e-3
        replay bisect --repo /tmp/demo demo-good demo-bad --steps 40 --workers 2
        replay bisect v1.2 main --cmd "pytest -x tests/test_model.py"
        replay bisect v1.2 main --executor submitit --partition gpu --gpus 1 --workers 8   # trials as SLURM jobs

    prints a table of the tried commits and

    \b
        first bad commit: 3f2a9c1e07 refactor the model
        author: Ada <ada@example.com>
        date:   2026-01-03T10:00:00+00:00
         model.py | 4 ++--

    The repository is only read; trials run in worktrees of a clone in ~/.cache/replaybisect
    ($REPLAYBISECT_CACHE). Exit status: 0 a result (a first bad commit, or the skipped commits it could be),
    2 bad input (unknown commit, GOOD not an ancestor of BAD, GOOD fails or BAD passes).
    """
    import sys

    from replaybisect.verbs.bisect.engine import bisect as run_bisect
    from replaybisect.verbs.bisect.report import publish, render

    from replaybisect.options import announce_store, stderr_console
    from replaybisect.store import locate_store

    announce_store(locate_store(request.tracking_uri), creating=True)  # a store inside the repository is moved to the cache (said then)
    # `kill` (SIGTERM) stops the bisect as cleanly as Ctrl-C (main() raises Terminated, a KeyboardInterrupt)
    try:
        with _Progress(stderr_console()) as progress:
            result = run_bisect(**request.arguments(), on_event=progress.event)
    except KeyboardInterrupt as stop:
        from replaybisect.errors import interruption

        # say what happened to the user's repository (sys.exit: main() would add its generic line for typer.Exit)
        line, code = interruption(stop)
        print(f"{line} (trials stopped, worktrees removed, your repository untouched)", file=sys.stderr)
        sys.exit(code)
    from replaybisect.store import open_store

    publish(open_store(result.tracking_uri), result)
    if as_json:
        print_json(result.to_dict())
    else:
        from replaybisect.report import console

        render(result, console)


class _Progress:
    """Progress on stderr: one line per tried commit, and a live bar of rounds when stderr is a terminal."""

    def __init__(self, console):
        self.console = console
        self.bar = None
        self.task = None
        self.per_run = True

    def __enter__(self):
        if self.console.is_terminal:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                console=self.console, transient=True)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False

    def _status(self, text: str, advance: int = 0) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, description=text, advance=advance)

    def event(self, kind: str, **data) -> None:
        from replaybisect.report import plain

        print_line = self.console.print if self.bar is None else self.bar.console.print
        if kind == "start":
            self.per_run = data["mode"] == "train"  # --cmd runs once per commit: the trial line says it all
            print_line(f"bisecting {data['history_length']} commits with {data['workers']} worker(s): "
                       f"about {data['expected_rounds']} rounds after the endpoints")
            if self.bar is not None:
                self.task = self.bar.add_task("endpoints", total=data["expected_rounds"] + 1)
        elif kind == "phase":
            print_line(plain(data["text"]))
            self._status(plain(data["text"][:60]))
        elif kind == "run" and self.per_run:
            run = data["run"]
            value = f" {run.metric:.5g}" if run.metric is not None else ""
            source = " (cached)" if run.cached else f" ({run.seconds:.1f}s)"
            print_line(f"  #{data['position']:<3} {data['sha'][:10]} seed {data['seed']}: {run.outcome}{value}{source}"
                       + (f"  {run.detail}" if run.detail and run.outcome not in ('ok', 'good') else ""), markup=False)
        elif kind == "endpoints":
            print_line(f"endpoints verified: {data['baseline'].describe()}", markup=False)
            self._status("round 1", advance=1)
        elif kind == "round":
            shas = ", ".join(sha[:10] for sha in data["shas"])
            print_line(f"round {data['number']}: testing {plain(shas)}")
            self._status(f"round {data['number']}: {plain(shas)}", advance=1 if data["number"] > 1 else 0)
        elif kind == "job":  # --executor submitit: where each trial runs
            print_line(f"  {data['trial']}: job {data['job_id']} {data['state']}", markup=False)
        elif kind == "trial":
            trial = data["trial"]
            style = {"good": "green", "bad": "red", "skip": "yellow"}.get(trial.verdict, "")
            print_line(f"  [bold]#{trial.position} {plain(trial.sha[:10])}[/] [{style}]{plain(trial.verdict)}[/] {plain(trial.note)}")


def register(app: typer.Typer) -> None:
    command = request_command(BisectRequest, bisect, extras=[JSON_OUTPUT])
    app.command("bisect", context_settings=HYDRA_CONTEXT, short_help="Which commit broke convergence.")(command)
