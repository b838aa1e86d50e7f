"""A TrainState as (named tensors, JSON) and back: what a snapshot holds and how restore applies it."""

from __future__ import annotations

import math
import platform
from typing import Any

import torch

from replaybisect.errors import SnapshotError
from replaybisect.record import rng


def live_tensors(state) -> dict[str, torch.Tensor]:
    """References (not copies) to every tensor a step depends on: model state and optimizer moments."""
    tensors = {f"model/{name}": value for name, value in state.model.state_dict().items()}
    for index, param_state in state.optimizer.state_dict()["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"optim/{index}/{key}"] = value
    return tensors


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # "nan" / "inf": JSON has no literal for them
    return value


def _unjson_float(value: Any) -> Any:
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, list):
        return [_unjson_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _unjson_float(v) for k, v in value.items()}
    return value


def state_json(state, step: int, rng_raw: dict, data_position: dict, reason: str) -> dict[str, Any]:
    optimizer_state = state.optimizer.state_dict()
    scalars = {
        str(index): {key: _jsonable(value) for key, value in param_state.items() if not torch.is_tensor(value)}
        for index, param_state in optimizer_state["state"].items()
    }
    return {
        "step": step,
        "reason": reason,
        "rng": rng.to_json(rng_raw),
        "optimizer": {"param_groups": _jsonable(optimizer_state["param_groups"]), "scalars": scalars},
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


def apply(state, tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    """Load model, optimizer, scheduler, scaler and RNG streams into a freshly built TrainState."""
    model_state = {name[len("model/"):]: value for name, value in tensors.items() if name.startswith("model/")}
    try:
        state.model.load_state_dict(model_state)
    except RuntimeError as error:
        raise SnapshotError(f"the snapshot does not fit the model built from the config: {str(error).splitlines()[0]}") from None

    optimizer_state: dict[int, dict[str, Any]] = {}
    for index, scalars in saved["optimizer"]["scalars"].items():
        optimizer_state[int(index)] = dict(_unjson_float(scalars))
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            optimizer_state.setdefault(int(index), {})[key] = value
    groups = _unjson_float(saved["optimizer"]["param_groups"])
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    state.optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})

    if saved.get("scheduler") is not None and state.scheduler is not None:
        state.scheduler.load_state_dict(_unjson_float(saved["scheduler"]))
    if saved.get("scaler") is not None and state.scaler is not None:
        state.scaler.load_state_dict(_unjson_float(saved["scaler"]))
    if saved.get("num_threads"):
        torch.set_num_threads(int(saved["num_threads"]))
    rng.restore_raw(rng.from_json(saved["rng"]))
