"""A `replay nan` report: rich (terminal), markdown (report.md), the plot (PNG), and `publish` (the child run)."""

from __future__ import annotations

import math
from typing import Any

from replaybisect.options import OUR_STDOUT
from replaybisect.report import fmt_number, mlflow_ui_hint, new_figure, plain

CATEGORY_STYLE = {
    "divergence": "red", "data": "yellow", "forward": "red", "loss": "red", "backward": "red", "optimizer": "magenta",
    "corrupt-state": "magenta", "transient": "cyan",
}


def _headline(report) -> list[tuple[str, Any]]:
    rows = [
        ("run", report.run_id),
        ("failing step", report.failing_step if report.recorded_failing_step in (None, report.failing_step)
         else f"{report.failing_step} (the run's first non-finite step is {report.recorded_failing_step})"),
        ("category", report.category),
        ("phase", report.phase),
        ("module", report.module or "-"),
        ("op", report.op or "-"),
    ]
    if report.source:
        rows.append(("source", report.source))
    if report.origin_step is not None:
        rows.append(("state corrupted at step", report.origin_step))
    rows.append(("replay", f"snapshot {report.snapshot_step} -> reproduced {report.reproduced}"))
    if report.state_match:
        rows.append(("state at failing step", report.state_match))
    growth = (report.divergence or {}).get("growth")
    if report.category == "divergence" and growth:
        rows.append(("growth", f"{growth['metric']} x{growth['factor']:.2g} from step {growth['onset_step']} to {growth['last_step']}"))
    elif report.history is not None:
        rows.append(("history", report.history.summary))
    if report.overflow:
        rows.append(("first overflow", f"{report.overflow['phase']}: " + ", ".join(str(v) for v in (report.overflow["module"], report.overflow["op"]) if v)))
    return rows


def print_rich(report, tracking_uri: str, console=None) -> None:
    """The terminal report. Long lines soft-wrap (the terminal folds them), so paths and ids stay whole."""
    from rich.console import Console

    console = console or Console(file=OUR_STDOUT)
    say = lambda text: console.print(text, soft_wrap=True)  # noqa: E731
    style = CATEGORY_STYLE.get(report.category, "bold")
    category, _, rest = (report.headline or report.category).partition(" ")
    say(f"[bold]replay nan[/bold]  run {plain(report.run_id)}  [bold {style}]{plain(category)}[/bold {style}] {plain(rest)}")
    for key, value in _headline(report)[1:]:
        say(f"  [dim]{key:>24}[/dim]  {plain(value)}")
    for warning in report.warnings:
        say(f"[yellow]warning:[/yellow] {plain(warning)}")
    say("[bold]evidence[/bold]")
    for line in report.evidence:
        say(f"  {'' if line.startswith('  ') else '- '}{plain(line)}")
    say("[bold]next[/bold]  " + plain(report.suggestion).replace("\n", "\n      "))
    if report.replay_run_id:
        say(f"report: child run {plain(report.replay_run_id)} (report.md, report.json, nan_report.png); "
            f"view: {plain(mlflow_ui_hint(tracking_uri))}")


def markdown(report) -> str:
    lines = [f"# replay nan: run {report.run_id}, step {report.failing_step}", ""]
    lines += [f"**{report.headline or report.category}**", ""]
    lines += ["| | |", "|---|---|"]
    for key, value in _headline(report):
        lines.append(f"| {key} | {str(value).replace('|', '/')} |")
    lines.append("")
    if report.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report.warnings] + [""]
    lines += ["## Evidence", ""]
    for line in report.evidence:
        lines.append(f"    {line.strip()}" if line.startswith("  ") else f"- {line}")
    lines += ["", "## Next", ""]
    if report.ablate_command:
        lines += [f"    {report.ablate_command}", "", report.suggestion_reason, ""]
    else:
        lines += [report.suggestion, ""]
    if report.fix:
        lines += [f"Fix `{report.fix['op']}`: {report.fix['change']}.", ""]
        if report.fix.get("prove"):
            lines += ["Prove it on this failure (same state, same batches) with your fixed copy of the file:", "",
                      f"    {report.fix['prove']}", ""]
    if report.layer_grad_norms:
        lines += ["## Per-layer gradient norms at the failing step", "", "| module | grad norm |", "|---|---|"]
        lines += [f"| {name} | {fmt_number(value)} |" for name, value in report.layer_grad_norms.items()]
        lines.append("")
    if report.isolation:
        lines += ["## Probe isolation", "", ", ".join(f"{k}: {v}" for k, v in report.isolation.items()), ""]
    lines += ["![loss and grad norm](nan_report.png)", ""]
    lines += ["## Method and sources", ""] + [f"- {source}" for source in SOURCES] + [""]
    return "\n".join(lines)


# Public sources for the method (the report's citations)
SOURCES = (
    "reproduction by replay from a snapshot, compared bit for bit with the recorded run: Megatron-Core's rerun state "
    "machine (megatron/core/rerun_state_machine.py) re-runs a step to tell a transient fault from a reproducible one",
    "the backward op: torch.autograd.detect_anomaly (PyTorch docs, \"Anomaly detection\"); the forward op: forward hooks "
    "and a TorchFunctionMode (PyTorch docs, torch.overrides), as TensorBoard Debugger V2 finds the first non-finite op",
    "exponential growth of the gradient norm before a NaN: Pascanu, Mikolov, Bengio 2013, \"On the difficulty of "
    "training recurrent neural networks\"",
    "fp16/bf16 overflow and loss scaling: Micikevicius et al. 2018, \"Mixed Precision Training\"",
)


def figure(report):
    """Loss and grad-norm history up to the failure (with the exponential fit), per-layer grad norms at it."""
    fig, axes = new_figure(1, 3, size=(15, 8.5))
    loss_ax, grad_ax, layer_ax = axes[0]
    fig.subplots_adjust(left=0.05, right=0.97, top=0.92, bottom=0.56, wspace=0.45)
    heat_ax = fig.add_axes((0.1, 0.06, 0.8, 0.38))
    t = report.failing_step

    steps = [s for s, v in report.loss_history if math.isfinite(v)]
    values = [v for s, v in report.loss_history if math.isfinite(v)]
    loss_ax.plot(steps, values, color="tab:blue", lw=1)
    if values and min(values) > 0 and max(values) / min(values) > 1e3:  # a climb by orders of magnitude: read it in logs
        loss_ax.set_yscale("log")
    loss_ax.axvline(t, color="red", ls="--", lw=1, label=f"non-finite at {t}")
    loss_ax.set_title("loss")
    loss_ax.set_xlabel("step")
    loss_ax.legend(loc="best", fontsize=8)

    points = [(s, v) for s, v in report.grad_norm_history if math.isfinite(v) and v > 0]
    if points:
        grad_ax.semilogy([s for s, _ in points], [v for _, v in points], color="tab:orange", lw=1, label="grad norm (pre-clip)")
    history = report.history
    growth = (report.divergence or {}).get("growth") if report.category == "divergence" else None
    if growth:
        grad_ax.axvline(growth["onset_step"], color="black", ls=":", lw=1, label=f"climb begins (x{growth['factor']:.2g} after)")
    elif history is not None and history.growth_per_step is not None and history.last_grad_norm:
        first, last = history.first_step, history.last_step
        rate = math.log1p(history.growth_per_step)
        fit_steps = [first, last]
        fit_values = [history.last_grad_norm * math.exp(rate * (s - last)) for s in fit_steps]
        grad_ax.semilogy(fit_steps, fit_values, color="black", ls=":", lw=1,
                         label=f"fit {history.growth_per_step * 100:+.2g}%/step" + (" (exploding)" if history.exploding else ""))
    grad_ax.axvline(t, color="red", ls="--", lw=1)
    grad_ax.set_title("gradient norm")
    grad_ax.set_xlabel("step")
    grad_ax.legend(loc="best", fontsize=8)

    _layer_panel(layer_ax, report)
    fig.suptitle(f"run {report.run_id[:12]}  {report.headline or report.category}", fontsize=10)
    _layer_step_panel(heat_ax, report, fig)
    return fig


def _layer_step_panel(ax, report, fig) -> None:
    """Layers x steps: each layer's gradient norm at each step (recorded, replayed, and the failing step), on a log
    colour scale; the first non-finite cell boxed in red, the earliest layer to climb named in bold."""
    import matplotlib.colors as mcolors
    import numpy as np
    from matplotlib.patches import Rectangle

    history = report.layer_history or {}
    steps = sorted({s for points in history.values() for s in points})[-80:]
    if not history or not steps:
        ax.set_title("per-layer grad norm by step: none recorded")
        ax.axis("off")
        return
    names = list(history)
    grid = np.full((len(names), len(steps)), np.nan)
    column = {s: i for i, s in enumerate(steps)}
    first_bad = None
    for row, name in enumerate(names):
        for s, value in history[name].items():
            if s in column:
                grid[row, column[s]] = value if math.isfinite(value) and value > 0 else np.nan
                if not math.isfinite(value) and (first_bad is None or (s, row) < first_bad):
                    first_bad = (s, row)
    finite = grid[np.isfinite(grid)]
    norm = mcolors.LogNorm(vmin=max(finite.min(), 1e-12), vmax=max(finite.max(), finite.min() * 10)) if finite.size else None
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01, label="grad norm (log)")
    ticks = list(range(0, len(steps), max(1, len(steps) // 20)))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(steps[i]) for i in ticks], fontsize=7)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    precursor = report.module if report.category == "divergence" else None
    for label in ax.get_yticklabels():
        if precursor and label.get_text() == precursor:
            label.set_fontweight("bold")
            label.set_color("red")
    if first_bad is not None:
        s, row = first_bad
        ax.add_patch(Rectangle((column[s] - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xlabel("step (blank: not recorded there, or non-finite; red box: the first non-finite cell)")
    ax.set_title("per-layer gradient norm by step" + (f": the climb began in {precursor}" if precursor else ""), fontsize=9)


def _layer_panel(ax, report) -> None:
    """Per-layer grad norms at the failing step: finite ones as bars on a log axis, non-finite ones marked as such
    (no bar: a NaN has no length), the culprit module (and its submodules) highlighted."""
    t = report.failing_step
    names = list(report.layer_grad_norms)
    norms = [report.layer_grad_norms[n] for n in names]
    if not names:
        ax.set_title(f"per-layer grad norm at step {t}: none recorded")
        ax.axis("off")
        return
    culprit = report.module or ""
    is_culprit = [bool(culprit) and (n == culprit or n.startswith(culprit + ".")) for n in names]
    finite = [v for v in norms if math.isfinite(v) and v > 0]
    low = min(finite) / 10 if finite else 1e-3
    high = max(finite) * 100 if finite else 1e3
    for row, (value, hit) in enumerate(zip(norms, is_culprit)):
        if math.isfinite(value) and value > 0:
            ax.barh(row, value - low, left=low, color="tab:orange" if hit else "tab:green",
                    edgecolor="black" if hit else "none", linewidth=1.5)
        elif math.isfinite(value):  # exactly zero: no gradient reached it
            ax.text(low * 1.2, row, "0", va="center", fontsize=7, color="gray")
        else:
            ax.axhspan(row - 0.4, row + 0.4, color="red", alpha=0.15 if not hit else 0.35, lw=0)
            ax.text(low * 1.2, row, f"{'NaN' if math.isnan(value) else value} (non-finite)", va="center", fontsize=7, color="red")
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    for label, hit, value in zip(ax.get_yticklabels(), is_culprit, norms):
        if hit:
            label.set_color("red")
            label.set_fontweight("bold")
        elif not math.isfinite(value):
            label.set_color("darkred")
    ax.invert_yaxis()
    ax.set_xlabel("gradient norm of the module's own parameters (log scale)")
    title = f"per-layer grad norm at step {t}"
    if culprit and any(is_culprit):
        title += f"\nculprit: {culprit} (bold red)"
    if any(not math.isfinite(v) for v in norms):
        title += ("; " if "culprit" in title else "\n") + "red band: non-finite"
    ax.set_title(title, fontsize=9)


# ---- publishing: the child run ---------------------------------------------------------------------------------
def publish(store, report) -> str:
    """Record the report as a replay run under the examined run: report.md, report.json and the plot. Sets
    `report.replay_run_id` (before report.json is written, so the file names its own run) and returns it."""
    from replaybisect.report import close_figure

    child = store.create_run(
        "replay",
        run_name=run_name(report),
        parent_run_id=report.run_id,
        tags={
            "replaybisect.verb": "nan",
            "replaybisect.category": report.category,
            "replaybisect.failing_step": str(report.failing_step),
            "replaybisect.snapshot_step": str(report.snapshot_step),
            "replaybisect.reproduced": report.reproduced,
            "replaybisect.module": report.module or "",
        },
    )
    try:
        report.replay_run_id = child
        store.log_params(child, {"failing_step": report.failing_step, "snapshot_step": report.snapshot_step})
        store.log_dict(child, report.to_json(), "report.json")
        store.log_text(child, markdown(report), "report.md")
        plot = figure(report)
        try:
            store.log_figure(child, plot, "nan_report.png")
        finally:
            close_figure(plot)
    except BaseException:
        store.finish_run(child, "crashed", "FAILED")
        raise
    store.finish_run(child, "ok")
    store.record_answer(report.run_id, "nan", answer(report), child, report=markdown(report))
    return child


def answer(report) -> str:
    """The one-line answer: the run descriptions in the MLflow UI."""
    if report.headline:
        return f"{report.headline} (replay {report.reproduced})"
    where = (f" in {report.module}" if report.module else "") + (f", op {report.op}" if report.op else "")
    return f"{report.category}{where} (replay {report.reproduced})"


def run_name(report) -> str:
    """The child run's name, the answer first: MLflow's default runs view always shows the name, but cuts a nested
    run's to ~13 characters: `divergence (lr, clip) · nan @ step 20`, `forward torch.exp in gate · nan @ step 20`."""
    if report.category == "divergence":
        what = "divergence (lr, clip)"
    elif report.category in ("forward", "loss", "backward", "optimizer") and report.op:
        what = f"{report.category} {report.op}" + (f" in {report.module}" if report.module else "")
    else:
        what = report.category + (f" in {report.module}" if report.module else "")
    return f"{what} · nan @ step {report.failing_step}"
