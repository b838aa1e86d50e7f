"""`replay profile`'s answer: printed (the step, the replay, the tables, the data-wait share, where the trace is), and
published as a child run of the profiled run with profile.md, profile.json and the trace."""

from __future__ import annotations

import shutil
from pathlib import Path

from replaybisect.core.jsonutil import strict_json
from replaybisect.report import console, plain, publish_child
from replaybisect.verbs.profile.engine import TRACE, ProfileReport

MARKDOWN, JSON_FILE = "profile.md", "profile.json"
VIEWER = "https://ui.perfetto.dev (Open trace file) or chrome://tracing"


def headline(report: ProfileReport) -> str:
    seconds = statistics_line(report)
    return f"profile of step {report.step}" + (f"..{report.step + report.steps - 1}" if report.steps > 1 else "") + f": {seconds}"


def statistics_line(report: ProfileReport) -> str:
    top = report.top_ops[0]["name"] if report.top_ops else "no op"
    module = f", most time in {report.top_modules[0]['name']}" if report.top_modules else ""
    median = sorted(report.step_seconds)[len(report.step_seconds) // 2] if report.step_seconds else 0.0
    return f"{median:.3g} s a step under the profiler, top op {top}{module}"


def to_markdown(report: ProfileReport) -> str:
    lines = [f"# replay profile: run {report.run_id}", "",
             f"Steps {report.step}..{report.step + report.steps - 1} ({report.why}), replayed from snapshot "
             f"{report.snapshot_step}: replay {report.reproduced}, profiled steps' losses {report.losses}; device {report.device}.", ""]
    lines += ["| step | under the profiler (s) | as recorded (s) |", "|---|---|---|"]
    for index, seconds in enumerate(report.step_seconds):
        recorded = report.recorded_step_seconds[index]
        lines.append(f"| {report.step + index} | {seconds:.4g} | {'-' if recorded is None else f'{recorded:.4g}'} |")
    lines += ["", "## Ops by self time", "", "| op | calls | self ms | total ms | memory MB |", "|---|---|---|---|---|"]
    lines += [f"| `{row['name']}` | {row['calls']} | {row['self_ms']:.3f} | {row['total_ms']:.3f} | {row['memory_mb']:.2f} |"
              for row in report.top_ops]
    if report.top_modules:
        lines += ["", "## Modules by forward time (inclusive)", "", "| module | type | forward ms | share of the steps |",
                  "|---|---|---|---|"]
        lines += [f"| `{row['name']}` | {row['type']} | {row['forward_ms']:.3f} | {row['share']:.0%} |" for row in report.top_modules]
    if report.data_wait_share is not None:
        lines += ["", f"The run spent a median {report.data_wait_share:.0%} of each step waiting for data (recorded)."]
    lines += ["", f"Trace: `{TRACE}` (open it in {VIEWER})."]
    lines += [f"- {warning}" for warning in report.warnings]
    return "\n".join(lines) + "\n"


def print_report(report: ProfileReport) -> None:
    from rich.table import Table

    console.print(f"[bold]replay profile[/] run {report.run_id}  steps {report.step}..{report.step + report.steps - 1} "
                  f"({plain(report.why)})")
    start = (f"from the step's own snapshot ({report.snapshot_step})" if report.snapshot_step == report.step
             else f"replayed from snapshot {report.snapshot_step}: {report.reproduced}")
    console.print(f"  {start}; the profiled steps' losses: {report.losses}; device {report.device}")
    times = ", ".join(f"{s:.3g} s" for s in report.step_seconds)
    recorded = ", ".join("-" if s is None else f"{s:.3g} s" for s in report.recorded_step_seconds)
    console.print(f"  step time under the profiler: {times} (recorded: {recorded})")
    ops = Table(title="ops by self time", title_justify="left")
    for column in ("op", "calls", "self ms", "total ms", "memory MB"):
        ops.add_column(column, justify="left" if column == "op" else "right")
    for row in report.top_ops:
        ops.add_row(plain(row["name"]), str(row["calls"]), f"{row['self_ms']:.3f}", f"{row['total_ms']:.3f}", f"{row['memory_mb']:.2f}")
    console.print(ops)
    if report.top_modules:
        modules = Table(title="modules by forward time (inclusive)", title_justify="left")
        for column in ("module", "type", "forward ms", "share"):
            modules.add_column(column, justify="left" if column in ("module", "type") else "right")
        for row in report.top_modules:
            modules.add_row(plain(row["name"]), plain(row["type"]), f"{row['forward_ms']:.3f}", f"{row['share']:.0%}")
        console.print(modules)
    if report.data_wait_share is not None:
        console.print(f"  waiting for data: a median {report.data_wait_share:.0%} of each recorded step")
    if report.peak_memory_mb is not None:
        console.print(f"  peak device memory: {report.peak_memory_mb:.1f} MB")
    for warning in report.warnings:
        console.print(f"  [yellow]warning:[/] {plain(warning)}")
    if report.report_run_id:
        console.print(f"  trace: {TRACE} in result run {report.report_run_id} (open it in {VIEWER})")
    else:
        console.print("  trace: not kept (--no-child-run records nothing)")


def publish(store, report: ProfileReport) -> str:
    """A child run of the profiled run (kind=profile) with profile.md, profile.json and the trace; returns its id."""
    child = publish_child(store, report.run_id, "profile", f"{headline(report)} · profile", lambda child, folder: _write(report, child, folder))
    store.describe(child, headline(report))
    return child


def _write(report: ProfileReport, child: str, folder: Path) -> None:
    if report.trace:
        shutil.copyfile(report.trace, folder / TRACE)
    report.report_run_id = child
    (folder / MARKDOWN).write_text(to_markdown(report), encoding="utf-8")
    (folder / JSON_FILE).write_text(strict_json(report.to_json(), indent=2), encoding="utf-8")
