"""What a run recorded, as the detectors read it: each metric's series (steps, values), and the run's tags
and params, loaded once from the store."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from replaybisect.core.tags import step_tag
from replaybisect.store import Store
from replaybisect.verbs.diagnose.ranks import RANK_METRIC



# ---- what the run recorded ----------------------------------------------------------------------------
@dataclass
class Series:
    """One metric's history: steps and values, sorted by step."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def finite(self) -> "Series":
        keep = np.isfinite(self.values)
        return Series(self.steps[keep], self.values[keep])

    def before(self, step: Optional[int]) -> "Series":
        if step is None:
            return self
        keep = self.steps < step
        return Series(self.steps[keep], self.values[keep])


EMPTY = Series(np.zeros(0, dtype=np.int64), np.zeros(0))

# Metrics diagnose reads; weight_norm/<module> is not needed by any detector, so it is never fetched.
SCALAR_KEYS = ("loss", "val_loss", "grad_norm", "lr", "step_time", "data_time", "update_ratio", "param_norm", "grads_carried",
               "memory/rss", "memory/allocated", "memory/recorder")
LAYER_PREFIXES = ("grad_norm/", "act_zero_frac/", "act_sat_frac/")


@dataclass
class Curves:
    """Everything diagnose looks at: the run's metric histories, tags and a few params."""

    run_id: str
    metrics: dict[str, Series]
    tags: dict[str, str]
    params: dict[str, str]
    run_name: str = ""
    metric_keys: list[str] = field(default_factory=list)  # every metric the run logged (histories not all fetched)

    def get(self, key: str) -> Series:
        return self.metrics.get(key, EMPTY)

    def layers(self, prefix: str) -> dict[str, Series]:
        """{module: series} for per-layer keys such as grad_norm/<module>."""
        return {key[len(prefix):]: series for key, series in self.metrics.items() if key.startswith(prefix) and len(series)}

    @property
    def failing_step(self) -> Optional[int]:
        """The first non-finite step: the recorder's tag, else the first non-finite loss / grad_norm logged."""
        tag = step_tag(self.tags, "first_nonfinite_step", self.run_id)  # checked by load_curves: a step or None
        if tag is not None:
            return tag
        # with fp16 a GradScaler skips steps whose gradients overflow: routine, not a failure (only the loss counts)
        keys = ("loss",) if self.params.get("train.precision") == "fp16" else ("loss", "grad_norm")
        bad = [int(s.steps[~np.isfinite(s.values)][0]) for s in map(self.get, keys) if len(s) and not np.isfinite(s.values).all()]
        return min(bad) if bad else None

    @property
    def healthy_loss(self) -> Series:
        """The finite training loss before the first non-finite step: the curve the shape detectors read."""
        return self.get("loss").before(self.failing_step).finite()


def load_curves(store: Store, run_id: str, workers: int = 8) -> Curves:
    """Fetch the histories diagnose needs (one MLflow get_metric_history per key, in parallel)."""
    run = store.get_run(run_id)  # RunNotFound: one line, exit 2
    keys = [k for k in run.data.metrics if k in SCALAR_KEYS or k.startswith(LAYER_PREFIXES) or RANK_METRIC.match(k)]

    def fetch(key: str) -> tuple[str, Series]:
        history = store.metric_history(run_id, key)
        if not history:
            return key, EMPTY
        steps, values = zip(*history)
        return key, Series(np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=float))

    if len(keys) > 1 and workers > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(keys)), thread_name_prefix="replaybisect-history") as pool:
            metrics = dict(pool.map(fetch, keys))
    else:
        metrics = dict(map(fetch, keys))
    tags = {k[len("replaybisect."):]: v for k, v in run.data.tags.items() if k.startswith("replaybisect.")}
    step_tag(tags, "first_nonfinite_step", run_id)  # a tag that is not a step is bad input: one line, before any analysis
    step_tag(tags, "failing_step", run_id)
    return Curves(run_id=run_id, metrics=metrics, tags=tags, params=dict(run.data.params), run_name=run.info.run_name or "",
                  metric_keys=sorted(run.data.metrics))
