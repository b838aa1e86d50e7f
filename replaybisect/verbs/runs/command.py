"""`replay runs`: recent runs with status, failing step and snapshot steps."""

from __future__ import annotations

import typer

from replaybisect.options import JSON_OUTPUT, print_json, request_command
from replaybisect.verbs.runs.request import RunsRequest


def runs(request: RunsRequest, as_json: bool) -> None:
    """List recent runs: status, failing step, snapshot steps, and what `replay watch` concluded (the triage
    column: its one-line answer, `-` for a run it has not triaged).

        replay runs --status nonfinite
    """
    from replaybisect.options import announce_store
    from replaybisect.store import locate_store

    location = locate_store(request.tracking_uri)
    announce_store(location)
    summaries = []
    if location.exists:  # reading never creates a store
        from replaybisect.store import open_store
        from replaybisect.verbs.runs.engine import recent_runs

        summaries = recent_runs(open_store(location.uri, create=False), limit=request.limit, kind=request.kind_filter,
                                status=request.status)
    if as_json:
        print_json({"tracking_uri": location.uri, "store": location.shown, "runs": [s.to_json() for s in summaries]})
    else:
        from replaybisect.report import print_runs

        print_runs(summaries, location)


def register(app: typer.Typer) -> None:
    command = request_command(RunsRequest, runs, extras=[JSON_OUTPUT])
    app.command("runs", short_help="Recent runs: status, failing step, snapshots.")(command)
