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
from typing import Any, Callable, NoReturn, Optional


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
PRELOAD = ["replaybisect.core.server_exit", "torch", "torch._dynamo", "hydra", "hydra.utils", "omegaconf", "mlflow", "mlflow.store.tracking.sqlalchemy_store"]
PRELOADED_PACKAGES = ("torch", "hydra", "omegaconf", "mlflow")
_starting = threading.Lock()  # a verb's threads may start several processes at once: one at a time


def preloaded_forkserver():
    """multiprocessing's forkserver context, its server importing PRELOAD. The server is an interpreter started
    for it that imports PRELOAD and nothing of the caller's (no threads, no store, no CUDA), so a process forked from
    it starts in a fraction of a second. What a fresh interpreter has and a forked one does not is the forked
    process's to set again: its environment (adopt_environment), and for a Forked one its standard streams
    (own_stdio) and how it ends (run_module)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


_as_fresh = threading.local()  # set while this thread starts a Forked process


def _preparation(name: str) -> dict:
    """multiprocessing's preparation of a process (spawn.get_preparation_data): a copy of this process's sys.path,
    and this process's `__main__` run again in it (a user's script that calls the API without a main guard would run
    again). A Forked process is a `python -m` of its own: it keeps the server's sys.path, a fresh interpreter's."""
    data = _full_preparation(name)
    if getattr(_as_fresh, "on", False):
        for key in ("sys_path", "init_main_from_name", "init_main_from_path"):
            data.pop(key, None)
    return data


def _install_preparation() -> None:
    global _full_preparation
    from multiprocessing import spawn

    if spawn.get_preparation_data is not _preparation:
        _full_preparation = spawn.get_preparation_data
        spawn.get_preparation_data = _preparation


class Forked:
    """A process of the preloaded server running `target(*args)` (a module-level function, named by pickle), with
    the part of subprocess.Popen's interface its callers wait for and stop it with (pid, poll, wait, terminate,
    kill, returncode). It starts with the server's sys.path and without this process's `__main__`."""

    def __init__(self, target: Callable[..., Any], args: tuple, name: str):
        self._process = preloaded_forkserver().Process(target=_forked, args=(target, args), name=name)
        with _starting:
            _install_preparation()
            _as_fresh.on = True
            try:
                self._process.start()
            finally:
                _as_fresh.on = False
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


def _forked(target: Callable[..., Any], args: tuple) -> None:
    """A Forked process's first step: let go of the server's "alive" pipe. multiprocessing hands every process of the
    server the write end its launcher holds (for processes of their own), so the server, and a child that dies
    with it (PR_SET_PDEATHSIG), would outlive a launcher killed with SIGKILL. One this process starts later gets a
    server of its own."""
    import multiprocessing
    from multiprocessing import forkserver

    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        forkserver._forkserver._forkserver_alive_fd = None
        os.close(alive)
    # as a fresh interpreter's: the server's forkserver would start a re-entered script's DataLoader workers by
    # running the script again as __mp_main__ (its Recorder and loop too), where `python train.py` forks them
    multiprocessing.set_start_method(None, force=True)
    target(*args)


def run_module(module: str, args: list[str], environment: dict[str, str], stdout: int, stderr: int,
               cwd: Optional[str] = None) -> None:
    """In a Forked process: become `cd CWD; ENVIRONMENT python -m MODULE ARGS` (stdin empty; stdout and stderr onto
    the descriptors given, which it closes), and end as that interpreter ends: its threads joined and its exit
    handlers run (a process of multiprocessing ends with os._exit). Its exit status is the module's."""
    import runpy
    import sys

    own_stdio(stdout, stderr)
    if cwd is not None:
        os.chdir(cwd)
    adopt_environment(environment)
    here = os.getcwd()
    if sys.path and sys.path[0] == "":  # the server's `python -c` entry: `python -m` puts the working folder there
        sys.path[0] = here
    else:
        sys.path.insert(0, here)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        _interpreter_exit_steps()


def end_process(code: Any) -> NoReturn:
    """End this process as the interpreter ends it after `sys.exit(code)`: its threads joined, its exit handlers run
    (MLflow's, multiprocessing's, logging's, temporary folders'), every open file's buffer written (Python's and C's,
    a user's module-level log file too), then os._exit. What it leaves out is tearing every module down, which writes
    nothing and costs a second or more of CPU in a process that imported torch and MLflow
    (benchmarks/process_exit.py). A Ctrl-C while threads are joined does not change the status."""
    import sys

    if code is not None and not isinstance(code, int):  # as sys.exit("message"): the message, status 1
        print(code, file=sys.stderr)
        code = 1
    _interpreter_exit_steps()
    _flush_everything()
    os._exit(code or 0)


def _interpreter_exit_steps() -> None:
    """What the interpreter does first as it ends: its threads joined, then its exit handlers run. A Ctrl-C meanwhile
    is ignored, as the interpreter ignores it there: the status stands."""
    import atexit

    for last_steps in (threading._shutdown, atexit._run_exitfuncs):  # type: ignore[attr-defined]
        try:
            last_steps()
        except KeyboardInterrupt:
            pass


def _flush_everything() -> None:
    """What the interpreter's teardown and C's exit() would write: Python's open files (their buffers), then C stdio's
    (a C extension's printf into a pipe)."""
    import ctypes
    import gc
    import io

    buffered = {io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper}
    for stream in gc.get_objects():
        if type(stream) in buffered:  # not isinstance: some objects warn or compute when their class is asked
            try:
                if not stream.closed:
                    stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe, a read-only stream: nothing of it to save
                pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def end_server_without_teardown() -> None:
    """In the preloaded server, importing PRELOAD (core/server_exit.py is its first entry): its last exit handler,
    run after those of its imports, ends it without tearing torch and MLflow down once its last client has gone
    (status 0). A server that failed ends as it would (its status kept); processes forked from it (their pid is
    another) run their own handlers and end their own way. Anywhere else this does nothing."""
    import atexit
    import sys

    names = []
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    if names != ["main"]:  # not the server's own preload (a process forked from it runs under _serve_one too)
        return
    server = os.getpid()

    def end_server() -> None:
        if os.getpid() != server or getattr(sys, "last_value", None) is not None:  # a fork of it, or a failure
            return
        _flush_everything()
        os._exit(0)

    atexit.register(end_server)


def own_stdio(stdout: int, stderr: int) -> None:
    """stdin from /dev/null, stdout and stderr onto these descriptors (closed here), and sys.stdout/sys.stderr made
    again over them, written through as `python -u` writes them (the server's were made for its own descriptors; a
    killed process's last line is there to quote)."""
    import io
    import sys

    empty = os.open(os.devnull, os.O_RDONLY)
    for source, fd in ((empty, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, fd)
    for source in {empty, stdout, stderr} - {0, 1, 2}:
        os.close(source)
    encoding = sys.__stdout__.encoding if sys.__stdout__ is not None else "utf-8"
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", write_through=True)


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
    """A module or package in `folder` (first on a process's path) named as one the server imported (torch/,
    mlflow.py, or one they import, such as yaml.py: those this process imported from elsewhere stand for them) would be
    imported by a fresh interpreter and not by a process forked from the server, which has the real one: such a
    process starts as a fresh interpreter instead."""
    import sys

    try:
        entries = os.listdir(folder)
    except OSError:
        return False
    names = {entry[:-3] if entry.endswith(".py") else entry for entry in entries
             if entry.endswith(".py") or (folder / entry).is_dir()}
    if names & set(PRELOADED_PACKAGES):
        return True
    own = str(Path(folder).resolve()) + os.sep
    for name in names & {module.partition(".")[0] for module in list(sys.modules)}:
        origin = getattr(sys.modules.get(name), "__file__", None) or ""
        if not os.path.realpath(origin).startswith(own):  # not the folder's own module, imported from it
            return True
    return False


def adopt_environment(environment: dict[str, str]) -> None:
    """In a process forked from the preloaded server: the environment of the process that asked for it (the server
    keeps the one it started with), and the thread count torch read from OMP_NUM_THREADS when the server imported
    it. Modules imported before this saw the server's."""
    import sys

    os.environ.clear()
    os.environ.update(environment)
    tempfile.tempdir = None  # read again from this environment's TMPDIR (a module the server imported may have read it)
    if "numpy.random" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew; a fork copies it
        sys.modules["numpy.random"].seed()
    if "torch" in sys.modules and environment.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(environment["OMP_NUM_THREADS"]))
