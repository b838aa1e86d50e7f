"""The one JSON encoder: results, reports and saved state as strict JSON (no NaN/Infinity literals).

Non-finite floats become the strings "nan", "inf", "-inf" (float() reads them back); tensors become
numbers or lists; numpy scalars and arrays become Python numbers and lists; dataclasses become dicts;
Paths become strings. torch and numpy are never imported here: a value can only be one of theirs
when its module is already loaded, so `replay --help` stays light.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import PurePath
from typing import Any


def to_jsonable(value: Any) -> Any:
    """`value` made of JSON types only; mapping keys become strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):  # numpy's float64 too: repr(float(...)), never "np.float64(nan)"
        number = float(value)
        return number if math.isfinite(number) else repr(number)  # "nan" / "inf" / "-inf"
    if isinstance(value, PurePath):
        return str(value)
    return _from_array_library(value)


def from_jsonable(value: Any) -> Any:
    """The floats to_jsonable spelled as text ("nan", "inf", "-inf") as floats again, in lists and dicts too."""
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, list):
        return [from_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {key: from_jsonable(item) for key, item in value.items()}
    return value


def _from_array_library(value: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and torch.is_tensor(value):
        return to_jsonable(value.item() if value.numel() == 1 else value.tolist())
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        return to_jsonable(value.tolist())  # numpy scalars -> int/float/bool, arrays -> lists
    return value


def json_default(value: Any) -> Any:
    """json.dumps(default=...) for values json cannot write (Paths, tensors, numpy, dataclasses); anything
    else as str(). Floats json can write are left as they are, so output of plain data does not change."""
    converted = to_jsonable(value)
    return str(value) if converted is value else converted


def strict_json(value: Any, indent: int | None = None) -> str:
    """`value` as JSON text that any parser reads (jq included): non-finite floats as strings, never NaN literals."""
    return json.dumps(to_jsonable(value), indent=indent, default=json_default, allow_nan=False)
