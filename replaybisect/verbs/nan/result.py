"""What `replay nan` answers: the NanReport (category, op, module, line, evidence, the arms to try) and the
names it uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from replaybisect.core.trend import HISTORY_WINDOW, HistoryFit

CATEGORIES = ("divergence", "data", "forward", "loss", "backward", "optimizer", "corrupt-state", "transient", "exception",
              "out-of-memory")
FAULTS = ("forward", "loss", "backward", "optimizer")  # verdicts a divergence can stand behind (the op met runaway values)
FIELDS_NAMED, FIELDS_SHOWN = 3, 10  # a data verdict's non-finite batch fields named in its headline, and in its evidence
ARMS = ("lr", "clip", "precision", "warmup", "eps", "skip-batch", "skip-rows", "seed", "zero-grad")  # `replay ablate` arm names


@dataclass
class NanReport:
    run_id: str
    failing_step: int  # the step examined
    recorded_failing_step: Optional[int]  # the run's first non-finite step
    snapshot_step: int
    reproduced: str  # exact | close | diverged | unchecked (no snapshot before t)
    category: str
    phase: str  # data | state | forward | loss | backward | update | none
    module: Optional[str]
    op: Optional[str]
    source: Optional[str]  # the user's source line that made the op
    evidence: list[str]
    suggestion: str
    arms: list[str]
    ablate_command: Optional[str]
    suggestion_reason: str = ""  # why those arms
    replay_run_id: Optional[str] = None
    origin_step: Optional[int] = None  # corrupt-state / optimizer: the step that made the state non-finite
    origin: Optional[str] = None  # how the state went bad: optimizer | forward-write | initial | unknown
    state_match: Optional[str] = None  # replayed state vs the snapshot saved at t
    warnings: list[str] = field(default_factory=list)
    replay: dict[str, Any] = field(default_factory=dict)
    history: Optional[HistoryFit] = None
    batch: list[Any] = field(default_factory=list)
    state_findings: list[Any] = field(default_factory=list)
    forward: dict[str, Any] = field(default_factory=dict)
    backward: dict[str, Any] = field(default_factory=dict)
    update: Optional[dict[str, Any]] = None
    anomaly: Optional[dict[str, Any]] = None
    plain_step: dict[str, Any] = field(default_factory=dict)
    layer_grad_norms: dict[str, float] = field(default_factory=dict)
    isolation: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    grad_norm_history: list[tuple[int, float]] = field(default_factory=list)
    precision: str = "fp32"
    headline: str = ""  # the answer in one line, the same words in every verb that reports it
    divergence: dict[str, Any] = field(default_factory=dict)  # divergence or fault: the evidence and the reason
    overflow: Optional[dict[str, Any]] = None  # a divergence: where the runaway values first overflowed
    layer_history: dict[str, dict[int, float]] = field(default_factory=dict)  # layer -> step -> grad norm (picture)
    fix: Optional[dict[str, str]] = None  # an op-level fault of a known pattern: the change, and the command proving it
    # a step that raised (the run's tag failure=exception): what it raised on replay, where, and what came before
    exception: Optional[dict[str, Any]] = None
    # a fault keyed on the data: the batch rows its first non-finite op made them in ({"rows", "of", "dataset_rows"})
    rows: Optional[dict[str, Any]] = None
    # every step from 1 to the failing one began with the gradients of the steps before it (the loop never clears them)
    gradients_never_cleared: bool = False

    def to_json(self) -> dict[str, Any]:
        from replaybisect.core.jsonutil import to_jsonable

        data = to_jsonable(self)
        # DESIGN §5 keys first
        ordered = {key: data.pop(key) for key in (
            "run_id", "failing_step", "snapshot_step", "reproduced", "headline", "category", "phase", "module", "op",
            "evidence", "suggestion", "replay_run_id",
        )}
        ordered.update(data)
        ordered["loss_history"] = ordered["loss_history"][-HISTORY_WINDOW:]
        ordered["grad_norm_history"] = ordered["grad_norm_history"][-HISTORY_WINDOW:]
        return ordered

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "NanReport":
        """The report as `to_json` wrote it: how a diagnosis made in a re-entered script comes back (the terminal
        report, the plot and the child run are made from it here). Numbers JSON keeps as text are numbers again."""
        from dataclasses import fields

        values = {name: data[name] for name in (f.name for f in fields(cls)) if name in data}
        if values.get("history") is not None:
            values["history"] = HistoryFit(**values["history"])
        for key in ("loss_history", "grad_norm_history"):
            values[key] = [(int(step), _number(value)) for step, value in values.get(key, [])]
        values["layer_history"] = {name: {int(step): _number(value) for step, value in series.items()}
                                   for name, series in values.get("layer_history", {}).items()}
        values["layer_grad_norms"] = {name: _number(value) for name, value in values.get("layer_grad_norms", {}).items()}
        return cls(**values)


def _number(value: Any) -> Any:
    """A float JSON could not hold ("nan", "inf", "-inf" from jsonutil.to_jsonable) as the float again."""
    return float(value) if value in ("nan", "inf", "-inf") else value


def shown_module(name: Optional[str]) -> str:
    return "the model" if name == "" else str(name)


def headline(report: NanReport) -> str:
    """The answer in one line: what went wrong, where; the same words in nan, diagnose, watch and the JSON."""
    t = report.failing_step
    category = report.category
    if category == "divergence":
        growth = (report.divergence or {}).get("growth") or {}
        climb = (f"{growth['metric']} x{growth['factor']:.2g} over {growth['last_step'] - growth['onset_step']} steps"
                 if growth else "the curves climbed by orders of magnitude")
        kind = (report.divergence or {}).get("precursor_type")
        began = f"; the climb began in {report.module}" + (f" ({kind})" if kind else "") if report.module else ""
        return f"divergence at step {t}: {climb}{began} (learning rate, clipping or init, not an op)"
    if category == "transient":
        if report.exception is not None:
            return f"transient at step {t}: raised {report.exception['recorded']} in the run, runs through on replay"
        return f"transient at step {t}: non-finite in the run, finite on replay from the same state and batch"
    if category == "out-of-memory":
        return f"out-of-memory at step {t}: the step ran out of memory under the run's cap (replay memory says what fits)"
    if category == "exception":
        crash = report.exception or {}
        line = f" at {line_of(crash.get('frame'))}" if crash.get("frame") else ""
        by = f" (raised by {crash['op']}" + (f" in {shown_module(crash.get('module'))}" if crash.get("module") is not None else "") + ")" \
            if crash.get("op") else ""
        first = crash.get("nonfinite_before")
        before = ""
        if first:
            before = f", after {first['op']}" + (f" in {shown_module(first['module'])}" if first.get("module") is not None else "") + " made a non-finite value"
        return f"exception at step {t}: {crash.get('replayed')}{line}{by}{before}"
    if category == "data":
        fields = list(dict.fromkeys(finding.field for finding in report.batch))  # (in the batch's order)
        named = ", ".join(fields[:FIELDS_NAMED]) + (f" and {len(fields) - FIELDS_NAMED} more" if len(fields) > FIELDS_NAMED else "")
        return f"data at step {t}: the batch holds non-finite values ({named or 'a field'})"
    if category == "corrupt-state":
        origin = f", made so at step {report.origin_step}" if report.origin_step is not None else ""
        return f"corrupt-state at step {t}: the state before the step was already non-finite{origin}" + (f" ({report.module})" if report.module else "")
    what = f"{report.op}" if report.op else "a non-finite value"
    where = f" in {report.module}" if report.module else ""
    line = f" at {line_of(report.source)}" if report.source else ""
    if category == "optimizer":
        owner = f"{report.module}'s" if report.module else "the"
        return f"optimizer at step {report.origin_step if report.origin_step is not None else t}: {what} made {owner} weights or moments non-finite from finite gradients"
    return f"{category} at step {t}: {what}{where} made a non-finite value from finite inputs{line}"


def line_of(source: Optional[str]) -> str:
    """`file.py:24` of a source line `path/file.py:24 in function: code`."""
    location = (source or "").split(" in ", 1)[0]
    return location.rsplit("/", 1)[-1]
