"""`replay runs`: recent runs with status, failing step and snapshot steps."""

from __future__ import annotations

from typing import Optional

import typer

from replaybisect.options import JsonFlag, TrackingUri, print_json
from replaybisect.verbs.runs.engine import KINDS, MAX_LIMIT, STATUSES, check_filters


def runs_command(
    limit: int = typer.Option(20, "--limit", "-n", min=1, max=MAX_LIMIT, help="How many runs, newest first."),
    kind: str = typer.Option("train", "--kind", help=" | ".join((*KINDS, "all"))),
    status: Optional[str] = typer.Option(None, "--status", help=" | ".join(STATUSES)),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = JsonFlag,
):
    """List recent runs: status, failing step, snapshot steps, and what `replay watch` concluded (the triage
    column: its one-line answer, `-` for a run it has not triaged).

        replay runs --status nonfinite
    """
    from replaybisect.options import announce_store
    from replaybisect.store import locate_store

    kind_filter = None if kind == "all" else kind
    check_filters(limit, kind_filter, status)  # before the store is looked for
    location = locate_store(tracking_uri)
    announce_store(location)
    summaries = []
    if location.exists:  # reading never creates a store
        from replaybisect.store import open_store
        from replaybisect.verbs.runs.engine import recent_runs

        summaries = recent_runs(open_store(location.uri, create=False), limit=limit, kind=kind_filter, status=status)
    if as_json:
        print_json({"tracking_uri": location.uri, "store": location.shown, "runs": [s.to_json() for s in summaries]})
    else:
        from replaybisect.report import print_runs

        print_runs(summaries, location)


def register(app: typer.Typer) -> None:
    app.command("runs", short_help="Recent runs: status, failing step, snapshots.")(runs_command)
