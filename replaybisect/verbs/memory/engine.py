"""`replay memory`: what keeps memory growing, named from a replay.

A few recorded steps are replayed from a snapshot while this process's tensors are watched between steps (the garbage
collector's view, so no cost inside a step): a tensor made in one step and still alive steps later that is not the
model's, its gradients' or its optimizer's state is kept by the loop. Its holder is named (a list, a dict or a tensor
reached from a module's globals, the loop's frame or an object), with how it grows a step and what it keeps alive (an
autograd graph: every step's activations), and the line of the script that adds to it. Two shapes are told apart:
a container that gains tensors each step (`losses.append(loss)`), and a tensor whose autograd graph gains nodes each
step (`total_loss += loss`).
"""

from __future__ import annotations

import gc
import os
import re
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.replay import restore as restore_mod
from replaybisect.core import oom, reentry
from replaybisect.errors import SnapshotError
from replaybisect.store import Store
from replaybisect.verbs.memory.oom import OutOfMemory, analyse

GRAPH_NODES_LIMIT = 200_000  # nodes walked in one autograd graph (a graph that grows a step is found long before)
OUR_PACKAGE = "replaybisect"


@dataclass
class Holder:
    """Something the loop keeps across steps, and what it keeps."""

    name: str  # `losses`, `self.history`, ...
    where: str  # "a global of main.py", "a local of train() (main.py)", "an attribute of Trainer"
    kind: str  # "list" | "dict" | "tensor"
    grows: str  # "1 tensor a step" | "an autograd graph of 12 nodes more a step"
    per_step: float  # tensors (a container) or graph nodes (a tensor) gained a step
    keeps_graph: bool  # what it keeps holds an autograd graph (every step's activations)
    line: Optional[str] = None  # `main.py:31  losses.append(loss)`: where the loop adds to it
    fix: str = ""


@dataclass
class MemoryReport:
    run_id: str
    step: int  # the first watched step
    steps: int
    snapshot_step: int
    losses: str  # the watched steps' losses against the logged ones: exact | close | diverged | unchecked
    rss_per_step: Optional[float]  # bytes the process grew a step while the steps ran (Linux: /proc/self/statm)
    holders: list[Holder] = field(default_factory=list)
    out_of_memory: Optional[OutOfMemory] = None  # the failing step ran out of memory: where it went, what fits
    warnings: list[str] = field(default_factory=list)
    report_run_id: Optional[str] = None

    @property
    def found(self) -> bool:
        return bool(self.holders) or self.out_of_memory is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MemoryReport":
        failed = data.get("out_of_memory")
        return cls(**{**data, "holders": [Holder(**holder) for holder in data.get("holders", [])],
                      "out_of_memory": OutOfMemory(**failed) if failed else None})


def memory(store: Store, run_id: str, step: Optional[int] = None, *, steps: int = 4, device=None, trust=None,
           log: Optional[Callable[[str], None]] = None) -> MemoryReport:
    """Replay `steps` recorded steps of run `run_id` from the snapshot at or before `step` (default: the newest snapshot
    with that many recorded steps after it) and name what the loop keeps across them. Reads the store, writes nothing."""
    log = log or (lambda message: None)
    cfg = restore_mod.run_config(store, run_id, trust)
    if cfg.train.get("script") is not None and not reentry.replaying():  # a script's loop: watched inside the script
        from replaybisect.replay.script import run_in_script

        arguments = {"step": step, "steps": steps, "device": str(device) if device is not None else None}
        return MemoryReport.from_json(run_in_script("memory", store, run_id, cfg, trust, arguments, log))
    losses = restore_mod.logged_losses(store, run_id)
    tags = store.tags(run_id)
    if tags.get("failure_kind") == oom.KIND:
        return _out_of_memory(store, run_id, cfg, tags, losses, device, log)
    if not losses:
        raise SnapshotError(f"run {run_id} logged no steps: nothing to replay")
    last = max(losses)
    warnings: list[str] = []
    snapshot = restore_mod.newest_good_snapshot(store, run_id, step if step is not None else max(0, last - steps + 1), warnings)
    count = max(1, min(steps, last - snapshot.step + 1))
    if count < steps:
        warnings.append(f"the run logged steps up to {last}: {count} step{'s' if count > 1 else ''} watched, not {steps}")
    log(f"restoring snapshot {snapshot.step}, watching steps {snapshot.step}..{snapshot.step + count - 1}")
    restored = restore_mod.restore(store, run_id, cfg=cfg, device=device, snapshot=snapshot)
    with restore_mod.stored_batch_errors(restored):
        report = MemoryReport(run_id=run_id, step=restored.snapshot.step, steps=count, snapshot_step=restored.snapshot.step,
                              losses="unchecked", rss_per_step=None, warnings=warnings)
        _watch(restored, report, losses)
    for warning in restored.warnings:
        restore_mod.add_warning(report.warnings, warning)
    return report


def _out_of_memory(store: Store, run_id: str, cfg, tags: dict[str, str], logged: dict[int, float], device,
                   log: Callable[[str], None]) -> MemoryReport:
    """The step that ran out of memory, reached by replaying the recorded steps before it from their snapshot, then
    examined (oom.analyse)."""
    from replaybisect.core import loop
    from replaybisect.core.tags import failing_step

    failing = failing_step(store, run_id)
    warnings: list[str] = []
    snapshot = restore_mod.newest_good_snapshot(store, run_id, failing, warnings)
    log(f"restoring snapshot {snapshot.step}, replaying steps {snapshot.step}..{failing - 1}")
    restored = restore_mod.restore(store, run_id, cfg=cfg, device=device, snapshot=snapshot)
    report = MemoryReport(run_id=run_id, step=snapshot.step, steps=failing - snapshot.step, snapshot_step=snapshot.step,
                          losses="unchecked", rss_per_step=None, warnings=warnings)
    with restore_mod.stored_batch_errors(restored):
        state, replayed = restored.state, {}
        for step in range(snapshot.step, failing):
            replayed[step] = loop.run_step(state, step, loop.to_device(restored.batch(step), state.device)).loss
        report.losses = restore_mod.losses_verdict(replayed, logged) if replayed else "unchecked"
        report.out_of_memory = analyse(state, run_id, failing, restored.batch(failing), tags, log)
    for warning in restored.warnings:
        restore_mod.add_warning(report.warnings, warning)
    return report


def _watch(restored, report: MemoryReport, logged: dict[int, float]) -> None:
    """Run the steps; after each, read what the loop's names hold: how many tensors each container holds, how many
    autograd nodes each tensor's graph has."""
    from replaybisect.core import loop

    state = restored.state
    counts: dict[tuple, list] = {}  # (name, where, file) -> the measure at each step's end (None: not there)
    values: dict[tuple, Any] = {}
    rss = [oom.resident()]
    replayed = {}
    for index in range(report.steps):
        step = report.step + index
        batch = loop.to_device(restored.batch(step), state.device)
        replayed[step] = loop.run_step(state, step, batch).loss
        gc.collect()
        for name, value in _named_values(state.model):
            measure = _measure(value)
            if measure is not None:
                counts.setdefault(name, [None] * index).append(measure)
                values[name] = value
        for series in counts.values():  # a name gone at this step's end
            series += [None] * (index + 1 - len(series))
        rss.append(oom.resident())
    report.losses = restore_mod.losses_verdict(replayed, logged)
    if all(value is not None for value in rss) and len(rss) > 2:
        deltas = sorted(b - a for a, b in zip(rss[1:], rss[2:]))  # the first step pays for warm-up
        report.rss_per_step = float(deltas[len(deltas) // 2])
    report.holders = [_holder(name, values[name], series) for name, series in counts.items() if _grows(series)]


def _grows(series: list[Optional[int]]) -> bool:
    """Present at every step's end and larger at each (a step may add more than one)."""
    return len(series) >= 3 and None not in series and all(b > a for a, b in zip(series, series[1:]))


def _measure(value: Any) -> Optional[int]:
    """A container's tensors (one level of nesting), or a tensor's autograd graph nodes; None for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return _graph_nodes(value) if value.grad_fn is not None else None
    if isinstance(value, (list, tuple, dict)) or type(value).__name__ == "deque":
        items = list(value.values()) if isinstance(value, dict) else list(value)
        nested = [inner for item in items if isinstance(item, (list, tuple)) for inner in item]
        count = sum(isinstance(item, torch.Tensor) for item in items + nested)
        return count or None
    return None


def _graph_nodes(tensor) -> int:
    """The nodes of the tensor's autograd graph (every node once), up to GRAPH_NODES_LIMIT."""
    seen = set()
    todo = [tensor.grad_fn]
    while todo and len(seen) < GRAPH_NODES_LIMIT:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return len(seen)


def _holder(name: tuple[str, str, Optional[str]], value: Any, series: list[int]) -> Holder:
    import torch

    per_step = (series[-1] - series[0]) / (len(series) - 1)
    if isinstance(value, torch.Tensor):
        grows, kind, keeps_graph = f"an autograd graph of {per_step:g} nodes more a step", "tensor", True
    else:
        items = list(value.values()) if isinstance(value, dict) else list(value)
        keeps_graph = any(isinstance(item, torch.Tensor) and item.grad_fn is not None for item in items)
        grows, kind = f"{per_step:g} tensor{'s' if per_step != 1 else ''} a step", type(value).__name__
    return Holder(name=name[0], where=name[1], kind=kind, grows=grows, per_step=per_step, keeps_graph=keeps_graph,
                  line=_adding_line(name[0], name[2]), fix=_fix(name[0], kind, keeps_graph))


# ---- the loop's names: its modules' globals, its frames' locals, its model's attributes ------------------------------
def _user_file(path: Optional[str]) -> bool:
    """A file of the user's code: not Python's, not an installed package's, not ours."""
    if not path or path.startswith("<"):
        return False
    path = os.path.realpath(path)
    library = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return not any(path.startswith(root + os.sep) for root in library | {os.path.dirname(ours)})


def _named_values(model) -> list[tuple[tuple[str, str, Optional[str]], Any]]:
    """(name, where, file) -> value for every value the loop's code can name."""
    found = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if _user_file(file):
            shown = Path(file).name
            found += [((key, f"a global of {shown}", file), value) for key, value in list(vars(module).items())
                      if not key.startswith("__")]
    for thread_id, frame in sys._current_frames().items():
        if thread_id == threading.get_ident():
            continue  # ours: the replay's own frames
        while frame is not None:
            file = frame.f_code.co_filename
            if _user_file(file) and frame.f_code.co_name != "<module>":
                shown = f"a local of {frame.f_code.co_name}() ({Path(file).name})"
                found += [((key, shown, file), value) for key, value in list(frame.f_locals.items())]
            frame = frame.f_back
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for key, value in list(vars(module).items()):
            if not key.startswith("_"):
                found.append(((f"model.{prefix}{key}", f"an attribute of {type(module).__name__}",
                               _source_file(type(module))), value))
    return found


def _source_file(cls) -> Optional[str]:
    import inspect

    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


ADDS = r"(\.\s*(append|extend|insert|add|update|setdefault|appendleft)\s*\(|\s*\[[^\]]*\]\s*=[^=]|\s*\+=)"


def _adding_line(name: str, file: Optional[str]) -> Optional[str]:
    """`main.py:31  losses.append(loss)`: the first line of `file` that adds to `name` (its last part for an
    attribute: `self.history.append(...)` adds to `model.history`)."""
    if not file or not os.path.isfile(file):
        return None
    short = name.rsplit(".", 1)[-1]
    pattern = re.compile(rf"(?<![\w.]){re.escape(short)}{ADDS}|\.{re.escape(short)}{ADDS}|(?<![\w.]){re.escape(short)}\s*=\s*{re.escape(short)}\s*[-+*]")
    try:
        lines = Path(file).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for number, text in enumerate(lines, start=1):
        if pattern.search(text.split("#", 1)[0]):
            return f"{Path(file).name}:{number}  {text.strip()}"
    return None


def _fix(name: str, kind: str, keeps_graph: bool) -> str:
    if kind == "tensor":
        return f"accumulate a number: `{name} += loss.item()` (a tensor sum keeps every step's graph)"
    if keeps_graph:
        return f"keep numbers in `{name}` (`loss.item()`), or `.detach()` what must stay a tensor: each element keeps its step's graph"
    return f"keep numbers (`.item()`) or CPU copies (`.cpu()`) in `{name}`, or clear it each step"
