"""A run's tags, read back: anyone who can write to the store can set them, so a value is parsed, never trusted.
Light: no torch, no MLflow."""

from __future__ import annotations

import math
from typing import Mapping, Optional

from replaybisect.errors import ReplayError

MAX_STEP_DIGITS = 12  # a trillion steps: anything longer is not a step the recorder wrote


def step_tag(tags: Mapping[str, str], key: str, run_id: str) -> Optional[int]:
    """The step stored in tag `replaybisect.<key>` (`tags` without the prefix), None when it is absent; a value
    that is not a step number is a one-line ReplayError saying how to fix the tag."""
    value = tags.get(key)
    if value is None or value == "":
        return None
    text = str(value).strip()
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_STEP_DIGITS):
        shown = repr(str(value)[:40]) + ("..." if len(str(value)) > 40 else "")
        raise ReplayError(f"run {run_id}: its tag replaybisect.{key}={shown} is not a step number (the recorder writes one); "
                          f"set it to the step, or delete it (MlflowClient().delete_tag(run_id, 'replaybisect.{key}')) "
                          "to date the failure from the logged losses")
    return int(text)


def step_tag_or_none(tags: Mapping[str, str], key: str) -> Optional[int]:
    """The step in tag `replaybisect.<key>`, or None when it is absent or not a step number (for listings, where
    one damaged run must not hide the others)."""
    try:
        return step_tag(tags, key, "")
    except ReplayError:
        return None


def failing_step(store, run_id: str) -> Optional[int]:
    """The first non-finite step of the run in `store` (a replaybisect.store.Store): the run's tag, else the step that
    raised (tag failing_step, failure=exception), else the first non-finite loss or grad_norm logged. Light: a
    command refuses a run that never failed with it before torch is imported."""
    tags = store.tags(run_id)
    tag = step_tag(tags, "first_nonfinite_step", run_id)  # a tag that is not a step: one line
    if tag is None:
        tag = step_tag(tags, "failing_step", run_id)
    if tag is not None:
        return tag
    steps = [
        step
        for key in ("loss", "grad_norm")
        for step, value in store.metric_history(run_id, key)
        if not math.isfinite(value)
    ]
    return min(steps) if steps else None
