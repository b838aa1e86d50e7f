"""Replaying a run recorded from a script as it is written (core/reentry.py): the script runs again in a child
process, as the run recorded it, and the verb's engine runs inside it on the objects the script hands over.

The script is the user's code: it runs only from a folder the user trusts (the working folder, a --code-dir), as
the importable functions of other runs do. Its output (stdout, stderr) is kept apart from ours, so `--json` stays
clean; its writes into the user's folders are refused (core/reentry.refuse_writes_under). The engine's progress
lines come back through a pipe, its result as JSON in a file of the replay's own temp folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect import errors
from replaybisect.core import replayed_args
from replaybisect.core.processes import shadows_preloaded
from replaybisect.core.trust import Trust
from replaybisect.errors import ReplayError, UntrustedConfig

CHILD_MODULE = "replaybisect.verbs.script_child"


_children: set = set()  # the scripts running now (an ablation runs several): Ctrl-C stops them all
_children_lock = threading.Lock()


def run_in_script(verb: str, store, run_id: str, cfg, trust: Optional[Trust], arguments: dict[str, Any],
                  log: Callable[[str], None]) -> Any:
    """Run `verb`'s engine inside the run's script, started again; returns what the engine returned there (JSON).
    `cfg` is what restore.run_config returned: its script was admitted there (admitted_script), before any import."""
    trust = trust or Trust.from_user()
    script = script_of(cfg, run_id)
    log(f"running {shlex.join([Path(script['path']).name, *script['args']])} again in {script['cwd']}, to take its "
        "objects over at its first step")
    with tempfile.TemporaryDirectory(prefix="replaybisect-script-") as scratch:
        job = {"verb": verb, "run_id": run_id, "tracking_uri": store.uri, "trust": trust.to_json(),
               "arguments": arguments, "script": {**script, "scratch": scratch}, "result": str(Path(scratch) / "result.json"),
               "protect": sorted({script["cwd"], str(Path(script["path"]).parent)})}
        output = Path(scratch) / "output.log"
        code = _run_child(job, Path(scratch), output, log)
        return _result(job, code, output, script)


def stop_all() -> None:
    """Kill every script a replay started and has not seen end (Ctrl-C in a caller running several)."""
    with _children_lock:
        for child in list(_children):
            child.kill()


def admitted_script(cfg, trust: Trust, run_id: str, artifact_root: Optional[Path] = None,
                    tags: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The stored `train.script`, if it names a Python file the user owns (in a folder they trust, outside every
    artifact folder), run from a trusted working folder that is still there, as a script or as the module that file
    is, with the sha256 the run recorded, and a command line a replay may give it (core/replayed_args.py); refused in
    one line otherwise, before anything runs. `tags`: the run's (verified with its config: core/provenance.py)."""
    script = script_of(cfg, run_id)
    path, cwd = Path(script["path"]), Path(script["cwd"])
    if not path.is_absolute() or path.suffix != ".py" or not trust.inside(path) or trust.uploaded(path, artifact_root):
        raise UntrustedConfig(f"refused to run {path} again for run {run_id}: it is not a .py file of yours in your working "
                              "folder or a --code-dir; run replay from your project folder, or pass --code-dir FOLDER; nothing was run")
    if not cwd.is_absolute() or not trust.inside(cwd):
        raise UntrustedConfig(f"refused to run {path.name} in {cwd} for run {run_id}: that folder is not your working folder "
                              "or a --code-dir (the script imports from it); pass --code-dir FOLDER; nothing was run")
    module = script.get("module")
    if module is not None and (not _DOTTED.match(module) or _module_file(cwd, module) != Path(os.path.realpath(path))):
        raise UntrustedConfig(f"refused to run module {str(module)[:80]!r} for run {run_id}: it is not {path} run with "
                              "`python -m` from its folder; the stored config was changed after recording; nothing was run")
    if not path.is_file():
        raise ReplayError(f"run {run_id} was recorded by {path}, which is gone; restore the script (a replay runs it again)")
    if not cwd.is_dir():
        raise ReplayError(f"run {run_id}'s script ran in {cwd}, which is gone; create it (a replay runs the script "
                          "there again, for the paths it reads)")
    _unchanged_since_recorded(path, tags or {}, run_id)
    script["hydra"] = replayed_args.admit(path, script, cfg.get("user"), run_id)
    return script


def _unchanged_since_recorded(path: Path, tags: dict[str, str], run_id: str) -> None:
    """A script runs again only as the run ran it: its file with the sha256 the run recorded (tag source_sha256)."""
    from replaybisect.core.repo import SOURCE_TAG, file_sha256

    try:
        hashes = json.loads(tags.get(SOURCE_TAG) or "{}")
    except ValueError:
        hashes = None
    if not hashes:
        return  # the recorder could not hash its files: nothing to compare with (the path itself is signed)
    recorded = hashes.get(path.stem) if isinstance(hashes, dict) else None
    if not isinstance(recorded, str):
        raise ReplayError(f"refused to run {path} again for run {run_id}: it is not the script the run recorded (its "
                          "recorded files are others); the stored config was changed after recording; nothing was run")
    now = file_sha256(path)
    if now != recorded:
        version = tags.get("git_sha")
        restore = f"git checkout {version[:12]} -- {path.name}" if version else "git stash"
        raise ReplayError(f"{path} changed since run {run_id} recorded it (sha256 {recorded[:12]} then, "
                          f"{now[:12] if now else 'unreadable'} now): a replay runs the script as the run ran it; put it "
                          f"back as it was ({restore}), or record the run again; nothing was run")


def script_of(cfg, run_id: str) -> dict[str, Any]:
    """The stored `train.script` as plain data: path, module, args, cwd (a damaged one is a one-line error)."""
    from omegaconf import DictConfig, OmegaConf

    node = cfg.train.get("script")
    script = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else None
    if not isinstance(script, dict) or not isinstance(script.get("path"), str) or not isinstance(script.get("cwd"), str) \
            or not isinstance(script.get("args"), list) or not all(isinstance(arg, str) for arg in script["args"]) \
            or not isinstance(script.get("module"), (str, type(None))) or not isinstance(script.get("hydra", False), bool):
        raise ReplayError(f"run {run_id}'s train.script is not a script's path, arguments and folder: the stored config "
                          "was changed after recording; re-record the run")
    return script


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _module_file(cwd: Path, module: str) -> Optional[Path]:
    """The file `python -m module` runs from `cwd`, if it is in that folder (a module, or a package's __main__)."""
    base = cwd.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return Path(os.path.realpath(candidate))
    return None


def _run_child(job: dict[str, Any], scratch: Path, output: Path, log: Callable[[str], None]) -> int:
    """Start the script under the child's runner; relay its progress lines to `log`; its exit status. The runner
    is forked from the preloaded server (an ablation's arms start in a fraction of a second each, not after seconds of
    imports), or a fresh interpreter started in the replay's own temp folder where the script's folder has a module
    of a preloaded library's name (the script's own must win, as it does when the script runs)."""
    job_file = scratch / "job.json"
    if shadows_preloaded(_import_folder(job["script"])):
        child, read_end = _start_interpreter(job, job_file, scratch, output)
    else:
        child, read_end = _start_forked(job, job_file, output)
    return _wait(child, read_end, log)


def _start_forked(job: dict[str, Any], job_file: Path, output: Path):
    """The child's runner forked from the preloaded server, its output into `output`, its progress through a pipe."""
    from replaybisect.core.processes import Forked, InheritedFd, call_by_name

    job_file.write_text(json.dumps(job), encoding="utf-8")
    read_end, write_end = os.pipe()
    try:
        child = Forked(call_by_name, (CHILD_MODULE, "forked_main", str(job_file), InheritedFd(write_end), str(output),
                                      {**os.environ, "PYTHONUNBUFFERED": "1"}), "replaybisect-script")
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the child holds the only write end: the relay ends when it does
    return child, read_end


def _start_interpreter(job: dict[str, Any], job_file: Path, scratch: Path, output: Path):
    """`python -m replaybisect.verbs.script_child JOB`, its output into `output`, its progress through a pipe."""
    read_end, write_end = os.pipe()
    job["progress_fd"] = write_end
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        job_file.write_text(json.dumps(job), encoding="utf-8")
        with open(output, "wb") as sink:
            child = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(job_file)], cwd=scratch,
                                     stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, pass_fds=(write_end,), env=env)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return child, read_end


def _wait(child, read_end: int, log: Callable[[str], None]) -> int:
    """Relay the child's progress until it ends; its exit status."""
    with _children_lock:
        _children.add(child)
    relay = threading.Thread(target=_relay, args=(read_end, log), daemon=True)
    relay.start()
    try:
        code = child.wait()
    except BaseException:  # Ctrl-C: the script stops with us
        child.kill()
        child.wait()
        raise
    finally:
        with _children_lock:
            _children.discard(child)
    relay.join(timeout=5)
    return code


def _import_folder(script: dict[str, Any]) -> Path:
    """The folder a script's imports look in first: its own (`python script.py`), or its working folder (`python -m`)."""
    return Path(script["cwd"]) if script.get("module") else Path(script["path"]).parent


def _relay(read_end: int, log: Callable[[str], None]) -> None:
    with os.fdopen(read_end, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                log(line.rstrip("\n"))
            except Exception:  # a progress display that fails must not stop the pipe being read (the child would block)
                pass


def _result(job: dict[str, Any], code: int, output: Path, script: dict[str, Any]) -> Any:
    name = Path(script["path"]).name
    try:
        result = json.loads(Path(job["result"]).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        result = {}
    if "ok" in result:
        return result["ok"]
    if "error" in result:  # a ReplayError inside the child: the same kind and line here (exit 2)
        kind = getattr(errors, str(result.get("kind")), None)
        raise (kind if isinstance(kind, type) and issubclass(kind, ReplayError) else ReplayError)(result["error"])
    if "taken_over" in result:  # the engine started inside the script and never finished: the process was killed
        raise ReplayError(f"{name}, run again for the replay, ended (exit status {code}) while the replay ran inside it, "
                          "without a result (killed, out of memory?)" + (f": {_last_line(output)}" if _last_line(output) else ""))
    if "ended" in result and result.get("during_replay"):  # a loop recorded as written ran the replay's steps
        raise ReplayError(f"{name}, run again for the replay, stopped while its loop ran the replay's steps "
                          f"({result['ended']}); where the script's own code between steps raised it (a write into "
                          f"your folders, a check of the loss), skip that code when replaybisect.replaying() is True")
    if "ended" in result:  # the script never reached its first step
        raise ReplayError(f"{name}, run again for the replay, ended before its first rec.step ({result['ended']}); "
                          "replay from the run's folder with the files it reads, or see what the script needs")
    if "crash" in result:  # a bug of ours inside the child: its traceback, then a failure
        print(result["crash"], file=sys.stderr)
        raise RuntimeError(f"the replay inside {name} failed (traceback above)")
    last = _last_line(output)
    raise ReplayError(f"{name}, run again for the replay, ended (exit status {code}) before its first rec.step"
                      + (f": {last}" if last else "") + "; run it as the run did, or examine the run's output")


def _last_line(output: Path) -> str:
    try:
        lines = [line.strip() for line in output.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
