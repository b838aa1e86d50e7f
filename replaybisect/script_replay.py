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
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect import errors
from replaybisect.core.trust import Trust
from replaybisect.errors import ReplayError, UntrustedConfig

CHILD_MODULE = "replaybisect.verbs.script_child"


def run_in_script(verb: str, store, run_id: str, cfg, trust: Optional[Trust], arguments: dict[str, Any],
                  log: Callable[[str], None]) -> Any:
    """Run `verb`'s engine inside the run's script, started again; returns what the engine returned there (JSON)."""
    trust = trust or Trust.from_user()
    script = admitted_script(cfg, trust, run_id)
    log(f"running {Path(script['path']).name} again (in {script['cwd']}) to take its objects over at its first step")
    with tempfile.TemporaryDirectory(prefix="replaybisect-script-") as scratch:
        job = {"verb": verb, "run_id": run_id, "tracking_uri": store.uri, "trust": trust.to_json(),
               "arguments": arguments, "script": script, "result": str(Path(scratch) / "result.json"),
               "protect": sorted({script["cwd"], str(Path(script["path"]).parent)})}
        output = Path(scratch) / "output.log"
        code = _run_child(job, Path(scratch), output, log)
        return _result(job, code, output, script)


def admitted_script(cfg, trust: Trust, run_id: str) -> dict[str, Any]:
    """The stored `train.script`, if it names a Python file in a folder the user trusts and a working folder that
    is still there; refused in one line otherwise, before anything runs."""
    from omegaconf import OmegaConf

    script = OmegaConf.to_container(cfg.train.script, resolve=True)
    if not isinstance(script, dict) or not isinstance(script.get("path"), str) or not isinstance(script.get("cwd"), str) \
            or not isinstance(script.get("args"), list) or not all(isinstance(arg, str) for arg in script["args"]):
        raise ReplayError(f"run {run_id}'s train.script is not a script's path, arguments and folder: the stored config "
                          "was changed after recording; re-record the run")
    path = Path(script["path"])
    if path.suffix != ".py" or not trust.inside(path):
        raise UntrustedConfig(f"refused to run {path} again for run {run_id}: it is not a .py file in your working folder "
                              "or a --code-dir; run replay from your project folder, or pass --code-dir FOLDER; nothing was run")
    if not path.is_file():
        raise ReplayError(f"run {run_id} was recorded by {path}, which is gone; restore the script (a replay runs it again)")
    if not Path(script["cwd"]).is_dir():
        raise ReplayError(f"run {run_id}'s script ran in {script['cwd']}, which is gone; create it (a replay runs the "
                          "script there again, for the paths it reads)")
    return script


def _run_child(job: dict[str, Any], scratch: Path, output: Path, log: Callable[[str], None]) -> int:
    """Start the script under the child's runner; relay its progress lines to `log`; its exit status."""
    read_end, write_end = os.pipe()
    job["progress_fd"] = write_end
    job_file = scratch / "job.json"
    job_file.write_text(json.dumps(job), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(output, "wb") as sink:
        try:
            child = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(job_file)], cwd=job["script"]["cwd"],
                                     stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, pass_fds=(write_end,), env=env)
        finally:
            os.close(write_end)
        relay = threading.Thread(target=_relay, args=(read_end, log), daemon=True)
        relay.start()
        try:
            code = child.wait()
        except BaseException:  # Ctrl-C: the script stops with us
            child.kill()
            child.wait()
            raise
        relay.join(timeout=5)
    return code


def _relay(read_end: int, log: Callable[[str], None]) -> None:
    with os.fdopen(read_end, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            log(line.rstrip("\n"))


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
