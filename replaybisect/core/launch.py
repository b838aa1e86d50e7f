"""Starting a job's processes on this machine as torchrun starts its workers (rank, world size, a free port on
127.0.0.1 for the rendezvous), waiting for them, and the answer file a rank leaves its launcher: `replay train
train.nproc=N` and `replay nan --nproc N`. Their stdout goes to the launcher's stderr: the launcher's stdout is
replay's own (`--json`), and user code may print anything. A rank is `python -m MODULE ARGS` forked from the
preloaded server (core/processes.py: no seconds of imports a rank), or started as that command where the working
folder has a module of a preloaded library's name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from replaybisect.core.processes import Forked, InheritedFd, run_module, shadows_preloaded

PEER_GRACE_SECONDS = 15.0  # after one rank failed, the others this long to end what they record before they are stopped


def start_ranks(command: list[str], nproc: int, num_threads: Optional[int] = None) -> list:
    with socket.socket() as probe:  # a free port for the job's rendezvous (as torchrun --standalone finds one)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    threads = str(num_threads or max(1, (os.cpu_count() or 1) // nproc))
    processes = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
        processes.append(_start_rank(command, env))
    return processes


def _start_rank(command: list[str], env: dict[str, str]):
    if command[:2] == [sys.executable, "-m"] and not shadows_preloaded(Path.cwd()):
        return Forked(_rank_main, (command[2], command[3:], env, InheritedFd(sys.stderr.fileno())), "replaybisect-rank")
    return subprocess.Popen(command, env=env, stdout=sys.stderr.fileno())


def _rank_main(module: str, args: list[str], env: dict[str, str], output: int) -> None:
    """In the forked rank: `python -m MODULE ARGS` run in this folder with `env`, printing onto `output`."""
    run_module(module, args, env, output, output)


def wait_ranks(processes: list) -> list[Optional[int]]:
    """Every rank's exit status. One that fails gives the others PEER_GRACE_SECONDS (they notice, and rank 0 or a
    survivor ends the run FAILED naming it), then they are stopped. Ctrl-C stops them all."""
    failed_at = None
    try:
        while any(process.poll() is None for process in processes):
            codes = [process.poll() for process in processes]
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_SECONDS:
                stop(processes)
            time.sleep(0.1)
    except BaseException:
        stop(processes)
        raise
    return [process.returncode for process in processes]


def stop(processes: list) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def write_answer(path: Path, answer: dict[str, Any]) -> None:
    """Written whole or not at all: the launcher reads it after every rank ended."""
    partial = path.with_suffix(f".{os.getpid()}.partial")  # ranks failing at once each write their own
    partial.write_text(json.dumps(answer), encoding="utf-8")
    partial.replace(path)


def read_answer(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def failure(rank: int, error: BaseException) -> dict[str, Any]:
    """A rank's error as its answer: its one line (a Ctrl-C or the launcher's SIGTERM: "stopped") and its kind."""
    from replaybisect.errors import ReplayError

    line = str(error) if isinstance(error, ReplayError) else "stopped"
    return {"error": f"rank {rank}: {line}", "kind": type(error).__name__}


def raise_failure(answer: dict[str, Any]) -> None:
    """The launcher raises a rank's error as the same kind (ConfigError, SnapshotError, DiskFull: their exit statuses)."""
    from replaybisect import errors

    kind = getattr(errors, str(answer.get("kind")), None)
    raise (kind if isinstance(kind, type) and issubclass(kind, errors.ReplayError) else errors.ReplayError)(answer["error"])
