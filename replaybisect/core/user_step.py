"""The step of a run recorded from the user's own loop (`replaybisect.Recorder`, the Lightning callback).

The user's step function does everything: forward, backward, clipping, the optimizer update, accumulation over
micro-batches. This module runs it so that everything built on the built-in step works unchanged:

  - observers see the same moments: `forward_context` around each forward (closed when `.backward()` is called),
    `after_forward` with the tensor being backpropagated, `after_backward` and `before_update` in a global
    optimizer pre-step hook (gradients unscaled by a GradScaler by then), `after_update` in a post-step hook;
  - a non-finite loss or gradient stops the step before the optimizer update (`halt_on_nonfinite`);
  - ablation arms act on the live objects: clipping in the pre-step hook (`train.clip_grad_norm`), fp32 by
    turning every autocast region off (`train.precision=fp32`), the lr through the optimizer's own hooks;
  - each stored batch carries the RNG states its step started with (torch, CUDA, Python, NumPy), so whatever
    the user's loop draws between steps (sampling a batch, say) does not shift a replay's dropout masks.

Replay rebuilds the objects with the user's importable `build(config)` (`train.build`), and calls the step
function (`train.step_fn`) with the arguments it names, from STEP_ARGUMENTS.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import warnings
from typing import Any, Callable, Optional

import torch

from replaybisect.core.config import needs_closure, once_per_callable
from replaybisect.core import rng, several
from replaybisect.core.ranks import agreed
from replaybisect.core.outside_model import names_read
from replaybisect.core.inline_step import RemoteStep
from replaybisect.core.step_watch import StepHalted, StepWatch
from replaybisect.errors import ConfigError, SnapshotError

STEP_ARGUMENTS = ("model", "optimizer", "scheduler", "scaler", "batch", "config", "cfg", "step", "carry")
RECORD_BATCH, RECORD_RNG, RECORD_LR, RECORD_CARRY, RECORD_VARIABLES = "batch", "rng", "lr", "carry", "variables"
RECORD_GRADS = "grads_carried"  # the step began with the gradients its loop left (not cleared): its replay keeps them
RECORD_EVAL = "eval_modules"  # the modules in eval mode as the step began (a frozen batch norm; "" the whole model)
RECORD_KEYS = {RECORD_BATCH, RECORD_RNG, RECORD_LR, RECORD_CARRY, RECORD_VARIABLES, RECORD_GRADS, RECORD_EVAL}
SCALARS = (bool, int, float, str, type(None))
NO_LOSS = type("NoLoss", (), {"__repr__": lambda self: "NO_LOSS"})()  # a step whose every batch was skipped: no loss, no failure
# A Lightning step's stored batch: its micro-batches, and where each sat in Lightning's loop (replaybisect.lightning)
LIGHTNING_BATCHES, LIGHTNING_POSITIONS = "batches", "lightning"


# ---- the step function's arguments ------------------------------------------------------------------------
@once_per_callable  # (a step asks three times)
def step_arguments(step_fn: Callable) -> list[str]:
    """The names the step function takes; a required one we cannot give is a ConfigError."""
    try:
        parameters = inspect.signature(step_fn).parameters.values()
    except (TypeError, ValueError):
        raise ConfigError(f"step_fn {step_fn!r} has no signature to read; pass a plain function") from None
    names = []
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name in STEP_ARGUMENTS:
            names.append(parameter.name)
        elif parameter.default is parameter.empty:
            raise ConfigError(f"step_fn's argument {parameter.name!r} is not one replaybisect can pass; name your "
                              f"arguments from {', '.join(STEP_ARGUMENTS)}")
    if "batch" not in names:
        raise ConfigError("step_fn takes no `batch` argument; write it as train_step(model, optimizer, batch, ...)")
    return names


def call_step(state, batch, step: int):
    if state.carry is None:  # a step given a plain batch, not a record (check's probes): it starts with an empty carry
        state.carry = {}
    values = {"model": state.model, "optimizer": state.optimizer, "scheduler": state.scheduler, "scaler": state.scaler,
              "batch": batch, "config": state.user_config, "cfg": state.user_config, "step": step, "carry": state.carry}
    return state.step_fn(**{name: values[name] for name in step_arguments(state.step_fn)})


def takes_carry(step_fn: Callable) -> bool:
    """A step that takes `carry` keeps state for the next step in it (an RNN's hidden state): stored with each
    step's batch, taken from the record by a replay's first step, then carried by the replay itself."""
    return "carry" in step_arguments(step_fn)


def steps_scheduler_itself(step_fn: Callable) -> bool:
    """A step function that takes `scheduler` steps it; otherwise the recorder steps the scheduler after the update."""
    return "scheduler" in step_arguments(step_fn)


# ---- building -----------------------------------------------------------------------------------------------
def user_config(cfg):
    """The user's own config, as their build and step functions get it: a (non-struct) DictConfig."""
    from omegaconf import OmegaConf

    node = cfg.get("user")
    return OmegaConf.create(OmegaConf.to_container(node, resolve=True) if node is not None else {})


def build_parts(cfg) -> dict[str, Any]:
    """model, optimizer, scheduler, scaler from the user's build(config), and the step function."""
    from replaybisect.core import ranks, reentry
    from replaybisect.core.config import instantiate

    if cfg.train.get("script") is not None:  # recorded from a script: the objects its re-entered run handed over
        parts = reentry.live_parts()
        parts["user_config"] = user_config(cfg)
        step_arguments(parts["step_fn"])
        return parts
    build = instantiate(cfg.train.build, "train.build")
    config = user_config(cfg)
    distributed = ranks.recorded_world_size(cfg) > 1
    if distributed:  # the user's build wraps the model in DDP: one process stands in for the recorded ranks
        ranks.one_process_group()
    parts = unpack_parts(build(config), "train.build")
    parts["step_fn"] = instantiate(cfg.train.step_fn, "train.step_fn")
    if distributed and not ranks.reduces_itself(parts["step_fn"]) and ranks.replaying_rank() is None:  # (--nproc: DDP's own)
        if ranks.recorded_sharded(cfg):
            ranks.attach_sharded_reduction(parts["model"])
        else:
            ranks.attach_reduction(parts["model"])
    parts["user_config"] = config
    step_arguments(parts["step_fn"])
    return parts


def unpack_parts(built: Any, what: str) -> dict[str, Any]:
    """A dict with model/optimizer[/scheduler/scaler], or a tuple in that order. Models, optimizers and schedulers
    may be several, each a dict by name (core/several.py)."""
    if isinstance(built, dict):
        parts = {key: built.get(key) for key in ("model", "optimizer", "scheduler", "scaler")}
    elif isinstance(built, (tuple, list)) and 2 <= len(built) <= 4:
        parts = dict(zip(("model", "optimizer", "scheduler", "scaler"), list(built) + [None] * (4 - len(built))))
    else:
        raise ConfigError(f"{what} returned a {type(built).__name__}; return (model, optimizer[, scheduler[, scaler]]) or a dict with those keys")
    parts = several.joined(parts)
    if not isinstance(parts["model"], torch.nn.Module):
        raise ConfigError(f"{what} returned a {type(parts['model']).__name__} as the model; return a torch.nn.Module")
    if parts["optimizer"] is None:  # the loop updates the parameters by hand: the update is observed, not made
        parts["optimizer"] = ManualUpdate(parts["model"].parameters())
    if not isinstance(parts["optimizer"], torch.optim.Optimizer):
        raise ConfigError(f"{what} returned a {type(parts['optimizer']).__name__} as the optimizer; return a torch.optim.Optimizer, "
                          "or None when your step updates the parameters itself")
    scheduler, scaler = parts["scheduler"], parts["scaler"]
    if scheduler is not None and not _has_methods(scheduler, SCHEDULER_METHODS):
        raise ConfigError(f"{what} got {_kind(scheduler)} as the scheduler, not a learning-rate scheduler (its "
                          f"{', '.join(SCHEDULER_METHODS)}); pass a torch.optim.lr_scheduler object built on the optimizer, or None")
    if scheduler is not None and getattr(scheduler, "optimizer", parts["optimizer"]) is not parts["optimizer"]:
        raise ConfigError(f"{what} got a scheduler ({type(scheduler).__name__}) built on another optimizer than its own; "
                          "build it on the optimizer passed with it")
    if scaler is not None and not _has_methods(scaler, SCALER_METHODS):
        raise ConfigError(f"{what} got {_kind(scaler)} as the scaler, not a gradient scaler (its {', '.join(SCALER_METHODS)}); "
                          "pass a torch.amp.GradScaler, or None")
    return parts


class ManualUpdate(torch.optim.Optimizer):
    """The optimizer of a loop that updates its parameters by hand (`p.data.add_(p.grad, alpha=-lr)`, no optimizer
    object): it changes nothing itself. The step watch sees the gradients when the step's one backward returns
    (the non-finite rule stops the step there, before the update; a clip arm clips them for the user's update),
    and calls `step()` once the user's step returned: it stands for the update the step made. At its recorded lr
    of 1.0 it leaves the parameters as the step left them; an lr arm's factor f makes the update f times the
    step's: before + f * (after - before)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1.0})
        self._before: Optional[list[torch.Tensor]] = None
        self._grads_at_mark: list = []

    def mark(self) -> None:
        """The parameters before the user's update (taken when the gradients are complete), and their gradients."""
        params = self._params()
        self._before = [p.detach().clone() for p in params]
        self._grads_at_mark = [(p.grad, p.grad._version if p.grad is not None else None) for p in params]

    def marked(self) -> bool:
        """The step's one backward returned: the user's update follows (until `step()` stands for it)."""
        return self._before is not None

    def untouched(self) -> bool:
        """Neither the gradients (the same tensors, never written since) nor the parameters changed since the mark:
        the loop went on without updating (a second micro-batch, accumulating). An update too small to change a
        parameter's value still comes with the gradients cleared or zeroed for the next step."""
        params = self._params()
        grads_kept = all(p.grad is grad and (grad is None or grad._version == version)
                         for p, (grad, version) in zip(params, self._grads_at_mark))
        return grads_kept and all(torch.equal(p, before) for p, before in zip(params, self._before))

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        factors = [float(group["lr"]) for group in self.param_groups for _ in group["params"]]
        if self._before is not None:
            for p, before, factor in zip(params, self._before, factors):
                if factor != 1.0:
                    p.copy_(before + factor * (p - before))
        self._before = None


SCHEDULER_METHODS = ("step", "state_dict", "load_state_dict")  # what recording and replaying a scheduler calls
SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale", "is_enabled", "state_dict", "load_state_dict")


def _has_methods(value: Any, names: tuple[str, ...]) -> bool:
    return not isinstance(value, type) and all(callable(getattr(value, name, None)) for name in names)


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def model_device(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


# ---- the stored batch: the user's batch and the RNG state its step started with ----------------------------
def pack(batch: Any, device: torch.device, raw: Optional[dict[str, Any]] = None, optimizer=None,
         carry: Optional[dict] = None, variables: Optional[dict[str, Any]] = None, grads_carried: bool = False,
         eval_modules: Optional[list[str]] = None) -> dict[str, Any]:
    """The batch as the recorder stores it (copied: a loop may reuse its buffers) with the RNG states its step
    starts with (core.rng.to_tensors). `raw`: those states as `core.rng.capture_raw` took them at this moment,
    when the caller has them. With `optimizer`, also each param group's lr as the loop set it for this step;
    with `carry`, what the previous step carried to this one (copied); with `variables`, the script's values
    the step reads (step_variables); with `grads_carried`, that the step begins with the gradients the loop left."""
    record = {RECORD_BATCH: copied(batch), RECORD_RNG: rng.to_tensors(raw if raw is not None else rng.capture_raw())}
    if grads_carried:
        record[RECORD_GRADS] = True
    if eval_modules:
        record[RECORD_EVAL] = list(eval_modules)
    if variables is not None:
        record[RECORD_VARIABLES] = variables
    if optimizer is not None:
        record[RECORD_LR] = [float(group["lr"]) for group in optimizer.param_groups]
    if carry is not None:
        if not all(isinstance(key, str) for key in carry):
            raise ConfigError(f"carry has the key {next(k for k in carry if not isinstance(k, str))!r}; name what your step "
                              "carries with strings (carry[\"hidden\"])")
        record[RECORD_CARRY] = copied(carry, "carry")
    return record


# ---- a script's step: the script's own numbers it reads, stored with each step and set again on replay ------
def step_variables(step_fn: Callable) -> dict[str, Any]:
    """The numbers, strings and flags a script's step reads from the script as this step starts: its closure's
    cells ("cell:NAME") and the module globals its code names ("global:NAME"). A replay takes the script's objects
    over at its first step, when the script's own counters and settings (an lr it anneals, iter_num) hold their
    first values: these are set again before each replayed step, as the param groups' lr is."""
    values = {}
    code = getattr(step_fn, "__code__", None)
    if code is None:
        return values
    for name, cell in zip(code.co_freevars, getattr(step_fn, "__closure__", None) or ()):
        try:
            content = cell.cell_contents
        except ValueError:  # a cell not yet assigned
            continue
        if isinstance(content, SCALARS):
            values[f"cell:{name}"] = content
    namespace = getattr(step_fn, "__globals__", {})
    for name in sorted(names_read(code)):
        if name in namespace and isinstance(namespace[name], SCALARS) and not name.startswith("__"):
            values[f"global:{name}"] = namespace[name]
    return values


def apply_recorded_variables(record: Any, step_fn: Callable) -> None:
    """Set the script's values the recorded step read (step_variables) again; only names the step reads today, only
    scalars: a stored record sets nothing else in the user's script."""
    stored = record.get(RECORD_VARIABLES) if _is_record(record) else None
    if not stored:
        return
    if not isinstance(stored, dict) or not all(isinstance(key, str) and isinstance(value, SCALARS) for key, value in stored.items()):
        raise SnapshotError("a stored step's script variables are not names with numbers, strings or flags: the snapshot "
                            "was changed after recording; re-record the run or examine another step (--step)")
    current = step_variables(step_fn)  # what may be set: a name the step reads that holds a value of that type now
    code = step_fn.__code__
    cells = dict(zip(code.co_freevars, getattr(step_fn, "__closure__", None) or ()))
    for key, value in stored.items():
        if key not in current or type(current[key]) is not type(value) and None not in (current[key], value):
            continue
        kind, _, name = key.partition(":")
        if kind == "cell":
            cells[name].cell_contents = value
        else:
            step_fn.__globals__[name] = value


def copied(value: Any, what: str = "batch") -> Any:
    """A detached copy of a batch or carry (`what`): tensors cloned, in the same containers."""
    kind = type(value)  # (the common containers first: every micro-batch of every recorded step passes here)
    if kind is torch.Tensor:
        return value.detach().clone()
    if kind is tuple or kind is list:
        return kind([copied(item, what) for item in value])
    if kind is dict:
        return {key: copied(item, what) for key, item in value.items()}
    from replaybisect.core.snapshot import is_namedtuple, like, storable_namedtuple

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        if type(value) not in (dict, collections.OrderedDict, collections.defaultdict):
            _warn_plain(type(value), "dict", 'batch["key"]')
        return {key: copied(item, what) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [copied(item, what) for item in value]
        if type(value) in (list, tuple) or (is_namedtuple(value) and storable_namedtuple(value)):
            return like(value, items)
        _warn_plain(type(value), "tuple", "batch[0]")
        return tuple(items)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # said at the first step, not when the first snapshot is written
    raise ConfigError(f"your {what} holds a {type(value).__name__}, which a snapshot cannot store (tensors, numbers, strings, "
                      f"and lists, tuples, namedtuples and dicts of them): pass e.g. a dict or tuple of its fields "
                      f"(dataclasses.asdict for a dataclass, .item() or a tensor for a NumPy value)")


def data_of(batch: Any) -> Any:
    """The data of a stored batch without the bookkeeping around it: a Lightning step's list of micro-batches; a
    distributed step's list of each rank's batch (the global batch, in rank order)."""
    from replaybisect.core import ranks

    if isinstance(batch, dict) and set(batch) == {LIGHTNING_BATCHES, LIGHTNING_POSITIONS} and isinstance(batch[LIGHTNING_BATCHES], list):
        return batch[LIGHTNING_BATCHES]
    if ranks.is_ranks_record(batch):
        merged = []
        for record in batch[ranks.RECORD_RANKS]:
            inner = unpack(record)[0]
            data = data_of(inner)
            merged += data if data is not inner else [data]  # a Lightning rank's micro-batches join the list
        return merged
    return batch


def batch_rows(batch: Any) -> Optional[int]:
    """How many rows a step's batch has: its first tensor's dim 0. None where a row number names no one row: no
    tensor, a distributed step (each rank's batch), or several micro-batches (an accumulated step)."""
    from torch.utils._pytree import tree_leaves

    from replaybisect.core import ranks
    from replaybisect.core.inline_step import ARGS

    if ranks.is_ranks_record(batch):
        return None
    inner = unpack(batch)[0]
    data = data_of(inner)
    micro_batches = data is not inner or (isinstance(data, list) and data and all(isinstance(b, dict) and ARGS in b for b in data))
    if micro_batches and len(data) != 1:
        return None
    return next((leaf.shape[0] for leaf in tree_leaves(data) if isinstance(leaf, torch.Tensor) and leaf.dim()), None)


def without_rows(batch: Any, rows: tuple[int, ...], size: int) -> Any:
    """A step's batch of `size` rows (batch_rows) with `rows` dropped from each of its tensors that has that many: the
    inputs, the targets a loss meets outside the model. Its RNG states and lrs stay as they are."""
    from torch.utils._pytree import tree_map

    kept = torch.tensor([row for row in range(size) if row not in set(rows)], dtype=torch.long)

    def dropped(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == size:
            return value.index_select(0, kept.to(value.device))
        return value

    if _is_record(batch):
        return {**batch, RECORD_BATCH: tree_map(dropped, batch[RECORD_BATCH])}
    return tree_map(dropped, batch)


def _warn_plain(kind: type, stored_as: str, access: str) -> None:
    """A batch container a replay cannot rebuild: said once per type, at record time."""
    if kind in _WARNED:
        return
    _WARNED.add(kind)
    warnings.warn(f"replaybisect: your batch's {kind.__name__} is stored as a plain {stored_as}: a replay hands your "
                  f"step a {stored_as} there (use {access}, or pass a dict, tuple or namedtuple)", stacklevel=4)


_WARNED: set[type] = set()


def _is_record(record: Any) -> bool:
    return isinstance(record, dict) and {RECORD_BATCH, RECORD_RNG} <= set(record) <= RECORD_KEYS


def recorded_carry(record: Any) -> dict:
    """What the recorded step started with in `carry` ({} for a step that takes none, or a plain batch)."""
    carry = record.get(RECORD_CARRY, {}) if _is_record(record) else {}
    if not isinstance(carry, dict) or not all(isinstance(key, str) for key in carry):
        raise SnapshotError(f"a stored step's carry is a {type(carry).__name__}, not a dict of named values: the snapshot "
                            "was changed after recording; re-record the run or examine another step (--step)")
    return copied(carry, "carry")  # the step writes into it: a record replayed again (probes) keeps its own


def unpack(record: Any) -> tuple[Any, Optional[dict]]:
    """A stored step's batch and the RNG states it started with (None for a plain batch)."""
    if _is_record(record):
        return record[RECORD_BATCH], record[RECORD_RNG]
    return record, None


def map_batch(record: Any, change: Callable[[Any], Any]) -> Any:
    """The stored step with `change` applied to its batch (each rank's, for a distributed step), the RNG states and
    the rest kept; None where `change` returns None for any of them."""
    from replaybisect.core import ranks

    if ranks.is_ranks_record(record):
        changed = [map_batch(rank, change) for rank in ranks.rank_records(record)]
        return None if any(rank is None for rank in changed) else {ranks.RECORD_RANKS: changed}
    if not _is_record(record):
        return change(record)
    batch = change(record[RECORD_BATCH])
    return None if batch is None else {**record, RECORD_BATCH: batch}


def apply_recorded_lrs(record: Any, optimizer) -> None:
    """Each param group's lr as the user's loop set it before the step (a schedule the loop computes itself, like
    nanoGPT's `lr = get_lr(iter_num)`): a replay sets it again. Runs recorded before lrs were stored, and plain
    batches (check's probes set their own lr), leave the groups alone."""
    lrs = record.get(RECORD_LR) if _is_record(record) else None
    if lrs is None:
        return
    if not isinstance(lrs, list) or not all(isinstance(lr, (int, float)) and not isinstance(lr, bool)
                                            and math.isfinite(lr) and lr >= 0 for lr in lrs):
        shown = lrs[:4] if isinstance(lrs, list) else type(lrs).__name__
        raise SnapshotError(f"a stored step's learning rates ({str(shown)[:60]}) are not a list of finite numbers >= 0: "
                            "the snapshot was changed after recording; re-record the run or examine another step (--step)")
    if len(lrs) != len(optimizer.param_groups):
        raise SnapshotError(f"a stored step holds {len(lrs)} learning rates, but the optimizer has "
                            f"{len(optimizer.param_groups)} param groups: build(config) makes other groups than the run "
                            "had; make the same optimizer")
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):  # a capturable optimizer's tensor lr
            group["lr"].fill_(lr)
        else:
            group["lr"] = float(lr)


# ---- precision: an fp32 arm turns every autocast region of the user's code off --------------------------
@contextlib.contextmanager
def autocast_off():
    """Every `torch.autocast` (and torch.cuda/cpu.amp.autocast) entered inside runs disabled."""
    autocast = torch.amp.autocast_mode.autocast
    original = autocast.__enter__

    def enter_disabled(self):
        self._enabled = False
        return original(self)

    autocast.__enter__ = enter_disabled
    try:
        yield
    finally:
        autocast.__enter__ = original


def precision_name(dtype: torch.dtype) -> str:
    """The run's precision an autocast dtype stands for."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


@contextlib.contextmanager
def noting_precision(seen: list[str]):
    """Notes the dtype of every enabled autocast region entered inside (fp32: none was): a run's precision."""
    autocast = torch.amp.autocast_mode.autocast
    original = autocast.__enter__

    def enter_noting(self):
        if self._enabled:
            seen.append(precision_name(self.fast_dtype))
        return original(self)

    autocast.__enter__ = enter_noting
    try:
        yield
    finally:
        autocast.__enter__ = original


# ---- one step --------------------------------------------------------------------------------------------
class _KeptFromTheScript:
    """In an inline run's replay (`watch.on_error` set), what stops the step inside its backward stays out of the
    script's code: a halt leaves the rest of its iteration idle, an error goes to the replay's engine. (A class, not
    a generator's context manager: it is entered at every backward of every recorded step.)"""

    __slots__ = ("watch",)

    def __init__(self, watch: StepWatch):
        self.watch = watch

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None or self.watch.on_error is None:
            return False
        if issubclass(kind, StepHalted):
            return True
        if not issubclass(kind, Exception):
            return False
        self.watch.on_error(error)
        return True


@contextlib.contextmanager
def watching(watch: StepWatch):
    """The step watch's moments where the user's step reaches them: every `.backward()` (the loss), the step's own
    `torch.nn.utils.clip_grad_norm_` or else a global optimizer pre-step hook (the gradients before any clip,
    unscaled by a GradScaler by then), and a global post-step hook (the update).
    Global hooks run before the optimizer's own pre-hooks (an arm's lr scaling) and after its post-hooks, so a
    halt never leaves an arm's scaled lr behind."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    original_backward = torch.Tensor.backward
    optimizer = watch.state.optimizer
    manual = isinstance(optimizer, ManualUpdate)
    # several optimizers (core/several.py): each one's gradients are seen at its own update or clip
    joined = isinstance(optimizer, several.Optimizers)
    members = {id(member): member for member in several.members(optimizer)}
    # LBFGS's step(closure): its pre-hook runs before the closure has made any gradient; the step's first evaluation
    # (the loss it returns) is the one observed, at the end of its backward, as the built-in step does
    first_evaluation = not manual and not joined and needs_closure(optimizer)

    def backward(tensor, *args, **kwargs):
        if watch.stopped:  # an inline run's replay halted this step: the rest of the script's iteration runs idle
            return None
        returned = None
        with _KeptFromTheScript(watch):
            try:
                watch.loss(tensor)
                returned = original_backward(tensor, *args, **kwargs)
                watch.backward_done()
                if first_evaluation:
                    watch.gradients()
            finally:
                if not watch.stopped:
                    watch.open_forward()
        if manual and not watch.stopped:  # no optimizer.step() to wait for: the user's update follows now
            with _KeptFromTheScript(watch):
                if optimizer.marked():
                    raise ConfigError("your step backpropagates more than once and updates the parameters itself: with no "
                                      "optimizer, replaybisect sees the update after the one backward; accumulate into one "
                                      "loss, or use a torch.optim optimizer")
                watch.gradients()
                optimizer.mark()
        return returned

    nested: dict[int, int] = {}  # an optimizer's step calls in progress: a subclass's step calling its parent's is one

    def before_update(stepping, args, kwargs) -> None:
        nested[id(stepping)] = nested.get(id(stepping), 0) + 1
        if nested[id(stepping)] > 1:
            return
        if id(stepping) in members and not manual:
            if not first_evaluation:
                watch.gradients(stepping if joined else None)
            if watch.device_guard is not None:  # a fused optimizer skips a failed update on the device: no read
                watch.device_guard.arm(optimizer, watch.verdict)
        elif not watch.stopped:  # another optimizer (a GAN's other half) updates: losses judged before it does
            with _KeptFromTheScript(watch):
                watch.judge_losses()

    def clip_grad_norm_(parameters, *args, **kwargs):  # the step's own clip (accelerate's and Lightning's call it too)
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        # only a clip of the step's own parameters (another model's, a GAN's discriminator, is not its moment)
        owner = next((owners[id(param)] for param in parameters if id(param) in owners), None)
        if not manual and not watch.stopped and owner is not None:
            measuring = not watch.saw_gradients and not joined
            with _KeptFromTheScript(watch):
                watch.gradients(owner if joined else None)  # the gradients before the clip: their norm, the non-finite rule, an arm's clip first
            if measuring and (norm := clipped_with_measured_norm(watch, parameters, args, kwargs)) is not None:
                return norm
        return original_clip(parameters, *args, **kwargs)

    def get_total_norm(tensors, *args, **kwargs):
        """A clip in two parts (accelerate's, torchtitan's: get_total_norm, then clip_grads_with_norm_) measures
        the step's gradients here first: the moment is before it, and the norm it takes is of what an arm left."""
        if not (manual or watch.stopped or watch.saw_gradients and not joined):  # (the watch's own norm, every step,
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # passes straight on)
            if (owner := _owner_of_gradients(tensors, owners)) is not None:
                with _KeptFromTheScript(watch):
                    watch.gradients(owner if joined else None)
                if not joined and (norm := measured_total_norm(watch, tensors, args, kwargs)) is not None:
                    return norm
        return original_total_norm(tensors, *args, **kwargs)

    def after_update(stepping, args, kwargs) -> None:
        nested[id(stepping)] = nested.get(id(stepping), 1) - 1
        if nested[id(stepping)] > 0:
            return
        if id(stepping) in members:
            if watch.device_guard is not None:
                watch.device_guard.disarm(optimizer)
            watch.updated()

    def judged_first(scaler_method):
        """The step's GradScaler unscales or steps (a fused optimizer's step sets its grad_scale before any pre-hook):
        with deferred reads the losses are judged before it changes anything, so a halted step leaves it as it was."""
        def method(scaler, *args, **kwargs):
            if scaler is watch.state.scaler and not watch.stopped:
                with _KeptFromTheScript(watch):
                    watch.judge_losses()
            return scaler_method(scaler, *args, **kwargs)
        return method

    original_clip, original_total_norm = torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm
    original_unscale, original_scaler_step = torch.amp.GradScaler.unscale_, torch.amp.GradScaler.step
    # the optimizer of each of the step's parameters: a clip of other parameters (a model the step does not train)
    # is no moment of the step's
    owners = {}
    for member in members.values():
        for group in member.param_groups:
            owners.update(dict.fromkeys(map(id, group["params"]), member))
    handles = [register_optimizer_step_pre_hook(before_update), register_optimizer_step_post_hook(after_update)]
    torch.Tensor.backward = backward
    torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm = clip_grad_norm_, get_total_norm
    if watch.defer_reads:
        torch.amp.GradScaler.unscale_, torch.amp.GradScaler.step = judged_first(original_unscale), judged_first(original_scaler_step)
    try:
        watch.open_forward()
        yield
    finally:
        watch.close_forward()
        if watch.device_guard is not None:
            watch.device_guard.disarm(optimizer)  # (a step that raised inside its optimizer's step)
        torch.Tensor.backward = original_backward
        torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm = original_clip, original_total_norm
        torch.amp.GradScaler.unscale_, torch.amp.GradScaler.step = original_unscale, original_scaler_step
        for handle in handles:
            handle.remove()


def clipped_with_measured_norm(watch: StepWatch, parameters: list, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """`clip_grad_norm_(parameters, *args, **kwargs)` done with the norm the watch just took of the same gradients (bit
    for bit the one the clip would take), saving the clip's own pass over every gradient: its returned norm, or None
    (nothing done) where the watch has no such norm or the clip is not of the 2-norm."""
    max_norm = _plain_clip(*args, **kwargs)
    if max_norm is None or (norm := watch.norm_of([param.grad for param in parameters if param.grad is not None])) is None:
        return None
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)  # as clip_grad_norm_ does with it
    return norm.clone()


def measured_total_norm(watch: StepWatch, tensors: list, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """`get_total_norm(tensors, *args, **kwargs)` as the norm the watch just took of the same gradients, or None."""
    norm = watch.norm_of(tensors) if _plain_norm(*args, **kwargs) else None
    return None if norm is None else norm.clone()


@contextlib.contextmanager
def reusing_measured_norm(watch: StepWatch):
    """A trainer's clip just after the step's gradients moment, with nothing between that could change the gradients
    (Lightning's precision plugin, accelerate's clip without a GradScaler): for its duration torch's clip_grad_norm_
    and get_total_norm take the norm the watch took of the same gradients instead of another pass over them; any
    other call of theirs passes through."""
    original_clip, original_total_norm = torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm

    def clip_grad_norm_(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        norm = clipped_with_measured_norm(watch, parameters, args, kwargs)
        return norm if norm is not None else original_clip(parameters, *args, **kwargs)

    def get_total_norm(tensors, *args, **kwargs):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        norm = measured_total_norm(watch, tensors, args, kwargs)
        return norm if norm is not None else original_total_norm(tensors, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm = clip_grad_norm_, get_total_norm
    try:
        yield
    finally:
        torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm = original_clip, original_total_norm


def _plain_clip(max_norm=None, *args, **kwargs):
    """The max_norm of a clip_grad_norm_ call that takes the 2-norm as the step watch does, else None: such a clip is
    get_total_norm then clip_grads_with_norm_, and the watch has that norm already."""
    return max_norm if max_norm is not None and _plain_norm(*args, **kwargs) else None


def _plain_norm(norm_type=2.0, error_if_nonfinite=False, foreach=None, **unknown) -> bool:
    """Whether a norm (get_total_norm's, a clip's) is the 2-norm as the step watch takes it (foreach chosen by torch,
    raising on nothing): the watch's norm is then the one it would take."""
    return not unknown and not error_if_nonfinite and foreach is None and float(norm_type) == 2.0


def _owner_of_gradients(tensors: list, owners: dict[int, Any]) -> Any:
    """The optimizer one of `tensors` is a gradient of a parameter of (None: no parameter of the step's)."""
    grads = {id(param.grad): owner for owner in set(owners.values()) for group in owner.param_groups
             for param in group["params"] if param.grad is not None}
    return next((grads[id(tensor)] for tensor in tensors if id(tensor) in grads), None)


def run(state, watch: StepWatch, record) -> None:
    """Run the user's step on `record` (a stored batch; a distributed run's global step: each rank's, core/ranks.py),
    filling `watch.outcome` (see loop.run_step)."""
    from replaybisect.core import ranks

    if not ranks.is_ranks_record(record):
        _run_record(state, watch, record)
    elif (here := ranks.replaying_rank()) is not None:  # replay nan --nproc: this process is one recorded rank, DDP's all-reduce is real
        _run_record(state, watch, ranks.rank_records(record)[here[0]])
    else:
        ranks.run_global_step(state, watch, record, _run_record)


def _run_record(state, watch: StepWatch, record) -> None:
    outcome = watch.outcome
    batch, stored_rng = unpack(record)
    fresh, state.fresh_record = state.fresh_record, False
    if not fresh:
        rng.restore_stored(stored_rng, state.device)
    apply_recorded_lrs(record, state.optimizer)
    if state.live and not isinstance(state.step_fn, RemoteStep):  # a re-entered script: its own values as the recorded step read them
        apply_recorded_variables(record, state.step_fn)  # (a loop recorded as written sets them in its own thread: RemoteStep)
    outcome.lr = float(state.optimizer.param_groups[0]["lr"])  # the lr this step runs with (set again just above)
    if state.carry is None:  # a replay's first step: what the recorded step started with; later steps carry their own
        state.carry = recorded_carry(record)
    if not fresh:
        set_modes(state.model, record.get(RECORD_EVAL) if _is_record(record) else None)
    if not carries_gradients(record, state):  # else it starts with what the loop left (the snapshot's, or the replay's own)
        state.optimizer.zero_grad(set_to_none=True)
    if isinstance(state.optimizer, ManualUpdate):
        state.optimizer._before = None  # a step that raised after its backward leaves no mark for this one
    # fp32 (an arm's precision, or a run that entered no autocast region) runs every autocast region disabled;
    # None (the recorder's first step, before the precision is known) leaves the user's code alone
    precision = autocast_off() if state.precision == "fp32" else contextlib.nullcontext()
    if isinstance(state.step_fn, RemoteStep):  # a loop recorded as written: the script's own loop runs the step
        state.step_fn.attach(watch, record.get(RECORD_VARIABLES) if _is_record(record) else None)
    with precision, watching(watch):
        try:
            returned = call_step(state, batch, outcome.step)
            if isinstance(state.optimizer, ManualUpdate) and state.optimizer._before is not None:
                state.optimizer.step()  # the update the step made (an lr arm scales it here)
            watch.judge_losses()  # deferred reads: losses no update came after (a step that skipped its update)
        except StepHalted:
            return
    if returned is NO_LOSS:  # NaN and no failure: the recorder logs no loss for it (Lightning's training_step -> None)
        outcome.loss = math.nan
    else:
        outcome.loss = _loss_value(returned, watch)
        # a returned loss that is not what was backpropagated: not finite after the update (with deferred reads,
        # read at the metrics flush and logged as it is)
        if not watch.defer_reads and outcome.nonfinite is None and agreed(not math.isfinite(outcome.loss)):
            outcome.nonfinite = "loss"  # (replay nan --nproc: every rank halts with the one whose value failed)
    watch.settle()
    if state.scheduler is not None and not steps_scheduler_itself(state.step_fn):
        state.scheduler.step()


def eval_modules(model: torch.nn.Module) -> list[str]:
    """The modules in eval mode (their names; "" the model itself): a step's modes, as the loop left them. (Names
    are made only when one is: named_modules() walks a GPT-2-sized tree in ~50 us, this check in ~13.)"""
    if _all_training(model):
        return []
    return [name for name, module in model.named_modules() if not module.training]


def _all_training(module: torch.nn.Module) -> bool:
    if not module.training:
        return False
    for child in module._modules.values():  # (a loop: a generator per module doubles the cost)
        if child is not None and not _all_training(child):
            return False
    return True


def set_modes(model: torch.nn.Module, in_eval: Optional[list[str]]) -> None:
    """Train mode, but for the modules the recorded step had in eval mode (a frozen batch norm, a model left in eval):
    each module's flag as it was (not train()/eval(), which set a module's children too)."""
    in_eval = set(in_eval or ())
    for name, module in model.named_modules():
        module.training = name not in in_eval


def carries_gradients(record: Any, state) -> bool:
    """Whether the recorded step began with the gradients its loop left (then so does its replay: the snapshot's, or
    the replay's own from the step before), unless an ablation arm clears them (`state.clear_grads`). A step
    function's step begins with cleared gradients unless the step before made no update (it accumulates over
    `rec.step` calls); a loop recorded as written with whatever it left."""
    return _is_record(record) and bool(record.get(RECORD_GRADS)) and not state.clear_grads


def _loss_value(returned: Any, watch: StepWatch) -> float:
    """What the step returned (a tensor or a number); a step that returns nothing logs the sum of what it
    backpropagated (the mean loss, for micro-batch losses divided by their count)."""
    if isinstance(returned, torch.Tensor):  # with deferred reads it stays on the device, read at the metrics flush
        # (a copy: a tensor the step reuses may change later; fp64 stays fp64, the store keeps doubles)
        value = returned.detach().reshape(()).to(torch.float64 if returned.dtype == torch.float64 else torch.float32).clone()
        return value if watch.defer_reads else float(value.item())
    if isinstance(returned, (int, float)):
        return float(returned)
    if returned is None and watch.running_loss is not None:
        return watch.running_loss if watch.defer_reads else watch.loss_so_far()
    raise ConfigError(f"step_fn returned a {type(returned).__name__}; return the step's loss (a tensor or a number)")
