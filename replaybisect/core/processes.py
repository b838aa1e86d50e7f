"""Processes of this host: whether one still runs (a DDP job's ranks, core/ranks.py, and a job followed by its id,
core/jobs.py, ask it), and the preloaded server that replaybisect's own processes are forked from: bisect trials,
ablation workers, a script's replay, the ranks of `--nproc` and `train.nproc`, a watcher's triage steps. Standard
library only."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional


def alive(pid: int) -> bool:
    """A process that has not exited (a killed one its launcher has not reaped yet, a zombie, has)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


# What a process forked for replaybisect's work (a bisect trial, an ablation worker, ...) has imported before it is
# forked: about 5 s of imports a fresh interpreter pays (2-core machines), paid once by the server instead of once per
# process. torch._dynamo is torch's own: building any optimizer imports it (1.5 s), and importing it starts no thread.
PRELOAD = ["torch", "torch._dynamo", "hydra", "hydra.utils", "omegaconf", "mlflow", "mlflow.store.tracking.sqlalchemy_store"]
PRELOADED_PACKAGES = ("torch", "hydra", "omegaconf", "mlflow")
_starting = threading.Lock()


def preloaded_forkserver():
    """multiprocessing's forkserver context, its server importing PRELOAD. The server is a fresh interpreter that
    only imports (no threads running, no store open, no CUDA), so a process forked from it starts as cleanly as a
    spawned one, but in a fraction of a second. It keeps the environment it started with: pass a process its own."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start_forked(process) -> None:
    """Start a process of the preloaded server (a multiprocessing Process of its context), one at a time: a verb's
    threads may start several at once."""
    with _starting:
        process.start()


class Forked:
    """A process of the preloaded server running `target(*args)`, with the part of subprocess.Popen's interface its
    callers wait for and stop it with (pid, poll, wait, terminate, kill, returncode)."""

    def __init__(self, target: Callable[..., Any], args: tuple, name: str):
        self._process = preloaded_forkserver().Process(target=target, args=args, name=name)
        start_forked(self._process)
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


class InheritedFd:
    """A file descriptor of this process, handed to a process of the preloaded server as an argument: duplicated into
    it as it starts (multiprocessing's DupFd), an int there."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate) -> int:
    return duplicate.detach()


def call_by_name(module: str, function: str, *args: Any) -> Any:
    """A Forked target named, not imported: the library starts a verb's process (a script's replay runs
    verbs/script_child.py) without importing a verb, as it names the module for `python -m` when it starts one fresh."""
    import importlib

    return getattr(importlib.import_module(module), function)(*args)


def shadows_preloaded(folder: Path) -> bool:
    """A top-level torch/, mlflow.py, ... in `folder` (first on a process's path) would not be imported by a process
    forked from the server, which imported the real one: such a process starts as a fresh interpreter instead."""
    return any((folder / name).exists() or (folder / f"{name}.py").exists() for name in PRELOADED_PACKAGES)


def adopt_environment(environment: dict[str, str]) -> None:
    """In a process forked from the preloaded server: the environment of the process that asked for it (the server
    keeps the one it started with), and the thread count torch read from OMP_NUM_THREADS when the server imported
    it. Modules imported before this (multiprocessing imports a script's `__main__` first) saw the server's."""
    import sys

    os.environ.clear()
    os.environ.update(environment)
    tempfile.tempdir = None  # read again from this environment's TMPDIR (a module the server imported may have read it)
    if "torch" in sys.modules and environment.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(environment["OMP_NUM_THREADS"]))
