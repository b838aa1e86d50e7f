"""Rendering for `replay ablate`: the rich table, a live progress display, ablation.md/.json and the loss plot."""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

from replaybisect.report import close_figure, fmt_number, markdown_table, mlflow_ui_hint, new_figure, plain, print_table
from replaybisect.options import say, stderr_console
from replaybisect.report import console as shared_console

VERDICT_STYLE = {
    "fixes": "bold green",
    "delays": "yellow",
    "no-effect": "dim",
    "worse": "bold red",
    "inconclusive": "magenta",
    "not-applicable": "dim",
    "error": "bold red",
    "fails-again": "red",
    "reference": "dim",
}
HEADERS = ("arm", "change", "verdict", "fails at", "final loss", "why")  # fails at: the first non-finite step
TABLE_WIDTH = 100  # the arms' table, wrapped inside it (a terminal or $COLUMNS narrower than this: theirs)


def _rows(result) -> list[tuple[Any, ...]]:
    rows = [("baseline", result.baseline.change, result.baseline.verdict, result.baseline.first_nonfinite_step,
             result.baseline.final_loss, result.baseline.reason)]
    for arm in result.arms:
        rows.append((arm.label or arm.name, arm.change, arm.verdict, arm.first_nonfinite_step, arm.final_loss, arm.reason))
    return rows


def _definitions(result) -> str:
    from replaybisect.verbs.ablate.outcome import BLOWUP_FACTOR, FINAL_WINDOW

    reference = (
        f"the loss blows up when the mean of an arm's last {FINAL_WINDOW} losses exceeds {BLOWUP_FACTOR:g}x the "
        f"pre-failure reference {fmt_number(result.reference_loss)} (= {fmt_number(result.blowup_threshold)})"
        if result.blowup_threshold is not None
        else "no pre-failure losses recorded: only non-finite steps count as failures"
    )
    return (
        f"fixes: finite through step {last_step_run(result)} and the loss does not blow up; delays: fails later "
        f"(or finite but blown up); no-effect: fails at the same step; worse: fails earlier. {reference}."
    )


def _header(result) -> str:
    failing = f"failed at step {result.failing_step}" if result.failing_step is not None else "never failed"
    start = f"from step {result.start_step}" + (
        f" (snapshot {result.snapshot_step})" if result.snapshot_step != result.start_step else " (snapshot)"
    )
    climb = f", its loss climbing since step {result.divergence_onset}" if result.divergence_onset is not None else ""
    ended = last_step_run(result)
    loop_end = f"; the loop ended at step {ended}" if ended < result.end_step - 1 else ""
    return (f"run {result.run_id} {failing}{climb}; arms replayed {start} to step {result.end_step - 1} "
            f"(horizon {result.horizon}{loop_end})")


def last_step_run(result) -> int:
    """The last step the arms that stayed finite ran: the horizon's end, or sooner where a script's own loop ended
    first (an arm that failed stopped at its failure, which says nothing of the loop's end)."""
    from replaybisect.verbs.ablate.outcome import last_step_of

    finite = [arm for arm in (result.baseline, *result.arms) if arm.first_nonfinite_step is None and arm.losses and not arm.error]
    return max((last_step_of(arm, result.end_step) for arm in finite), default=result.end_step - 1)


def _notes(result) -> list[str]:
    """What an arm's row cannot say: its note, why the report added it (a suggested value), the patch, the sweep."""
    arms_of: dict[str, list[str]] = {}  # a note several arms share is said once, for all of them
    for arm in result.arms:
        if arm.note:
            arms_of.setdefault(arm.note, []).append(arm.label or arm.name)
    lines = [f"{', '.join(names)}: {note}" for note, names in arms_of.items()]
    lines += [f"{arm.label}: added to prove a suggested value: {arm.suggested}" for arm in result.arms if arm.suggested]
    if result.patch:
        lines.append(f"patch: {result.patch} (the same snapshot and batches as the baseline)")
    if result.sweep:
        rounds = "; ".join(f"round {i + 1}: {', '.join(names)}" for i, names in enumerate(result.sweep["rounds"]))
        lines.append(f"sweep {result.sweep['knob']} over {result.sweep['range'][0]:.3g}..{result.sweep['range'][1]:.3g} "
                     f"(bisection in log, stops within x{result.sweep['precision']}): {rounds}")
    return lines


def _cost(result) -> str:
    return f"{result.replays} replays on {result.executor} x{result.workers} in {result.seconds:.1f}s"


# ---- rich -------------------------------------------------------------------------------------------
def print_result(result, console=None) -> None:
    from rich.table import Table

    console = console or shared_console
    console.print(f"[bold]ablation[/bold] {plain(_header(result))}")
    table = Table(title_justify="left", show_lines=False, width=min(console.width, TABLE_WIDTH))
    for header in HEADERS:
        table.add_column(header)
    for row in _rows(result):
        cells = [plain(fmt_number(cell)) for cell in row]  # arm names, changes, reasons: text, never markup
        style = VERDICT_STYLE.get(str(row[2]), "")
        cells[2] = f"[{style}]{cells[2]}[/{style}]" if style else cells[2]
        table.add_row(*cells)
    print_table(table, console)
    for line in _notes(result):
        console.print(f"  {plain(line)}")
    for warning in result.warnings:
        console.print(f"  [yellow]warning[/yellow] {plain(warning)}")
    style = "magenta" if result.status == "inconclusive" else "bold"
    console.print(f"[{style}]conclusion[/{style}] {plain(result.conclusion)}")
    console.print(f"  [dim]{plain(_definitions(result))}[/dim]")
    console.print(
        f"  {plain(_cost(result))}; report: run {plain(result.report_run_id or '-')} ({plain(', '.join(result.artifacts) or '-')}); "
        f"view: {plain(mlflow_ui_hint(result.tracking_uri))}"
    )


def print_list(entries: list[tuple[str, str]], console=None) -> None:
    from rich.table import Table

    console = console or shared_console
    table = Table(title="interventions (replay ablate ARM1,ARM2 --run-id ID)", title_justify="left")
    table.add_column("arm")
    table.add_column("change")
    for name, description in entries:
        table.add_row(plain(name), plain(description))
    print_table(table, console)


class ArmProgress:
    """One progress bar per arm on stderr while the arms run; a line per arm started and finished when stderr is
    not a terminal."""

    def __init__(self, enabled: Optional[bool] = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = None
        self._tasks: dict[str, Any] = {}
        self._start = 0

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=stderr_console(), transient=True,
            )
            self._progress.__enter__()
        return self

    def plan(self, arms: list[str], start: int, end: int) -> None:
        self._start = start
        if self._progress is None:
            say(f"ablate: replaying {len(arms)} arm(s) ({', '.join(arms)}) over steps {start}..{end - 1}")
            return
        for arm in arms:
            self._tasks[arm] = self._progress.add_task(plain(arm), total=end - start)  # a bar's description is markup

    def update(self, arm: str, event: str, step: int) -> None:
        if self._progress is None and event == "done":
            say(f"  {arm}: done")
        if self._progress is None or arm not in self._tasks:
            return
        if event == "step":
            self._progress.update(self._tasks[arm], completed=step - self._start + 1)
        elif event == "done":
            task = self._tasks[arm]
            self._progress.update(task, completed=self._progress.tasks[task].total)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        return False


# ---- markdown, JSON, plot ------------------------------------------------------------------------------
def to_markdown(result) -> str:
    lines = [
        f"# Ablation of run {result.run_id}",
        "",
        _header(result) + ".",
        "",
        f"**{result.status}**: {result.conclusion}",
        "",
        markdown_table(HEADERS, _rows(result)),
        "",
        _definitions(result),
        "",
        _cost(result) + ".",
        "",
        f"Baseline losses against the recorded ones before the failure: {result.baseline.reproduced}.",
    ]
    notes = [f"- {line}" for line in _notes(result)]
    if notes:
        lines += ["", *notes]
    if result.warnings:
        lines += ["", "Warnings:", *[f"- {w}" for w in result.warnings]]
    runs = [f"- {arm.label or arm.name}: {arm.run_id}" for arm in [result.baseline, *result.arms] if arm.run_id]
    if runs:
        lines += ["", "Child runs (kind=ablation-arm):", *runs]
    lines += ["", "Sources:", *[f"- {source}" for source in SOURCES]]
    return "\n".join(lines) + "\n"


# Public sources for the arms and the method (the report's citations)
SOURCES = (
    "one change at a time against a replayed baseline: Karpathy 2019, \"A Recipe for Training Neural Networks\"; "
    "the replay tolerance of Megatron-Core's rerun state machine",
    "lr: Smith 2017, \"Cyclical Learning Rates for Training Neural Networks\" (LR range test); warmup: Goyal et al. 2017, "
    "\"Accurate, Large Minibatch SGD\"",
    "clip: Pascanu, Mikolov, Bengio 2013, \"On the difficulty of training recurrent neural networks\"",
    "precision: Micikevicius et al. 2018, \"Mixed Precision Training\"; eps: Kingma and Ba 2015, \"Adam\" (eps guards v = 0)",
)


def loss_figure(result):
    figure, axes = new_figure(size=(9, 4.5))
    ax = axes[0][0]
    all_values = []
    for arm in [result.baseline, *result.arms]:
        if not arm.losses:
            continue
        steps = [s for s, v in arm.losses.items() if math.isfinite(v)]
        values = [v for v in arm.losses.values() if math.isfinite(v)]
        all_values += values
        style = {"linewidth": 2.0, "color": "black", "zorder": 5, "alpha": 0.8} if arm.name == "baseline" else {"linewidth": 1.2}
        (line,) = ax.plot(steps, values, label=f"{arm.label or arm.name} ({arm.verdict})", **style)
        if arm.first_nonfinite_step is not None and values:
            ax.plot([arm.first_nonfinite_step], [values[-1]], marker="x", markersize=9, color=line.get_color())
    if result.failing_step is not None:
        ax.axvline(result.failing_step, color="red", linestyle="--", linewidth=1, label=f"recorded failure (step {result.failing_step})")
    if result.blowup_threshold is not None:
        ax.axhline(result.blowup_threshold, color="gray", linestyle=":", linewidth=1, label="blow-up threshold")
    if all_values and min(all_values) > 0 and max(all_values) / min(all_values) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"ablation of {result.run_id[:12]}: x = first non-finite step")
    ax.legend(fontsize=8, loc="best")
    figure.tight_layout()
    return figure


def _arm_params(result, arm) -> dict[str, Any]:
    return {"arm": arm.name, "change": arm.change, "snapshot_step": result.snapshot_step, "start_step": result.start_step,
            "end_step": result.end_step, "failing_step": result.failing_step,
            **{f"change.{key}": value for key, value in arm.params.items()}}


def _arm_points(arm) -> list[tuple[str, float, int]]:
    """The arm's loss, gradient norm and lr curves, and the non-finite loss where it stopped."""
    points = [("loss", v, s) for s, v in arm.losses.items()]
    points += [("grad_norm", v, s) for s, v in arm.grad_norms.items()]
    points += [("lr", v, s) for s, v in arm.lrs.items()]
    if arm.first_nonfinite_step is not None:
        points.append(("loss", arm.nonfinite_loss if arm.nonfinite_loss is not None else math.nan, arm.first_nonfinite_step))
    return points


# MLflow's default runs view shows the Run Name column (190 px) and not the Description: a run nested under the
# failed run shows ~16 characters of its name, an arm (nested twice) ~11. So a name starts with a verdict mark,
# then the arm or the answer: `✓ lr=x0.1: fixes · ablate @ step 47` reads `✓ lr=x0.1: f...` there.
VERDICT_MARK = {"fixes": "✓", "delays": "~", "no-effect": "✗", "worse": "✗", "fails-again": "✗", "reference": "·",
                "inconclusive": "?", "error": "!", "not-applicable": "-"}


def arm_run_name(arm, where: str) -> str:
    """`✓ lr=x0.1: fixes · ablate @ step 47`: the verdict's mark and the arm first."""
    return f"{VERDICT_MARK.get(arm.verdict, '?')} {arm.label or arm.name}: {arm.verdict} · {where}"


def ablation_run_name(result, where: str) -> str:
    """The answer first (`✓ lr=x0.1, clip=1 · ablate @ step 47 (lr, clip, precision)`)."""
    arms = f"({', '.join(arm.name for arm in result.arms)})"
    if result.status == "inconclusive":
        answer = "? inconclusive"
    elif result.sweep:
        knob = result.sweep["knob"]
        shown = next((arm.label for arm in result.arms if arm.name == result.sweep.get("stable_arm")), None)
        answer = f"✓ {shown.replace('=', ' <= ')}" if shown else f"✗ no stable {knob}"
        arms = f"(sweep {knob}, {len(result.arms)} arms)"
    else:
        patch = next((arm for arm in result.arms if arm.intervention == "patch"), None)
        fixes = [arm.label or arm.name for arm in result.arms if arm.verdict == "fixes" and arm is not patch]
        if patch is not None:
            answer = "✓ your patch fixes" if patch.verdict == "fixes" else f"✗ your patch: {patch.verdict}"
            answer += f"; fixed by {', '.join(fixes)}" if fixes else ""
        else:
            answer = f"✓ {', '.join(fixes)}" if fixes else "✗ no single fix"
    return f"{answer} · {where} {arms}"[:250]


def _record_arm(store, result, arm, where: str) -> None:
    """One replayed arm as a child run of the ablation's run (kind=ablation-arm): its change as params, its curves."""
    child = store.create_run("ablation-arm", run_name=arm_run_name(arm, where), parent_run_id=result.report_run_id,
                             tags={"replaybisect.arm": arm.name})
    store.log_params(child, _arm_params(result, arm))
    if arm.verdict == "error":
        store.finish_run(child, "crashed", "FAILED")
        return
    store.log_metrics(child, _arm_points(arm))
    store.describe(child, arm.verdict + (f" (first non-finite step {arm.first_nonfinite_step})" if arm.first_nonfinite_step is not None
                                         else f" (final loss {fmt_number(arm.final_loss)})"))
    if arm.first_nonfinite_step is not None:
        store.set_tags(child, {"first_nonfinite_step": arm.first_nonfinite_step, "nonfinite_what": arm.nonfinite_what})
    store.finish_run(child, "nonfinite" if arm.first_nonfinite_step is not None else "ok")
    arm.run_id = child


def write_artifacts(store, result) -> list[str]:
    """ablation.md, ablation.json and ablation.png on the ablation's run (each ablation keeps its own)."""
    result.artifacts = ["ablation.md", "ablation.json", "ablation.png"]
    store.log_text(result.report_run_id, to_markdown(result), "ablation.md")
    store.log_dict(result.report_run_id, result.to_json(), "ablation.json")
    figure = loss_figure(result)
    try:
        store.log_figure(result.report_run_id, figure, "ablation.png")
    finally:
        close_figure(figure)
    return result.artifacts


def publish(store, result) -> None:
    """Record what `ablate()` found as one run under the examined run (`✓ lr=x0.1 · ablate @ step 47 (lr, clip)`,
    kind=ablation): every replayed arm (the baseline first) as its child (`✓ lr=x0.1: fixes · ablate @ step 47`), the
    report on it, the conclusion as its description and a line of the examined run's. A second ablation is a second
    run: nothing is overwritten."""
    step = result.failing_step if result.failing_step is not None else result.start_step
    where = f"ablate @ step {step}"
    result.report_run_id = store.create_run("ablation", run_name=ablation_run_name(result, where), parent_run_id=result.run_id,
                                            tags={"replaybisect.arms": ",".join(arm.name for arm in result.arms)})
    try:
        for arm in [result.baseline, *result.arms]:
            if arm.verdict != "not-applicable":
                _record_arm(store, result, arm, where)
        if result.sweep and result.sweep.get("stable_arm"):
            result.sweep["stable_run_id"] = next(arm.run_id for arm in result.arms if arm.name == result.sweep["stable_arm"])
        write_artifacts(store, result)
    except BaseException:
        store.finish_run(result.report_run_id, "crashed", "FAILED")
        raise
    store.finish_run(result.report_run_id, "ok")
    store.record_answer(result.run_id, "ablate", result.conclusion, result.report_run_id, report=to_markdown(result))
