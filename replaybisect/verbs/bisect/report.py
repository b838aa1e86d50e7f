"""Rendering a BisectResult: rich (terminal), markdown (bisect.md) and a PNG of the metric per tried commit;
`publish` writes them, with bisect.json and summary tags, to the bisect's parent run."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replaybisect.verbs.bisect.engine import BisectResult

VERDICT_STYLE = {"good": "green", "bad": "red", "skip": "yellow"}
VERDICT_COLOR = {"good": "tab:green", "bad": "tab:red", "skip": "tab:orange"}


def _metric_text(trial) -> str:
    if trial.metric is None:
        return "-"
    return f"{trial.metric:.5g}"


def _runs_text(trial) -> str:
    cached = sum(run.cached for run in trial.runs)
    text = f"{len(trial.runs)}"
    return text + (f" ({cached} cached)" if cached else "")


def headline(result: "BisectResult") -> str:
    if result.first_bad:
        return f"first bad commit: {result.first_bad[:10]} {result.subject}"
    return ("only skipped commits are left: the first bad commit is one of "
            + ", ".join(sha[:10] for sha in result.candidates))


def render(result: "BisectResult", console) -> None:
    """The rich report: the answer, the commit, and a table of tried commits in history order."""
    from rich.panel import Panel
    from rich.table import Table

    from replaybisect.report import plain, print_table

    table = Table(title=f"tried commits ({result.n_trials} of {result.history_length}, {result.n_rounds} rounds, "
                        f"{result.workers} worker{'s' * (result.workers > 1)})")
    table.add_column("#", justify="right")
    table.add_column("commit")
    table.add_column("subject", overflow="fold", max_width=48)
    table.add_column("verdict")
    table.add_column(f"{plain(result.metric_name)} (seed mean)" if result.mode == "train" else "", justify="right")
    table.add_column("seeds", justify="right")
    table.add_column("round", justify="right")
    table.add_column("why", overflow="fold", max_width=48)
    for trial in result.trials:
        style = VERDICT_STYLE.get(trial.verdict, "")
        marker = " ◀" if trial.sha == result.first_bad else ""
        table.add_row(str(trial.position), plain(trial.sha[:10]) + marker, plain(trial.subject), f"[{style}]{plain(trial.verdict)}[/]",
                      _metric_text(trial), _runs_text(trial), str(trial.round) if trial.round else "end", plain(trial.note))
    print_table(table, console)
    lines = [f"[bold]{plain(headline(result))}[/]"]  # a commit's subject, author and diffstat are text, never markup
    if result.commit:
        lines += [f"author: {plain(result.commit.author)}", f"date:   {plain(result.commit.date)}"]
        if result.commit.diffstat:
            lines += ["", plain(result.commit.diffstat)]
    if numerics_line(result):
        lines += ["", plain(numerics_line(result))]
    lines += ["", f"test: {plain(result.baseline.describe())}",
              f"{result.n_runs} runs trained, {result.n_cached} reused from earlier bisects, {result.seconds:.1f}s"]
    if result.run_id:
        lines.append(f"MLflow run {plain(result.run_id)} (bisect.md, bisect.png)")
    console.print(Panel("\n".join(lines), title="replay bisect", expand=False), soft_wrap=False)  # wrapped inside its box, not cut


def numerics_line(result: "BisectResult") -> str:
    """What the commit changed in the numbers: the first op of the first step whose outputs differ (or why not said)."""
    found = result.numerics
    if found is None:
        return ("the commit's first training step computes the same numbers, op for op, as its parent's: the change "
                "shows later (or in what the step does not compute)") if result.first_bad and result.mode == "train" else ""
    if "error" in found:
        return f"numerics not compared: {found['error']}"
    good, bad = found.get("good") or {}, found.get("bad") or {}
    where = bad.get("at") or good.get("at") or "the framework's own code"
    if found["same_op"]:
        return (f"first op whose outputs changed: {bad['op']} (op {found['index'] + 1} of {found['ops'][1]} in step 0) at {where}")
    return (f"first op that changed: {good.get('op', 'nothing')} -> {bad.get('op', 'nothing')} (op {found['index'] + 1} of "
            f"step 0) at {where}")


def to_markdown(result: "BisectResult") -> str:
    out = [f"# replay bisect {result.good[:10]}..{result.bad[:10]}", "", f"**{headline(result)}**", ""]
    if result.commit:
        out += [f"- author: {result.commit.author}", f"- date: {result.commit.date}", ""]
        if result.commit.diffstat:
            out += ["```", result.commit.diffstat, "```", ""]
    if numerics_line(result):
        out += [numerics_line(result), ""]
    out += [f"- repository: `{result.repo}`",
            f"- history: {result.history_length} commits on BAD's first-parent chain; {result.n_trials} tried in "
            f"{result.n_rounds} rounds with {result.workers} worker{'s' * (result.workers > 1)}",
            f"- test: {result.baseline.describe()}",
            f"- runs: {result.n_runs} trained, {result.n_cached} reused", ""]
    from replaybisect.report import markdown_table

    rows = [(trial.position, f"`{trial.sha[:10]}`", trial.subject, trial.verdict,
             _metric_text(trial) if result.mode == "train" else ", ".join(run.detail for run in trial.runs),
             ", ".join(map(str, trial.seeds)), trial.round or "end", trial.note) for trial in result.trials]
    out.append(markdown_table(["#", "commit", "subject", "verdict", f"{result.metric_name} (seed mean)" if result.mode == "train" else "outcome",
                               "seeds", "round", "why"], rows))
    return "\n".join(out) + "\n"


def plot(result: "BisectResult"):
    """Metric (each seed, and the mean) per tried commit, in history order; skips on the axis; the first bad marked."""
    from matplotlib.lines import Line2D

    from replaybisect.report import new_figure

    figure, grid = new_figure(size=(8, 4))
    axes = grid[0][0]
    train_mode = result.mode == "train"
    for trial in result.trials:
        color = VERDICT_COLOR.get(trial.verdict, "gray")
        if train_mode and trial.metrics:
            axes.scatter([trial.position] * len(trial.metrics), trial.metrics, s=12, color=color, alpha=0.5)
            axes.scatter([trial.position], [trial.metric], s=60, color=color, marker="D", edgecolors="black", linewidths=0.5)
        else:
            level = {"good": 0.0, "bad": 1.0}.get(trial.verdict, 0.5)
            if train_mode:  # non-finite or skipped: nothing to plot but where it is
                axes.axvline(trial.position, color=color, alpha=0.4, linestyle=":")
            else:
                axes.scatter([trial.position], [level], s=60, color=color, marker="D", edgecolors="black", linewidths=0.5)
    if not train_mode:
        axes.set_yticks([0.0, 0.5, 1.0], ["good", "skip", "bad"])
    for position in {t.position for t in result.trials if t.sha in result.candidates}:
        axes.axvline(position - 0.5, color="tab:red", alpha=0.6, linestyle="--")
    axes.set_xlim(-1, result.history_length)
    axes.set_xlabel("commit (position in BAD's first-parent history; GOOD = 0)")
    axes.set_ylabel(result.metric_name if train_mode else "verdict")
    axes.set_title(headline(result)[:90], fontsize=9)
    axes.legend(handles=[Line2D([], [], marker="D", color=color, linestyle="", label=verdict)
                         for verdict, color in VERDICT_COLOR.items()], fontsize=8, loc="best")
    figure.tight_layout()
    return figure


def publish(store, result: "BisectResult") -> None:
    """bisect.md, bisect.json, bisect.png and the summary tags on the parent `kind=bisect` run (result.run_id)."""
    from replaybisect.report import close_figure

    run_id = result.run_id
    store.log_text(run_id, to_markdown(result), "bisect.md")
    store.log_dict(run_id, result.to_dict(), "bisect.json")
    figure = plot(result)
    try:
        store.log_figure(run_id, figure, "bisect.png")
    finally:
        close_figure(figure)
    if result.numerics and result.numerics.get("rows"):
        store.log_text(run_id, ops_html(result), "ops.html")
    store.set_tags(run_id, summary_tags(result))
    store.describe(run_id, headline(result))


def ops_html(result: "BisectResult") -> str:
    """The first training step's ops in the last good commit and the first bad one, side by side around the first
    that differs (its output's digest, the line that called it): a page the MLflow UI shows as the run's artifact."""
    from html import escape

    def cell(op) -> str:
        if op is None:
            return "<td class=gap colspan=3>(no op here)</td>"
        return f"<td><code>{escape(op['op'])}</code></td><td><code>{escape(op['out'])}</code></td><td><code>{escape(op.get('at') or '')}</code></td>"

    rows = "\n".join(f"<tr class={'same' if row['same'] else 'differs'}>{cell(row['good'])}{cell(row['bad'])}</tr>"
                      for row in result.numerics["rows"])
    good, bad = (escape(sha[:10]) for sha in result.numerics["commits"])
    return f"""<!doctype html><meta charset=utf-8><title>replay bisect: ops of step 0</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse;font-size:13px}} td,th{{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}}
tr.differs td{{background:#fde2e2}} td.gap{{color:#999;font-style:italic}}</style>
<h3>{escape(numerics_line(result))}</h3>
<p>Step 0 of each commit, traced op by op (the output's digest, the line that called it), aligned by op name; red: the
outputs differ, or an op only one side has.</p>
<table><tr><th colspan=3>{good} (last good)</th><th colspan=3>{bad} (first bad)</th></tr>
<tr><th>op</th><th>output</th><th>called at</th><th>op</th><th>output</th><th>called at</th></tr>
{rows}</table>
"""


def summary_tags(result: "BisectResult") -> dict:
    return {"bisect_first_bad": result.first_bad or "", "bisect_candidates": ",".join(c[:10] for c in result.candidates),
            "bisect_rounds": result.n_rounds, "bisect_runs": result.n_runs, "bisect_cached_runs": result.n_cached}
