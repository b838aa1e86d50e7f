"""Rendering shared by the verbs: rich output, markdown, plots (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.table import Table

from replaybisect.options import OUR_STDOUT

console = Console(file=OUR_STDOUT, width=None if sys.stdout.isatty() else 160)  # piped: wide tables, never cut run ids


def fmt_number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt_number(cell).replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def rich_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*(fmt_number(cell) for cell in row))
    return table


def new_figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (8, 4)):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def close_figure(figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def mlflow_ui_hint(tracking_uri: str) -> str:
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def print_train_result(result) -> None:
    status_style = "green" if result.status == "ok" else "bold red"
    console.print(f"[bold]run[/bold] {result.run_id}  status [{status_style}]{result.status}[/{status_style}]")
    console.print(f"  steps completed {result.steps_completed}   final loss {fmt_number(result.final_loss)}")
    if result.snapshot_steps:
        console.print(f"  snapshots at steps {', '.join(str(s) for s in result.snapshot_steps)}")
    if result.status == "nonfinite":
        failure = f"  [red]non-finite {result.nonfinite_what} at step {result.first_nonfinite_step}[/red]; "
        if result.first_nonfinite_step in result.snapshot_steps:
            console.print(
                failure + "the state before it is saved.\n"
                f"  next: [bold]replay nan --run-id {result.run_id}[/bold]   then   replay ablate lr,clip,precision --run-id {result.run_id}"
            )
        else:
            console.print(failure + "no snapshot saved (snapshot.enabled=false): train again with the recorder on to replay it.")
    console.print(f"  view: {mlflow_ui_hint(result.tracking_uri)}")


def print_runs(summaries, tracking_uri: str) -> None:
    if not summaries:
        console.print(f"no runs in {tracking_uri} yet; start one with [bold]replay train[/bold]")
        return
    rows = []
    for run in summaries:
        status = run.status
        if status == "nonfinite":
            status = f"[red]nonfinite @ {run.first_nonfinite_step}[/red]"
        elif status == "ok":
            status = "[green]ok[/green]"
        snapshots = ",".join(str(s) for s in run.snapshot_steps[-6:])
        if len(run.snapshot_steps) > 6:
            snapshots = "…," + snapshots
        rows.append((run.run_id, run.kind, status, run.steps, fmt_number(run.last_loss), snapshots, run.started[5:16].replace("T", " "), run.name))
    table = Table(title=f"runs in {tracking_uri}", title_justify="left")
    table.add_column("run id", no_wrap=True)
    for header in ("kind", "status", "steps", "last loss", "snapshots", "started", "name"):
        table.add_column(header)
    for row in rows:
        table.add_row(*(str(cell) if cell is not None else "-" for cell in row))
    console.print(table)
