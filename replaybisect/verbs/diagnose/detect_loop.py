"""Detectors of the training loop and its resources: gradients never cleared, a model left in eval mode,
parameters no optimizer holds, a memory leak, an input-bound loop, replicas that drifted, a rank's loss
scaled apart."""

from __future__ import annotations

from typing import Any

import numpy as np

from replaybisect.core.tags import step_tag
from replaybisect.verbs.diagnose import ranks
from replaybisect.core.thresholds import INPUT_BOUND_MIN_SECONDS, INPUT_BOUND_SHARE
from replaybisect.verbs.diagnose.curves import Curves, Series
from replaybisect.verbs.diagnose.findings import Finding, Skip, command_for, edge_count, loss_levels, rounded, detector


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
                    {"bytes_per_step": round(per_step), "from_step": int(steps[0]), "r2": rounded(r2), "memory": key,
                     "first_bytes": float(values[0]), "last_bytes": float(values[-1]), "samples": int(len(values))},
                    command_for("memory", curves) + "   # what holds it, and the line that adds to it",
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
        edge = edge_count(len(norms))
        early, late = float(np.median(norms.values[:edge])), float(np.median(norms.values[-edge:]))
        evidence.update(grad_norm_early=rounded(early), grad_norm_late=rounded(late))
        if early > 0:
            said.append(f"grad norm x{late / early:.3g} (median {early:.3g} -> {late:.3g})")
    healthy = curves.healthy_loss
    if len(healthy) >= 2 * NOT_ZEROED_MIN_STEPS:
        start, end = loss_levels(healthy)
        evidence.update(loss_start=rounded(start), loss_end=rounded(end))
        said.append(f"loss {start:.3g} -> {end:.3g}")
    return [Finding("gradients-not-zeroed",
                    "the loop never clears its gradients: from step 1 every step's backward added to all earlier steps' "
                    "(no optimizer.zero_grad()), so each update applies the sum of every gradient so far"
                    + (f"; {', '.join(said)}" if said else "")
                    + (f"; add optimizer.zero_grad() before the backward in the loop at {loop}" if loop else ""),
                    evidence, command_for("ablate zero-grad", curves) + ("" if curves.failing_step is not None else " --from-step 1"),
                    step=1, source="the recorder saw each step's backward add to gradients its loop had not cleared "
                    "(the Stack Overflow / PyTorch forum 'forgot optimizer.zero_grad()' bug, TrainCheck's silent-error set)")]


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
                "data_time_median_s": rounded(data_median),
                "step_time_median_s": rounded(compute_median),
                "data_share": rounded(share),
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
            {"rank": rank, "median_ratio": rounded(scale["median_ratio"]), "one_sided_share": rounded(scale["one_sided_share"]),
             "steps": scale["steps"]},
            "grep -nE 'get_rank|world_size|/ *len\\(|\\.sum\\(\\) */' <your script>   # how each rank divides its loss",
            step=scale["first_step"], source=ranks.SOURCE))
    return findings
