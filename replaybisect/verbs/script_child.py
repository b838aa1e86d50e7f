"""The child side of a script's replay (replaybisect/replay/script.py starts it): a process forked from the
preloaded server (core/processes.py) running `forked_main`, or, where the script's folder would shadow a preloaded
library, `python -m replaybisect.verbs.script_child JOB`. It runs the user's script as `python script.py ARGS` would,
with writes into the user's folders refused; the script's Recorder hands its objects over at the first `rec.step`
(core/reentry.py), the verb's engine runs on them, its result goes to the job's result file, and the process ends
there (the rest of the script, its `finally` blocks and exit handlers, never runs).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.core import reentry
from replaybisect.errors import ReplayError


def main() -> None:
    """`python -m replaybisect.verbs.script_child JOB`: stdout and stderr are the output file, the progress pipe
    is an inherited descriptor."""
    job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    _serve(job, os.fdopen(job["progress_fd"], "w", encoding="utf-8", buffering=1))


def forked_main(job_file: str, progress_fd: int, output: str, environment: dict[str, str]) -> None:
    """In a process forked from the preloaded server: become what `main` is in a fresh interpreter (this replay's
    environment, stdin empty, stdout and stderr written through into `output`), then serve the job."""
    from replaybisect.core.processes import adopt_environment, own_stdio

    adopt_environment(environment)
    target = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    own_stdio(target, target)
    progress = os.fdopen(progress_fd, "w", encoding="utf-8", buffering=1)
    _serve(json.loads(Path(job_file).read_text(encoding="utf-8")), progress)


def _serve(job: dict[str, Any], progress) -> None:
    sys.dont_write_bytecode = True  # no __pycache__ in the user's folders either
    reentry.refuse_writes_under([Path(folder) for folder in job["protect"]])
    _redirect_saves_under(job["protect"], Path(job["script"]["scratch"]) / "saved")
    reentry.set_takeover(lambda parts: _take_over(job, progress), job["run_id"])
    os.chdir(job["script"]["cwd"])  # only now: our own imports came from nowhere of the script's
    failure, clean, error = _run_script(job["script"])
    if error is not None and reentry.taken_over():
        reentry.script_raised(error)  # a replayed step's: this thread serves the replay until it ends the process
    if clean and reentry.taken_over():
        reentry.script_ended()  # a loop recorded as written ended without rec.close(): its replay is told so
    _finish(job, progress, {"ended": failure, "during_replay": reentry.taken_over()})
    os._exit(3)


def _run_script(script: dict[str, Any]) -> tuple[str, bool, Optional[BaseException]]:
    """Run the script as its run did; it returns only if the script ends without reaching `rec.step` (or, for a loop
    recorded as written, ends its loop): why, whether it ended cleanly (its end, or exit status 0), and the exception
    that ended it."""
    sys.argv = [script["path"], *script["args"]]
    if script.get("hydra"):  # Hydra writes its output folder before the script's first line: in the replay's temp folder
        sys.argv += reentry.hydra_overrides(Path(script["scratch"]) / "hydra")
    try:
        if script.get("module"):
            sys.path[0] = script["cwd"]  # as `python -m` does
            runpy.run_module(script["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(script["path"]).parent)  # as `python script.py` does
            runpy.run_path(script["path"], run_name="__main__")
    except SystemExit as stop:
        return f"it exited (status {stop.code})", stop.code in (0, None), None
    except BaseException as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", False, error
    return "it ended", True, None


def _take_over(job: dict[str, Any], progress) -> None:
    """The script reached its first step: run the verb on its objects, write the result, end the process."""
    log = lambda line: print(line, file=progress)  # noqa: E731
    _finish(job, progress, {"taken_over": True})  # replaced by the result: a process killed from here on is said so
    try:
        result = {"ok": JOBS[job["verb"]](job, log)}
    except ReplayError as error:
        result = {"error": str(error), "kind": type(error).__name__}
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group: the parent stops too, without our traceback
        result = {"error": "interrupted", "kind": "ReplayError"}
    except BaseException:
        result = {"crash": traceback.format_exc()}
    _finish(job, progress, result)
    os._exit(0)


def _finish(job: dict[str, Any], progress, result: dict[str, Any]) -> None:
    """Write the result where the parent reads it (whole or not at all), and flush what the script printed."""
    from replaybisect.core.jsonutil import to_jsonable

    target = Path(job["result"])
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(to_jsonable(result)), encoding="utf-8")
    os.replace(partial, target)
    for stream in (sys.stdout, sys.stderr, progress):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _redirect_saves_under(protected: list[str], elsewhere: Path) -> None:
    """A checkpoint the script saves into the user's folders (`torch.save(obj, path)`, or a file it opens for
    writing: `with open(args.save, "wb") as f: torch.save(model, f)`) goes to `elsewhere` instead (the replay's temp
    folder, under the same relative path), so a loop the replay runs (record/inline.py) keeps going past it; reading
    it back (`open`, `torch.load`) reads the replay's copy. torch.save writes through its own C++ file writer, which
    Python's audit hooks do not see; other writes there stay refused (reentry.refuse_writes_under)."""
    import builtins

    import torch

    roots = [os.path.realpath(folder) for folder in protected]
    moved: dict[str, Path] = {}  # a path in the user's folders -> where the replay wrote it

    def redirected(target: Any, writing: bool) -> Any:
        if not isinstance(target, (str, os.PathLike)):
            return target
        full = os.path.realpath(os.fspath(target))
        if not writing:
            return moved.get(full, target)
        root = next((root for root in roots if full == root or full.startswith(root + os.sep)), None)
        if root is None:
            return target
        moved[full] = elsewhere / Path(root).name / os.path.relpath(full, root)
        os.makedirs(moved[full].parent, exist_ok=True)
        return moved[full]

    original_save, original_load, original_open = torch.save, torch.load, builtins.open

    def save(obj, f, *args, **kwargs):
        return original_save(obj, redirected(f, writing=True), *args, **kwargs)

    def load(f, *args, **kwargs):
        return original_load(redirected(f, writing=False), *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        return original_open(redirected(file, writing=any(flag in mode for flag in "wax+")), mode, *args, **kwargs)

    torch.save, torch.load, builtins.open = save, load, open_


# ---- the verbs a script's run can be replayed by -----------------------------------------------------------
def _opened(job: dict[str, Any]):
    """What every job reads the run with: the store (read once), the device asked for (None: the run's), the trust."""
    from replaybisect.core.device import resolve_device
    from replaybisect.core.trust import Trust
    from replaybisect.store import open_store

    device = job["arguments"].get("device")
    return (open_store(job["tracking_uri"], create=False, read_once=True),
            resolve_device(device, "--device") if device else None, Trust.from_json(job["trust"]))


def _nan(job: dict[str, Any], log: Callable[[str], None]) -> Any:
    from replaybisect.core.jsonutil import to_jsonable
    from replaybisect.verbs.nan.engine import find_nan

    store, device, trust = _opened(job)
    report = find_nan(store, job["run_id"], job["arguments"].get("step"), device=device, trust=trust, log=log)
    return to_jsonable(report)  # every field, whole (to_json shortens the histories), for NanReport.from_json


def _arm(job: dict[str, Any], log: Callable[[str], None]) -> Any:
    from replaybisect.verbs.ablate.engine import ARM_STEP, run_arm

    return run_arm(job["arguments"]["spec"], lambda step: log(f"{ARM_STEP}{step}"))


def _check(job: dict[str, Any], log: Callable[[str], None]) -> Any:
    from replaybisect.verbs.check.engine import CheckOptions, check

    store, _, trust = _opened(job)
    arguments = job["arguments"]
    report = check(store, run_id=job["run_id"], step=arguments.get("step"), options=CheckOptions(**arguments["options"]),
                   trust=trust, progress=log)
    return report.to_full_json()


def _profile(job: dict[str, Any], log: Callable[[str], None]) -> Any:
    from replaybisect.verbs.profile.engine import profile

    store, device, trust = _opened(job)
    arguments = job["arguments"]
    return profile(store, job["run_id"], arguments.get("step"), steps=arguments["steps"], device=device, trust=trust,
                   trace_folder=Path(arguments["trace_folder"]), log=log).to_json()


def _memory(job: dict[str, Any], log: Callable[[str], None]) -> Any:
    from replaybisect.verbs.memory.engine import memory

    store, device, trust = _opened(job)
    arguments = job["arguments"]
    return memory(store, job["run_id"], arguments.get("step"), steps=arguments["steps"], device=device, trust=trust,
                  log=log).to_json()


def _verify(job: dict[str, Any], log: Callable[[str], None]) -> Any:
    from replaybisect.replay import restore as restore_mod
    from replaybisect.verbs.verify.engine import replay_segment

    store, device, trust = _opened(job)
    arguments = job["arguments"]
    cfg = restore_mod.run_config(store, job["run_id"], trust)
    replayed = replay_segment(store, job["run_id"], cfg, device, arguments["snapshot"], arguments["end"])
    return {key: {str(step): value for step, value in values.items()} for key, values in replayed.items()}


JOBS: dict[str, Callable[[dict[str, Any], Callable[[str], None]], Any]] = {
    "nan": _nan, "arm": _arm, "check": _check, "profile": _profile, "memory": _memory, "verify": _verify,
}


if __name__ == "__main__":
    main()
