"""Running one triage step (`replay nan`, `ablate` or `diagnose` on a claimed run): in a child process here with the
memory and time limits (watch/child.py), or as a job through core/jobs.py that a later watcher can follow; its JSON
result read back, or why it failed in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from threading import Event as Flag
from typing import Any, Callable, Optional

from replaybisect.core.jobs import JOB_FAILED
from replaybisect.core.processes import Forked
from replaybisect.store import Store
from replaybisect.verbs.watch.answer import ablate_args
from replaybisect.verbs.watch.request import CODE_DIR_ENV, WatchOptions

JOB = "triage.job"  # triage.job.<step>: the id of the step's job, with --executor submitit (for people; never read back)


@dataclass
class TriageStepResult:
    """One triage step's child process: its JSON result or why it failed."""

    name: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0
    detail: str = ""  # the end of the child's stderr (a failure's evidence: was it the tracking server?)


class LeftRunning(Exception):
    """A triage job this watcher stopped waiting for: the run is no longer its own (released, lost, shutting down)."""


class Abandoned(Exception):
    """The grace is over (--grace, or a second signal): a triage waiting out an outage gives its run back."""


class TriageSteps:
    """Runs the triage's verbs for a watcher: `call` is its store call that waits out an outage, `say(kind, text,
    run_id)` its event log, `abandon` set when the grace is over."""

    def __init__(self, store: Store, options: WatchOptions, call: Callable[..., Any], say: Callable[[str, str, str], None],
                 abandon: Flag):
        self.store, self.options, self.call, self.say, self.abandon = store, options, call, say, abandon

    def run(self, step: str, run_id: str, active, scratch: str, lines: dict[str, str]) -> TriageStepResult:
        """Run one verb of the triage (`active`: the run's claim, which may be released or lost meanwhile)."""
        if self.options.executor == "submitit":
            return self._as_job(step, run_id, active, lines)
        return self._here(step, run_id, active, scratch, lines)

    def _as_job(self, step: str, run_id: str, active, lines: dict[str, str]) -> TriageStepResult:
        """One verb as a job (core/jobs.py). The job is noted in the watcher's private job folder before it is waited
        on (and its id on the run, for people): a watcher that takes the run over after this one stopped or died
        follows that job to its end instead of submitting it again. A job that failed, timed out or was cancelled is
        the step's failure, with the scheduler's reason in one line."""
        from replaybisect.core import jobs

        settings, note = self.options.jobs, f"{run_id}.{step}"
        job = jobs.recall(settings, note)
        if job is not None:
            self.say("step", f"{step}: following job {job.job_id} ({job.cluster}), submitted by an earlier watcher", run_id)
        else:
            argv = [sys.executable, "-m", "replaybisect.verbs.watch.child", str(self.options.memory_mb), "--scratch", "--",
                    *self.verb_args(step, run_id, lines)]
            env = dict(os.environ)
            if env.get(CODE_DIR_ENV):
                env[CODE_DIR_ENV] = os.pathsep.join(absolute(part) for part in env[CODE_DIR_ENV].split(os.pathsep) if part.strip())
            job = jobs.submit_command(settings, f"replay-triage-{step}", argv, tempfile.gettempdir(), env)
            jobs.remember(job, settings, note)
            self.say("step", f"{step}: job {job.job_id} submitted ({job.cluster})", run_id)
        self.call(self.store.set_tags, run_id, {f"{JOB}.{step}": job.job_id}, run_id=run_id)
        started = time.monotonic()
        said = None

        def watch_it() -> None:  # the job's state as it changes; a run this watcher no longer holds is left to it
            nonlocal said
            if active.released or active.lost or self.abandon.is_set():
                raise LeftRunning()
            state = job.state()
            if state != said and state != "done":
                self.say("step", f"{step}: job {job.job_id} {state}", run_id)
            said = state

        try:
            if not job.wait(self.options.time_limit, on_poll=watch_it):
                job.cancel()
                jobs.forget(settings, note)
                return TriageStepResult(step, False, reason=f"job {job.job_id} stopped at the time limit ({self.options.time_limit:.0f} s)",
                                        seconds=time.monotonic() - started)
        except LeftRunning:  # the job runs on: the watcher that holds the run now (or next) follows it
            if self.abandon.is_set():
                raise Abandoned() from None
            return TriageStepResult(step, False, reason=f"job {job.job_id} left to the next watcher", seconds=time.monotonic() - started)
        returncode, stdout, error_text = job.communicate()
        jobs.forget(settings, note)  # consumed: a rerun submits anew
        return self._result(step, returncode, stdout, error_text, time.monotonic() - started, job_id=job.job_id)

    def _here(self, step: str, run_id: str, active, scratch: str, lines: dict[str, str]) -> TriageStepResult:
        """One verb in a child process with the memory and time limits (watch/child.py); its JSON comes back in a file
        of ours. It runs in the triage's scratch folder (never the watcher's working folder: nothing there is trusted
        or importable) with its caches and temporary files there too."""
        from replaybisect.verbs.watch.child import start_step

        work = os.path.join(scratch, "work")
        env = dict(os.environ, PWD=work, TMPDIR=os.path.join(scratch, "tmp"), REPLAYBISECT_CACHE=os.path.join(scratch, "cache"))
        if env.get(CODE_DIR_ENV):  # the folders as the watcher reads them, not relative to the child's scratch folder
            env[CODE_DIR_ENV] = os.pathsep.join(absolute(part) for part in env[CODE_DIR_ENV].split(os.pathsep) if part.strip())
        started = time.monotonic()
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            process = start_step(self.options.memory_mb, self.verb_args(step, run_id, lines), work, env, stdout, stderr)
            active.process = process
            if active.released or active.lost:  # given up while it started, when _release or _renew saw no process yet
                kill(process)
            try:  # the limit counts from the step's start: the child's own start (a fork, its imports) is the step's too
                process.wait(timeout=max(0.0, self.options.time_limit - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                kill(process)
                process.wait()
                return TriageStepResult(step, False, reason=f"stopped at the time limit ({self.options.time_limit:.0f} s)",
                                   seconds=time.monotonic() - started)
            finally:
                active.process = None
            stdout.seek(0)
            stderr.seek(0)
            output, error_text = stdout.read(), stderr.read().decode("utf-8", "replace")
        return self._result(step, process.returncode, output, error_text, time.monotonic() - started)

    def _result(self, step: str, returncode: int, stdout, error_text: str, seconds: float,
                     job_id: Optional[str] = None) -> TriageStepResult:
        """A finished step's outcome: its JSON result, or why it failed (one line)."""
        if returncode == 0:
            try:
                import json

                return TriageStepResult(step, True, result=json.loads(stdout), seconds=seconds)
            except ValueError:
                return TriageStepResult(step, False, reason="its JSON result did not parse", seconds=seconds)
        if job_id is not None and returncode == JOB_FAILED:  # the job itself failed (the scheduler's reason is the text)
            return TriageStepResult(step, False, reason=error_text, seconds=seconds, detail=error_text)
        reason = failure_reason(returncode, error_text, self.options.memory_mb)
        return TriageStepResult(step, False, reason=f"job {job_id}: {reason}" if job_id else reason,
                                seconds=seconds, detail="\n".join(error_text.splitlines()[-40:]))

    def verb_args(self, step: str, run_id: str, lines: dict[str, str]) -> list[str]:
        """The verb's command line; ablate tries the arms nan suggested (from where it said) and the standard ones."""
        common = ["--run-id", run_id, "--json", "--tracking-uri", self.store.uri]
        trust = [arg for folder in self.options.code_dirs for arg in ("--code-dir", absolute(folder))]
        trust += [arg for prefix in self.options.trust_prefixes for arg in ("--trust", prefix)]
        if step == "nan":
            return ["nan", *common, *trust]
        if step == "ablate":
            return ["ablate", *ablate_args(lines), *common, "--horizon", str(self.options.horizon), *trust]
        if step == "verify":  # an audit: the triage's own report is the run's record of it
            return ["verify", "--sample", f"{self.options.audit:g}", "--no-child-run", *common, *trust]
        return ["diagnose", *common]


def absolute(folder: str) -> str:
    return os.path.abspath(os.path.expanduser(folder))


def kill(process: Optional[Forked]) -> None:
    """The step's child and its own workers (its session)."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # forked a moment ago: its session is not made yet
        process.kill()
    except PermissionError:
        pass


# how running out of address space (RLIMIT_AS) shows: Python, torch's allocator, the loader mapping a library
OUT_OF_MEMORY = ("MemoryError", "std::bad_alloc", "DefaultCPUAllocator", "failed to map segment", "Cannot allocate memory")


def failure_reason(returncode: int, stderr: str, memory_mb: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    if any(sign in line for line in lines[-20:] for sign in OUT_OF_MEMORY):
        return f"ran out of memory (limit {memory_mb} MiB, --memory-mb)"
    last = next((line for line in reversed(lines) if line.startswith("replay:")), lines[-1] if lines else "no output")
    return f"exit {returncode}: {last.removeprefix('replay: ').removeprefix('error: ')}"
