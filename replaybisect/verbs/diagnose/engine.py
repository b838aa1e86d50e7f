"""`replay diagnose`: read a run's recorded curves and name the pathology they show.

Reads the metrics only (no replay, no torch). The symptom -> cause table of public debugging guides (below) is a registry of small
detectors: each takes the run's curves and returns findings with evidence (steps, numbers) and the next
command to run. A healthy run gets a clean bill, never a list of guesses, so every threshold is a
published one (cited beside it) applied to robust statistics (medians, medians of blocks, rolling
medians) that ordinary SGD noise does not trip.

Steps are the recorded, 0-based step numbers: "the first step" is step 0.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from replaybisect.errors import ReplayError
from replaybisect.core.tags import step_tag
from replaybisect.core.growth import divergence as divergence_growth
from replaybisect.core.jsonutil import to_jsonable as _jsonable
from replaybisect.store import Store
from replaybisect.verbs.diagnose import ranks
from replaybisect.verbs.diagnose.ranks import RANK_METRIC  # a distributed run's per-rank curves

__all__ = ["Finding", "Diagnosis", "Curves", "DETECTORS", "detector", "diagnose", "load_curves", "analyse"]

# ---- thresholds (defaults; the source is cited beside each) -------------------------------------------
from replaybisect.core.thresholds import (  # noqa: E402  (sources cited there)
    INPUT_BOUND_MIN_SECONDS, INPUT_BOUND_SHARE, OVERFIT_GAP, OVERFIT_PATIENCE, OVERFIT_RISE, OVERFIT_TREND_P,
    PLATEAU_MIN_LEVEL, PLATEAU_MIN_SHARE, PLATEAU_TREND_P, PLATEAU_TREND_SE, SPIKE_BASELINE_SAMPLES, SPIKE_FACTOR,
    DEAD_LAYER_ZERO_FRACTION as DEAD_ZERO_FRACTION,
    LAYER_GRAD_GROWTH_EXPLODING as EXPLODING_RATIO,
    LAYER_GRAD_NORM_EXPLODING_MIN as EXPLODING_MIN_NORM,
    DIVERGENCE_RISE, SLOW_FALL_MAX, SLOW_GRAD_NORM_MAX,
    LAYER_GRAD_NORM_VANISHING as VANISHING_ABSOLUTE,
    LAYER_GRAD_NORM_VANISHING_WITH_RATIO as VANISHING_NORM,
    LAYER_TO_LARGEST_GRAD_RATIO_VANISHING as VANISHING_RATIO,
    UPDATE_RATIO_FAIL as UPDATE_RATIO_RANGE,
)


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


# ---- findings -------------------------------------------------------------------------------------------
@dataclass
class Finding:
    pattern: str  # e.g. "spikes", "overfitting", "dead-relu"
    summary: str  # one line a person reads first
    evidence: dict[str, Any]  # the steps and numbers behind it
    next: str  # the next command to run
    step: Optional[int] = None  # the step it starts at (marked on the plot)
    layer: Optional[str] = None  # the module it names, for per-layer patterns
    steps: list[int] = field(default_factory=list)  # further steps to mark (spikes)
    source: str = ""  # where the threshold comes from

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "summary": self.summary,
            "step": self.step,
            "layer": self.layer,
            "evidence": _jsonable(self.evidence),
            "next": self.next,
            "source": self.source,
        }


@dataclass
class Diagnosis:
    run_id: str
    run_name: str
    status: str
    findings: list[Finding]
    summary: dict[str, Any]
    checked: list[str]  # the patterns that had the metrics they need
    skipped: dict[str, str]  # pattern -> why it could not be checked
    artifacts: list[str] = field(default_factory=list)

    @property
    def judged(self) -> bool:
        """Enough curve to judge: the loss-shape detectors ran (a run stopped at step 0 is judged by its NaN)."""
        return bool(self.findings) or "flat-from-start" in self.checked

    @property
    def healthy(self) -> bool:
        return not self.findings and self.judged

    @property
    def verdict(self) -> str:
        if self.findings:
            return ", ".join(dict.fromkeys(f.pattern for f in self.findings))
        if not self.judged:
            return f"not enough data to judge ({self.skipped.get('flat-from-start', 'too few metrics')})"
        return "no pathology found"

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_name": self.run_name,
            "status": self.status,
            "healthy": self.healthy,
            "verdict": self.verdict,
            "findings": [f.to_json() for f in self.findings],
            "summary": _jsonable(self.summary),
            "checked": self.checked,
            "skipped": self.skipped,
            "artifacts": self.artifacts,
        }


class Skip(Exception):
    """A detector lacks the metrics it needs (the reason is reported, never a guess)."""


Detector = Callable[[Curves], list[Finding]]
DETECTORS: list[tuple[str, Detector]] = []


def detector(pattern: str):
    """Register a detector: adding a pattern is adding one function."""

    def register(function: Detector) -> Detector:
        DETECTORS.append((pattern, function))
        return function

    return register


# ---- robust statistics ------------------------------------------------------------------------------------
def _round(value: float, digits: int = 4) -> float:
    if value is None or not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")


def _edge_count(n: int) -> int:
    """How many samples make a robust 'start' or 'end' level: a tenth of the run, at least 5."""
    return max(5, n // 10)


def rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling median (edges padded with the edge value): smooths SGD noise, keeps the steps.
    scipy's C median filter: a 10,000-step curve with a 500-step window takes about a millisecond."""
    from scipy.ndimage import median_filter

    values = np.asarray(values, dtype=float)
    window = max(1, min(int(window), len(values)))
    if window <= 1:
        return values.copy()
    return median_filter(values, size=window, mode="nearest")


def block_medians(values: np.ndarray, blocks: int) -> np.ndarray:
    return np.array([np.median(chunk) for chunk in np.array_split(values, blocks) if len(chunk)])


def noise_sigma(values: np.ndarray) -> float:
    """Robust per-sample noise: 1.4826 x MAD of the residual around a rolling median."""
    if len(values) < 5:
        return 0.0
    residual = values - rolling_median(values, max(5, len(values) // 20) | 1)
    return float(1.4826 * np.median(np.abs(residual - np.median(residual))))


def _loss_levels(loss: Series) -> tuple[float, float]:
    """(start, end): medians of the first and last tenth of the curve."""
    edge = _edge_count(len(loss))
    return float(np.median(loss.values[:edge])), float(np.median(loss.values[-edge:]))


def _initial_loss(loss: Series) -> float:
    """The untrained level: median of the first 5 values (a fast learner is far lower after a tenth of the run)."""
    return float(np.median(loss.values[:5]))


def _cmd(verb: str, curves: Curves, extra: str = "") -> str:
    return f"replay {verb} --run-id {curves.run_id}" + (f" {extra}" if extra else "")


# ---- the detectors (symptoms -> causes; each cites its public source) ------------------------------------------------
@detector("exception")
def detect_exception(curves: Curves) -> list[Finding]:
    """A step that raised (the recorder's tags failure=exception, failing_step, error_type, error, error_frame): the
    run stopped there, the state before it and its batch kept; `replay nan` reproduces it."""
    tags = curves.tags
    if tags.get("failure") != "exception":
        return []
    step = step_tag(tags, "failing_step", curves.run_id)
    raised = f"{tags.get('error_type') or 'an exception'}" + (f": {tags['error']}" if tags.get("error") else "")
    frame = tags.get("error_frame")
    where = f" at {os.path.basename(frame.split(' in ', 1)[0])}" if frame else ""
    evidence = {"failing_step": step, "error_type": tags.get("error_type"), "error": tags.get("error"), "frame": frame,
                "finite_steps_before": int(np.sum(curves.get("loss").steps < step)) if step is not None else None}
    return [Finding("exception", f"step {step} raised {raised}{where}: the run crashed there (the state before the step "
                    "and its batch are kept)", evidence, _cmd("nan", curves), step=step,
                    source="the recorder keeps a step that raised as it keeps a non-finite one; replay nan reproduces it")]


LEAK_MIN_POINTS = 5  # memory samples (one per metrics flush) a trend needs
LEAK_MIN_BYTES = 64 << 20  # the memory held grew by at least 64 MB (a process's libraries alone hold ~0.5 GB) ...
LEAK_MIN_R2 = 0.9  # ... along a straight line over the steps (a one-off jump, a cache filling once, is not a leak)


@detector("memory-leak")
def detect_memory_leak(curves: Curves) -> list[Finding]:
    """The memory the run holds (the allocator's on a GPU, the process's resident set on CPU, sampled at each metrics
    flush) grows along a straight line with the steps: something keeps each step's tensors alive (the classic
    `losses.append(loss)`, which holds every step's graph), and the run ends out of memory at that rate."""
    series = next((curves.get(key) for key in ("memory/allocated", "memory/rss") if len(curves.get(key))), None)
    if series is None:  # (a run recorded before memory was, or by another tool)
        return []
    memory = _less_the_recorders(series.finite(), curves.get("memory/recorder"))
    if len(memory) < LEAK_MIN_POINTS:  # a run of a few flushes: too short to grow by a leak's 64 MB on a line
        return []
    steps, values = memory.steps[1:].astype(float), memory.values[1:]  # the first flush holds the warm-up's allocations
    if len(values) < LEAK_MIN_POINTS - 1 or values[0] <= 0:
        return []
    slope, intercept = np.polyfit(steps, values, 1)
    fitted = slope * steps + intercept
    r2 = 1 - float(np.sum((values - fitted) ** 2)) / max(float(np.sum((values - values.mean()) ** 2)), 1e-12)
    growth = float(values[-1] - values[0])
    if slope <= 0 or growth < LEAK_MIN_BYTES or r2 < LEAK_MIN_R2:
        return []
    per_step = float(slope)
    key = "allocated" if len(curves.get("memory/allocated")) else "resident"
    return [Finding("memory-leak", f"memory grows {_bytes(per_step)} per step along a straight line (R² {r2:.2f}): "
                    f"{_bytes(float(values[0]))} at step {int(steps[0])} -> {_bytes(float(values[-1]))} at step "
                    f"{int(steps[-1])}; something the loop fills across steps keeps each step's tensors alive (a list "
                    "of outputs or features, a logging dict of tensors)",
                    {"bytes_per_step": round(per_step), "from_step": int(steps[0]), "r2": _round(r2), "memory": key,
                     "first_bytes": float(values[0]), "last_bytes": float(values[-1]), "samples": int(len(values))},
                    "keep numbers (.item()) or CPU copies of what the loop collects across steps, then record again",
                    step=int(steps[0]), source="the memory the recorder samples at each metrics flush, less the batches "
                    "it keeps itself; PyTorch's FAQ: don't accumulate history across your training loop")]


def _less_the_recorders(memory: Series, recorder: Series) -> Series:
    """The memory the run held less what the recorder kept then (the batches of its open snapshot interval, written
    and freed when the interval closes): the loop's own."""
    if not len(recorder):
        return memory
    held = dict(zip(recorder.steps.tolist(), recorder.values.tolist()))
    return Series(memory.steps, np.array([value - held.get(step, 0.0) for step, value in zip(memory.steps.tolist(),
                                                                                         memory.values.tolist())]))


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


@detector("not-optimized")
def detect_not_optimized(curves: Curves) -> list[Finding]:
    """Parameters that get gradients but are in no optimizer (the Recorder's tag not_optimized, from the first
    step): they never change; typically a layer added or replaced after the optimizer was built."""
    names = [name for name in (curves.tags.get("not_optimized") or "").split(",") if name]
    if not names:
        return []
    listed = ", ".join(names)
    return [Finding("not-optimized", f"{listed} get{'s' if len(names) == 1 else ''} gradients but {'is' if len(names) == 1 else 'are'} "
                    "in no optimizer: never updated (a layer added after the optimizer was built?)", {"parameters": names},
                    "build the optimizer after the model is complete (or optimizer.add_param_group for them), then record again",
                    step=0, layer=names[0].rsplit(".", 1)[0],
                    source="the recorder compared the first step's gradients with the optimizer's parameters (TrainCheck's silent-error set)")]


@detector("model-in-eval")
def detect_model_in_eval(curves: Curves) -> list[Finding]:
    """The whole model trained in eval mode from some step on (the Recorder's tag eval_mode_step): a model.eval()
    for an evaluation pass never undone, so dropout is off and batch norm normalises with its running statistics."""
    step = step_tag(curves.tags, "eval_mode_step", curves.run_id)
    if step is None:
        return []
    return [Finding("model-in-eval", f"the model trained in eval mode from step {step}: dropout is off and batch norm "
                    "normalises with its running statistics (a model.eval() for evaluation never undone)",
                    {"from_step": step}, "call model.train() at the top of each training step (after any evaluation), "
                    "then record again", step=step,
                    source="the recorder saw the model in eval mode as a training step began (TrainCheck's silent-error set)")]


NOT_ZEROED_MIN_STEPS = 5  # steps carrying gradients in a row, from step 1, before a loop is said never to clear them


@detector("gradients-not-zeroed")
def detect_gradients_not_zeroed(curves: Curves) -> list[Finding]:
    """Every step from step 1 on began with the gradients of the steps before it (the recorder's grads_carried): the
    loop never clears them (no optimizer.zero_grad()), so each update applies the sum of every gradient so far. A
    loop that accumulates over steps on purpose clears them every few steps, and is not this."""
    carried = curves.get("grads_carried")
    loss = curves.get("loss")
    if len(carried) < NOT_ZEROED_MIN_STEPS or not len(loss):
        return []
    steps = set(int(step) for step in carried.steps)
    last = int(loss.steps[-1]) if curves.failing_step is None else curves.failing_step
    if steps != set(range(1, last + 1)) and steps != set(range(1, last)):  # (the failing step may have stopped first)
        return []
    loop = curves.tags.get("loop_line")  # the loop's first training call (or its step function): where the fix goes
    evidence: dict[str, Any] = {"carried_steps": len(steps), "from_step": 1, **({"loop": loop} if loop else {})}
    said = []
    norms = curves.get("grad_norm").finite()
    if len(norms) >= 2 * NOT_ZEROED_MIN_STEPS:
        edge = _edge_count(len(norms))
        early, late = float(np.median(norms.values[:edge])), float(np.median(norms.values[-edge:]))
        evidence.update(grad_norm_early=_round(early), grad_norm_late=_round(late))
        if early > 0:
            said.append(f"grad norm x{late / early:.3g} (median {early:.3g} -> {late:.3g})")
    healthy = curves.healthy_loss
    if len(healthy) >= 2 * NOT_ZEROED_MIN_STEPS:
        start, end = _loss_levels(healthy)
        evidence.update(loss_start=_round(start), loss_end=_round(end))
        said.append(f"loss {start:.3g} -> {end:.3g}")
    return [Finding("gradients-not-zeroed",
                    "the loop never clears its gradients: from step 1 every step's backward added to all earlier steps' "
                    "(no optimizer.zero_grad()), so each update applies the sum of every gradient so far"
                    + (f"; {', '.join(said)}" if said else "")
                    + (f"; add optimizer.zero_grad() before the backward in the loop at {loop}" if loop else ""),
                    evidence, _cmd("ablate zero-grad", curves) + ("" if curves.failing_step is not None else " --from-step 1"),
                    step=1, source="the recorder saw each step's backward add to gradients its loop had not cleared "
                    "(the Stack Overflow / PyTorch forum 'forgot optimizer.zero_grad()' bug, TrainCheck's silent-error set)")]


@detector("nan")
def detect_nan(curves: Curves) -> list[Finding]:
    """NaN at step 1 (data, weights, init) or NaN after K steps (LR, explosion, overflow, log(0), 0/0)."""
    failing = curves.failing_step
    if failing is None:
        return []
    what = curves.tags.get("nonfinite_what") or _nonfinite_what(curves, failing)
    loss = curves.get("loss").finite()
    first_step = int(min([failing] + ([int(loss.steps[0])] if len(loss) else [])))
    evidence: dict[str, Any] = {"failing_step": failing, "nonfinite": what, "finite_steps_before": int(np.sum(curves.get("loss").steps < failing))}
    first_ranks = _ranks_nonfinite_at(curves, failing)
    if first_ranks:  # a distributed run: the ranks whose own loss went non-finite (the others' gradients followed)
        evidence["ranks_nonfinite_loss"] = first_ranks
        what = f"loss on rank {', '.join(map(str, first_ranks))}"
    precision = curves.params.get("train.precision")
    if precision:
        evidence["precision"] = precision
    if failing <= first_step:
        return [
            Finding(
                "nan-at-start",
                f"non-finite {what} at the first step (step {failing}): NaN/Inf in the data or the weights, or a bad initialisation",
                evidence,
                _cmd("nan", curves),
                step=failing,
                source="Karpathy, \"A Recipe for Training Neural Networks\" (2019): verify the data and the loss at init; Megatron-Core rerun state machine: NaN/Inf checks",
            )
        ]
    grads = curves.get("grad_norm").before(failing).finite()
    lr = curves.get("lr").before(failing)
    if len(lr):
        evidence["lr_before"] = _round(float(lr.values[-1]))
    before = loss.before(failing)
    if len(before):
        evidence["loss_before"] = _round(float(before.values[-1]))
        evidence["loss_min"] = _round(float(before.values.min()))
    growth = _growth(grads)
    evidence.update(growth)
    climb = divergence_growth(list(zip(before.steps.tolist(), before.values.tolist())),
                              list(zip(grads.steps.tolist(), grads.values.tolist())))
    arms = "lr,clip,precision"
    if climb is not None:  # the words `replay nan` uses for the same failure
        cause = f"a divergence ({climb.sentence()}): learning rate, clipping or init"
        evidence["divergence"] = {"metric": climb.metric, "onset_step": climb.onset_step, "factor": _round(climb.factor)}
        arms = "lr,clip"
    elif growth.get("grad_norm_growth", 1.0) >= EXPLODING_RATIO:
        cause = "exploding gradients"
    elif "grad_norm_growth" in growth and growth["grad_norm_growth"] < 2 and "grad_norm_growth_per_step" not in growth:
        cause = "a sudden failure with no growth before it: a bad batch, or one op overflowing"
    else:
        cause = "LR too high, overflow, log(0) or 0/0"
    return [
        Finding(
            "nan-after-k",
            f"non-finite {what} at step {failing} after {failing} finite steps; likely {cause}"
            + (f" (grad norm x{growth['grad_norm_growth']:.3g} over the run" if "grad_norm_growth" in growth else "")
            + (f", growing exponentially x{growth['grad_norm_growth_per_step']:.3g} a step)" if "grad_norm_growth_per_step" in growth else ")" if "grad_norm_growth" in growth else ""),
            evidence,
            _cmd("nan", curves) + f"   # then: {_cmd('ablate ' + arms, curves)}",
            step=failing,
            source="Pascanu et al. 2013 (exploding gradients); Micikevicius et al. 2018, Mixed Precision Training (fp16 overflow); Megatron-Core rerun state machine",
        )
    ]


def _ranks_nonfinite_at(curves: Curves, step: int) -> list[int]:
    """A distributed run's ranks whose own loss is non-finite at `step` (rank 0's is `loss`); [] for one process."""
    keys = [key for key in curves.metrics if RANK_METRIC.match(key) and key.startswith("loss/")]
    if not keys:
        return []
    by_rank = {0: curves.get("loss"), **{int(key.rsplit("rank", 1)[1]): curves.get(key) for key in keys}}
    return sorted(rank for rank, series in by_rank.items()
                  if step in series.steps and not np.isfinite(series.values[series.steps == step]).all())


def _nonfinite_what(curves: Curves, step: int) -> str:
    """Which logged value went non-finite at `step` (a run recorded with on_nonfinite=continue)."""
    for key in ("loss", "grad_norm"):
        series = curves.get(key)
        at_step = series.values[series.steps == step]
        if len(at_step) and not np.isfinite(at_step).all():
            return key
    return "loss"


def _growth(grads: Series) -> dict[str, Any]:
    """How the total grad norm moved before a failure: early level, last level, and the growth rate."""
    if len(grads) < 5:
        return {}
    edge = min(_edge_count(len(grads)), 20)
    early = float(np.median(grads.values[:edge]))
    last = float(np.median(grads.values[-3:]))
    out: dict[str, Any] = {"grad_norm_early": _round(early), "grad_norm_last": _round(last)}
    if early > 0:
        out["grad_norm_growth"] = _round(last / early)
    tail = grads.values[-min(len(grads), 30):]
    if len(tail) >= 5 and np.all(tail > 0):
        slope, _ = np.polyfit(np.arange(len(tail)), np.log(tail), 1)
        if slope > 0 and tail[-1] > 2 * tail[0]:
            out["grad_norm_growth_per_step"] = _round(float(math.exp(slope)))
    return out


@detector("flat-from-start")
def detect_flat(curves: Curves) -> list[Finding]:
    """The loss never moves: zero gradient (no backward, detached graph, frozen or unconnected params)."""
    loss = curves.healthy_loss
    if len(loss) < 20:
        raise Skip(f"{len(loss)} finite loss values (needs 20)")
    values = loss.values
    start, end = _loss_levels(loss)
    initial = _initial_loss(loss)
    blocks = block_medians(values, 10)
    block_size = len(values) / 10
    sigma = noise_sigma(values)
    # How far a median can wander by noise alone: 4 standard errors (~1.25 sigma / sqrt(samples)), or 2%.
    tolerance = max(0.02 * abs(start), 4 * 1.25 * sigma / math.sqrt(block_size))
    initial_tolerance = max(0.02 * abs(initial), 4 * 1.25 * sigma / math.sqrt(5))
    lowest = float(blocks.min())
    if start - lowest > tolerance or initial - lowest > initial_tolerance:
        return []  # it decreased at some point (perhaps within the first tenth): not flat from the start
    # Under heavy noise the medians are loose: a clear downward trend (Mann-Kendall p < 0.01) is progress.
    from scipy.stats import kendalltau

    thinned = values[:: len(values) // 2000 + 1]
    tau, p_value = kendalltau(np.arange(len(thinned)), thinned)
    if tau < 0 and p_value < 0.01 and start - end > 0.02 * abs(start):
        return []
    grads = curves.get("grad_norm").before(curves.failing_step).finite()
    evidence: dict[str, Any] = {
        "steps": [int(loss.steps[0]), int(loss.steps[-1])],
        "loss_start": _round(start),
        "loss_end": _round(end),
        "largest_decrease": _round(start - lowest),
        "tolerance": _round(tolerance),
    }
    zero_grad = False
    if len(grads):
        median_grad = float(np.median(grads.values))
        evidence["grad_norm_median"] = _round(median_grad)
        zero_grad = median_grad <= 1e-12
    updates = curves.get("update_ratio").finite()
    if len(updates):
        evidence["update_ratio_median"] = _round(float(np.median(updates.values)))
    if zero_grad:
        summary = f"flat from step {int(loss.steps[0])}: the loss stays at {start:.4g}; no parameter gets a gradient (grad norm 0): no backward, a detached graph, or frozen / unconnected parameters"
    else:
        summary = f"flat from step {int(loss.steps[0])}: the loss stays at {start:.4g} (never {tolerance:.2g} lower) although gradients are non-zero: the updates do not reach the loss"
    return [
        Finding(
            "flat-from-start",
            summary,
            evidence,
            _cmd("check", curves) + "   # gradient flow: parameters with no or zero gradient",
            step=int(loss.steps[0]),
            source="AUTOTRAINER (Zhang et al., ICSE 2021): not converging; Karpathy's recipe: use backprop to chart dependencies",
        )
    ]


@detector("no-gradient")
def detect_no_gradient(curves: Curves) -> list[Finding]:
    """Modules whose parameters never get a gradient: the recorder logs weight_norm/<module> for every module with
    parameters and grad_norm/<module> only for those with a gradient, so a module with weights and no (or only
    zero) gradient norm at every recorded step sits on a detached branch or is frozen."""
    weights = {k[len("weight_norm/"):] for k in curves.metric_keys if k.startswith("weight_norm/")}
    grads = {m: s.before(curves.failing_step).finite() for m, s in curves.layers("grad_norm/").items()}
    if not weights or not grads:
        raise Skip("no weight_norm/<module> or grad_norm/<module> metrics (snapshot.layer_stats_every=0?)")
    recorded = max(len(s) for s in grads.values())
    if recorded < 3:
        raise Skip(f"{recorded} recorded layer statistics (needs 3)")
    learning = {m for m, s in grads.items() if len(s) and float(np.max(np.abs(s.values))) > 0}
    silent = sorted(weights - learning)
    if not silent or not learning:
        return []  # nothing learns at all: flat-from-start says so
    total_weights = len(weights)
    return [
        Finding(
            "no-gradient",
            f"{len(silent)} of {total_weights} modules never get a gradient ({', '.join(silent[:4])}{', ...' if len(silent) > 4 else ''}): "
            "a detached branch (.detach(), .data, torch.no_grad in forward) or frozen parameters (requires_grad=False); "
            "if the freeze is intended, ignore this",
            {"modules": silent, "modules_with_gradient": sorted(learning), "stats_steps": recorded},
            _cmd("check", curves) + "   # gradient flow: parameters with no gradient",
            step=int(min(s.steps[0] for s in grads.values() if len(s))),
            layer=silent[0],
            source="Karpathy, \"A Recipe for Training Neural Networks\" (2019): use backprop to chart dependencies; "
            "AUTOTRAINER / DeepDiagnosis: parameters without gradient do not learn",
        )
    ]


@detector("slow-learning")
def detect_slow_learning(curves: Curves) -> list[Finding]:
    """The loss falls, but very slowly, and the gradients are small and shrinking: the signature of softmax fed
    into cross-entropy (probabilities in [0, 1] as logits cap the loss at log(e + C - 1) - 1 for C classes)."""
    loss = curves.healthy_loss
    if len(loss) < 50:
        raise Skip(f"{len(loss)} finite loss values (needs 50)")
    grads = curves.get("grad_norm").before(curves.failing_step).finite()
    if len(grads) < 20:
        raise Skip(f"{len(grads)} finite grad_norm values (needs 20)")
    initial = _initial_loss(loss)
    _, end = _loss_levels(loss)
    if initial <= 0:
        return []
    fall = (initial - end) / initial
    from scipy.stats import kendalltau

    thinned = loss.values[:: len(loss) // 2000 + 1]
    tau, p_value = kendalltau(np.arange(len(thinned)), thinned)
    edge = _edge_count(len(grads))
    grad_median = float(np.median(grads.values))
    grad_early, grad_late = float(np.median(grads.values[:edge])), float(np.median(grads.values[-edge:]))
    if not (0 < fall < SLOW_FALL_MAX and tau < 0 and p_value < 0.01 and grad_median < SLOW_GRAD_NORM_MAX and grad_late <= grad_early):
        return []
    classes = math.exp(initial)
    floor = math.log(math.e + classes - 1) - 1  # the lowest cross-entropy of probabilities over C = e^initial classes
    return [
        Finding(
            "slow-learning",
            f"the loss falls very slowly ({initial:.4g} -> {end:.4g}, {100 * fall:.1f}% in {int(loss.steps[-1] - loss.steps[0]) + 1} steps) "
            f"with small, shrinking gradients (median grad norm {grad_median:.3g}, {grad_early:.3g} -> {grad_late:.3g}): "
            f"likely softmax fed into cross-entropy (probabilities as logits: the loss cannot go below {floor:.3g} for "
            f"~{classes:.0f} classes); feed the loss raw logits",
            {
                "loss_start": _round(initial), "loss_end": _round(end), "fall": _round(fall),
                "grad_norm_median": _round(grad_median), "grad_norm_early": _round(grad_early), "grad_norm_late": _round(grad_late),
                "trend_tau": _round(float(tau)), "probability_ce_floor": _round(floor),
            },
            _cmd("check", curves) + "   # loss/head mismatch: do the loss input rows sum to 1?",
            step=int(loss.steps[0]),
            source="Karpathy, \"A Recipe for Training Neural Networks\" (2019); PyTorch CrossEntropyLoss docs "
            "(the input is expected to contain unnormalized logits)",
        )
    ]


@detector("divergence")
def detect_divergence(curves: Curves) -> list[Finding]:
    """The loss climbs far above its untrained level (LR too high), or climbs exponentially into the NaN."""
    loss = curves.healthy_loss
    if len(loss) < 10:
        raise Skip(f"{len(loss)} finite loss values (needs 10)")
    climb = _climb_to_failure(curves)
    if climb is not None:
        return [climb]
    if len(loss) < 20:
        return []
    # the untrained level: the first logged loss (an LR typo can make step 1 jump already), or the first 5's median
    initial = min(_initial_loss(loss), float(loss.values[0]))
    _, end = _loss_levels(loss)
    sigma = noise_sigma(loss.values)
    noise = 4 * 1.25 * sigma / math.sqrt(_edge_count(len(loss)))  # 4 standard errors of the end level's median
    if not (initial > 0 and end > DIVERGENCE_RISE * initial and end - initial > noise):
        return []
    smooth = rolling_median(loss.values, max(5, len(loss) // 20) | 1)
    lowest = int(np.argmin(smooth))
    start_step = int(loss.steps[lowest])
    return [
        Finding(
            "divergence",
            f"the loss diverged: from {initial:.4g} at the start it rose to {end:.4g} at the end (x{end / initial:.3g}), rising from "
            f"step {start_step}: learning rate too high (a typo in lr?)",
            {"loss_start": _round(initial), "loss_end": _round(end), "rise": _round(end / initial), "rising_from_step": start_step,
             "lr": _round(float(curves.get("lr").values[0])) if len(curves.get("lr")) else None},
            _cmd("ablate lr,warmup", curves) + "   # or an LR range test: " + _cmd("check", curves),
            step=start_step,
            source="Smith 2017, \"Cyclical Learning Rates\" (LR range test: the loss diverges above the largest usable LR)",
        )
    ]


def _climb_to_failure(curves: Curves) -> Optional[Finding]:
    """An exponential climb of the loss or the grad norm that ends in the failing step: one divergence."""
    failing = curves.failing_step
    if failing is None:
        return None
    climbs = [finding for key in ("grad_norm", "loss") if (finding := _climb_of(curves, key, failing)) is not None]
    # the metric whose climb started first tells the whole divergence (a noisy grad norm can hide its early climb)
    return min(climbs, key=lambda finding: finding.evidence["from_step"], default=None)


def _climb_of(curves: Curves, key: str, failing: int) -> Optional[Finding]:
    """The exponential climb of one metric into the failing step, or None."""
    series = curves.get(key).before(failing).finite()
    if len(series) < 10 or np.any(series.values <= 0):
        return None
    start = _climb_start(series.values, len(series) - _rising_streak(series.values))
    streak = len(series) - start
    if streak < 5:
        return None
    first, last = float(series.values[start]), float(series.values[-1])
    if last < SPIKE_FACTOR * first:
        return None
    per_step = math.exp(math.log(last / first) / max(1, streak - 1))
    return Finding(
        "divergence",
        f"{key} climbed exponentially from step {int(series.steps[start])} ({first:.3g}) to {last:.3g} at step "
        f"{int(series.steps[-1])} (x{per_step:.3g} a step), then went non-finite at step {failing}: a divergence (learning rate, "
        "clipping or init), not a run of spikes",
        {"metric": key, "from_step": int(series.steps[start]), "to_step": int(series.steps[-1]), "from_value": _round(first),
         "to_value": _round(last), "growth_per_step": _round(per_step), "failing_step": failing},
        _cmd("ablate lr,clip", curves),
        step=int(series.steps[start]),
        source="Megatron-Core rerun machine: >= 10x the early level; Smith 2017 (the loss diverges above the usable LR)",
    )


def _climb_start(values: np.ndarray, start: int) -> int:
    """The streak's start moved past a flat head (a plateau within a tenth is part of the streak, not the climb):
    the climb begins with its first rise of more than a tenth."""
    while start < len(values) - 1 and values[start + 1] <= 1.1 * values[start]:
        start += 1
    return start


def _rising_streak(values: np.ndarray) -> int:
    """How many of the last values rise (allowing a dip of a tenth), counted back from the end."""
    count = 1
    peak = values[-1]
    for value in values[-2::-1]:
        if value > peak * 1.1 or value <= 0:
            break
        peak = min(peak, value)
        count += 1
    return count


@detector("spikes")
def detect_spikes(curves: Curves) -> list[Finding]:
    """Loss or gradient-norm values >= 10x the max |value| of the first 100 samples (Megatron-Core); spikes inside
    those samples count only when one recurs after them (a bad batch each epoch), not as the early transient."""
    failing = curves.failing_step
    found: dict[str, dict[str, Any]] = {}
    for key in ("loss", "grad_norm"):
        series = curves.get(key).before(failing).finite()
        if len(series) < 20:
            continue
        baseline_count = min(SPIKE_BASELINE_SAMPLES, len(series) // 2)
        magnitude = np.abs(series.values)
        early = magnitude[:baseline_count]
        # Megatron takes the max of the first 100 samples; a bad batch that recurs every epoch is already
        # among them, so early values that are themselves isolated spikes (>= 10x the rolling median of
        # their 9 neighbours) are left out of the max. A fast early decrease is not isolated: it stays.
        local = rolling_median(magnitude, 9)[:baseline_count]
        typical = early[early < SPIKE_FACTOR * local]
        baseline = float(typical.max()) if len(typical) else float(np.median(early))
        if baseline <= 0:
            continue
        hits = np.nonzero(magnitude >= SPIKE_FACTOR * baseline)[0]
        if len(hits) and hits[-1] < baseline_count:
            # every hit is inside the early window and none recurs after it: the first steps of training
            # (word_language_model's pre-clip gradient norms at steps 5 and 9), which Megatron's max takes in
            hits = hits[:0]
        if len(hits):
            found[key] = {
                "baseline_max": _round(baseline),
                "baseline_samples": baseline_count,
                "spike_steps": [int(series.steps[i]) for i in hits[:20]],
                "spike_values": [_round(float(series.values[i])) for i in hits[:20]],
                "count": int(len(hits)),
                "largest_factor": _round(float(np.abs(series.values[hits]).max() / baseline)),
            }
    if not found:
        return []
    steps = sorted({s for info in found.values() for s in info["spike_steps"]})
    what = " and ".join(f"{key} ({info['count']}x, up to {info['largest_factor']:.3g}x the early max {info['baseline_max']:.3g})" for key, info in found.items())
    return [
        Finding(
            "spikes",
            f"spikes in {what} at step{'s' if len(steps) > 1 else ''} {_list_steps(steps)}: bad batches or an LR near instability",
            found,
            _cmd("ablate clip,skip-batch", curves, f"--from-step {steps[0]}"),
            step=steps[0],
            steps=steps,
            source=f"Megatron-Core rerun machine: >= {SPIKE_FACTOR:g}x the max |value| of the first {SPIKE_BASELINE_SAMPLES} samples"
            " (isolated early spikes left out of that max)",
        )
    ]


def _list_steps(steps: list[int], limit: int = 6) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" (+{len(steps) - limit} more)" if len(steps) > limit else "")


@detector("exploding-gradients")
def detect_exploding(curves: Curves) -> list[Finding]:
    """A layer's grad norm grows > 70x its early level (AUTOTRAINER) to >= 1 (a tiny start growing to a small value
    is not an explosion), or turns non-finite."""
    layers = curves.layers("grad_norm/")
    if not layers:
        raise Skip("no grad_norm/<module> metrics (snapshot.layer_stats_every=0?)")
    nonfinite = {}
    growth = {}
    total = curves.get("grad_norm").finite()
    for module, series in layers.items():
        bad = ~np.isfinite(series.values)
        if bad.any():
            nonfinite[module] = int(series.steps[bad][0])
        finite = series.finite()
        if len(finite) < 4:
            continue
        early = float(np.median(finite.values[:3]))
        late = float(np.median(finite.values[-2:]))  # two samples: one noisy sample is not a trend
        total_early = total.values[np.isin(total.steps, finite.steps[:3])]
        if len(total_early) and early < 1e-3 * float(np.median(total_early)):
            continue  # the layer started with (almost) no gradient, e.g. behind a zero-initialised one: growing from ~0 is not exploding
        if early > 0 and late / early > EXPLODING_RATIO and late >= EXPLODING_MIN_NORM:
            growth[module] = (late / early, early, late, int(finite.steps[-1]))
    if not nonfinite and not growth:
        return []
    findings = []
    if nonfinite:
        first = min(nonfinite.values())
        modules = sorted((m for m, s in nonfinite.items() if s == first))
        findings.append(
            Finding(
                "exploding-gradients",
                f"non-finite gradient in {', '.join(modules)} at step {first}",
                {"first_nonfinite_step": first, "modules": {m: nonfinite[m] for m in sorted(nonfinite)}},
                _cmd("nan", curves),
                step=first,
                layer=modules[0],
                source="AUTOTRAINER: exploding = any NaN/Inf gradient",
            )
        )
    if growth:
        ranked = sorted(growth.items(), key=lambda item: -item[1][0])
        module, (ratio, early, late, at) = ranked[0]
        findings.append(
            Finding(
                "exploding-gradients",
                f"exploding gradients in {module}: grad norm x{ratio:.3g} ({early:.3g} -> {late:.3g} by step {at})"
                + (f"; also {', '.join(m for m, _ in ranked[1:4])}" if len(ranked) > 1 else ""),
                {"layers": {m: {"growth": _round(r), "early": _round(e), "late": _round(l), "step": s} for m, (r, e, l, s) in ranked}},
                _cmd("nan", curves) if curves.failing_step is not None else _cmd("ablate clip,lr", curves),
                step=at,
                layer=module,
                source=f"AUTOTRAINER: exploding gradient ratio > {EXPLODING_RATIO:g}; and at least {EXPLODING_MIN_NORM:g}, the usual clip_grad_norm (nanoGPT, Megatron-LM)",
            )
        )
    return findings


@detector("vanishing-gradients")
def detect_vanishing(curves: Curves) -> list[Finding]:
    """A layer whose gradient is < 1e-3 of the largest layer's and < 1e-4 (AUTOTRAINER), or < 1e-7 (SageMaker)."""
    layers = {m: s.before(curves.failing_step).finite() for m, s in curves.layers("grad_norm/").items()}
    layers = {m: s for m, s in layers.items() if len(s)}
    if len(layers) < 2:
        raise Skip("fewer than two grad_norm/<module> metrics")
    steps = sorted(set.intersection(*(set(s.steps.tolist()) for s in layers.values())))
    if not steps:
        return []
    table = np.array([[dict(zip(s.steps.tolist(), s.values.tolist()))[step] for step in steps] for s in layers.values()])
    names = list(layers)
    largest = table.max(axis=0)
    if np.median(largest) <= 1e-12:
        return []  # nothing gets a gradient at all: that is flat-from-start, not vanishing
    ratio = table / np.maximum(largest, 1e-30)
    median_norm = np.median(table, axis=1)
    median_ratio = np.median(ratio, axis=1)
    flagged = [
        i for i in range(len(names))
        if (median_ratio[i] < VANISHING_RATIO and median_norm[i] < VANISHING_NORM) or median_norm[i] < VANISHING_ABSOLUTE
    ]
    if not flagged:
        return []
    flagged.sort(key=lambda i: median_norm[i])
    top = int(np.argmax(np.median(table, axis=1)))
    evidence = {
        "largest_layer": names[top],
        "largest_median_norm": _round(float(median_norm[top])),
        "stats_steps": len(steps),
        "layers": {names[i]: {"median_norm": _round(float(median_norm[i])), "ratio_to_largest": _round(float(median_ratio[i]))} for i in flagged},
    }
    saturated = {m[len("act_sat_frac/"):]: _round(float(np.median(s.values))) for m, s in curves.metrics.items() if m.startswith("act_sat_frac/") and len(s)}
    if saturated:
        evidence["saturated_fraction"] = saturated
    first = names[flagged[0]]
    return [
        Finding(
            "vanishing-gradients",
            f"vanishing gradients in {first}: grad norm {median_norm[flagged[0]]:.2g}, {median_ratio[flagged[0]]:.2g} of {names[top]}'s"
            + (f"; {len(flagged) - 1} more layer{'s' if len(flagged) > 2 else ''}" if len(flagged) > 1 else ""),
            evidence,
            _cmd("check", curves) + "   # gradient flow and saturation per layer",
            step=steps[0],
            layer=first,
            source="AUTOTRAINER: ratio < 1e-3 with norm < 1e-4; SageMaker Debugger: < 1e-7",
        )
    ]


@detector("dead-relu")
def detect_dead_relu(curves: Curves) -> list[Finding]:
    """A ReLU layer whose output is zero >= 99% of the time (SageMaker: active < 1% of the time = dead)."""
    layers = {m: s.before(curves.failing_step).finite() for m, s in curves.layers("act_zero_frac/").items()}
    layers = {m: s for m, s in layers.items() if len(s)}
    if not layers:
        raise Skip("no act_zero_frac/<module> metrics (no ReLU, or no layer statistics)")
    findings = []
    for module, series in sorted(layers.items()):
        half = series.values[len(series) // 2:]  # the state the run ended in, robust to one odd batch
        if np.median(half) < DEAD_ZERO_FRACTION:
            continue
        dead = series.values >= DEAD_ZERO_FRACTION
        # the step from which it stays dead (to the end)
        alive_after = np.nonzero(~dead)[0]
        since_index = int(alive_after[-1]) + 1 if len(alive_after) else 0
        since_index = min(since_index, len(series) - 1)
        since = int(series.steps[since_index])
        findings.append(
            Finding(
                "dead-relu",
                f"dead ReLU {module}: {100 * float(np.median(half)):.1f}% of its outputs are zero"
                + (" from the first step" if since_index == 0 else f" since step {since}"),
                {"zero_fraction_median": _round(float(np.median(half))), "dead_since_step": since, "samples": int(len(series))},
                _cmd("check", curves) + "   # activations and initialisation per layer",
                step=since,
                layer=module,
                source="SageMaker Debugger: a unit active < 1% of the time is dead",
            )
        )
    return findings


@detector("update-ratio")
def detect_update_ratio(curves: Curves) -> list[Finding]:
    """‖Δθ‖/‖θ‖ outside [1e-8, 10] (SageMaker Debugger); about 1e-3 is healthy."""
    series = curves.get("update_ratio").before(curves.failing_step).finite()
    if len(series) < 3:
        raise Skip("fewer than 3 update_ratio values (snapshot.layer_stats_every)")
    median = float(np.median(series.values))
    low, high = UPDATE_RATIO_RANGE
    grads = curves.get("grad_norm").finite()
    if median < low and len(grads) and float(np.median(grads.values)) <= 1e-12:
        return []  # no gradient at all: flat-from-start names the cause, a zero update is its consequence
    if low <= median <= high:
        return []
    lr = curves.get("lr").finite()
    evidence = {
        "update_ratio_median": _round(median),
        "update_ratio_min": _round(float(series.values.min())),
        "update_ratio_max": _round(float(series.values.max())),
        "healthy_range": [low, high],
        "samples": int(len(series)),
    }
    if len(lr):
        evidence["lr_median"] = _round(float(np.median(lr.values)))
    if median < low:
        summary = f"updates too small: update/weight ratio {median:.2g} (median of {len(series)}), below {low:g}: the LR is too small or the updates are masked"
        next_command = _cmd("check", curves) + "   # LR range test"
    else:
        summary = f"updates too large: update/weight ratio {median:.2g} (median of {len(series)}), above {high:g}: the LR is far too high"
        next_command = _cmd("ablate lr,warmup", curves)
    return [Finding("update-ratio", summary, evidence, next_command, step=int(series.steps[0]), source="SageMaker Debugger: update/weight ratio outside [1e-8, 10]; ~1e-3 healthy")]


@detector("plateau")
def detect_plateau(curves: Curves) -> list[Finding]:
    """The loss decreased, then stopped improving far above where it started from (LR too small, capacity)."""
    loss = curves.healthy_loss
    n = len(loss)
    if n < 50:
        raise Skip(f"{n} finite loss values (needs 50)")
    _, end = _loss_levels(loss)
    start = _initial_loss(loss)
    if start <= 0 or (start - end) < 0.05 * start:
        return []  # never decreased by 5%: flat-from-start's business, not a plateau
    if end < PLATEAU_MIN_LEVEL * start:
        return []  # it got most of the way down: converged, not stuck (healthy built-in runs end at <= 0.34x)
    window = max(5, n // 20) | 1
    smooth = rolling_median(loss.values, window)
    # The band the smoothed curve must stay in: 2% of the level, or 4 standard errors of a rolling median
    # (~1.25 sigma / sqrt(window)) so ordinary SGD noise never ends a plateau.
    band = max(0.02 * end, 4 * 1.25 * noise_sigma(loss.values) / math.sqrt(window))
    outside = np.nonzero(np.abs(smooth - end) > band)[0]
    start_index = int(outside[-1]) + 1 if len(outside) else 0
    if n - start_index < max(20, PLATEAU_MIN_SHARE * n):
        return []  # stuck only lately: a healthy run converging looks the same, so it is not called a plateau
    # Still improving, only slowly (a healthy run converging to a high floor)? Compare the first and last
    # quarter of the candidate plateau: a decrease beyond 1% of the level or 1 standard error of the
    # difference of two medians (1.25 sigma / sqrt(samples) each) is progress, not a plateau.
    segment = loss.values[start_index:]
    quarter = max(5, len(segment) // 4)
    decline = float(np.median(segment[:quarter]) - np.median(segment[-quarter:]))
    standard_error = math.sqrt(2) * 1.25 * noise_sigma(segment) / math.sqrt(quarter)
    if decline > max(0.01 * end, PLATEAU_TREND_SE * standard_error):
        return []
    # ... nor a monotone trend down across it (Mann-Kendall: Kendall's tau against the step, p < 0.2),
    # which sees a slow, steady creep that two quarter medians miss under heavy noise.
    from scipy.stats import kendalltau

    thinned = segment[:: len(segment) // 2000 + 1]
    tau, p_value = kendalltau(np.arange(len(thinned)), thinned)
    if tau < 0 and p_value < PLATEAU_TREND_P and decline > 0.01 * end:
        return []
    plateau_step = int(loss.steps[start_index])
    evidence: dict[str, Any] = {
        "plateau_start_step": plateau_step,
        "plateau_level": _round(end),
        "loss_start": _round(start),
        "decrease_before": _round(start - end),
        "plateau_steps": int(loss.steps[-1] - plateau_step),
        "band": _round(band),
        "decline_across_plateau": _round(decline),
    }
    lr = curves.get("lr")
    if len(lr):
        evidence["lr_at_plateau"] = _round(float(np.median(lr.values[lr.steps >= plateau_step]))) if np.any(lr.steps >= plateau_step) else None
        evidence["lr_start"] = _round(float(lr.values[0]))
    updates = curves.get("update_ratio").finite()
    if len(updates) and np.any(updates.steps >= plateau_step):
        evidence["update_ratio_at_plateau"] = _round(float(np.median(updates.values[updates.steps >= plateau_step])))
    return [
        Finding(
            "plateau",
            f"plateau from step {plateau_step}: the loss fell from {start:.4g} to {end:.4g} ({100 * end / start:.0f}% of its start) and has not improved for {evidence['plateau_steps']} steps: LR too small or too little capacity",
            evidence,
            _cmd("check", curves) + "   # LR range test",
            step=plateau_step,
            source="Smith 2017, \"Cyclical Learning Rates\" (LR range test); Karpathy's recipe: overfit, then regularize",
        )
    ]


@detector("oscillation")
def detect_oscillation(curves: Curves) -> list[Finding]:
    """The smoothed loss keeps going up and down by a large fraction of its level (LR too high, not diverging)."""
    loss = curves.healthy_loss
    n = len(loss)
    if n < 60:
        raise Skip(f"{n} finite loss values (needs 60)")
    start, end = _loss_levels(loss)
    half = loss.values[n // 2:]
    window = max(5, len(half) // 10) | 1
    smooth = rolling_median(half, window)
    level = float(np.median(half))
    if level <= 0:
        return []
    rises = np.diff(smooth)
    total_rise = float(rises[rises > 0].sum())
    net_change = float(smooth[0] - smooth[-1])
    swing = float(np.percentile(smooth, 90) - np.percentile(smooth, 10))
    # Oscillating: the smoothed second half climbs back by more than its own level in total, spans at
    # least half its level and a tenth of the untrained loss (near-zero losses are noisy in relative terms
    # only), and ends no lower than where it was half-way (no progress). Healthy built-in runs: net
    # decrease >= 1.06x the swing.
    initial = _initial_loss(loss)
    if not (total_rise > level and swing > 0.5 * level and net_change < 0.25 * swing and swing > 0.1 * initial):
        return []
    turning = int(np.sum(np.diff(np.sign(rises[np.abs(rises) > 1e-12 * level])) != 0))
    first_step = int(loss.steps[n // 2])
    return [
        Finding(
            "oscillation",
            f"oscillating loss from step {first_step}: the smoothed loss swings by {swing:.3g} around {level:.3g} ({100 * swing / level:.0f}%) with no net progress: LR too high without diverging",
            {
                "from_step": first_step,
                "level": _round(level),
                "swing_p10_p90": _round(swing),
                "total_rise": _round(total_rise),
                "net_decrease": _round(net_change),
                "turning_points": turning,
                "loss_start": _round(start),
            },
            _cmd("ablate lr,warmup", curves),
            step=first_step,
            source="Smith 2017 (above the usable LR the loss oscillates or diverges); AUTOTRAINER: oscillating loss",
        )
    ]


def _train_at(loss: Series, steps: np.ndarray) -> np.ndarray:
    """The training loss around each evaluation step: median of the interval since the previous one."""
    out = []
    previous = -1
    for step in steps:
        window = loss.values[(loss.steps > previous) & (loss.steps <= step)]
        if not len(window):
            window = loss.values[loss.steps <= step][-5:]
        out.append(float(np.median(window)) if len(window) else math.nan)
        previous = step
    return np.array(out)


def _val_and_train(curves: Curves) -> tuple[Series, np.ndarray, Series]:
    val = curves.get("val_loss").before(curves.failing_step).finite()
    loss = curves.healthy_loss
    if len(val) < 4 or len(loss) < 20:
        raise Skip(f"{len(val)} validation losses (needs 4; set val_data and train.val_every)")
    return val, _train_at(loss, val.steps), loss


@detector("overfitting")
def detect_overfitting(curves: Curves) -> list[Finding]:
    """Train down, validation up after K, gap (val - train)/train > 0.1 with patience (SageMaker)."""
    val, train, loss = _val_and_train(curves)
    values = val.values
    best = int(np.argmin(values))
    if best == 0 or values[best] > 0.95 * values[0]:
        return []  # validation never improved: a mismatch, not overfitting (see distribution-mismatch)
    after = values[best + 1:]
    if len(after) < OVERFIT_PATIENCE:
        return []
    tail_val = values[-OVERFIT_PATIENCE:]
    tail_train = train[-OVERFIT_PATIENCE:]
    gap = (tail_val - tail_train) / np.maximum(np.abs(tail_train), 1e-12)
    rose = np.all(tail_val > values[best] * (1 + OVERFIT_RISE))
    train_kept_falling = np.median(tail_train) <= train[best] * 1.05
    if not (rose and np.all(gap > OVERFIT_GAP) and train_kept_falling):
        return []
    # A rise is a trend, not the noise of a converged run around its best (Mann-Kendall on val from the best).
    from scipy.stats import kendalltau

    tau, p_value = kendalltau(np.arange(len(values) - best), values[best:])
    if not (tau > 0 and p_value < OVERFIT_TREND_P):
        return []
    k = int(val.steps[best])
    return [
        Finding(
            "overfitting",
            f"overfitting from step {k}: val_loss rose from {values[best]:.4g} (step {k}) to {values[-1]:.4g} (step {int(val.steps[-1])}) while the train loss fell from {train[best]:.4g} to {train[-1]:.4g}; gap (val-train)/train {gap[-1]:.3g}",
            {
                "best_val_step": k,
                "best_val_loss": _round(float(values[best])),
                "last_val_loss": _round(float(values[-1])),
                "val_rise": _round(float(values[-1] / values[best] - 1)),
                "train_at_best": _round(float(train[best])),
                "train_last": _round(float(train[-1])),
                "gap_last": [_round(float(g)) for g in gap],
                "patience": OVERFIT_PATIENCE,
                "trend_tau": _round(float(tau)),
                "trend_p": _round(float(p_value)),
                "evaluations": int(len(values)),
            },
            f"replay train <your config> train.steps={k + 1}   # stop at the best validation step, or add data / regularisation (weight decay, dropout)",
            step=k,
            source="SageMaker Debugger overfit rule: (val-train)/train > 0.1 with patience",
        )
    ]


@detector("distribution-mismatch")
def detect_mismatch(curves: Curves) -> list[Finding]:
    """Train falls, validation stays flat from the start: the validation data is not what the model trains on."""
    val, train, loss = _val_and_train(curves)
    _, end = _loss_levels(loss)
    start = _initial_loss(loss)
    if start <= 0:
        return []
    train_gain = 1 - end / start
    val_gain = 1 - float(val.values.min()) / start
    # Train lost more than half of its starting loss while validation never got 20% below it.
    if not (train_gain > 0.5 and val_gain < 0.2):
        return []
    gap = (val.values[-1] - train[-1]) / max(abs(train[-1]), 1e-12)
    return [
        Finding(
            "distribution-mismatch",
            f"train/validation mismatch: the train loss fell from {start:.4g} to {end:.4g} while val_loss never went below {val.values.min():.4g} "
            f"(first {val.values[0]:.4g} at step {int(val.steps[0])}, last {val.values[-1]:.4g}): the validation data differs from the training data",
            {
                "loss_start": _round(start),
                "train_end": _round(end),
                "val_first": _round(float(val.values[0])),
                "val_min": _round(float(val.values.min())),
                "val_last": _round(float(val.values[-1])),
                "train_gain": _round(train_gain),
                "val_gain": _round(val_gain),
                "gap_last": _round(float(gap)),
                "evaluations": int(len(val)),
            },
            _cmd("check", curves) + "   # data sanity: compare train and validation preprocessing",
            step=int(val.steps[0]),
            source="Zinkevich, \"Rules of Machine Learning\" #37 (training-serving skew); Karpathy's recipe: become one with the data",
        )
    ]


@detector("input-pipeline-bound")
def detect_input_bound(curves: Curves) -> list[Finding]:
    """The step waits on data: median data_time >= median step_time (and >= 1 ms)."""
    data = curves.get("data_time").finite()
    compute = curves.get("step_time").finite()
    if len(data) < 10 or len(compute) < 10:
        raise Skip("fewer than 10 data_time / step_time values")
    skip = min(5, len(data) // 5)  # the first steps pay for warm-up (allocations, caches)
    data_median = float(np.median(data.values[skip:]))
    compute_median = float(np.median(compute.values[skip:]))
    share = data_median / max(data_median + compute_median, 1e-12)
    if share < INPUT_BOUND_SHARE or data_median < INPUT_BOUND_MIN_SECONDS:
        return []
    target = curves.params.get("data._target_", "the dataset")
    return [
        Finding(
            "input-pipeline-bound",
            f"input-pipeline bound: {1000 * data_median:.3g} ms a batch waiting for data against {1000 * compute_median:.3g} ms of compute ({100 * share:.0f}% of each step)",
            {
                "data_time_median_s": _round(data_median),
                "step_time_median_s": _round(compute_median),
                "data_share": _round(share),
                "dataset": target,
                "steps": int(len(data)),
            },
            f"python -m cProfile -s cumtime -m replaybisect train <your config> train.steps=20 snapshot.enabled=false   # where {target}.__getitem__ spends its time",
            step=int(data.steps[skip]),
            source="TensorFlow Profiler guide: input-bound when the step waits on the input pipeline; PyTorch Profiler",
        )
    ]


@detector("replicas-drifted")
def detect_replica_drift(curves: Curves) -> list[Finding]:
    """A distributed run's parameter checksums (taken as each step starts) differ between ranks: from the first
    step, the replicas began different; later, an update differed between ranks after the all-reduce."""
    logged = ranks.ranks_logged(curves.metric_keys, "param_checksum")
    if len(logged) < 2:  # one process: nothing to compare (not a skipped check)
        return []
    drift = ranks.replica_drift({rank: dict(zip(s.steps.tolist(), s.values.tolist()))
                                 for rank in logged if len(s := curves.get(f"param_checksum/rank{rank}"))})
    if drift is None:
        return []
    names = ", ".join(str(rank) for rank in drift["ranks"])
    if drift["at_start"]:
        summary = (f"the replicas differ from the first step (rank {names} vs rank 0 at step {drift['step']}): their initial "
                   "parameters were not the same; a rank-dependent seed with DDP's init sync off, or parameters changed "
                   "after wrapping the model in DDP")
    else:
        summary = (f"the replicas drifted apart at step {drift['step']} (rank {names} vs rank 0): an update differed between "
                   "ranks after the all-reduce; a gradient hook or in-place change on one rank, the model used outside its "
                   "DDP wrapper, or no_sync misuse")
    return [Finding("replicas-drifted", summary, drift,
                    "grep -nE 'manual_seed|init_sync|register_.*hook|no_sync|\\.module\\(' <your script>   # what runs on one rank only",
                    step=drift["step"], source=ranks.SOURCE)]


@detector("rank-loss-scale")
def detect_rank_loss_scale(curves: Curves) -> list[Finding]:
    """One rank's loss sits on another scale than rank 0's at nearly every step: each rank normalises its loss
    differently (a per-rank count or weight), so DDP's average weights the ranks' gradients unequally."""
    base = curves.get("loss").before(curves.failing_step).finite()
    findings = []
    for rank in ranks.ranks_logged(curves.metric_keys, "loss"):
        other = curves.get(f"loss/rank{rank}").before(curves.failing_step).finite()
        scale = ranks.loss_scale((base.steps, base.values), (other.steps, other.values))
        if scale is None:
            continue
        findings.append(Finding(
            "rank-loss-scale",
            f"rank {rank}'s loss is x{scale['median_ratio']:.3g} of rank 0's on {100 * scale['one_sided_share']:.0f}% of "
            f"{scale['steps']} steps: more than different data explains; each rank normalises its loss differently (a "
            "per-rank count or weight), so the averaged gradient weights the ranks unequally",
            {"rank": rank, "median_ratio": _round(scale["median_ratio"]), "one_sided_share": _round(scale["one_sided_share"]),
             "steps": scale["steps"]},
            "grep -nE 'get_rank|world_size|/ *len\\(|\\.sum\\(\\) */' <your script>   # how each rank divides its loss",
            step=scale["first_step"], source=ranks.SOURCE))
    return findings


# ---- the analysis ----------------------------------------------------------------------------------------
ORDER = [
    "exception", "gradients-not-zeroed", "model-in-eval", "not-optimized", "memory-leak", "nan-at-start", "nan-after-k", "divergence", "dead-relu", "flat-from-start", "no-gradient", "exploding-gradients",
    "vanishing-gradients", "update-ratio", "spikes", "oscillation", "slow-learning", "plateau", "overfitting",
    "distribution-mismatch", "input-pipeline-bound", "replicas-drifted", "rank-loss-scale",
]


def _explain(findings: list[Finding]) -> list[Finding]:
    """Tie findings to what explains them: a layer that gets exactly no gradient because the ReLU after it
    is dead is a blocked path, not a vanishing one (dropped); a flat loss names its cause when one is found."""
    dead = [f.layer for f in findings if f.pattern == "dead-relu"]
    climbs = [f.evidence["from_step"] for f in findings if f.pattern == "divergence" and "from_step" in f.evidence]
    kept = []
    for finding in findings:
        if climbs and finding.pattern == "spikes" and all(step >= min(climbs) for step in finding.steps):
            continue  # the climb into the NaN, not bad batches: the divergence finding says so
        if finding.pattern in ("flat-from-start", "oscillation") and any(f.pattern == "divergence" for f in findings):
            continue  # a loss that rose far above its start is neither flat nor oscillating: the divergence says what happened
        if finding.pattern == "plateau" and any(f.pattern == "slow-learning" for f in findings):
            continue  # the slow fall explains the flat stretch: slow-learning names the cause
        if dead and finding.pattern == "vanishing-gradients":
            layers = finding.evidence.get("layers", {})
            if layers and all((info.get("median_norm") or 0.0) <= 1e-12 for info in layers.values()):
                continue
        kept.append(finding)
    causes = [
        f"{f.pattern} ({f.layer})" if f.layer else f.pattern
        for f in kept
        if f.pattern in ("dead-relu", "vanishing-gradients", "update-ratio")
    ]
    for finding in kept:
        if finding.pattern == "flat-from-start" and causes:
            finding.summary += f"; explained by {', '.join(causes)}"
            finding.evidence["explained_by"] = causes
    return kept


def summarise(curves: Curves) -> dict[str, Any]:
    """The numbers a clean bill rests on."""
    loss = curves.get("loss")
    finite = loss.finite()
    summary: dict[str, Any] = {"steps_logged": int(len(loss))}
    if len(finite):
        start = _initial_loss(finite)
        # loss_end is the last finite loss logged (for a healthy run, the final loss `replay train` prints);
        # the detectors read robust levels (medians), given as loss_end_median
        end_median = _loss_levels(finite)[1] if len(finite) >= 10 else float(finite.values[-1])
        summary.update(first_step=int(finite.steps[0]), last_step=int(finite.steps[-1]), loss_start=_round(start),
                       loss_end=float(finite.values[-1]), loss_end_median=_round(end_median))
    val = curves.get("val_loss").finite()
    if len(val):
        best = int(np.argmin(val.values))
        summary.update(val_best=_round(float(val.values[best])), val_best_step=int(val.steps[best]), val_last=_round(float(val.values[-1])))
    grads = curves.get("grad_norm").finite()
    if len(grads):
        summary["grad_norm_median"] = _round(float(np.median(grads.values)))
    updates = curves.get("update_ratio").finite()
    if len(updates):
        summary["update_ratio_median"] = _round(float(np.median(updates.values)))
    data, compute = curves.get("data_time").finite(), curves.get("step_time").finite()
    if len(data) and len(compute):
        d, c = float(np.median(data.values)), float(np.median(compute.values))
        summary["data_share"] = _round(d / max(d + c, 1e-12))
        summary["step_time_median_s"] = _round(c)
    layers = curves.layers("grad_norm/")
    if layers:
        summary["layers"] = len(layers)
    return summary


def analyse(curves: Curves) -> Diagnosis:
    """Run every detector on the curves; a detector without its metrics is listed as skipped, with why."""
    if not any(len(s) for s in curves.metrics.values()) and curves.failing_step is None:
        raise ReplayError(f"run {curves.run_id} has no metrics to diagnose; was it recorded by `replay train`? (check `replay runs`)")
    findings: list[Finding] = []
    checked: list[str] = []
    skipped: dict[str, str] = {}
    for pattern, function in DETECTORS:
        try:
            findings += function(curves)
            checked.append(pattern)
        except Skip as why:
            skipped[pattern] = str(why)
    findings = _explain(findings)
    if any(f.pattern.startswith("nan") for f in findings):
        # The non-finite exploding-gradient finding repeats what the NaN finding says.
        findings = [f for f in findings if not (f.pattern == "exploding-gradients" and f.evidence.get("first_nonfinite_step") is not None)]
    findings.sort(key=lambda f: (ORDER.index(f.pattern) if f.pattern in ORDER else len(ORDER), f.step if f.step is not None else -1))
    return Diagnosis(
        run_id=curves.run_id,
        run_name=curves.run_name,
        status=curves.tags.get("status", "unknown"),
        findings=findings,
        summary=summarise(curves),
        checked=checked,
        skipped=skipped,
    )


def diagnose(store: Store, run_id: str) -> Diagnosis:
    """Read the run's curves and name the pathologies; reads the store, writes nothing
    (`replaybisect.verbs.diagnose.report.publish` attaches diagnosis.md and the annotated loss curve)."""
    return analyse(load_curves(store, run_id))
