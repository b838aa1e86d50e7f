"""A long run's metric points, logged by a process of their own.

MLflow's SQL store spends some 55 us of Python on each point it logs (SQLAlchemy's objects for the row and the
latest value), and the recorder's writer thread does that work holding the GIL the training thread needs: a flush
of 50 steps' points (310 for the GPT example) took the step it overlapped 20-35 ms longer. Once a run's logging has
cost the training process HANDOFF_SECONDS, about what this process costs once to start (importing MLflow), the
writer hands each flush's points to it instead, as one JSON line on its stdin, and it logs them on another core.

The protocol is ours alone: the child runs no user code; it reads JSON lines of points, logs them to the run the
recorder gave it, and at the END line (or when its parent is gone) logs what it has and exits. A failure is one
JSON line on its reply pipe (its stdout as it starts; what a library prints goes nowhere), then exit status 1; the
recorder raises it as its own write would have been raised (a full disk: DiskFull). The END line, not the pipe's
end, closes it: a DataLoader worker forked from the training process holds a copy of the pipe's write end as long
as it lives. SIGINT, SIGTERM and SIGHUP are its recorder's to handle (a job's scheduler sends SIGTERM to every
process): the recorder then ends it with the run, every point it was sent logged. They are blocked from its start
until it ignores them, so one sent to every process of the job as it starts is held, not its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from replaybisect.errors import DiskFull

HANDOFF_SECONDS = 2.0  # the in-process logging time after which the points go to the logger process
END = "end"  # the line that ends the logger process, once it has logged every point before it
PARENT_CHECK_SECONDS = 1.0  # how often an idle logger process looks whether its recorder is still there
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what a terminal or a job's scheduler sends to stop
REPLY_WAIT_SECONDS = 5.0  # how long the recorder waits for an ended logger's reply (it was written before it exited)


class MetricsProcess:
    """The recorder's side: start the logger process, send it each flush's points, end it."""

    def __init__(self, uri: str, run_id: str):
        self.uri = uri
        self._failure: Optional[Exception] = None  # what it said when it failed, read once
        package_root = str(Path(__file__).resolve().parents[2])  # this replaybisect, however the recorder imported it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        # the signals its recorder handles are blocked from its first instruction (a thread's mask is what a process it
        # starts begins with) until it ignores them: one sent to every process of the job as it starts does not end it
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
        try:
            self._process = subprocess.Popen(
                # -P (Python 3.11+): not the working folder first on its path (a module of the user's there is not imported)
                [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m",
                 "replaybisect.record.metrics_process", uri, run_id, str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                start_new_session=True)  # a Ctrl-C at the terminal is the recorder's to handle: it ends the logger itself
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def log(self, points: list[tuple[str, float, int]]) -> None:
        """Send the points (on the recorder's writer thread: this waits only when the logger is a pipe's worth behind)."""
        self._raise_if_failed()
        try:
            self._process.stdin.write(json.dumps([[name, float(value), int(step)] for name, value, step in points]) + "\n")
            self._process.stdin.flush()
        except OSError:  # (a broken pipe: it has ended)
            self._process.wait()
            self._raise_if_failed()
            raise RuntimeError(f"the metrics logger process ended before its run did: the run's later metrics are not in "
                               f"{self.uri}") from None

    def close(self, quiet: bool = False) -> None:
        """Every point sent is logged when this returns; the logger's failure, if it had one, raised (not `quiet`).
        Once: a second call (the recorder's cleanup after a failure) does nothing."""
        if self._process.stdout.closed:
            return
        try:
            if self._process.poll() is None:
                self._process.stdin.write(END + "\n")
                self._process.stdin.flush()
        except OSError:
            pass
        finally:
            self._process.wait()
            with contextlib.suppress(OSError):  # (what is left in its buffer has no reader)
                self._process.stdin.close()
        try:
            if not quiet:
                self._raise_if_failed()
        finally:
            self._process.stdout.close()

    def _raise_if_failed(self) -> None:
        if self._process.poll() in (None, 0):
            return
        if self._failure is None:
            failure = _reply(self._process.stdout)
            message = failure.get("error") or (f"the metrics logger process exited with status {self._process.returncode}: "
                                              f"the run's metrics after that point are not in {self.uri}")
            self._failure = DiskFull(message) if failure.get("disk_full") else RuntimeError(message)
        raise self._failure


def _reply(pipe) -> dict:
    """An ended logger's reply, read without waiting for the pipe's end (a process forked while it started may hold
    a copy of its write end); {} where it wrote none."""
    ready, _, _ = select.select([pipe], [], [], REPLY_WAIT_SECONDS)
    said = os.read(pipe.fileno(), 1 << 16).decode(errors="replace").strip().splitlines() if ready else []
    try:
        reply = json.loads(said[-1]) if said else {}
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}


def _serve(uri: str, run_id: str, parent: int) -> int:
    """The logger process: log each line's points until END, or until the recorder's process is gone."""
    for caught in STOPPING:
        signal.signal(caught, signal.SIG_IGN)  # (its recorder ends it)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)  # (blocked since it started: see MetricsProcess)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what MLflow or a library prints: not the reply
    try:
        from replaybisect.errors import disk_full_named
        from replaybisect.store import open_store

        store = open_store(uri, create=False)
        for points in _lines(parent):
            with disk_full_named("metrics", uri, in_store=True):
                store.log_metrics(run_id, [(name, value, step) for name, value, step in points])
    except DiskFull as error:
        return _said(reply, {"error": str(error), "disk_full": True})
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return _said(reply, {"error": f"logging metrics to {uri} failed: {type(error).__name__}: {first}"})
    return 0


def _said(reply, failure: dict) -> int:
    reply.write(json.dumps(failure) + "\n")
    reply.flush()
    return 1


def _lines(parent: int):
    """Each line's points, until END, the end of the pipe, or (waiting for a line) the recorder's process `parent` is
    gone (this process was given another parent)."""
    pending = ""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], PARENT_CHECK_SECONDS)
        if not ready:
            if os.getppid() != parent:
                return
            continue
        chunk = os.read(sys.stdin.fileno(), 1 << 20).decode()
        if not chunk:
            return
        pending += chunk
        *complete, pending = pending.split("\n")
        for line in complete:
            if line == END:
                return
            yield json.loads(line)


class HandOff:
    """The recorder's logging, in its writer thread until it has cost HANDOFF_SECONDS, then in a MetricsProcess
    (in the writer thread for good where that process cannot be started)."""

    def __init__(self, store, run_id: str):
        self.store, self.run_id = store, run_id
        self.spent = 0.0  # seconds the logging has taken in this process
        self.process: Optional[MetricsProcess] = None

    def log(self, points: list[tuple[str, float, int]]) -> None:
        if self.process is not None:
            self.process.log(points)
            return
        started = time.perf_counter()
        self.store.log_metrics(self.run_id, points)
        self.spent += time.perf_counter() - started
        if self.spent >= HANDOFF_SECONDS:
            try:
                self.process = MetricsProcess(self.store.uri, self.run_id)
            except OSError:  # (no process to be had: nothing was sent, nothing is lost)
                self.spent = -float("inf")

    def close(self, quiet: bool = False) -> None:
        if self.process is not None:
            self.process.close(quiet)


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
