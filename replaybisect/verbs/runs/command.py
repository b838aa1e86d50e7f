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
    """List recent runs: status, failing step and snapshot steps.

        replay runs --status nonfinite
    """
    from replaybisect.report import print_runs
    from replaybisect.verbs.runs.engine import recent_runs
    from replaybisect.store import open_store

    kind_filter = None if kind == "all" else kind
    check_filters(limit, kind_filter, status)  # before the store is opened (or created)
    store = open_store(tracking_uri)
    summaries = recent_runs(store, limit=limit, kind=kind_filter, status=status)
    if as_json:
        print_json({"tracking_uri": store.uri, "runs": [s.to_json() for s in summaries]})
    else:
        print_runs(summaries, store.uri)


def register(app: typer.Typer) -> None:
    app.command("runs")(runs_command)
