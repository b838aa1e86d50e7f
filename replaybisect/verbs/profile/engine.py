"""`replay profile`: the recorded step replayed under torch.profiler, offline, as often as needed.

The run is restored at the newest good snapshot before the step and replayed up to it (compared with the logged losses,
so the profiled state is the recorded one), then `steps` recorded steps run under the profiler (CPU, and CUDA on a GPU;
shapes and memory), each module's forward marked with its name. The answer: the top ops by time and by memory, the
modules by forward time, each step's time against the time the run logged for it, the share of the run's steps spent
waiting for data (from the recording), and the trace, which opens in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.replay import restore as restore_mod
from replaybisect.core import reentry
from replaybisect.core.inline_step import RemoteStep
from replaybisect.errors import SnapshotError
from replaybisect.store import Store

TRACE = "trace.json"
MODULE_MARK = "module: "  # the profiler's label of a module's forward
TOP = 10  # rows of each table
WARMUP_STEPS = 2  # the first steps' time (allocator warm-up, lazy inits) is left out when the slowest step is chosen


@dataclass
class ProfileReport:
    run_id: str
    step: int  # the first profiled step
    steps: int  # how many were profiled
    why: str  # why this step
    snapshot_step: int
    reproduced: str  # the replay up to `step` against the logged losses: exact | close | diverged | unchecked
    losses: str  # the profiled steps' losses against the logged ones: exact | close | diverged | unchecked
    device: str
    step_seconds: list[float] = field(default_factory=list)  # each profiled step's wall time, under the profiler
    recorded_step_seconds: list[Optional[float]] = field(default_factory=list)  # what the run logged for those steps
    data_wait_share: Optional[float] = None  # the run's median share of a step spent waiting for data (recorded)
    top_ops: list[dict[str, Any]] = field(default_factory=list)  # by self time: name, calls, self_ms, total_ms, memory_mb
    top_memory: list[dict[str, Any]] = field(default_factory=list)  # by memory the op allocated itself
    top_modules: list[dict[str, Any]] = field(default_factory=list)  # by forward time: name, type, forward_ms, share
    peak_memory_mb: Optional[float] = None  # CUDA: the allocator's peak over the profiled steps
    trace: Optional[str] = None  # the trace file (a local path here; an artifact of the result run once published)
    warnings: list[str] = field(default_factory=list)
    report_run_id: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ProfileReport":
        return cls(**data)


def profile(store: Store, run_id: str, step: Optional[int] = None, *, steps: int = 3, device=None, trust=None,
            trace_folder: Path, log: Optional[Callable[[str], None]] = None) -> ProfileReport:
    """Profile `steps` recorded steps of run `run_id` from `step` (default: its slowest); the trace is written into
    `trace_folder`. Reads the store, writes nothing to it."""
    log = log or (lambda message: None)
    cfg = restore_mod.run_config(store, run_id, trust)
    if cfg.train.get("script") is not None and not reentry.replaying():  # a script's run: profiled inside the script
        from replaybisect.replay.script import run_in_script

        arguments = {"step": step, "steps": steps, "device": str(device) if device is not None else None,
                     "trace_folder": str(trace_folder)}
        return ProfileReport.from_json(run_in_script("profile", store, run_id, cfg, trust, arguments, log))
    losses = restore_mod.logged_losses(store, run_id)
    step_times = dict(store.metric_history(run_id, "step_time"))
    target, why = _chosen_step(run_id, step, losses, step_times)
    warnings: list[str] = []
    snapshot = restore_mod.newest_good_snapshot(store, run_id, target, warnings)
    last = max(losses) if losses else target
    count = max(1, min(steps, last - target + 1))
    if count < steps:
        warnings.append(f"the run logged steps up to {last}: {count} step{'s' if count > 1 else ''} profiled, not {steps}")
    log(f"restoring snapshot {snapshot.step}, replaying steps {snapshot.step}..{target - 1}, profiling {target}..{target + count - 1}")
    restored = restore_mod.restore(store, run_id, cfg=cfg, device=device, snapshot=snapshot)
    with restore_mod.stored_batch_errors(restored):
        replayed = restore_mod.replay(restored, target, logged=losses, stop_on_nonfinite=False) if target > restored.snapshot.step else None
        report = ProfileReport(run_id=run_id, step=target, steps=count, why=why, snapshot_step=restored.snapshot.step,
                               reproduced=replayed.reproduced if replayed is not None else "unchecked", losses="unchecked",
                               device=str(restored.state.device), warnings=warnings)
        _profile_steps(restored, report, losses, step_times, trace_folder)
    report.data_wait_share = _data_wait_share(store, run_id)
    for warning in restored.warnings:
        restore_mod.add_warning(report.warnings, warning)
    return report


def _chosen_step(run_id: str, step: Optional[int], losses: dict[int, float], step_times: dict[int, float]) -> tuple[int, str]:
    """--step, else the slowest recorded step (after the first few), else the last one."""
    if not losses:
        raise SnapshotError(f"run {run_id} logged no steps: nothing to profile")
    last = max(losses)
    if step is not None:
        if step > last:
            raise SnapshotError(f"--step {step} is past the end of run {run_id} (its last step is {last}); pass a step up to {last}")
        return step, "the step asked for"
    timed = {s: t for s, t in step_times.items() if s >= WARMUP_STEPS and s in losses} or {s: t for s, t in step_times.items() if s in losses}
    if timed:
        slowest = max(timed, key=timed.get)
        return slowest, f"the run's slowest recorded step ({timed[slowest]:.3g} s; median {statistics.median(timed.values()):.3g} s)"
    return last, "the run's last step (it logged no step times)"


def _profile_steps(restored, report: ProfileReport, losses: dict[int, float], step_times: dict[int, float],
                   trace_folder: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from replaybisect.core import loop

    state = restored.state
    cuda = state.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.reset_peak_memory_stats(state.device)
    replayed_losses = {}
    prof = torch_profile(activities=activities, record_shapes=True, profile_memory=True)
    # the profiler records the thread it starts in: a loop recorded as written runs its steps in the script's thread
    in_loop_thread = state.step_fn.in_script_thread if isinstance(state.step_fn, RemoteStep) else (lambda fn: fn())
    with _module_marks(state.model):
        in_loop_thread(prof.start)
        try:
            for step in range(report.step, report.step + report.steps):
                batch = loop.to_device(restored.batch(step), state.device)
                started = time.perf_counter()
                outcome = loop.run_step(state, step, batch)
                if cuda:
                    torch.cuda.synchronize(state.device)
                report.step_seconds.append(time.perf_counter() - started)
                report.recorded_step_seconds.append(step_times.get(step))
                replayed_losses[step] = outcome.loss
        finally:
            in_loop_thread(prof.stop)
    if cuda:
        report.peak_memory_mb = torch.cuda.max_memory_allocated(state.device) / 2**20
    report.losses = restore_mod.losses_verdict(replayed_losses, losses)
    trace_folder.mkdir(parents=True, exist_ok=True)
    trace = trace_folder / TRACE
    prof.export_chrome_trace(str(trace))
    report.trace = str(trace)
    _tables(report, prof.key_averages(), cuda)


class _module_marks:
    """Each module's forward marked in the profile with its name (`module: blocks.0.attn`), by forward hooks."""

    def __init__(self, model):
        self.model, self.handles, self.open = model, [], {}

    def __enter__(self):
        from torch.profiler import record_function

        def before(name):
            def hook(module, args):
                mark = record_function(f"{MODULE_MARK}{name} ({type(module).__name__})")
                mark.__enter__()
                self.open.setdefault(id(module), []).append(mark)
            return hook

        def after(module, args, output):
            marks = self.open.get(id(module))
            if marks:
                marks.pop().__exit__(None, None, None)

        named = [(name, module) for name, module in self.model.named_modules() if name]
        for name, module in named or [("(model)", self.model)]:  # a model of one layer: itself
            self.handles.append(module.register_forward_pre_hook(before(name)))
            self.handles.append(module.register_forward_hook(after))
        return self

    def __exit__(self, *exc):
        for marks in self.open.values():  # a forward that raised left its marks open
            while marks:
                marks.pop().__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        return False


def _tables(report: ProfileReport, averages, cuda: bool) -> None:
    """The ops by self time and by memory, and the modules by forward time (inclusive of what they call)."""
    ops, modules = [], []
    for event in averages:
        key = event.key
        if key.startswith(MODULE_MARK):
            name, _, kind = key[len(MODULE_MARK):].rpartition(" (")
            modules.append({"name": name, "type": kind.rstrip(")"), "forward_ms": event.cpu_time_total / 1000, "calls": event.count})
        elif not key.startswith("ProfilerStep"):
            row = {"name": key, "calls": event.count, "self_ms": event.self_cpu_time_total / 1000,
                   "total_ms": event.cpu_time_total / 1000, "memory_mb": event.self_cpu_memory_usage / 2**20}
            if cuda:
                row["device_ms"] = getattr(event, "self_device_time_total", 0) / 1000
                row["device_memory_mb"] = getattr(event, "self_device_memory_usage", 0) / 2**20
            ops.append(row)
    total = sum(report.step_seconds) * 1000 or 1.0
    by_time = "device_ms" if cuda else "self_ms"
    report.top_ops = sorted(ops, key=lambda row: row[by_time], reverse=True)[:TOP]
    report.top_memory = [row for row in sorted(ops, key=lambda row: row["memory_mb"], reverse=True)[:TOP] if row["memory_mb"] > 0]
    for row in modules:
        row["share"] = row["forward_ms"] / total
    report.top_modules = sorted(modules, key=lambda row: row["forward_ms"], reverse=True)[:TOP]


def _data_wait_share(store: Store, run_id: str) -> Optional[float]:
    """The median share of a recorded step spent waiting for data (data_time / (data_time + step_time))."""
    data = dict(store.metric_history(run_id, "data_time"))
    steps = dict(store.metric_history(run_id, "step_time"))
    shares = [data[s] / (data[s] + steps[s]) for s in data if s in steps and data[s] + steps[s] > 0]
    return statistics.median(shares) if shares else None
