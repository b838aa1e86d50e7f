"""`replay verify`: is the recording what this code computes here? Recorded steps replayed from their snapshots and
compared with the logged losses and gradient norms, bit for bit; replays on CPU are exact, and were measured exact on
CUDA in fp32, bf16 and fp16, so any difference is evidence.

The verdict (Megatron-LM's rerun machine asks the same of one step; silent data corruption shows as a loss or a
gradient slightly wrong far more often than as a NaN):
- exact: every compared step is reproduced bit for bit: a failure in the run is the code's or the data's;
- transient: the machine that recorded the run (its device label) does not reproduce a step from that step's own
  state and batch, and two replays here agree with each other: a fault while recording (a flipped bit), not the code;
- device: this machine reproducibly computes a step differently from the machine that recorded it (another device
  label): verify there too; the machine whose replays agree with its recording computes its own numbers;
- hardware (--cross-check): this machine reproducibly computes a step differently, and another machine (a submitit
  job) reproduces the recording bit for bit: this machine's device;
- recorder (--cross-check): this machine and another agree with each other, not with the recording: the machine that
  recorded it computed it differently (its hardware, or a fault while recording);
- code: the run's code changed since it was recorded (the difference is the change's);
- nondeterministic: two replays here of the same state and batch differ from each other;
- loop: a loop recorded as written made another number of training calls in a differing step's replay than it made
  recording it: its control flow hangs on what a replay does not restore (an episode counter, an environment), so
  the replay is no evidence about the machine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from replaybisect.replay import restore as restore_mod
from replaybisect.core import reentry
from replaybisect.core.inline_step import CALLS_DECIDED, RemoteStep
from replaybisect.core.jsonutil import from_jsonable
from replaybisect.core.faults import device_label
from replaybisect.errors import ReplayError, SnapshotError
from replaybisect.store import Store
from replaybisect.verbs.verify import elsewhere

CALLS_DIFFER = "calls_differ"  # a replayed segment's steps whose training calls differed (RemoteStep.calls_differ)
VERDICTS = ("exact", "transient", "device", "hardware", "recorder", "code", "nondeterministic", "loop")
DEVICE_LABEL = "device_label"  # the tag the recording machine's label is kept in (record/session.py)


@dataclass
class Difference:
    step: int
    metric: str  # loss | grad_norm
    logged: float
    replayed: float
    relative: float


@dataclass
class VerifyReport:
    run_id: str
    start: int
    end: int  # exclusive
    steps_compared: int
    segments: list[dict[str, Any]]  # {snapshot, start, end, differences: n}
    differences: list[Difference] = field(default_factory=list)  # the first few, in step order
    verdict: str = "exact"
    sentence: str = ""
    recorded_on: Optional[str] = None
    replayed_on: str = ""
    second_replay: Optional[str] = None  # same | differs: the first differing segment replayed again here
    elsewhere: Optional[dict] = None  # --cross-check: the other machine's label, verdict and first difference
    sample: Optional[float] = None  # --sample: steps per thousand, from the intervals in `segments`
    code_changes: list[str] = field(default_factory=list)  # the run's own modules changed since it was recorded
    # a loop recorded as written: steps whose replay made another number of training calls, [made, recorded]
    calls_differ: dict[int, list[int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    report_run_id: Optional[str] = None

    @property
    def first(self) -> Optional[Difference]:
        return self.differences[0] if self.differences else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "VerifyReport":
        return cls(**{**data, "differences": [Difference(**d) for d in data.get("differences", [])],
                      "calls_differ": {int(step): calls for step, calls in data.get("calls_differ", {}).items()}})


def verify(store: Store, run_id: str, start: Optional[int] = None, end: Optional[int] = None, *, device=None, trust=None,
           sample: Optional[float] = None, cross_check=None, log: Optional[Callable[[str], None]] = None) -> VerifyReport:
    """Replay the recorded steps start..end-1 (default: the whole run) from their snapshots and compare. `sample`: at
    least this many steps per thousand instead, from snapshot intervals drawn at random (seeded by the run's id).
    `cross_check` (JobSettings): a difference this machine reproduces is replayed once more as a job on another machine."""
    log = log or (lambda message: None)
    tags = store.tags(run_id)
    cfg = restore_mod.run_config(store, run_id, trust)
    losses = restore_mod.logged_losses(store, run_id)
    grad_norms = dict(store.metric_history(run_id, "grad_norm"))
    if not losses:
        raise SnapshotError(f"run {run_id} logged no steps: nothing to verify")
    start = 0 if start is None else start
    end = max(losses) + 1 if end is None else end
    if start >= end or start > max(losses):
        raise ReplayError(f"--steps {start}:{end} holds no step run {run_id} logged (steps 0..{max(losses)}); pass "
                          f"e.g. --steps 0:{max(losses) + 1}")
    segments = _segments(store, run_id, start, end)
    if sample is not None:
        segments = _sampled(segments, run_id, math.ceil((end - start) * sample / 1000))
    report = VerifyReport(run_id=run_id, start=segments[0][1], end=end, steps_compared=0, segments=[],
                          recorded_on=tags.get(DEVICE_LABEL), replayed_on=device_label(),
                          code_changes=restore_mod.code_changes(tags, cfg), sample=sample)
    first_differing = None
    for snapshot, seg_start, seg_end in segments:
        log(f"replaying steps {seg_start}..{seg_end - 1} from snapshot {snapshot}")
        try:
            replayed = _replay_segment(store, run_id, cfg, trust, device, snapshot, seg_end, log)
            report.calls_differ.update(replayed.pop(CALLS_DIFFER, {}))
        except SnapshotError as error:  # a snapshot that does not verify: its interval is not compared, said
            report.warnings.append(f"{error}; steps {seg_start}..{seg_end - 1} not compared")
            report.segments.append({"snapshot": snapshot, "start": seg_start, "end": seg_end, "differences": None})
            continue
        found = _differences(replayed, losses, grad_norms, seg_start)
        report.steps_compared += sum(1 for step in replayed["losses"] if step >= seg_start)
        report.segments.append({"snapshot": snapshot, "start": seg_start, "end": seg_end, "differences": len(found)})
        report.differences += found[: max(0, 20 - len(report.differences))]
        if found and first_differing is None:
            first_differing = (snapshot, seg_end, replayed)
    if first_differing is not None and _loop_diverged(report) is None:  # (a loop's other step: no replay tells more)
        snapshot, seg_end, replayed = first_differing
        log(f"replaying from snapshot {snapshot} again: is the difference this machine's own?")
        again = _replay_segment(store, run_id, cfg, trust, device, snapshot, seg_end, log)
        again.pop(CALLS_DIFFER, None)
        report.second_replay = "same" if _same(again, replayed) else "differs"
        if cross_check is not None and report.second_replay == "same" and not report.code_changes and \
                report.recorded_on != report.replayed_on:
            log(f"replaying steps {snapshot}..{seg_end - 1} on another machine: a submitit job")
            try:
                report.elsewhere = elsewhere.replayed_elsewhere(store, run_id, snapshot, seg_end, trust, device, cross_check)
            except ReplayError as error:  # the replays here still answer; the verdict says what one machine can
                report.warnings.append(f"{error}; the verdict stands on this machine's replays alone")
    if not report.steps_compared:
        raise SnapshotError(f"run {run_id}: no snapshot covering steps {start}..{end - 1} verifies ({report.warnings[0]}); "
                            "nothing could be compared")
    report.verdict, report.sentence = _verdict(report)
    return report


def _segments(store: Store, run_id: str, start: int, end: int) -> list[tuple[int, int, int]]:
    """(snapshot, first compared step, end) for each snapshot interval covering start..end-1."""
    steps = restore_mod.snapshot_steps(store, run_id)
    if not steps:
        raise SnapshotError(f"run {run_id} has no snapshots; train with snapshot.every > 0 to make it replayable")
    first = max([s for s in steps if s <= start], default=None)
    if first is None:
        first = min(steps)
        if first >= end:
            raise SnapshotError(f"run {run_id} has no snapshot at or before step {end - 1} (its snapshots: "
                                f"{', '.join(map(str, steps[:8]))}); verify later steps")
    starts = [first] + [s for s in steps if first < s < end]
    return [(s, max(s, start), min(starts[i + 1] if i + 1 < len(starts) else end, end)) for i, s in enumerate(starts)]


def _sampled(segments: list[tuple[int, int, int]], run_id: str, wanted: int) -> list[tuple[int, int, int]]:
    """Snapshot intervals drawn at random (the same for the same run), each compared from its snapshot on, until
    `wanted` steps are; in step order."""
    import random

    chosen = []
    for snapshot, first, end in random.Random(run_id).sample(segments, len(segments)):
        if wanted <= 0:
            break
        chosen.append((snapshot, first, min(end, first + wanted)))
        wanted -= chosen[-1][2] - first
    return sorted(chosen)


def _replay_segment(store, run_id, cfg, trust, device, snapshot: int, end: int, log) -> dict[str, dict[int, float]]:
    """The losses and gradient norms of the steps snapshot..end-1 replayed from that snapshot."""
    if cfg.train.get("script") is not None and not reentry.replaying():  # a script's run: replayed inside the script
        from replaybisect.replay.script import run_in_script

        arguments = {"snapshot": snapshot, "end": end, "device": str(device) if device is not None else None}
        result = from_jsonable(run_in_script("verify", store, run_id, cfg, trust, arguments, log))  # (a NaN loss came as text)
        return {key: {int(step): value for step, value in values.items()} for key, values in result.items()}
    return replay_segment(store, run_id, cfg, device, snapshot, end)


def replay_segment(store, run_id, cfg, device, snapshot: int, end: int) -> dict[str, dict[int, float]]:
    """The losses and gradient norms of steps snapshot..end-1, replayed from that snapshot in this process."""
    restored = restore_mod.restore(store, run_id, cfg=cfg, device=device, snapshot=restore_mod.load_snapshot(store, run_id, snapshot))
    with restore_mod.stored_batch_errors(restored):
        replayed = restore_mod.replay(restored, end, stop_on_nonfinite=False)
    answer = {"losses": dict(replayed.losses), "grad_norms": {s: float(v) for s, v in replayed.grad_norms.items() if v is not None}}
    step_fn = restored.state.step_fn
    if isinstance(step_fn, RemoteStep) and step_fn.calls_differ:  # (the script's iterations: see the "loop" verdict)
        answer[CALLS_DIFFER] = {step: list(calls) for step, calls in step_fn.calls_differ.items() if snapshot <= step < end}
    return answer


def _differences(replayed: dict, losses: dict[int, float], grad_norms: dict[int, float], start: int) -> list[Difference]:
    found = []
    for step in sorted(replayed["losses"]):
        if step < start:
            continue
        for metric, logged_values, value in (("loss", losses, replayed["losses"][step]),
                                             ("grad_norm", grad_norms, replayed["grad_norms"].get(step))):
            if step in logged_values and value is not None and not restore_mod.same_loss(logged_values[step], value):
                found.append(Difference(step, metric, logged_values[step], value, restore_mod.relative_error(logged_values[step], value)))
    return found


def _same(a: dict, b: dict) -> bool:
    return all(a[key].keys() == b[key].keys() and all(restore_mod.same_loss(a[key][s], b[key][s]) for s in a[key]) for key in a)


def _loop_diverged(report: VerifyReport) -> Optional[tuple[int, list[int]]]:
    """A loop recorded as written whose replay ran another step at or before the first difference: the first step of
    that difference's interval, from its snapshot on (replayed, compared or not), whose iteration made another
    number of training calls than recorded, with (made, recorded); None where none did."""
    first = report.first
    if first is None:
        return None
    snapshot = max((part["snapshot"] for part in report.segments if part["snapshot"] <= first.step), default=first.step)
    steps = [step for step in report.calls_differ if snapshot <= step <= first.step]
    return (min(steps), report.calls_differ[min(steps)]) if steps else None


def _verdict(report: VerifyReport) -> tuple[str, str]:
    span = f"steps {report.start}..{report.end - 1}"
    if report.sample is not None:
        span = "the sampled steps " + ", ".join(f"{part['start']}..{part['end'] - 1}" for part in report.segments)
    first = report.first
    if first is None:
        return "exact", (f"every logged loss and gradient norm of {span} is reproduced bit for bit ({report.steps_compared} "
                         "steps): the recording is what this code computes here; a failure in it is the code's or the data's")
    where = (f"step {first.step}'s {first.metric.replace('_', ' ')} was logged {first.logged!r} and replays as "
             f"{first.replayed!r} ({first.relative:.2g} relative)")
    later = sum(1 for d in report.differences if d.step != first.step)
    after = "; the steps after it differ too (the state went on from it)" if later else "; only that step differs"
    loop = _loop_diverged(report)
    if loop is not None:
        step, (made, recorded) = loop
        at = "in its replay" if step == first.step else f"in its replay of step {step}, before it,"
        return "loop", (f"{where}: the script's loop made {made} training calls of the model {at} where the "
                        f"recording made {recorded}: {CALLS_DECIDED}, so this replay ran another step, and "
                        "the difference says nothing of the machine (a replay from the run's first snapshot runs the loop "
                        "as the recording did)")
    if report.second_replay == "differs":
        return "nondeterministic", f"{where}, and two replays here of the same state and batch differ from each other: a nondeterministic op or this machine's hardware"
    if report.code_changes:
        return "code", f"{where}{after}: the run's code changed since it was recorded ({report.code_changes[0]})"
    other = report.elsewhere
    if other is not None and other["label"] != report.replayed_on:
        if other["verdict"] == "exact":
            return "hardware", (f"{where}{after}: this machine ({report.replayed_on}) computes it so on every replay, and "
                                f"another ({other['label']}) reproduces the recording bit for bit: this machine's hardware")
        theirs = other.get("first")
        if theirs is not None and (theirs["step"], theirs["metric"]) == (first.step, first.metric) and \
                restore_mod.same_loss(theirs["replayed"], first.replayed):
            return "recorder", (f"{where}{after}: this machine ({report.replayed_on}) and another ({other['label']}) both "
                                f"compute it so: the machine that recorded it ({report.recorded_on or 'not recorded'}) "
                                "computed it differently, its hardware or a fault while recording")
    if report.recorded_on is not None and report.recorded_on == report.replayed_on:
        return "transient", (f"{where}{after}: the machine that recorded it ({report.recorded_on}) does not reproduce it "
                             "from its own state and batch, and two replays here agree: a fault while recording (a "
                             "flipped bit, a hardware error), not the code")
    return "device", (f"{where}{after}: this machine ({report.replayed_on}) reproducibly computes it differently from the "
                      f"one that recorded it ({report.recorded_on or 'not recorded'}): run `replay verify` there too; the "
                      "machine whose own replays match its recording computes its own numbers (its hardware, where they are wrong)")
