"""The triage child's launcher: limits first, then `python -m replaybisect ARGS...` in their place.

    python -m replaybisect.verbs.watch.child MEMORY_MB [--scratch] -- nan --run-id X --json ...

The memory limit (RLIMIT_AS, inherited by the verb's own worker processes) makes a run that allocates too much
fail with MemoryError instead of taking the watcher's machine down; the watcher enforces the time limit. The
child dies with the watcher thread that started it (Linux PR_SET_PDEATHSIG), so a watcher killed with SIGKILL
leaves no triage running on behind its expired claim. Standard library only: this runs before anything else.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(137)


def main(argv: list[str]) -> None:
    memory_mb, *rest = argv
    scratch = rest[:1] == ["--scratch"]  # a triage job: its own scratch folder on the node it runs on
    separator, *verb_args = rest[1:] if scratch else rest
    if separator != "--":
        raise SystemExit("usage: python -m replaybisect.verbs.watch.child MEMORY_MB [--scratch] -- VERB ARGS...")
    _die_with_parent()
    if int(memory_mb) > 0:
        limit = int(memory_mb) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    command = [sys.executable, "-m", "replaybisect", *verb_args]
    if not scratch:
        os.execv(sys.executable, command)
    sys.exit(_in_scratch(command))


def _in_scratch(command: list[str]) -> int:
    """The verb run in a scratch folder of its own (its working folder, temporary files and caches), removed after:
    as the watcher's local children run, for a job on a node that has none of the watcher's folders."""
    import shutil
    import subprocess
    import tempfile

    scratch = tempfile.mkdtemp(prefix="replaybisect-triage-job-")
    try:
        work = os.path.join(scratch, "work")
        for name in ("work", "tmp", "cache"):
            os.makedirs(os.path.join(scratch, name))
        env = dict(os.environ, PWD=work, TMPDIR=os.path.join(scratch, "tmp"), REPLAYBISECT_CACHE=os.path.join(scratch, "cache"))
        return subprocess.run(command, cwd=work, env=env, preexec_fn=_die_with_parent).returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
