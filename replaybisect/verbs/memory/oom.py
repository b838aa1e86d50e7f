"""`replay memory` on a run whose step ran out of memory: the step replayed from its snapshot without a cap, under
torch.profiler's memory profile (each tensor's kind: activation, gradient, optimizer state, temporary) with every
tensor saved for the backward attributed to the module whose forward saved it; again at half the batch, which gives
the bytes each sample adds; then the batch size that fits the recorded cap, proven by running the step under that
cap (CPU: the process's address-space limit, RLIMIT_AS, set to what the recorded step had left), where the full
batch runs out of memory again as it did."""

from __future__ import annotations

import collections
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from replaybisect.core import oom

MARGIN = 0.9  # of the headroom a suggested batch may plan for (allocator overhead, fragmentation)
BIG_TENSOR = 2**20  # saved tensors listed with their line: at least this many bytes
SHOWN = 5


@dataclass
class OutOfMemory:
    """What the failing step needed, where it went, and what fits."""

    step: int
    rows: int  # the failing step's batch size
    cap: Optional[int] = None  # the memory limit the run had (bytes; CPU: RLIMIT_AS)
    headroom: Optional[float] = None  # what the step had left for its own tensors under that cap (bytes)
    peak: float = 0.0  # the step's own tensors at their peak (bytes), replayed without a cap
    at_peak: dict[str, float] = field(default_factory=dict)  # that peak by kind: activations, gradients, ...
    modules: list[list] = field(default_factory=list)  # [module, bytes of the activations it saved], largest first
    tensors: list[dict] = field(default_factory=list)  # the largest saved tensors: module, shape, bytes, line
    per_sample: Optional[float] = None  # bytes one more sample adds to the peak
    fits: Optional[int] = None  # a batch size that fits the cap
    reproduced: Optional[bool] = None  # the full batch ran out of memory again under the cap
    proven: bool = False  # the step at `fits` ran under the cap
    detail: str = ""  # how the fit was found, or why it could not be proven
    suggestion: str = ""


def analyse(state, run_id: str, step: int, batch, tags: dict[str, str], log: Callable[[str], None]) -> OutOfMemory:
    """The failing step (`batch` as stored) replayed on copies of `state`, which stays the state before it."""
    from replaybisect.core import user_step
    from replaybisect.verbs.check.batches import batch_size_of, samples_of

    rows = batch_size_of(user_step.data_of(user_step.unpack(batch)[0]))
    found = OutOfMemory(step=step, rows=rows, cap=_int_tag(tags, "memory_limit"))
    log(f"replaying step {step} ({rows} samples) under the memory profiler")
    try:
        full = _profiled(state, step, batch, _int_tag(tags, "failed_allocation"))
    except Exception as error:  # noqa: BLE001 - out of memory with no cap at all: the step, not the machine
        if not oom.is_out_of_memory(error):
            raise
        capped = oom.address_space_cap()
        if capped is not None:  # (a script replayed in its own process may set RLIMIT_AS again as it starts)
            found.detail = (f"the step runs out of memory here too, under this process's own cap of {capped} bytes "
                            "(ulimit -v, or the script's setrlimit): replay it where nothing caps it to measure it")
            return found
        found.detail = (f"the step runs out of memory here too, with no cap ({type(error).__name__}: "
                        f"{str(error).splitlines()[0][:160]}): it asks for more than this machine has, whatever the batch size")
        found.suggestion = f"replay nan --run-id {run_id}: the op that asked for it, its line and the batch's values"
        return found
    found.peak, found.at_peak = full.peak, full.at_peak
    found.modules = [[name, size] for name, size in full.saved.most_common(SHOWN)]
    found.tensors = sorted(full.big, key=lambda item: -item["bytes"])[:SHOWN]
    half = samples_of(batch, rows // 2) if rows >= 2 else None
    if half is not None:
        log(f"again at {rows // 2} samples: the bytes a sample adds")
        found.per_sample = max(0.0, (full.peak - _profiled(state, step, half, None).peak) / (rows - rows // 2))
    at_failure = _int_tag(tags, "memory_at_failure")
    if found.cap is not None and at_failure is not None and full.before_failure is not None:
        found.headroom = float(found.cap - (at_failure - full.before_failure))
    _fit(found, state, batch, log)
    found.suggestion = _suggestion(found)
    return found


# ---- one step, profiled -----------------------------------------------------------------------------------------
@dataclass
class _Profile:
    peak: float  # the step's own tensors (made in it) at their peak
    at_peak: dict[str, float]
    before_failure: Optional[float]  # the step's own tensors alive as it asked for the recorded failing allocation
    saved: collections.Counter
    big: list


def _profiled(state, step: int, batch, failing: Optional[int]) -> _Profile:
    from torch.profiler import ProfilerActivity, profile

    from replaybisect.core import loop

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if state.device.type == "cuda" else [])
    with loop.state_copy(state) as copy, _saved_activations(copy.model) as (saved, big):
        with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
            loop.run_step(copy, step, loop.to_device(batch, copy.device), halt_on_nonfinite=False)
    return _Profile(*_timeline(prof._memory_profile(), failing), saved, big)


def _timeline(memory, failing: Optional[int]) -> tuple[float, dict[str, float], Optional[float]]:
    """(peak of the tensors made in the step, that peak by kind, what was alive as the failing allocation was asked)."""
    live: collections.Counter = collections.Counter()
    made = 0.0
    peak, at_peak, before_failure = 0.0, {}, None
    for _, action, (key, version), size in memory.timeline:
        if action.name == "PREEXISTING" or action.name == "INCREMENT_VERSION":
            continue
        category = memory._categories.get(key, version)
        kind = _KINDS.get(category.name if category is not None else None, "other")
        if action.name == "CREATE":
            if failing is not None and before_failure is None and size == failing:
                before_failure = made
            live[kind] += size
            made += size
        elif action.name == "DESTROY":
            live[kind] -= size
            made -= size
        if made > peak:
            peak, at_peak = made, {name: float(value) for name, value in live.items() if value > 0}
    return peak, at_peak, before_failure


_KINDS = {"ACTIVATION": "activations", "AUTOGRAD_DETAIL": "activations", "GRADIENT": "gradients",
          "OPTIMIZER_STATE": "optimizer state", "TEMPORARY": "temporaries", "INPUT": "inputs", "PARAMETER": "parameters"}


@contextmanager
def _saved_activations(model: torch.nn.Module) -> Iterator[tuple[collections.Counter, list]]:
    """Bytes of the tensors each module's forward saved for the backward (its innermost module; parameters left
    out), and the large ones with the line of the user's code that made them."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    names = {id(module): f"{name or 'model'} ({type(module).__name__})" for name, module in model.named_modules()}
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}
    stack: list[torch.nn.Module] = []
    saved: collections.Counter = collections.Counter()
    big: list[dict] = []
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in weights or pointer in seen or storage.nbytes() == 0:
            return tensor
        seen.add(pointer)
        module = next((names[id(m)] for m in reversed(stack) if id(m) in names), "(outside the model's modules)")
        saved[module] += storage.nbytes()
        if storage.nbytes() >= BIG_TENSOR:
            big.append({"module": module, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
                        "bytes": storage.nbytes(), "line": _user_line()})
        return tensor

    def entered(module, args) -> None:
        stack.append(module)

    def left(module, args, output) -> None:  # (a forward hook that returns something replaces the output)
        if stack:
            stack.pop()

    hooks = [register_module_forward_pre_hook(entered), register_module_forward_hook(left)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield saved, big
    finally:
        for hook in hooks:
            hook.remove()


def _user_line() -> Optional[str]:
    import traceback

    from replaybisect.frames import is_user_code

    for frame in reversed(traceback.extract_stack(limit=40)):
        if is_user_code(frame.filename):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}  {(frame.line or '').strip()}"
    return None


# ---- what fits, proven under the cap ------------------------------------------------------------------------------
def _fit(found: OutOfMemory, state, batch, log: Callable[[str], None]) -> None:
    from replaybisect.verbs.check.batches import samples_of

    if found.headroom is None:
        found.detail = "the run recorded no memory cap (RLIMIT_AS) with the failure, so no batch size can be proven to fit it"
        return
    if found.per_sample is None:
        found.detail = "the step's batch cannot be cut into samples (its tensors differ in their first dimension): no smaller batch was tried"
        return
    if found.per_sample <= 0:
        found.detail = "the step's memory does not grow with its batch: no batch size fits"
        return
    fixed = found.peak - found.per_sample * found.rows
    size = _rounded(math.floor((MARGIN * found.headroom - fixed) / found.per_sample))
    if size < 1:
        found.detail = f"even one sample needs more than the {_mb(found.headroom)} the step had under the cap"
        return
    size = min(size, found.rows - 1)
    if oom.address_space() is None or state.device.type != "cpu":
        found.fits, found.detail = size, "estimated from the profile (proven under a cap on CPU only, with RLIMIT_AS)"
        return
    found.reproduced = _runs_under_cap(state, found.step, batch, found.headroom) is False
    estimate = size
    for _ in range(4):
        log(f"step {found.step} at {size} samples under the recorded cap")
        if _runs_under_cap(state, found.step, samples_of(batch, size), found.headroom):
            found.fits, found.proven = size, True
            found.detail = (f"step {found.step} at batch size {size} ran under the same cap ({_mb(found.headroom)} left for the "
                            f"step's tensors)" + ("; at the recorded " + str(found.rows) + " it ran out of memory again, as recorded"
                                                  if found.reproduced else ""))
            return
        size = _rounded(size * 3 // 4)
        if size < 1:
            break
    found.detail = f"no batch size tried ran under the cap here (from {estimate} down); the profile's estimate is {estimate}"


def _runs_under_cap(state, step: int, batch, headroom: float) -> Optional[bool]:
    """Whether the step runs with this process's address space capped at its size now plus `headroom`."""
    import gc

    from replaybisect.core import loop

    if batch is None:
        return None
    with loop.state_copy(state) as copy:
        device_batch = loop.to_device(batch, copy.device)
        gc.collect()
        try:
            with oom.address_space_capped(int(oom.address_space() + headroom)):
                loop.run_step(copy, step, device_batch, halt_on_nonfinite=False)
        except Exception as error:  # noqa: BLE001 - running out of memory is the answer; anything else goes up
            if not oom.is_out_of_memory(error):
                raise
            return False
    return True


def _rounded(size: int) -> int:
    """A batch size as people pick one: a multiple of 8 from 16 up."""
    return size - size % 8 if size >= 16 else size


def _suggestion(found: OutOfMemory) -> str:
    parts = []
    if found.fits is not None:
        parts.append(f"train with batch size {found.fits}" + (f" (or {math.ceil(found.rows / found.fits)} accumulated "
                                                               f"micro-batches of it for the same {found.rows})" if found.fits < found.rows else ""))
    if found.modules:
        module, size = found.modules[0]
        parts.append(f"checkpoint the activations of {module} (torch.utils.checkpoint): it saves {_mb(size)} for the backward")
    return "; or ".join(parts)


def _mb(size: float) -> str:
    return f"{size / 2**20:.0f} MiB"


def _int_tag(tags: dict[str, Any], name: str) -> Optional[int]:
    try:
        return int(tags[name]) if name in tags else None
    except (TypeError, ValueError):
        return None
