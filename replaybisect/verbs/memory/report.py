"""`replay memory`'s answer: printed (what grows, by how much a step, the line that adds to it, the fix), and
published as a child run of the examined run with memory.md and memory.json."""

from __future__ import annotations

from pathlib import Path

from replaybisect.core.jsonutil import strict_json
from replaybisect.report import answer_markdown, print_answer, publish_child
from replaybisect.verbs.memory.engine import MemoryReport

MARKDOWN, JSON_FILE = "memory.md", "memory.json"


def _bytes(value: float) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def headline(report: MemoryReport) -> str:
    failed = report.out_of_memory
    if failed is not None:
        top = f"; {failed.modules[0][0]} saves the most activations" if failed.modules else ""
        fits = f"; batch size {failed.fits} fits{' (proven under the cap)' if failed.proven else ''}" if failed.fits else ""
        return f"step {failed.step} ran out of memory at batch size {failed.rows}{top}{fits}"
    if not report.holders:
        return "nothing the loop names grows across steps"
    holder = report.holders[0]
    line = f" ({holder.line.split('  ', 1)[0]})" if holder.line else ""
    return f"`{holder.name}` grows {holder.grows}{line}"


def lines_of(report: MemoryReport) -> list[str]:
    grew = f"; the process grew {_bytes(report.rss_per_step)} a step" if report.rss_per_step else ""
    out = [f"steps {report.step}..{report.step + report.steps - 1} replayed from snapshot {report.snapshot_step} "
           f"(losses {report.losses}){grew}" if report.steps else f"the state before step {report.step} restored from its snapshot"]
    if report.out_of_memory is not None:
        return out + oom_lines(report.out_of_memory) + [f"warning: {warning}" for warning in report.warnings]
    if not report.holders:
        out.append("nothing the loop's code names (its globals, its frames' locals, its model's attributes) gains tensors "
                   "or autograd nodes from step to step")
    for index, holder in enumerate(report.holders, start=1):
        graph = ", each keeping its step's autograd graph (activations)" if holder.keeps_graph and holder.kind != "tensor" else ""
        out.append(f"{index}. `{holder.name}` ({holder.kind}, {holder.where}) gains {holder.grows}{graph}")
        if holder.line:
            out.append(f"   {holder.line}")
        out.append(f"   fix: {holder.fix}")
    return out + [f"warning: {warning}" for warning in report.warnings]


def oom_lines(failed) -> list[str]:
    cap = f" under a cap of {_bytes(failed.cap)}, {_bytes(failed.headroom)} of it left for the step" if failed.headroom else ""
    out = [f"step {failed.step} ({failed.rows} samples) ran out of memory{cap}; replayed without the cap its own tensors "
           f"peak at {_bytes(failed.peak)}: " + ", ".join(f"{kind} {_bytes(size)}" for kind, size in
                                                         sorted(failed.at_peak.items(), key=lambda item: -item[1]))]
    if failed.per_sample:
        out.append(f"each sample adds {_bytes(failed.per_sample)} to that peak")
    if failed.modules:
        out.append("activations saved for the backward, by module: " +
                   ", ".join(f"{name} {_bytes(size)}" for name, size in failed.modules))
    for tensor in failed.tensors:
        line = f" made at {tensor['line']}" if tensor.get("line") else ""
        out.append(f"  {tensor['dtype']}{tensor['shape']} {_bytes(tensor['bytes'])} saved by {tensor['module']}{line}")
    if failed.detail:
        out.append(failed.detail)
    if failed.suggestion:
        out.append(f"next: {failed.suggestion}")
    return out


def to_markdown(report: MemoryReport) -> str:
    return answer_markdown("memory", report.run_id, headline(report), lines_of(report))


def print_report(report: MemoryReport) -> None:
    print_answer("memory", report.run_id, headline(report), lines_of(report), report.report_run_id, (MARKDOWN, JSON_FILE))


def publish(store, report: MemoryReport) -> str:
    """A child run of the examined run (kind=memory) with memory.md and memory.json; returns its id."""
    child = publish_child(store, report.run_id, "memory", f"{headline(report)} · memory", lambda child, folder: _write(report, child, folder))
    store.record_answer(report.run_id, "memory", headline(report), child, report=to_markdown(report))
    return child


def _write(report: MemoryReport, child: str, folder: Path) -> None:
    report.report_run_id = child
    (folder / MARKDOWN).write_text(to_markdown(report), encoding="utf-8")
    (folder / JSON_FILE).write_text(strict_json(report.to_json(), indent=2), encoding="utf-8")
