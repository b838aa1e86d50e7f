"""`replay verify`'s answer: printed (the verdict, the sentence, the first differences), and published as a child run of
the verified run with verify.md and verify.json, its verdict tagged on the run (replaybisect.verify)."""

from __future__ import annotations

from pathlib import Path

from replaybisect.core.jsonutil import strict_json
from replaybisect.report import answer_markdown, print_answer, publish_child
from replaybisect.verbs.verify.engine import VerifyReport

MARKDOWN, JSON_FILE = "verify.md", "verify.json"


def headline(report: VerifyReport) -> str:
    first = report.first
    return report.verdict if first is None else f"{report.verdict} at step {first.step}"


def lines_of(report: VerifyReport) -> list[str]:
    span = f"steps {report.start}..{report.end - 1}" if report.sample is None else \
        f"a sample of {report.sample:g} steps per thousand"
    out = [f"{span} replayed from {len(report.segments)} snapshot"
           f"{'s' if len(report.segments) != 1 else ''} on {report.replayed_on} (recorded on {report.recorded_on or 'an unknown machine'}): "
           f"{report.steps_compared} steps compared", report.sentence]
    if report.differences:
        out.append("differences (step, metric, logged, replayed, relative):")
        out += [f"  {d.step}  {d.metric}  {d.logged!r}  {d.replayed!r}  {d.relative:.3g}" for d in report.differences[:10]]
    if report.second_replay is not None:
        out.append(f"a second replay here of the first differing interval: {report.second_replay}")
    other = report.elsewhere
    if other is not None:
        first = other.get("first")
        seen = f"first difference at step {first['step']}: {first['replayed']!r}" if first else "no difference"
        out.append(f"on another machine ({other['label']}, job {other['job']}): {other['verdict']} ({seen})")
    return out + [f"warning: {warning}" for warning in report.code_changes + report.warnings]


def to_markdown(report: VerifyReport) -> str:
    return answer_markdown("verify", report.run_id, headline(report), lines_of(report))


def print_report(report: VerifyReport) -> None:
    print_answer("verify", report.run_id, headline(report), lines_of(report), report.report_run_id, (MARKDOWN, JSON_FILE),
                 style="green" if report.verdict == "exact" else "red")


def publish(store, report: VerifyReport) -> str:
    """A child run of the verified run (kind=verify) with verify.md and verify.json; its verdict tagged on the run."""
    child = publish_child(store, report.run_id, "verify", f"{headline(report)} · verify", lambda child, folder: _write(report, child, folder),
                          tags={"replaybisect.verify": report.verdict})
    store.set_tags(report.run_id, {"verify": report.verdict})
    store.record_answer(report.run_id, "verify", f"{headline(report)}: {report.sentence}", child, report=to_markdown(report))
    return child


def _write(report: VerifyReport, child: str, folder: Path) -> None:
    report.report_run_id = child
    (folder / MARKDOWN).write_text(to_markdown(report), encoding="utf-8")
    (folder / JSON_FILE).write_text(strict_json(report.to_json(), indent=2), encoding="utf-8")
