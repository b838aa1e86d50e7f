"""A TrainState as (named tensors, JSON) and back: what a snapshot holds and how restore applies it."""

from __future__ import annotations

import copy
import platform
import warnings
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from replaybisect.errors import SnapshotError
from replaybisect.core import rng
from replaybisect.core.shards import is_shard, shard_like, whole
from replaybisect.core.jsonutil import from_jsonable, to_jsonable as _jsonable


GRAD_PREFIX = "grad/"  # a snapshot's gradients (core/snapshot.py GRADS), beside model/<name> and optim/<index>/<key>


def live_tensors(state, grads: bool = False) -> dict[str, torch.Tensor]:
    """References (not copies) to every tensor a step depends on: model state and optimizer moments (and with
    `grads`, the gradients the parameters hold: a loop that does not clear them carries them into its next step)."""
    tensors = dict(iter_live_tensors(state))
    if grads:
        tensors.update({f"{GRAD_PREFIX}{name}": param.grad for name, param in state.model.named_parameters()
                        if param.grad is not None})
    return tensors


def iter_live_tensors(state) -> Iterator[tuple[str, torch.Tensor]]:
    """live_tensors one at a time. A sharded tensor (fully_shard) is gathered whole as it comes: every rank of the job
    iterates at the same point, and each may drop a tensor before the next is gathered."""
    for name, value in state_entries(state):
        yield name, whole(value)


def state_entries(state) -> list[tuple[str, torch.Tensor]]:
    """The state's tensors by snapshot name, a shard as it is (not gathered): its name, shape and dtype are the whole
    tensor's."""
    entries = [(f"model/{name}", value) for name, value in state.model.state_dict().items()]
    optimizer_state = state.optimizer.state_dict()["state"]
    for index, param_state in _per_parameter(optimizer_state).items():
        entries.extend((f"optim/{index}/{key}", value) for key, value in param_state.items() if torch.is_tensor(value))
    entries.extend((f"{OWN_PREFIX}{key}", value) for key, value in own_entries(optimizer_state).items() if torch.is_tensor(value))
    return entries


def state_json(state, step: int, rng_raw: dict, data_position: dict, reason: str) -> dict[str, Any]:
    optimizer_state = state.optimizer.state_dict()
    scalars = {
        str(index): {key: _jsonable(value) for key, value in param_state.items() if not torch.is_tensor(value)}
        for index, param_state in _per_parameter(optimizer_state["state"]).items()
    }
    own = {key: _jsonable(value) for key, value in own_entries(optimizer_state["state"]).items() if not torch.is_tensor(value)}
    return {
        "step": step,
        "reason": reason,
        "rng": rng.to_json(rng_raw),
        # ("own" only where there is one: a snapshot without is readable by the versions before it)
        "optimizer": {"param_groups": _jsonable(optimizer_state["param_groups"]), "scalars": scalars, **({"own": own} if own else {})},
        "scheduler": _jsonable(state.scheduler.state_dict()) if state.scheduler is not None else None,
        "scaler": _jsonable(state.scaler.state_dict()) if state.scaler is not None else None,
        "data": data_position,
        "precision": state.precision,
        "device": str(state.device),
        "num_threads": torch.get_num_threads(),
        "deterministic": {
            "algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        },
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }


# ---- an optimizer's own entries: what it keeps in optimizer.state under a key that is no parameter --------------
OWN_PREFIX = "optim/own/"  # their tensors' names in a snapshot; their other values are state.json's optimizer.own
_warned_unkept: set[str] = set()


def _per_parameter(optimizer_state: dict) -> dict[int, dict]:
    """The entries of an optimizer state_dict's "state" that belong to a parameter (its index: a dict of moments)."""
    return {key: value for key, value in optimizer_state.items() if _of_parameter(key, value)}


def _of_parameter(key: Any, value: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool) and isinstance(value, dict)


def own_entries(optimizer_state: dict) -> dict[str, Any]:
    """The optimizer's own entries (a step counter a custom optimizer keeps in `self.state["step"]`) that a snapshot
    holds: under a name (a string that is not a number), a tensor or plain data (numbers, strings, and lists and
    dicts of them). Any other is left out, with a warning once: a replay then starts without it."""
    kept = {}
    for key, value in optimizer_state.items():
        if _of_parameter(key, value):
            continue
        if storable_key(key) and (torch.is_tensor(value) or _plain_data(value)):
            kept[key] = value
        elif repr(key) not in _warned_unkept:
            _warned_unkept.add(repr(key))
            warnings.warn(f"replaybisect: your optimizer keeps {type(value).__name__} under optimizer.state[{key!r}], which a "
                          "snapshot cannot hold (it keeps a tensor or plain numbers, strings, lists and dicts of them under a "
                          "name): a replay starts without it and may differ; keep such state under a string key", stacklevel=2)
    return kept


def storable_key(key: Any) -> bool:
    """A name an own entry is kept under: a string of one line, up to 200 characters, not a number (a parameter's)."""
    return isinstance(key, str) and 0 < len(key) <= 200 and "\n" not in key and not key.isdigit()


def optimizer_tensors(optimizer) -> Iterator[tuple[Optional[torch.Tensor], str, torch.Tensor]]:
    """Every tensor in optimizer.state: (its parameter, its key, the tensor) for a parameter's moments, (None, the
    key, the tensor) for the optimizer's own entries."""
    from replaybisect.core import several

    for member in several.members(optimizer):  # (several optimizers may each keep an entry of the same name)
        for key, value in member.state.items():
            if torch.is_tensor(key) and isinstance(value, dict):
                yield from ((key, name, tensor) for name, tensor in value.items() if torch.is_tensor(tensor))
            elif torch.is_tensor(value):
                yield None, str(key), value


def _plain_data(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain_data(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain_data(item) for key, item in value.items())
    return False


MAX_THREADS = 1024  # torch.set_num_threads crashes the process on absurd counts: bounded before it is called
# Optimizer state tensors that always have their parameter's shape (Adam/AdamW, SGD, RMSprop, Adagrad, Adadelta, Rprop).
PARAM_SHAPED = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "acc_delta",
                "sum", "prev", "step_size", "ax"}
JsonObject = dict[str, Any]


class OptimizerJson(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    param_groups: list[JsonObject]
    scalars: dict[Annotated[str, Field(pattern=r"^\d{1,9}$")], JsonObject]
    own: dict[Annotated[str, Field(min_length=1, max_length=200)], Any] = {}  # own_entries that are not tensors

    @field_validator("own")
    @classmethod
    def _named(cls, value: dict[str, Any]) -> dict[str, Any]:
        unnamed = next((key for key in value if not storable_key(key)), None)
        if unnamed is not None:
            raise ValueError(f"the optimizer's own entry {unnamed[:60]!r} is not named as a snapshot names one")
        return value


class DataPosition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    dataset_len: Optional[int] = Field(default=None, ge=0, le=2**40)
    batch_size: Optional[int] = Field(default=None, ge=1, le=2**31)
    seed: Optional[int] = None


class StateJson(BaseModel):
    """state.json as state_json() writes it. Extra keys are tolerated; every key restore reads is checked."""

    model_config = ConfigDict(extra="allow", strict=True)
    step: int = Field(ge=0)
    reason: Optional[str] = None
    rng: JsonObject
    optimizer: OptimizerJson
    scheduler: Optional[JsonObject] = None
    scaler: Optional[JsonObject] = None
    data: Optional[DataPosition] = None
    precision: Optional[str] = None
    device: Optional[str] = None
    num_threads: Optional[int] = Field(default=None, ge=1, le=MAX_THREADS)
    deterministic: Optional[dict[str, bool]] = None
    versions: Optional[dict[str, str]] = None

    @field_validator("rng")
    @classmethod
    def _streams(cls, value: JsonObject) -> JsonObject:
        rng.Streams.model_validate(value)
        return value


def schema_error(error: ValidationError) -> str:
    """The first problem pydantic found, as `where: what` (one line)."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the top level"
    return f"{where}: {first['msg']}"


def check_state(saved: Any, step: int, bad: Callable[[str], Exception]) -> StateJson:
    """Validate a snapshot's state.json (already parsed) for the snapshot of `step`; `bad(why)` makes the error."""
    try:
        state = StateJson.model_validate(saved)
    except ValidationError as error:
        raise bad(f"is not a valid snapshot state ({schema_error(error)})") from None
    if state.step != step:
        raise bad(f"says step {state.step}, but the snapshot is of step {step}")
    return state


def _fits(saved: Any, fresh: Any) -> bool:
    """Whether a value read from state.json can stand in for the freshly built object's value: same kind,
    same keys (no new attributes), same lengths. Recursion follows `fresh`, so depth is bounded by it."""
    if fresh is None or isinstance(fresh, str):
        return saved is None or isinstance(saved, (bool, int, float, str))
    if isinstance(fresh, bool):
        return isinstance(saved, bool)
    if isinstance(fresh, int):
        return isinstance(saved, int) and not isinstance(saved, bool)
    if isinstance(fresh, float) or torch.is_tensor(fresh) and fresh.numel() == 1:
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) or saved in ("nan", "inf", "-inf")
    if isinstance(fresh, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(fresh) and all(_fits(s, f) for s, f in zip(saved, fresh))
    if isinstance(fresh, dict):
        return (isinstance(saved, dict) and set(saved) <= {str(k) for k in fresh}
                and all(_fits(v, fresh[_key(fresh, k)]) for k, v in saved.items()))
    return False


def _key(mapping: dict, text: str):
    return next(k for k in mapping if str(k) == text)


def _optimizer_state(optimizer, tensors: dict[str, torch.Tensor], saved: OptimizerJson) -> dict[str, Any]:
    """The optimizer's state_dict from the snapshot, checked against the freshly built optimizer: the same
    groups and hyperparameters, and moments shaped like the parameters they belong to."""
    fresh_groups = optimizer.state_dict()["param_groups"]
    groups = from_jsonable(saved.param_groups)
    if len(groups) != len(fresh_groups):
        raise SnapshotError(f"the snapshot's optimizer has {len(groups)} parameter group(s), the config's {len(fresh_groups)}")
    params_by_index: dict[int, torch.Tensor] = {}
    for group, fresh, live in zip(groups, fresh_groups, optimizer.param_groups):
        ids = group.get("params")
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)) or len(ids) != len(live["params"]):
            raise SnapshotError("the snapshot's optimizer parameter groups do not match the model's parameters")
        # a key the optimizer does not know is never read by its step (e.g. a scheduler's initial_lr)
        if not all(_fits(v, fresh.get(k)) for k, v in group.items() if k != "params"):
            raise SnapshotError("the snapshot's optimizer hyperparameters do not fit the optimizer built from the config")
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        params_by_index.update(zip(ids, live["params"]))
    if len(params_by_index) != sum(len(g["params"]) for g in groups):
        raise SnapshotError("the snapshot's optimizer lists a parameter twice")

    per_param: dict[int, dict[str, Any]] = {int(index): dict(from_jsonable(s)) for index, s in saved.scalars.items()}
    own: dict[str, Any] = {key: from_jsonable(value) for key, value in saved.own.items()}
    device = next((param.device for group in optimizer.param_groups for param in group["params"]), None)
    for name, value in tensors.items():
        if name.startswith(OWN_PREFIX):  # (on the parameters' device: torch's load moves only a parameter's moments)
            own[name[len(OWN_PREFIX):]] = value.to(device) if device is not None else value
        elif name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            per_param.setdefault(int(index), {})[key] = value
    for index, param_state in per_param.items():
        param = params_by_index.get(index)
        if param is None:
            raise SnapshotError(f"the snapshot's optimizer state names parameter {index}, which no group holds")
        for key, value in param_state.items():
            if key in PARAM_SHAPED and not (torch.is_tensor(value) and value.shape == param.shape and value.is_floating_point()):
                raise SnapshotError(f"the snapshot's optimizer state {key} of parameter {index} does not have the parameter's shape {tuple(param.shape)}")
            if not torch.is_tensor(value) and not (value is None or isinstance(value, (bool, int, float, str))):
                raise SnapshotError(f"the snapshot's optimizer state {key} of parameter {index} is not a number")
    return {"state": {**per_param, **own}, "param_groups": groups}


def apply(state, tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    """Load model, optimizer, scheduler, scaler and RNG streams into a freshly built TrainState. Everything is
    checked before the process-wide settings (threads, RNG streams) change; a snapshot that does not fit raises
    SnapshotError, and the caller builds a fresh TrainState for another snapshot."""
    step = saved.get("step") if isinstance(saved, dict) else None
    checked = check_state(saved, step, lambda why: SnapshotError(f"state.json {why}"))
    live = state.model.state_dict()
    model_state = {name[len("model/"):]: value for name, value in tensors.items() if name.startswith("model/")}
    try:
        model_state = {name: shard_like(value, live[name]) if name in live else value for name, value in model_state.items()}
        state.model.load_state_dict(model_state)
    except RuntimeError as error:
        raise SnapshotError(f"the snapshot does not fit the model built from the config: {str(error).splitlines()[0]}") from None
    optimizer_state = _optimizer_state(state.optimizer, tensors, checked.optimizer)
    for what, value, live in (("scheduler", checked.scheduler, state.scheduler), ("scaler", checked.scaler, state.scaler)):
        if value is not None and live is not None and not _fits(value, live.state_dict()):
            raise SnapshotError(f"the snapshot's {what} state does not fit the {what} built from the config")
    raw_rng = rng.from_json(checked.rng)
    try:
        state.optimizer.load_state_dict(optimizer_state)
        _shard_optimizer_state(state.optimizer)
        if checked.scheduler is not None and state.scheduler is not None:
            state.scheduler.load_state_dict(from_jsonable(checked.scheduler))
        if checked.scaler is not None and state.scaler is not None:
            state.scaler.load_state_dict(from_jsonable(checked.scaler))
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as error:
        raise SnapshotError(f"the snapshot's optimizer or scheduler state does not load: {str(error)[:120]}") from None
    _set_gradients(state.model, tensors)
    if checked.num_threads:
        torch.set_num_threads(checked.num_threads)
    rng.restore_raw(raw_rng)


def _set_gradients(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """The gradients the snapshot's step began with (its loop had not cleared them); none where it holds none."""
    grads = {name[len(GRAD_PREFIX):]: value for name, value in tensors.items() if name.startswith(GRAD_PREFIX)}
    params = dict(model.named_parameters())
    if set(grads) - set(params):
        raise SnapshotError(f"the snapshot holds gradients of {sorted(set(grads) - set(params))[0]!r}, which the model has not")
    for name, param in params.items():
        grad = grads.get(name)
        if grad is not None and grad.shape != param.shape:
            raise SnapshotError(f"the snapshot's gradient of {name} does not have the parameter's shape {tuple(param.shape)}")
        param.grad = grad.to(device=param.device, dtype=param.dtype).clone() if grad is not None else None


def _shard_optimizer_state(optimizer) -> None:
    """Moments loaded whole for sharded parameters (fully_shard), placed as their parameters are."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not is_shard(param) or param not in optimizer.state:
                continue
            moments = optimizer.state[param]
            for key, value in moments.items():
                if key in PARAM_SHAPED and torch.is_tensor(value):
                    moments[key] = shard_like(value, param)


# ---- copies of a live state, in memory (a check's trial steps, a distributed replay's rank passes) -------------
@dataclass
class StateCopy:
    """Deep copies of everything a step changes: weights and buffers, optimizer, scheduler and scaler state (what
    a check's trial steps put back before each batch and after the last)."""

    model: dict
    optimizer: dict
    scheduler: Optional[dict]
    scaler: Optional[dict]


def copy_state(state) -> StateCopy:
    return StateCopy(**{name: _copied_state(getattr(state, name)) for name in STATE_PARTS})


def load_state(state, saved: StateCopy) -> None:
    """Put `saved` into the state's objects (a scheduler or scaler only where both have one); `saved` stays intact
    for the next load."""
    _load_parts(state, {name: getattr(saved, name) for name in STATE_PARTS})


def copy_into(target, source) -> None:
    """`source`'s weights, optimizer, scheduler and scaler state loaded into `target`'s objects: one copy of each."""
    _load_parts(target, {name: getattr(source, name).state_dict() if getattr(source, name) is not None else None
                         for name in STATE_PARTS})


STATE_PARTS = ("model", "optimizer", "scheduler", "scaler")


def _copied_state(part) -> Optional[dict]:
    return copy.deepcopy(part.state_dict()) if part is not None else None


def _load_parts(state, values: dict[str, Optional[dict]]) -> None:
    state.model.load_state_dict(values["model"])  # copies into the parameters and buffers
    for name in STATE_PARTS[1:]:  # load_state_dict keeps the tensors it is given: each gets its own copy
        part, value = getattr(state, name), values[name]
        if part is not None and value is not None:
            part.load_state_dict(copy.deepcopy(value))
