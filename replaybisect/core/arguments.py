"""The Python API's arguments, checked at the call: a value of the wrong kind is a one-line ReplayError there, not
an AttributeError from deep inside MLflow or a run recorded with nonsense. Light: no torch, no MLflow."""

from __future__ import annotations

from typing import Any, Optional

from replaybisect.errors import ReplayError

MAX_RUN_ID = 256


def shown(value: Any) -> str:
    """A value as an error line quotes it: its repr, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tracking_uri(value: Any, name: str = "tracking_uri") -> Optional[str]:
    if value is None or (isinstance(value, str) and value.strip() and "\0" not in value):
        return value
    raise ReplayError(f"{name}={shown(value)} is not a tracking URI; pass a string such as 'sqlite:///mlflow.db' or "
                      "'http://mlflow:5000', or None for $MLFLOW_TRACKING_URI, else the nearest mlflow.db")


def run_id(value: Any) -> str:
    if isinstance(value, str) and value.strip() and len(value) <= MAX_RUN_ID and "\0" not in value:
        return value
    raise ReplayError(f"run_id={shown(value)} is not a run id; pass the id of a recorded run as a string "
                      "(`replay runs` lists them)")


def count(value: Any, name: str, minimum: int = 0, optional: bool = False) -> Optional[int]:
    """An int >= minimum (None too when optional); a bool is not a count."""
    if value is None and optional:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
    raise ReplayError(f"{name}={shown(value)} is not {allowed}")


def integer(value: Any, name: str) -> int:
    """Any int (a seed), also a NumPy integer; not a bool, a float or a string."""
    import operator

    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ReplayError(f"{name}={shown(value)} is not an integer")


def text(value: Any, name: str) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    raise ReplayError(f"{name}={shown(value)} is not a string (or None)")
