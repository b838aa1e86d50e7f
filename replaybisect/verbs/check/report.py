"""Rendering and publishing for `replay check`: the rich table, check.md, the LR range test and overfit plots,
and `publish`, the check run with its artifacts, metrics and tags (the only MLflow writing of `replay check`)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

from replaybisect.report import close_figure, console, fmt_number, markdown_table, mlflow_ui_hint, new_figure, plain, print_table
from replaybisect.core.jsonutil import strict_json

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def _value(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
        return f"{value:.3g}"
    return fmt_number(value)


def _subject(report) -> str:
    if report.checked_run_id:
        if report.snapshot_step is None:
            return f"run {report.checked_run_id} (its config, at init)"
        why = f": {report.snapshot_reason}" if report.snapshot_reason else ""
        return f"run {report.checked_run_id} at snapshot step {report.snapshot_step}{why}"
    return "config (at initialization)"


def _next_steps(report) -> list[str]:
    hints = []
    failing = {c.name for c in report.checks if c.status == "fail"}
    wiring = {c.name for c in report.checks if c.status == "fail" and not c.extra.get("nonfinite")}  # a NaN is no wiring bug
    lr = report.lr_range
    if "data.finite" in failing:
        hints.append("fix the non-finite data first: every other check reads it")
    overfit = report.find("overfit.one_batch")
    if overfit is not None and overfit.extra.get("diverged"):
        hints.append("the overfit probe diverged at your lr: lower it (LR range test below)")
    if "grad.nonfinite" in failing:
        hints.append("the state checked already makes non-finite values: check an earlier snapshot (--step N); "
                     "`replay nan --run-id` says where they come from")
    elif wiring & {"overfit.one_batch", "grad.missing", "loss.output_mismatch"}:
        hints.append("fix the model/loss wiring, then re-run `replay check` before training")
    if lr and lr.stop_reason == "fault" and "grad.nonfinite" not in failing:
        hints.append("the loss turns non-finite whatever the lr: " + (f"`replay nan --run-id {report.checked_run_id}` says where"
                     if report.checked_run_id else "train it, then `replay nan --run-id ID` says where it comes from"))
    range_check = report.find("lr.range_test")
    judged = range_check.extra.get("lr_judgement") if range_check is not None else None
    # a low lr is worth changing only when the model does not learn at it (a short sweep's steepest point is no target)
    slow = judged == "low" and overfit is not None and overfit.status != "pass"
    if lr and lr.suggested_lr and report.configured_lr and (judged == "high" or slow):
        hints.append(f"try a learning rate of about {lr.suggested_lr:.2g} (the LR range test's suggestion; yours is "
                     f"{report.configured_lr:.2g}): optim.lr={lr.suggested_lr:.2g} in a replay train config, your own "
                     "setting in your code")
    if not failing:
        hints.append("train: replay train ... ; after a run, `replay diagnose --run-id ID` reads its curves")
    return hints


def print_check_report(report) -> None:
    from rich.table import Table

    console.print(f"[bold]replay check[/bold] {plain(_subject(report))}")
    table = Table(show_header=True, header_style="bold", title_justify="left")
    for header in ("check", "status", "value", "detail"):
        table.add_column(header, overflow="fold")
    for check in report.checks:
        style = STYLE[check.status]
        table.add_row(plain(check.name), f"[{style}]{MARK[check.status]}[/{style}]", plain(_value(check.value)), plain(check.detail))
    print_table(table, console)
    counts = report.counts()
    style = STYLE[report.status]
    console.print(
        f"[{style}]{report.status.upper()}[/{style}]: {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skipped"
        f"  ({report.seconds:.1f} s)"
    )
    lr = report.lr_range
    if lr and lr.suggested_lr:
        console.print(f"  LR range test: suggested lr {lr.suggested_lr:.3g}, your lr {report.configured_lr:.3g} ({plain(report.lr_source)})")
    for warning in report.warnings:
        console.print(f"  [yellow]note:[/yellow] {plain(warning)}")
    for hint in _next_steps(report):
        console.print(f"  next: {plain(hint)}")
    shown = ", ".join(name for name in report.artifacts if name.endswith((".md", ".png"))) or "check.md"
    console.print(f"  check run {plain(report.run_id)} ({plain(shown)}); view: {plain(mlflow_ui_hint(report.tracking_uri))}")


def check_markdown(report) -> str:
    counts = report.counts()
    lines = [
        f"# replay check: {report.status.upper()}",
        "",
        f"Checked: {_subject(report)}. {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skipped.",
        "",
        markdown_table(["check", "status", "value", "detail"], [(c.name, MARK[c.status], _value(c.value), c.detail) for c in report.checks]),
        "",
    ]
    lr = report.lr_range
    if lr:
        lines += [
            "## LR range test",
            "",
            f"Exponential sweep over {len(lr.lrs)} of {lr.planned_steps} steps, smoothing 0.05, stop at 4x the best loss "
            "(Lightning / fastai / torch-lr-finder).",
            f"Suggested lr: {fmt_number(lr.suggested_lr)}; lowest loss at lr {fmt_number(lr.best_lr)}; "
            f"stopped: {lr.stop_reason}{f' at lr {lr.diverged_lr:.3g}' if lr.diverged_lr else ''}; your lr: {fmt_number(report.configured_lr)} ({report.lr_source}).",
            "",
            "![LR range test](lr_range.png)",
            "",
        ]
    overfit = report.find("overfit.one_batch")
    if overfit and overfit.extra.get("losses"):
        lines += ["## Overfit one batch", "", overfit.detail, "", "![overfit one batch](overfit.png)", ""]
    if report.warnings:
        lines += ["## Notes", ""] + [f"- {w}" for w in report.warnings] + [""]
    hints = _next_steps(report)
    if hints:
        lines += ["## Next", ""] + [f"- {h}" for h in hints] + [""]
    return "\n".join(lines)


def lr_range_figure(lr, configured_lr: float | None):
    figure, axes = new_figure(size=(8, 4.5))
    ax = axes[0][0]
    ax.plot(lr.lrs, lr.losses, color="0.75", linewidth=1, label="loss")
    ax.plot(lr.lrs, lr.smoothed, color="C0", linewidth=2, label="smoothed (0.05)")
    if lr.suggested_lr:
        ax.axvline(lr.suggested_lr, color="C2", linestyle="--", label=f"suggested {lr.suggested_lr:.2g}")
        ax.plot([lr.suggested_lr], [lr.smoothed[lr.suggested_index]], "o", color="C2")
    if configured_lr:
        ax.axvline(configured_lr, color="C1", linestyle=":", label=f"your lr {configured_lr:.2g}")
    if lr.diverged_lr:
        ax.axvline(lr.diverged_lr, color="C3", linestyle="-.", label=f"stopped ({lr.stop_reason}) {lr.diverged_lr:.2g}")
    finite = [v for v in lr.smoothed + lr.losses if math.isfinite(v)]
    if finite:
        low, high = min(finite), max(v for v in lr.smoothed if math.isfinite(v)) if any(math.isfinite(v) for v in lr.smoothed) else max(finite)
        span = max(high - low, 1e-6)
        ax.set_ylim(low - 0.05 * span, high + 0.3 * span)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title("LR range test")
    ax.legend(loc="best", fontsize="small")
    figure.tight_layout()
    return figure


def overfit_figure(check):
    figure, axes = new_figure(size=(8, 4))
    ax = axes[0][0]
    losses = check.extra["losses"]
    ax.plot(range(len(losses)), losses, color="C0", label="training loss")
    floor = check.extra.get("floor")
    if floor is not None:
        ax.axhline(floor, color="C2", linestyle="--", label=f"floor {floor:.3g}")
    if losses and min(losses) > 0 and max(losses) / max(min(losses), 1e-12) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"Overfit one batch ({check.extra.get('samples')} samples): {check.status}")
    ax.legend(loc="best", fontsize="small")
    figure.tight_layout()
    return figure


def publish(store, report, cfg=None, code_folder: Path | None = None) -> None:
    """Record `report` as a check run (kind=check, a child of the checked run, else standalone): the composed
    config (params and config.yaml, when a config was checked), check.md, check.json, the plots, per-check
    metrics and tags. Sets report.run_id, tracking_uri and artifacts; adds the time spent to report.seconds."""
    started = time.perf_counter()
    check_run = store.create_run("check", run_name=_run_name(report), parent_run_id=report.checked_run_id,
                                 tags=_run_tags(report, code_folder))
    report.run_id, report.tracking_uri = check_run, store.uri
    try:
        if report.source == "config":
            from replaybisect.core import config as config_mod

            store.log_params(check_run, config_mod.flatten(cfg))
            store.log_text(check_run, config_mod.to_yaml(cfg), "config.yaml")
        report.artifacts = log_to_run(store, check_run, report)
        report.seconds += time.perf_counter() - started
        store.finish_run(check_run, "ok")
    except BaseException:
        store.finish_run(check_run, "crashed", "FAILED")
        raise
    if report.checked_run_id:
        store.record_answer(report.checked_run_id, "check", answer(report), check_run)
    else:
        store.describe(check_run, answer(report))


def answer(report) -> str:
    """The one-line answer: the run descriptions in the MLflow UI."""
    counts = report.counts()
    failing = [c.name for c in report.checks if c.status == "fail"]
    return (f"{report.status}: {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail"
            + (f" ({', '.join(failing)})" if failing else ""))


def _run_name(report) -> str:
    """The answer first: MLflow's runs table cuts a nested run's name after ~13 characters (`2 fail: grad.miss…`).
    `2 fail: grad.nonfinite, overfit.one_batch · check @ run 3f2a9c0d step 15`, `all pass · check @ config`."""
    counts = report.counts()
    worst = next((status for status in ("fail", "warn") if counts[status]), None)
    if worst:
        names = [c.name for c in report.checks if c.status == worst]
        answer = f"{counts[worst]} {worst}: " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    else:
        answer = "all pass" if counts["pass"] else "nothing checked"
    where = "config"
    if report.checked_run_id:
        where = f"run {report.checked_run_id[:8]}" + (f" step {report.snapshot_step}" if report.snapshot_step is not None else "")
    return f"{answer} · check @ {where}"


def _run_tags(report, code_folder: Path | None) -> dict[str, str]:
    tags = {"replaybisect.check_status": report.status}
    if report.checked_run_id:
        tags["replaybisect.checked_run_id"] = report.checked_run_id
    if report.snapshot_step is not None:
        tags["replaybisect.checked_snapshot_step"] = str(report.snapshot_step)
    if code_folder is not None:
        tags["replaybisect.code_dir"] = str(code_folder)
    return tags


def log_to_run(store, run_id: str, report) -> list[str]:
    """check.md, check.json, the plots and the per-check values on the check run. Returns artifact names."""
    names = []
    with tempfile.TemporaryDirectory(prefix="replay-check-") as folder:
        out = Path(folder)
        (out / "check.md").write_text(check_markdown(report), encoding="utf-8")
        (out / "check.json").write_text(strict_json({k: v for k, v in report.to_json().items() if k != "artifacts"}, indent=2), encoding="utf-8")
        names += ["check.md", "check.json"]
        lr = report.lr_range
        if lr and lr.lrs:
            figure = lr_range_figure(lr, report.configured_lr)
            figure.savefig(out / "lr_range.png", dpi=110)
            close_figure(figure)
            names.append("lr_range.png")
        overfit = report.find("overfit.one_batch")
        if overfit and overfit.extra.get("losses"):
            figure = overfit_figure(overfit)
            figure.savefig(out / "overfit.png", dpi=110)
            close_figure(figure)
            names.append("overfit.png")
        store.log_artifacts(run_id, out)
    points = [(f"check/{c.name}", c.value, 0) for c in report.checks if isinstance(c.value, (int, float)) and math.isfinite(c.value)]
    if lr:
        points += [("lr_range/lr", v, i) for i, v in enumerate(lr.lrs)]
        points += [("lr_range/loss", v, i) for i, v in enumerate(lr.smoothed) if math.isfinite(v)]
    if overfit and overfit.extra.get("losses"):
        points += [("overfit/loss", v, i) for i, v in enumerate(overfit.extra["losses"]) if math.isfinite(v)]
    store.log_metrics(run_id, points)
    counts = report.counts()
    store.set_tags(run_id, {"check_fail": counts["fail"], "check_warn": counts["warn"]})
    return names
