"""`replay runs`: recent runs with status, failing step and snapshot steps."""

from __future__ import annotations

from typing import Optional

import typer

from replaybisect.cli.common import JsonFlag, TrackingUri, print_json


def runs_command(
    limit: int = typer.Option(20, "--limit", "-n", help="How many runs, newest first."),
    kind: str = typer.Option("train", "--kind", help="train | replay | ablation-arm | bisect | bisect-trial | check | all"),
    status: Optional[str] = typer.Option(None, "--status", help="ok | nonfinite | crashed | running"),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = JsonFlag,
):
    """List recent runs: status, failing step and snapshot steps.

        replay runs --status nonfinite
    """
    from replaybisect.errors import ReplayError
    from replaybisect.report import print_runs
    from replaybisect.runs import recent_runs
    from replaybisect.store import open_store

    if limit <= 0:
        raise ReplayError(f"--limit {limit} must be positive")
    store = open_store(tracking_uri)
    summaries = recent_runs(store, limit=limit, kind=None if kind == "all" else kind, status=status)
    if as_json:
        print_json({"tracking_uri": store.uri, "runs": [s.to_json() for s in summaries]})
    else:
        print_runs(summaries, store.uri)


def register(app: typer.Typer) -> None:
    app.command("runs")(runs_command)
