"""What a watcher reports: each run's triage result, and the events of its log (rich lines or JSON lines, the health
line, the notifications)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class TriageResult:
    run_id: str
    run_name: str
    experiment_id: str
    failure: str  # nonfinite | failed | killed: why the run was picked
    state: str  # done | failed
    verdict: str  # the nan category or the diagnose verdict ("" when the triage failed)
    summary: str  # the one line tagged on the run
    next_command: str
    reason: str = ""  # a failed triage's one-line reason
    evidence: list[str] = field(default_factory=list)  # a few lines of the verbs' evidence
    fix: str = ""  # the fix the ablation proved, in one line ("" when none did)
    to_prove: str = ""  # none did: the command that proves the op's fix replay nan proposes
    headline: str = ""  # the answer in a few words first: the triage run's name
    links: list[dict[str, Any]] = field(default_factory=list)  # the verbs' result runs: step, name, run_id, url, path
    steps: list[str] = field(default_factory=list)  # the steps run by this watcher (resumed ones are not rerun)
    results: dict[str, Any] = field(default_factory=dict)  # step -> its JSON
    seconds: float = 0.0
    watcher_id: str = ""
    run_url: Optional[str] = None
    triage_run_id: Optional[str] = None  # the triage's own run under the examined one (report.publish)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Event:
    """What the watcher did, for the log (rich lines or JSON lines) and the health line."""

    kind: str  # start | poll | claimed | lost | step | done | failed | released | skipped | outage | error | health | stop
    message: str
    run_id: Optional[str] = None
    data: dict[str, Any] = field(default_factory=dict)
    result: Optional[TriageResult] = None
