"""`replay runs`: recent recorded runs, their status, failing step and snapshot steps."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from replaybisect.errors import ReplayError
from replaybisect.core.tags import step_tag_or_none
from replaybisect.store import TAG, Store, unclamped

KINDS = ("train", "replay", "ablation-arm", "bisect", "bisect-trial", "check", "ablation", "diagnosis", "triage")
STATUSES = ("ok", "nonfinite", "crashed", "killed", "running")
MAX_LIMIT = 50_000  # MLflow's SEARCH_MAX_RESULTS_THRESHOLD: a search asking for more is refused


@dataclass
class RunSummary:
    run_id: str
    name: str
    kind: str
    status: str
    first_nonfinite_step: Optional[int]
    steps: Optional[int]  # steps logged (last step + 1)
    last_loss: Optional[float]
    snapshot_steps: list[int]
    started: str
    parent_run_id: Optional[str]
    triage: Optional[str] = None  # `replay watch`'s one-line answer (None: not triaged)
    crash: Optional[str] = None  # a step that raised: "step 7: IndexError: index 4 is out of bounds ... (model.py:17)"

    def to_json(self) -> dict:
        return asdict(self)


def _summary(run) -> RunSummary:
    import datetime

    tags = run.data.tags
    snapshot_tag = tags.get(TAG + "snapshot_steps", "")
    first = step_tag_or_none({"step": tags.get(TAG + "first_nonfinite_step")}, "step")
    status = tags.get(TAG + "status", "")
    if status == "running" and run.info.status in ("FAILED", "KILLED"):
        status = "crashed"
    return RunSummary(
        run_id=run.info.run_id,
        name=run.info.run_name or "",
        kind=tags.get(TAG + "kind", ""),
        status=status,
        first_nonfinite_step=first,  # None also for a tag that is not a step: one damaged run does not hide the list
        steps=None,
        last_loss=unclamped(loss) if (loss := run.data.metrics.get("loss")) is not None else None,
        snapshot_steps=[int(s) for s in snapshot_tag.split(",") if s],
        started=datetime.datetime.fromtimestamp(run.info.start_time / 1000).isoformat(timespec="seconds"),
        parent_run_id=tags.get("mlflow.parentRunId"),
        triage=triage_answer(tags),
        crash=crash_line(tags),
    )


def crash_line(tags: dict[str, str]) -> Optional[str]:
    """A run whose step raised (tags failure=exception, failing_step, error_type, error, error_frame), in one line."""
    if tags.get(TAG + "failure") != "exception":
        return None
    step = step_tag_or_none({"step": tags.get(TAG + "failing_step")}, "step")
    error = tags.get(TAG + "error")
    frame = tags.get(TAG + "error_frame")
    where = f" ({frame.split(' in ', 1)[0].rsplit('/', 1)[-1]})" if frame else ""
    return f"step {'?' if step is None else step}: {tags.get(TAG + 'error_type') or 'exception'}" + (f": {error}" if error else "") + where


def triage_answer(tags: dict[str, str]) -> Optional[str]:
    """The triage's one line from the run's tags: its summary once finished (done, or failed with its reason), the
    step in progress while a watcher holds it, None when no watcher has triaged it."""
    from replaybisect.verbs.watch.engine import FINISHED_STATES, REASON, STEP, SUMMARY, TRIAGE

    state = tags.get(TAG + TRIAGE)
    if not state:
        return None
    if state in FINISHED_STATES:
        return tags.get(TAG + SUMMARY) or (f"triage failed: {tags.get(TAG + REASON, '')}" if state == "failed" else state)
    return f"triaging ({tags.get(TAG + STEP) or 'claimed'})"


def recent_runs(store: Store, limit: int = 20, kind: str | None = "train", status: str | None = None) -> list[RunSummary]:
    """Recent runs recorded by replaybisect (default: training runs), newest first."""
    check_filters(limit, kind, status)
    filters = [f"tags.`{TAG}kind` = '{kind}'"] if kind else [f"tags.`{TAG}kind` != ''"]
    if status:
        filters.append(f"tags.`{TAG}status` = '{status}'")
    summaries = [_summary(run) for run in store.search_runs(" and ".join(filters), max_results=limit)]
    for summary in summaries:
        history = store.client.get_metric_history(summary.run_id, "loss") if summary.last_loss is not None else []
        summary.steps = max((m.step for m in history), default=-1) + 1 if history else 0
    return summaries


def check_filters(limit: int, kind: str | None, status: str | None) -> None:
    """Bad filters are bad input, not an empty list."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ReplayError(f"--limit {limit} must be between 1 and {MAX_LIMIT} (MLflow's cap on one search)")
    if kind is not None and kind not in KINDS:
        raise ReplayError(f"--kind {kind!r} is not a run kind; use one of {', '.join(KINDS)}, all")
    if status is not None and status not in STATUSES:
        raise ReplayError(f"--status {status!r} is not a run status; use one of {', '.join(STATUSES)}")
