"""Whose code a traceback frame runs: replaybisect's, the user's, or a library's. Used by `replay nan` to name the
user's source line and by the CLI to show a crash from the user's code down (imports nothing heavy)."""

from __future__ import annotations

import os
import re
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # replaybisect/
# the standard library and the environment's own folders (its bin/ scripts, its site-packages)
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(os.__file__)) + os.sep,) + tuple(
    {os.path.abspath(prefix) + os.sep for prefix in (sys.prefix, sys.exec_prefix, sys.base_prefix)})
QUOTED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')  # a frame in a traceback quoted as text


def is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(PACKAGE_DIR)


def is_user_code(filename: str, libraries: tuple[str, ...] = ()) -> bool:
    """Not replaybisect, the standard library, installed packages or generated code; `libraries`: more folders."""
    path = os.path.abspath(filename)
    return not (path.startswith((PACKAGE_DIR, *_LIBRARY_DIRS, *libraries)) or "site-packages" in path
                or "dist-packages" in path or filename.startswith("<"))


INTERCEPTS = ("__torch_function__", "__torch_dispatch__")


def raised_at(error: BaseException) -> str | None:
    """Where `error` was raised in the user's code: the innermost frame of theirs after replaybisect's own frames
    (torch, the standard library and installed packages skipped), as "file:line in function: code"; None if none."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    # (our torch function modes are no caller of the user's code: an op raising inside one is still the user's)
    ours = [i for i, frame in enumerate(frames) if is_ours(frame.filename) and frame.name not in INTERCEPTS]
    frames = frames[ours[-1] + 1:] if ours else frames
    torch = sys.modules.get("torch")
    libraries = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,) if torch is not None and torch.__file__ else ()
    frame = next((frame for frame in reversed(frames) if is_user_code(frame.filename, libraries)), None)
    if frame is None:
        return None
    line = (frame.line or "").strip()
    return f"{frame.filename}:{frame.lineno} in {frame.name}" + (f": {line}" if line else "")


def error_message(error: BaseException) -> str:
    """The first line of `error`'s message, at most 300 characters ("" for none)."""
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""
