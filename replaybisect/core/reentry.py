"""A run recorded from a script as it is written: the step a closure over the script's own objects, no importable
`build`. A replay cannot import such a script (it trains when run) nor rebuild its objects, so it re-enters it:
the script runs again in a child process, as the run recorded it (interpreter, command line, working folder), and
its `Recorder`, finding itself in a replay, hands the live objects over at the loop's first `rec.step` instead of
training. The replay (replay/script.py starts it, verbs/script_child.py runs inside the script) then loads the snapshot into those objects and drives the step function
itself on the stored batches, learning rates and carry; copies for probes are saved and put back in place.

This module is what both sides share: what a recording notes about the script (`script_entry`), the hand-over
(`hand_over`, `live_parts`), and the child's guard that keeps a replay's writes out of the user's folders.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.errors import ConfigError, ReplayError

# set in a re-entered script's process (verbs/script_child.py) before the script runs: what to do with the live objects
_takeover: Optional[Callable[[dict[str, Any]], None]] = None
_live: Optional[dict[str, Any]] = None
_run_id: Optional[str] = None


def script_entry() -> dict[str, Any]:
    """How this process was started, for a replay to start it again: the script (or `-m` module), its arguments
    and the working folder. A step function from an interactive session has no script to re-enter."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    if not path or not Path(path).is_file():
        raise ConfigError("this step function is not in a script (an interactive session has no file a replay can run "
                          "again); run your training as `python train.py`, or pass build= with importable functions")
    return {"path": str(Path(path).resolve()), "module": spec.name if spec is not None and spec.name != "__main__" else None,
            "args": [str(arg) for arg in sys.argv[1:]], "cwd": str(_launch_folder()), "hydra": _in_hydra_app()}


def _in_hydra_app() -> bool:
    """A `@hydra.main` app: a replay gives Hydra its output folder elsewhere (Hydra writes one in the working
    folder before the script's first line runs)."""
    core = sys.modules.get("hydra.core.hydra_config")
    return bool(core is not None and core.HydraConfig.initialized())


def _launch_folder() -> Path:
    """Where the script was started: a Hydra app that changed into its output folder (hydra.job.chdir) was
    started in Hydra's original working folder."""
    if _in_hydra_app():
        from hydra.utils import get_original_cwd

        return Path(get_original_cwd()).resolve()
    return Path.cwd().resolve()


def hydra_overrides(output_folder: Path) -> list[str]:
    """What a replay adds to a Hydra app's command line: its outputs (config copies, logs) in `output_folder`."""
    return [f"hydra.run.dir={output_folder}", "hydra.output_subdir=null", "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled"]


def replaying() -> bool:
    """True in a script a replay re-entered: its Recorder hands the objects over instead of recording."""
    return _takeover is not None


def set_takeover(function: Callable[[dict[str, Any]], None], run_id: str) -> None:
    global _takeover, _run_id
    _takeover, _run_id = function, run_id


def replayed_run_id() -> Optional[str]:
    """The run a re-entered script is replaying (its Recorder's run_id there)."""
    return _run_id


def hand_over(parts: dict[str, Any]) -> None:
    """The script's loop reached its first step: the replay takes the live objects (and never returns here)."""
    global _live
    _live = parts
    assert _takeover is not None
    _takeover(parts)


_script_end: Optional[Callable[[], None]] = None  # what a re-entered script's loop end means to its replay


def at_script_end(function: Callable[[], None]) -> None:
    """A loop recorded as written (core/inline_step.py): the script ending without `rec.close()` ends its loop."""
    global _script_end
    _script_end = function


class WriteRefused(PermissionError):
    """A replay refused a write of the re-run script's into the user's folders (refuse_writes_under)."""


_script_raised: Optional[Callable[[BaseException], None]] = None  # the same, for an exception that ends the script


def at_script_raise(function: Callable[[BaseException], None]) -> None:
    """A loop recorded as written: an exception its own code raises inside a replayed step (an update by hand, a
    check between backward and update) is that step's (`function` takes it, and serves the replay until its end)."""
    global _script_raised
    _script_raised = function


def script_raised(error: BaseException) -> None:
    """The re-entered script ended with `error`: where a replayed step takes it as its own, the replay goes on in its
    thread, and this returns when it is over (it ends the process) or gone; else at once."""
    if _script_raised is not None:
        _script_raised(error)


def script_ended() -> None:
    """The re-entered script ran to its end after the hand-over: tell its replay (which may then end the process)."""
    if _script_end is not None:
        _script_end()


def taken_over() -> bool:
    """The script handed its objects over (its loop may run on for a replay of a loop recorded as written)."""
    return _live is not None


def live_parts() -> dict[str, Any]:
    """The objects the re-entered script handed over: what `build(config)` is for an importable run."""
    if _live is None:
        raise ReplayError("this run was recorded from a script (its step a closure, no importable build): `replay nan`, "
                          "`replay ablate` and `replay check` replay it, by running the script again")
    return dict(_live)


# ---- the child's writes stay out of the user's folders -----------------------------------------------------
# audited events that change files, and which of their arguments name what they change (a copy's source is read)
WRITE_EVENTS = {"os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.truncate": (0,), "shutil.rmtree": (0,),
                "os.chmod": (0,), "os.utime": (0,), "os.rename": (0, 1), "shutil.move": (0, 1), "os.symlink": (1,),
                "os.link": (1,), "shutil.copyfile": (1,), "shutil.copytree": (1,)}


def refuse_writes_under(folders: list[Path]) -> None:
    """In a re-entered script: opening a file for writing, or creating, moving or removing one, inside `folders`
    (the user's working and script folders) raises PermissionError naming the file; reading stays free. What the
    script writes elsewhere (a temp folder) is its own business."""
    roots = [str(folder.resolve()) for folder in folders]

    def inside(path: Any) -> Optional[str]:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return None
        try:
            full = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        return full if any(full == root or full.startswith(root + os.sep) for root in roots) else None

    def audit(event: str, args: tuple) -> None:
        if event == "open":
            path, mode = args[0], args[1]
            writing = (isinstance(mode, str) and any(flag in mode for flag in "wax+")) or \
                      (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            targets = [path] if writing else []
        elif event in WRITE_EVENTS:
            targets = [args[index] for index in WRITE_EVENTS[event] if index < len(args)]
        else:
            return
        for target in targets:
            refused = inside(target)
            if refused is not None:
                raise WriteRefused(f"replaybisect: a replay re-running this script writes nothing in your folders "
                                      f"(refused: {refused}); skip the write when replaybisect.replaying() is True")

    sys.addaudithook(audit)
