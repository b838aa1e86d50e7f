"""The triage child: limits first, then `python -m replaybisect ARGS...` in their place.

A watcher's own step (`start_step`) is forked from the preloaded server (core/processes.py: no seconds of imports a
step); a triage job runs this module on its node:

    python -m replaybisect.verbs.watch.child MEMORY_MB [--scratch] -- nan --run-id X --json ...

The memory limit (RLIMIT_AS, inherited by the verb's own worker processes) makes a run that allocates too much
fail with MemoryError instead of taking the watcher's machine down; the watcher enforces the time limit. A
watcher's step ends with the watcher, and a job's child with its launcher (Linux PR_SET_PDEATHSIG), so a watcher
killed with SIGKILL leaves no triage running on behind its expired claim. Standard library only: this runs before
anything else.
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


def _die_with_launcher() -> None:
    """A forked step's session ends at once when the watcher that started it does, SIGKILL included: its parent is
    the preloaded server, which ends with the watcher but seconds later (it finalizes torch and MLflow first), so a
    thread waits on multiprocessing's sentinel of the launching process instead."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait

    launcher = multiprocessing.parent_process()

    def end_with_launcher() -> None:
        wait([launcher.sentinel])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=end_with_launcher, name="replaybisect-ends-with-watcher", daemon=True).start()


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def start_step(memory_mb: int, verb_args: list[str], cwd: str, env: dict[str, str], stdout, stderr):
    """`python -m replaybisect VERB_ARGS` in `cwd` with `env`, its output into the files `stdout` and `stderr`, in a
    session of its own (a timeout stops its workers too): forked from the preloaded server. A Popen-like process."""
    from replaybisect.core.processes import Forked, InheritedFd

    return Forked(_forked_step, (memory_mb, verb_args, cwd, env, InheritedFd(stdout.fileno()), InheritedFd(stderr.fileno())),
                  "replaybisect-triage")


def _forked_step(memory_mb: int, verb_args: list[str], cwd: str, env: dict[str, str], stdout: int, stderr: int) -> None:
    from replaybisect.core.processes import run_module

    os.setsid()
    _die_with_launcher()
    _limit_memory(memory_mb)
    run_module("replaybisect", verb_args, env, stdout, stderr, cwd=cwd)


def main(argv: list[str]) -> None:
    memory_mb, *rest = argv
    scratch = rest[:1] == ["--scratch"]  # a triage job: its own scratch folder on the node it runs on
    separator, *verb_args = rest[1:] if scratch else rest
    if separator != "--":
        raise SystemExit("usage: python -m replaybisect.verbs.watch.child MEMORY_MB [--scratch] -- VERB ARGS...")
    _die_with_parent()
    _limit_memory(int(memory_mb))
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
