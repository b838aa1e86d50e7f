"""RNG streams: capture and restore every stream a step can draw from, as JSON-safe data."""

from __future__ import annotations

import array
import base64
import contextlib
import random
from typing import Annotated, Any, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


def capture_raw() -> dict[str, Any]:
    """Cheap capture (a few microseconds): raw state objects, serialised only when saved."""
    raw = {
        "python": random.getstate(),  # includes gauss_next
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():  # (initialized implies available; is_available() asks the driver each call)
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


Word = Annotated[int, Field(ge=0, lt=2**32)]
TORCH_STATE_BYTES = 5056  # torch.get_rng_state().numel(): the CPU generator's Mersenne Twister state


class PythonStream(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: Literal[3]
    internal: list[Word] = Field(min_length=625, max_length=625)  # 624 words + the position
    gauss_next: Optional[float]

    @field_validator("internal")
    @classmethod
    def _position(cls, internal: list[int]) -> list[int]:
        if internal[-1] > 624:
            raise ValueError("the Mersenne Twister position is past 624")
        return internal


class NumpyStream(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["MT19937"]
    keys: list[Word] = Field(min_length=624, max_length=624)
    pos: int = Field(ge=0, le=624)
    has_gauss: int = Field(ge=0, le=1)
    cached_gaussian: float


class Streams(BaseModel):
    """The RNG streams as state.json holds them; sizes are checked here so restoring can never fail half-way."""

    model_config = ConfigDict(extra="forbid", strict=True)
    python: PythonStream
    numpy: NumpyStream
    torch: str = Field(max_length=2 * TORCH_STATE_BYTES)
    cuda: Optional[list[str]] = None

    @field_validator("torch")
    @classmethod
    def _torch_size(cls, text: str) -> str:
        if len(base64.b64decode(text, validate=True)) != TORCH_STATE_BYTES:
            raise ValueError(f"the torch generator state is not {TORCH_STATE_BYTES} bytes")
        return text

    @field_validator("cuda")
    @classmethod
    def _cuda_base64(cls, states: Optional[list[str]]) -> Optional[list[str]]:
        for text in states or []:
            base64.b64decode(text, validate=True)
        return states


def from_json(state: dict[str, Any]) -> dict[str, Any]:
    """Raw streams from state.json's `rng`; pydantic.ValidationError (a ValueError) when they are not streams."""
    streams = Streams.model_validate(state)
    py, npy = streams.python, streams.numpy
    raw = {
        "python": (py.version, tuple(py.internal), py.gauss_next),
        "numpy": (npy.kind, np.array(npy.keys, dtype=np.uint32), npy.pos, npy.has_gauss, npy.cached_gaussian),
        "torch": _from_b64(streams.torch),
    }
    if streams.cuda is not None:
        raw["cuda"] = [_from_b64(s) for s in streams.cuda]
    return raw


# ---- the same streams as a stored batch carries them: tensors and numbers (batches are stored with safetensors) ----
def to_tensors(raw: dict[str, Any]) -> dict[str, Any]:
    """`capture_raw`'s streams as a stored batch holds them: the Mersenne Twister words as int32 tensors of the same
    bits, every CUDA device's state stacked (one row a device)."""
    version, internal, gauss_next = raw["python"]
    kind, keys, position, has_gauss, cached_gaussian = raw["numpy"]
    stored = {
        "torch": raw["torch"],
        "python": _words(internal), "python_gauss": gauss_next,
        "numpy": _words(keys), "numpy_position": int(position), "numpy_gauss": [int(has_gauss), float(cached_gaussian)],
    }
    if "cuda" in raw:
        stored["cuda"] = torch.stack([state.cpu() for state in raw["cuda"]])
    return stored


def from_tensors(stored: dict) -> dict[str, Any]:
    """A stored batch's streams in `capture_raw`'s form (torch, and Python/NumPy/CUDA where stored), checked as a
    snapshot's streams are (sizes, ranges, types): a damaged store is a SnapshotError, never a bad state."""
    from pydantic import ValidationError

    from replaybisect.errors import SnapshotError

    torch_state = stored.get("torch") if isinstance(stored, dict) else None
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8 or torch_state.numel() != TORCH_STATE_BYTES:
        raise SnapshotError("a stored batch's torch RNG state is damaged; record the run again")
    raw: dict[str, Any] = {"torch": torch_state.cpu()}
    cuda = stored.get("cuda")
    if isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8:  # one row a device (a single row: older runs)
        cuda = cuda.cpu()  # a stored batch travels to the model's device, its RNG states with it
        raw["cuda"] = [state.clone() for state in cuda.unbind(0)] if cuda.dim() == 2 else [cuda]
    if "python" not in stored:  # recorded before Python and NumPy were stored per step
        return raw
    try:
        has_gauss, cached_gaussian = stored["numpy_gauss"]
        python = PythonStream.model_validate({"version": 3, "internal": [int(w) for w in _unsigned(stored["python"])],
                                              "gauss_next": stored["python_gauss"]})
        numpy = NumpyStream.model_validate({"kind": "MT19937", "keys": [int(w) for w in _unsigned(stored["numpy"])],
                                            "pos": stored["numpy_position"], "has_gauss": has_gauss, "cached_gaussian": cached_gaussian})
    except (TypeError, ValueError, KeyError, AttributeError, ValidationError) as error:
        raise SnapshotError(f"a stored batch's Python/NumPy RNG state is damaged ({type(error).__name__}); record the run again") from None
    raw["python"] = (3, tuple(python.internal), python.gauss_next)
    raw["numpy"] = ("MT19937", np.array(numpy.keys, dtype=np.uint32), numpy.pos, numpy.has_gauss, numpy.cached_gaussian)
    return raw


def restore_stored(stored: Optional[dict], device: torch.device) -> None:
    """Set the streams a stored step started with (runs recorded before Python and NumPy were stored per step
    restore torch's, and CUDA's, only; a single CUDA state is the one of `device`)."""
    if stored is None:
        return
    raw = from_tensors(stored)
    torch.set_rng_state(raw["torch"])
    if "cuda" in raw and torch.cuda.is_available():
        rows = raw["cuda"]
        if len(rows) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rows)
        elif device.type == "cuda":  # recorded with another device count (one row: a run recorded on one device)
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_rng_state(rows[index] if len(rows) > 1 and index < len(rows) else rows[0], device)
    if "python" in raw:
        random.setstate(raw["python"])
        np.random.set_state(raw["numpy"])


def _words(values) -> torch.Tensor:
    """Mersenne Twister words (uint32) as an int32 tensor of the same bits."""
    if isinstance(values, tuple) and _UINT32 is not None:  # Python's state: a third of NumPy's conversion's time
        return torch.frombuffer(array.array(_UINT32, values), dtype=torch.int32)
    return torch.from_numpy(np.asarray(values, dtype=np.uint32).view(np.int32).copy())


_UINT32 = next((code for code in "IL" if array.array(code).itemsize == 4), None)  # array's 4-byte unsigned type code


def _unsigned(words: torch.Tensor) -> np.ndarray:
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32:
        raise TypeError("Mersenne Twister words are not an int32 tensor")
    return words.cpu().numpy().view(np.uint32)


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


# ---- derived seeds ---------------------------------------------------------------------------------------
# Two sites derive a seed from (seed, counter) with the same multiplier but different moduli. The moduli
# are kept as recorded runs used them: changing either would change the data order of an epoch or the
# draws of a reseeded ablation arm, and so what a replay of an existing run computes.
SEED_MULTIPLIER = 1_000_003
EPOCH_SEED_MODULUS = 2**63  # torch.Generator.manual_seed takes up to 2**64-1; 2**63 since the first release
RESEED_MODULUS = 2**62  # `replay ablate seed`: the arm's seed for seed_everything


def mix_seed(seed: int, counter: int, modulus: int) -> int:
    """A seed derived from `seed` and a counter (epoch, step): (seed * 1_000_003 + counter) mod modulus."""
    return (seed * SEED_MULTIPLIER + counter) % modulus


def epoch_permutation_seed(seed: int, epoch: int) -> int:
    """The seed of the generator that shuffles epoch `epoch` (core.loop's data order)."""
    return mix_seed(seed, epoch, EPOCH_SEED_MODULUS)


def ablation_reseed(reseed: int, start_step: int) -> int:
    """The seed `replay ablate`'s seed arm gives seed_everything when it replays from `start_step`."""
    return mix_seed(reseed, start_step, RESEED_MODULUS)


SAMPLE_SEED_MODULUS = 2**63


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed that dataset item `index` is read under in the batch of step `step`: its random augmentation is
    then the same whichever process reads it (train.num_workers) and whatever was read before it.
    ((seed * m + step) * m + index): step and index both reach the low 32 bits, the only ones torch's CPU
    generator keeps (manual_seed(s) == manual_seed(s + 2**32)). In a dataset of more than 1_000_003 items, item
    i + 1_000_003 of step t draws as item i of step t + 1 does."""
    return mix_seed(mix_seed(seed, step, SAMPLE_SEED_MODULUS), index, SAMPLE_SEED_MODULUS)


def seed_sample_streams(seed: int) -> None:
    """Seed the streams a dataset's __getitem__ may draw from: python, numpy and torch's CPU generator (items are
    read on CPU; CUDA streams are left alone). numpy and torch both seed a Mersenne Twister from 32 bits: numpy
    gets the two halves folded, so that its draws are not torch's."""
    random.seed(seed)
    np.random.seed((seed ^ (seed >> 32)) & 0xFFFF_FFFF)
    torch.default_generator.manual_seed(seed)


def draws_no_randomness(getitem):
    """Mark a dataset's __getitem__ as drawing no random numbers: its items are then read without seeding the
    streams per sample (which costs ~15 us an item). A subclass that overrides __getitem__ is not marked."""
    getitem.draws_no_randomness = True
    return getitem
