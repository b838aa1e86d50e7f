"""Rendering shared by the verbs: rich output, markdown, plots (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.table import Table

from replaybisect.options import OUR_STDOUT

def _piped_width() -> int:
    """Piped output is as wide as $COLUMNS says, else 160: wide tables, never cut run ids."""
    import os

    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else 160


# piped: as wide as _piped_width for tables, and a long line of text (a command to copy) never broken in two
console = Console(file=OUR_STDOUT, width=None if sys.stdout.isatty() else _piped_width(), soft_wrap=not sys.stdout.isatty())


def plain(text: Any) -> str:
    """`text` for a rich string (console.print, a table cell, a progress line), printed as it is: a `[red]` or a `[/x]`
    in it is no markup. Every value we print that a store, the user's code or its config can write (run names, tags,
    warnings, module names, paths, arm names, a child's log lines, error text) goes through this one function."""
    from rich.markup import escape

    return escape(str(text))


def print_table(table: Table, out: Console | None = None) -> None:
    """A table when every word fits whole in the width, else the same facts as a plain list (one block per row):
    a cell is never broken mid-word (`fails-agai` / `n`)."""
    from rich.measure import Measurement

    out = out or console
    if Measurement.get(out, out.options.update_width(100_000), table).minimum <= out.width:  # longest words
        out.print(table)
        return
    if table.title:
        out.print(table.title)
    headers = [str(column.header) for column in table.columns]
    for cells in zip(*(list(column.cells) for column in table.columns)):
        for index, (header, cell) in enumerate(zip(headers, cells)):
            label = f"{header}: " if header else ""
            out.print(f"{'- ' if index == 0 else '  '}{label}", end="")
            out.print(cell, soft_wrap=True)


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


def new_figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (8, 4)):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def close_figure(figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


UI_SWITCH = "pick Model training (top left)"  # MLflow 3's UI opens experiments on its GenAI pages otherwise


def mlflow_ui_hint(tracking_uri: str) -> str:
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri} and {UI_SWITCH}"
    return f"mlflow ui --backend-store-uri {tracking_uri}, open http://127.0.0.1:5000 and {UI_SWITCH}"


def run_label(cfg, config_dir=None, config_name: str = "config") -> str:
    """What a training run is, readable in the MLflow UI: `train mlp/digits` (built-in config groups), `train
    nan_forward` (a config folder), `train diagnose_pathologies/spikes` (another config in it)."""
    from omegaconf import OmegaConf

    def short(group: str) -> str:
        target = OmegaConf.select(cfg, f"{group}._target_", default=None)
        return str(target).rsplit(".", 1)[-1].lower() if target else ""

    if config_dir is None:
        return "train " + ("/".join(part for part in (short("model"), short("data")) if part) or "config")
    return f"train {Path(config_dir).resolve().name}" + ("" if config_name in (None, "config") else f"/{config_name}")


def print_train_result(result) -> None:
    status_style = "green" if result.status == "ok" else "bold red"
    console.print(f"[bold]run[/bold] {plain(result.run_id)}  status [{status_style}]{plain(result.status)}[/{status_style}]")
    console.print(f"  steps completed {result.steps_completed}   final loss {fmt_number(result.final_loss)}")
    if result.snapshot_steps:
        steps = result.snapshot_steps
        shown = ", ".join(str(s) for s in steps) if len(steps) <= 12 else \
            f"{', '.join(str(s) for s in steps[:3])}, ..., {', '.join(str(s) for s in steps[-3:])} ({len(steps)} snapshots)"
        console.print(f"  snapshots at steps {shown}")
    if result.status == "nonfinite":
        failure = f"  [red]non-finite {plain(result.nonfinite_what)} at step {result.first_nonfinite_step}[/red]; "
        if result.first_nonfinite_step in result.snapshot_steps:
            console.print(
                failure + "the state before it is saved.\n"
                f"  next: [bold]replay nan --run-id {plain(result.run_id)}[/bold]   then   replay ablate lr,clip,precision --run-id {plain(result.run_id)}"
            )
        else:
            console.print(failure + "no snapshot saved (snapshot.enabled=false): train again with the recorder on to replay it.")
    console.print(f"  view: {plain(mlflow_ui_hint(result.tracking_uri))}")


def print_runs(summaries, location) -> None:
    if not summaries:
        if location.exists:
            console.print(f"no runs yet in {plain(location.shown)}; start one with [bold]replay train[/bold]", soft_wrap=True)
        else:
            console.print(f"no runs yet: no mlflow.db in {plain(Path.cwd())} or a folder above it (the store would be "
                          f"{plain(location.shown)}); start one with [bold]replay train[/bold]", soft_wrap=True)  # paths unbroken
        return
    rows = []
    for run in summaries:
        status = plain(run.status)
        if run.status == "nonfinite":
            status = f"[red]nonfinite @ {'?' if run.first_nonfinite_step is None else run.first_nonfinite_step}[/red]"
        elif run.crash is not None:
            status = f"[red]crashed @ {plain(': '.join(run.crash.split(': ', 2)[:2]).split(' (')[0])}[/red]"  # step N: Type
        elif run.status == "ok":
            status = "[green]ok[/green]"
        snapshots = ",".join(str(s) for s in run.snapshot_steps[-6:])
        if len(run.snapshot_steps) > 6:
            snapshots = "…," + snapshots
        rows.append((plain(run.run_id), plain(run.kind), status, run.steps, fmt_number(run.last_loss), snapshots,
                     run.started[5:16].replace("T", " "), None if run.name is None else plain(run.name),
                     None if run.triage is None else plain(run.triage)))  # what a tag says is data, never markup
    table = Table(title=f"runs in {plain(location.shown)}", title_justify="left")
    table.add_column("run id", no_wrap=True)
    for header in ("kind", "status", "steps", "last loss", "snapshots", "started", "name", "triage"):
        table.add_column(header)
    for row in rows:
        table.add_row(*(str(cell) if cell is not None else "-" for cell in row))
    print_table(table)


def print_answer(verb: str, run_id: str, headline: str, lines: list[str], child: str | None, files: tuple[str, ...],
                 style: str | None = None) -> None:
    """A replaying verb's answer as printed: its headline, its lines, and the child run that holds its files."""
    shown = f"[{style}]{plain(headline)}[/]" if style else plain(headline)
    console.print(f"[bold]replay {verb}[/] run {run_id}: {shown}")
    for line in lines:
        console.print(f"  {plain(line)}")
    if child:
        console.print(f"  report: child run {child} ({', '.join(files)})")


def answer_markdown(verb: str, run_id: str, headline: str, lines: list[str]) -> str:
    return f"# replay {verb}: run {run_id}\n\n**{headline}**\n\n" + "\n".join(lines) + "\n"


def publish_child(store, parent_run_id: str, kind: str, run_name: str, write, tags: dict | None = None) -> str:
    """A child run (`kind`) of the examined run holding the files `write(child_run_id, folder)` puts in a temporary
    folder; finished ok, or crashed (FAILED) when making or logging them fails. Returns its id."""
    import tempfile

    child = store.create_run(kind, run_name=run_name, parent_run_id=parent_run_id, tags=tags)
    try:
        with tempfile.TemporaryDirectory(prefix=f"replaybisect-{kind}-") as folder:
            write(child, Path(folder))
            store.log_artifacts(child, folder)
    except BaseException:
        store.finish_run(child, "crashed", "FAILED")
        raise
    store.finish_run(child, "ok")
    return child
