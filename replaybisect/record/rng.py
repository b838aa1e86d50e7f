"""RNG streams: capture and restore every stream a step can draw from, as JSON-safe data."""

from __future__ import annotations

import base64
import contextlib
import random
from typing import Any

import numpy as np
import torch


def capture_raw() -> dict[str, Any]:
    """Cheap capture (a few microseconds): raw state objects, serialised only when saved."""
    raw = {
        "python": random.getstate(),  # includes gauss_next
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raw["cuda"] = torch.cuda.get_rng_state_all()
    return raw


def restore_raw(raw: dict[str, Any]) -> None:
    random.setstate(raw["python"])
    np.random.set_state(raw["numpy"])
    torch.set_rng_state(raw["torch"])
    if "cuda" in raw and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(raw["cuda"])


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def to_json(raw: dict[str, Any]) -> dict[str, Any]:
    version, internal, gauss_next = raw["python"]
    kind, keys, pos, has_gauss, cached_gaussian = raw["numpy"]
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": _b64(raw["torch"]),
    }
    if "cuda" in raw:
        state["cuda"] = [_b64(s) for s in raw["cuda"]]
    return state


def from_json(state: dict[str, Any]) -> dict[str, Any]:
    py = state["python"]
    npy = state["numpy"]
    raw = {
        "python": (py["version"], tuple(py["internal"]), py["gauss_next"]),
        "numpy": (npy["kind"], np.array(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"]),
        "torch": _from_b64(state["torch"]),
    }
    if "cuda" in state:
        raw["cuda"] = [_from_b64(s) for s in state["cuda"]]
    return raw


@contextlib.contextmanager
def isolated_rng():
    """Run a side computation (validation, probes, LR range test) without shifting any RNG stream."""
    saved = capture_raw()
    try:
        yield
    finally:
        restore_raw(saved)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
