"""Rendering `replay diagnose`: rich report, diagnosis.md and the annotated loss-curve PNG; `publish` attaches them to the run."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from replaybisect.core.jsonutil import strict_json
from replaybisect.report import close_figure, fmt_number, markdown_table, new_figure, plain, print_table
from replaybisect.report import console as shared_console

MARKDOWN = "diagnosis.md"
PLOT = "diagnosis_loss.png"
JSON_FILE = "diagnosis.json"

SUMMARY_LABELS = [
    ("steps_logged", "steps logged"),
    ("loss_start", "loss at start"),
    ("loss_end", "final loss (the last finite one logged)"),
    ("loss_end_median", "loss at end (median of the last tenth)"),
    ("val_best", "best val_loss"),
    ("val_best_step", "  at step"),
    ("val_last", "last val_loss"),
    ("grad_norm_median", "median grad norm"),
    ("update_ratio_median", "median update/weight ratio"),
    ("data_share", "share of step waiting for data"),
    ("layers", "layers with statistics"),
]


def _evidence_lines(evidence: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in evidence.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k}={_short(v)}" for k, v in list(value.items())[:8])
            lines.append(f"{key}: {inner}")
        else:
            lines.append(f"{key}: {_short(value)}")
    return lines


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_short(v) for v in value[:8])
        return f"[{shown}{', ...' if len(value) > 8 else ''}]"
    return fmt_number(value)


# ---- rich -----------------------------------------------------------------------------------------------
def print_diagnosis(result, console=None, report_run_id: str | None = None) -> None:
    from rich.table import Table

    console = console or shared_console
    name = f" ({plain(result.run_name)})" if result.run_name else ""  # a run's name, a layer's: text, never markup
    console.print(f"[bold]diagnosis of run[/bold] {plain(result.run_id)}{name}  status {plain(result.status)}")
    if result.healthy:
        console.print("  [green]no pathology found[/green]: " + plain(_summary_sentence(result.summary)))
    elif not result.findings:
        console.print(f"  [yellow]{plain(result.verdict)}[/yellow]: " + plain(_summary_sentence(result.summary)))
    else:
        for number, finding in enumerate(result.findings, 1):
            where = f" {plain(f'[{finding.layer}]')}" if finding.layer else ""
            console.print(f"\n[bold red]{number}. {plain(finding.pattern)}[/bold red]{where}  {plain(finding.summary)}")
            for line in _evidence_lines(finding.evidence):
                console.print(f"     {line}", markup=False, highlight=False)
            if finding.source:
                console.print(f"     [dim]threshold: {plain(finding.source)}[/dim]")
            console.print(f"   next: [bold]{plain(finding.next)}[/bold]", highlight=False)
    table = Table(title="summary", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    for key, label in SUMMARY_LABELS:
        if key in result.summary:
            table.add_row(label, plain(fmt_number(result.summary[key])))
    print_table(table, console)
    if result.skipped:
        console.print("[dim]not checked: " + plain("; ".join(f"{p} ({why})" for p, why in result.skipped.items())) + "[/dim]")
    if result.artifacts:
        holder = f"child run {report_run_id}" if report_run_id else "the run"
        console.print(f"[dim]report: {plain(holder)} ({plain(', '.join(result.artifacts))})[/dim]")


def _summary_sentence(summary: dict[str, Any]) -> str:
    parts = []
    if "loss_start" in summary:
        parts.append(f"loss {fmt_number(summary['loss_start'])} -> {fmt_number(summary['loss_end'])} over {summary.get('steps_logged')} steps")
    if "val_best" in summary:
        parts.append(f"best val_loss {fmt_number(summary['val_best'])} at step {summary['val_best_step']}")
    if "grad_norm_median" in summary:
        parts.append(f"median grad norm {fmt_number(summary['grad_norm_median'])}")
    if "update_ratio_median" in summary:
        parts.append(f"update/weight ratio {fmt_number(summary['update_ratio_median'])}")
    return "; ".join(parts) or "no curve to read"


# ---- markdown --------------------------------------------------------------------------------------------
def to_markdown(result) -> str:
    lines = [f"# Diagnosis of run {result.run_id}", ""]
    if result.run_name:
        lines += [f"Run name: {result.run_name}; status: {result.status}", ""]
    if result.healthy:
        lines += ["**No pathology found.** " + _summary_sentence(result.summary) + ".", ""]
    elif not result.findings:
        lines += [f"**{result.verdict[0].upper() + result.verdict[1:]}.** " + _summary_sentence(result.summary) + ".", ""]
    else:
        lines += [f"**{len(result.findings)} finding{'s' if len(result.findings) != 1 else ''}.**", ""]
        for number, finding in enumerate(result.findings, 1):
            where = f" — `{finding.layer}`" if finding.layer else ""
            lines += [f"## {number}. {finding.pattern}{where}", "", finding.summary, ""]
            lines += [f"- {line}" for line in _evidence_lines(finding.evidence)]
            if finding.source:
                lines.append(f"- threshold: {finding.source}")
            lines += ["", f"Next: `{finding.next}`", ""]
    lines += ["## Summary", "", markdown_table(["what", "value"], [(label, result.summary[key]) for key, label in SUMMARY_LABELS if key in result.summary]), ""]
    lines += ["Checked: " + ", ".join(result.checked), ""]
    if result.skipped:
        lines += ["Not checked: " + "; ".join(f"{p} ({why})" for p, why in result.skipped.items()), ""]
    lines += [f"![loss curve]({PLOT})", ""]
    return "\n".join(lines)


# ---- the annotated loss curve ----------------------------------------------------------------------------
def loss_figure(result, curves):
    """Loss (raw and smoothed) with validation, and the grad norm below; findings marked where they happen."""
    import numpy as np

    from replaybisect.verbs.diagnose.findings import rolling_median

    figure, axes = new_figure(2, 1, size=(10, 7))
    ax_loss, ax_grad = axes[0][0], axes[1][0]
    loss = curves.get("loss")
    finite = loss.finite()
    if len(finite):
        ax_loss.plot(finite.steps, finite.values, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
        if len(finite) >= 10:
            ax_loss.plot(finite.steps, rolling_median(finite.values, max(5, len(finite) // 50) | 1), color="tab:blue", linewidth=1.6, label="loss (rolling median)")
        positive = finite.values[finite.values > 0]
        if len(positive) and positive.max() / max(positive.min(), 1e-30) > 100:
            ax_loss.set_yscale("log")
    val = curves.get("val_loss").finite()
    if len(val):
        ax_loss.plot(val.steps, val.values, "o-", color="tab:orange", markersize=3, label="val_loss")
    grads = curves.get("grad_norm").finite()
    if len(grads):
        ax_grad.plot(grads.steps, grads.values, color="tab:green", linewidth=0.8, label="grad_norm (pre-clip)")
        if np.all(grads.values > 0):
            ax_grad.set_yscale("log")
    for finding in result.findings:
        _annotate(ax_loss, ax_grad, finding, curves)
    title = result.verdict if len(result.verdict) < 60 else result.verdict[:57] + "..."
    ax_loss.set_title(f"run {result.run_id[:12]}: {title}")
    ax_loss.set_ylabel("loss")
    ax_grad.set_ylabel("grad norm")
    ax_grad.set_xlabel("step")
    for ax in (ax_loss, ax_grad):
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    figure.tight_layout()
    return figure


COLORS = {
    "exception": "red", "nan-at-start": "red", "nan-after-k": "red", "spikes": "crimson", "plateau": "purple", "overfitting": "darkorange",
    "distribution-mismatch": "brown", "oscillation": "magenta", "flat-from-start": "gray", "exploding-gradients": "red",
    "vanishing-gradients": "teal", "dead-relu": "black", "update-ratio": "olive", "input-pipeline-bound": "navy",
    "divergence": "red", "no-gradient": "gray", "slow-learning": "purple", "gradients-not-zeroed": "darkred", "model-in-eval": "darkorange",
}


def _annotate(ax_loss, ax_grad, finding, curves) -> None:
    color = COLORS.get(finding.pattern, "black")
    step = finding.step
    if finding.pattern == "spikes":
        for key, ax in (("loss", ax_loss), ("grad_norm", ax_grad)):
            info = finding.evidence.get(key)
            if info:
                ax.scatter(info["spike_steps"], [float(v) for v in info["spike_values"]], marker="x", color=color, s=50, zorder=5, label=f"{key} spike")
        return
    if step is None:
        return
    what = finding.evidence.get("nonfinite") or "loss"  # the metric that went non-finite: loss or grad_norm
    label = {
        "nan-at-start": f"{what} non-finite at step {step}",
        "nan-after-k": f"{what} non-finite at step {step}",
        "exception": f"raised {finding.evidence.get('error_type') or 'an exception'} at step {step}",
        "divergence": f"diverging from {step}" + (f" ({finding.evidence['metric']})" if "metric" in finding.evidence else ""),
        "plateau": f"plateau from {step}",
        "overfitting": f"overfitting from {step}",
        "oscillation": f"oscillating from {step}",
        "flat-from-start": "flat from the start",
        "gradients-not-zeroed": "gradients never cleared from here",
        "model-in-eval": "trained in eval mode from here",
        "distribution-mismatch": "val flat (mismatch)",
    }.get(finding.pattern, f"{finding.pattern}{' ' + finding.layer if finding.layer else ''} @ {step}")
    on_grad = finding.pattern in ("exploding-gradients", "vanishing-gradients") or (finding.pattern.startswith("nan") and what == "grad_norm")
    target = ax_grad if on_grad else ax_loss
    target.axvline(step, color=color, linestyle="--", linewidth=1.2, label=label)


# ---- publishing: artifacts on the run ----------------------------------------------------------------------------------
def publish(store, result, curves) -> str:
    """A child run of the diagnosed run (`spikes · diagnose`, the answer first; kind=diagnosis) holding diagnosis.md, diagnosis.json
    and the annotated PNG (a second diagnosis is a second run: nothing is overwritten); the verdict as its
    description, a line of the diagnosed run's and its replaybisect.diagnosis tag. Returns the child run's id."""
    verdict = "healthy" if result.healthy else ",".join(dict.fromkeys(f.pattern for f in result.findings)) or "not-enough-data"
    child = store.create_run("diagnosis", run_name=f"{verdict.replace(',', ', ')} · diagnose", parent_run_id=result.run_id,
                             tags={"replaybisect.diagnosis": verdict})
    figure = loss_figure(result, curves)
    result.artifacts = [MARKDOWN, JSON_FILE, PLOT]
    try:
        with tempfile.TemporaryDirectory(prefix="replaybisect-diagnose-") as folder:
            folder = Path(folder)
            figure.savefig(folder / PLOT, dpi=100)
            (folder / MARKDOWN).write_text(to_markdown(result), encoding="utf-8")
            (folder / JSON_FILE).write_text(strict_json(result.to_json(), indent=2), encoding="utf-8")
            store.log_artifacts(child, folder)
    except BaseException:
        store.finish_run(child, "crashed", "FAILED")
        raise
    finally:
        close_figure(figure)
    store.finish_run(child, "ok")
    store.set_tags(result.run_id, {"diagnosis": verdict})
    store.record_answer(result.run_id, "diagnose", answer(result), child, report=to_markdown(result))
    return child


def answer(result) -> str:
    """The one-line answer: the run descriptions in the MLflow UI."""
    if not result.findings:
        return result.verdict
    first = result.findings[0]
    return f"{result.verdict}; next: {first.next}"
