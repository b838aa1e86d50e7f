"""Starting one bisect trial as a process of its own, in its worktree, with the worktree first on the path.

A short trial of `python -m replaybisect train` spends most of its time importing torch, MLflow and Hydra
(about 2 s each, measured on 2-core CI machines). So training trials are forked from a multiprocessing
*forkserver* that has imported those libraries once: each trial is still a fresh process of its own (own
session, cwd, environment, stdout/stderr, exit status), but starts in a fraction of a second. The fork
imports nothing of replaybisect or of the user's code before the trial sets its path, so the worktree's own
modules (and its own replaybisect, when the repository being bisected is replaybisect) are the ones used.

Plain `subprocess` is used for `--cmd`, when the worktree has a top-level module that would shadow a
preloaded library, and when REPLAYBISECT_TRIAL_FORK=0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from replaybisect.core.processes import Forked, run_module, shadows_preloaded


class PlainProcess:
    """A trial run with subprocess.Popen, in a session of its own."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]):
        self.process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.pid = self.process.pid

    def communicate(self) -> tuple[int, str, str]:
        stdout, stderr = self.process.communicate()
        return self.process.returncode, stdout, stderr

    def wait(self, timeout: float) -> None:
        self.process.wait(timeout=timeout)


class ForkedProcess:
    """A `python -m replaybisect ...` trial forked from the preloaded forkserver."""

    def __init__(self, module_args: list[str], cwd: Path, env: dict[str, str]):
        folder = Path(tempfile.mkdtemp(prefix="replaybisect-trial-"))
        self.folder = folder
        self.stdout_path, self.stderr_path = folder / "stdout", folder / "stderr"
        self.process = Forked(_forked_main, (module_args, str(cwd), env, str(self.stdout_path), str(self.stderr_path)),
                              "replaybisect-trial")
        self.pid = self.process.pid

    def communicate(self) -> tuple[int, str, str]:
        code = self.process.wait()
        try:
            stdout = self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""
            stderr = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        finally:
            for path in (self.stdout_path, self.stderr_path):
                path.unlink(missing_ok=True)
            self.folder.rmdir()
        return code, stdout, stderr

    def wait(self, timeout: float) -> None:
        self.process.wait(timeout)


def _forked_main(module_args: list[str], cwd: str, env: dict[str, str], stdout_path: str, stderr_path: str) -> None:
    """Runs in the forked trial: `cd CWD; env ... python -m replaybisect ARGS` in a session of its own (like
    start_new_session: the bisect signals the whole group), its output into the two files."""
    os.setsid()
    stdout, stderr = (os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for path in (stdout_path, stderr_path))
    for name in [name for name in sys.modules if name == "replaybisect" or name.startswith("replaybisect.")]:
        del sys.modules[name]  # imported fresh from the path: the worktree's own copy wins if it has one
    run_module("replaybisect", module_args, env, stdout, stderr, cwd=cwd)


class Launcher:
    """Starts trial processes: forked from the preloaded forkserver when it can, else plain subprocesses."""

    def __init__(self, fork: bool | None = None):
        self.fork = os.environ.get("REPLAYBISECT_TRIAL_FORK", "1") != "0" if fork is None else fork

    def start(self, argv: list[str], cwd: Path, env: dict[str, str]):
        module_args = argv[3:] if argv[:3] == [sys.executable, "-m", "replaybisect"] else None
        if self.fork and module_args is not None and not shadows_preloaded(cwd):
            return ForkedProcess(module_args, cwd, env)
        return PlainProcess(argv, cwd, env)


class JobLauncher:
    """Starts each trial as a submitit job (--executor submitit: SLURM, or submitit's local executor), waited on as a
    process is; `on_state` hears each job's id as it moves (queued, running, done)."""

    def __init__(self, settings, on_state=None):
        self.settings, self.on_state = settings, on_state

    def start(self, argv: list[str], cwd: Path, env: dict[str, str]):
        from replaybisect.core.jobs import submit_command

        trial = f"{env.get('REPLAYBISECT_SHA', '')[:10]} seed {env.get('REPLAYBISECT_SEED', '?')}"
        on_state = (lambda job_id, state: self.on_state(job_id, state, trial)) if self.on_state is not None else None
        return TrialJob(submit_command(self.settings, "replay-bisect", argv, str(cwd), env), on_state)


class TrialJob:
    """A trial's job: communicate() waits for it (saying each change of state), stop() cancels it."""

    def __init__(self, job, on_state=None):
        self.job, self.on_state = job, on_state
        self._said = None
        self._stopped = False

    def _poll(self) -> None:
        if self._stopped:  # cancelled: the scheduler may say so only minutes later; the bisect does not wait for it
            raise _JobStopped()
        state = self.job.state()
        if state != self._said and self.on_state is not None:
            self.on_state(self.job.job_id, state)
        self._said = state

    def communicate(self) -> tuple[int, str, str]:
        try:
            self.job.wait(on_poll=self._poll)
            self._poll()
        except _JobStopped:
            return -signal.SIGINT, "", f"submitit job {self.job.job_id} cancelled"
        return self.job.communicate()

    def wait(self, timeout: float) -> None:
        """A stopped job is not waited for (its cancel is sent); a running one up to `timeout` seconds."""
        if not self._stopped and not self.job.wait(timeout):
            raise subprocess.TimeoutExpired(f"submitit job {self.job.job_id}", timeout)

    def stop(self, signum: int) -> None:
        self._stopped = True
        self.job.cancel()


class _JobStopped(Exception):
    pass


def signal_group(process, signum: int) -> None:
    """Send `signum` to the trial's process group (its session), or to the process if the group is not made yet; a
    trial's job is cancelled."""
    if isinstance(process, TrialJob):
        process.stop(signum)
        return
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
