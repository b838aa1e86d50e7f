"""Work a verb runs elsewhere: ablate's arms, bisect's trials, watch's triage steps. `local` (the default) runs them as
processes here; `submitit` runs them as jobs through submitit: on SLURM when `sbatch` is on the PATH (or
`cluster="slurm"`), else with submitit's local executor, which runs the same jobs as subprocesses here.

The job settings are one frozen dataclass, checked once (a negative GPU count, an unknown SLURM parameter, a job folder
that is a file: one line, before anything is submitted) and turned into submitit's parameters in one place. A command
job (`submit_command`) runs an argv in a folder with an environment and hands back its exit status and output, as a
local process would. A job noted in the job folder (`remember`) is found again from another process (`recall`),
which is how a watcher that takes a run over follows the job its predecessor submitted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from replaybisect.core.processes import alive
from replaybisect.errors import ReplayError
from replaybisect.request import Bound, option

EXECUTORS = ("local", "submitit")
CLUSTERS = ("slurm", "local", "debug")  # what submitit.AutoExecutor runs on without plugins
DEFAULT_FOLDER = ".replaybisect/submitit"
# the settings by name, as the Python API's `submitit={...}` takes them
SETTINGS = ("cluster", "partition", "time_min", "gpus", "cpus", "mem_gb", "account", "slurm", "executor_folder")
POLL_SECONDS = 0.25


@dataclass(frozen=True)
class JobSettings:
    """Where and how submitit runs a verb's jobs. `slurm`: extra SLURM parameters (`("qos", "high")`, ...) by
    submitit's names, with or without the `slurm_` prefix."""

    cluster: Optional[str] = option(None, "--cluster", help="submitit cluster: slurm | local | debug (default: slurm "
                                    "when sbatch exists, else local).")
    partition: Optional[str] = option(None, "--partition", help="SLURM partition (submitit).")
    time_min: int = option(60, "--time", help="Job time limit in minutes (submitit).", bound=Bound("", ("--time",), low=1))
    gpus: int = option(0, "--gpus", help="GPUs per job (submitit).", bound=Bound("", ("--gpus",), low=0))
    cpus: Optional[int] = option(None, "--cpus", help="CPUs per job (submitit).", bound=Bound("", ("--cpus",), low=1))
    mem_gb: Optional[float] = option(None, "--mem-gb", help="Memory per job in GB (submitit).",
                                     bound=Bound("", ("--mem-gb",), low=0.001))
    account: Optional[str] = option(None, "--account", help="SLURM account to charge (submitit).")
    slurm: tuple[tuple[str, str], ...] = option((), "--slurm", kind=Optional[list[str]], parse=lambda items: parse_slurm(items or ()),
                                                help="Another SLURM parameter as KEY=VALUE, by submitit's name (qos=high, "
                                                "constraint=a100); repeat it.")
    folder: str = option(DEFAULT_FOLDER, "--executor-folder", help="submitit's job folder (a shared file system on SLURM).")

    def in_range(self, verb: str = "") -> "JobSettings":
        """These settings, or a one-line ReplayError for a number of the wrong kind or out of its option's range, in
        the words the command line's parser uses (`verb`'s help named): whatever the executor."""
        import dataclasses

        from replaybisect import request as checks

        for setting in dataclasses.fields(self):
            cli = checks.cli_of(setting)
            if cli is not None and cli.bound is not None:
                check = checks.number if setting.name == "mem_gb" else checks.integer
                check(getattr(self, setting.name), setting.name, dataclasses.replace(cli.bound, verb=verb),
                      optional=setting.default is None)
        return self

    def checked(self, verb: str = "") -> "JobSettings":
        """These settings, or a one-line ReplayError naming the first that cannot work; nothing is submitted."""
        self.in_range(verb)
        if self.cluster is not None and self.cluster not in known_clusters():
            raise ReplayError(f"--cluster {self.cluster[:80]!r} is not a submitit cluster; use {', '.join(known_clusters())} "
                              "(or leave it out: slurm when sbatch exists, else local)")
        for flag, value, low in (("--time", self.time_min, 1), ("--gpus", self.gpus, 0), ("--cpus", self.cpus, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ReplayError(f"{flag} {value!r} must be a whole number >= {low}")
        if self.mem_gb is not None and not (isinstance(self.mem_gb, (int, float)) and 0 < self.mem_gb < 1e6):
            raise ReplayError(f"--mem-gb {self.mem_gb!r} must be a positive number of GB")
        for flag, text in (("--partition", self.partition), ("--account", self.account)):
            if text is not None and (not text.strip() or any(c.isspace() or not c.isprintable() for c in text)):
                raise ReplayError(f"{flag} {text[:80]!r} is not a SLURM name; pass one word")
        valid = slurm_parameters()
        for key, _ in self.slurm:
            if key not in valid:
                raise ReplayError(f"--slurm {key[:80]!r} is not a SLURM parameter submitit knows; use one of "
                                  f"{', '.join(sorted(valid)[:12])}, ... (submitit's SlurmExecutor parameters)")
        _check_folder(self.folder)
        return self

    @property
    def resolved_cluster(self) -> str:
        return self.cluster or ("slurm" if shutil.which("sbatch") else "local")

    def executor(self, name: str, parallelism: Optional[int] = None):
        """submitit's executor for jobs named `name`, with these settings."""
        import submitit

        executor = submitit.AutoExecutor(folder=str(private_folder(self.folder) / "%j"), cluster=self.resolved_cluster)
        parameters: dict[str, Any] = {"name": name, "timeout_min": self.time_min}
        if parallelism:
            parameters["slurm_array_parallelism"] = parallelism
        if self.gpus:
            parameters["gpus_per_node"] = self.gpus
        if self.cpus:
            parameters["cpus_per_task"] = self.cpus
        if self.mem_gb:
            parameters["mem_gb"] = self.mem_gb
        if self.partition:
            parameters["slurm_partition"] = self.partition
        if self.account:
            parameters["slurm_account"] = self.account
        parameters.update({f"slurm_{key}": _number_or_text(value) for key, value in self.slurm})
        executor.update_parameters(**parameters)
        return executor


def given_settings(value: Any, verb: str) -> Optional[JobSettings]:
    """A request's job settings as given (None: none), or one line for something that is no JobSettings or holds a
    number out of its range."""
    if value is not None and not isinstance(value, JobSettings):
        raise ReplayError(f"jobs={value!r:.60} is not a JobSettings; pass the options as submitit={{...}}")
    return value.in_range(verb) if value is not None else None


def settings_from(values: dict) -> JobSettings:
    """JobSettings from the Python API's `submitit={...}` (names as SETTINGS), checked by the request that takes them."""
    if not isinstance(values, dict) or not all(isinstance(key, str) for key in values):
        raise ReplayError(f"submitit={values!r:.60} is not a dict of submitit options; pass e.g. {{'partition': 'gpu'}}")
    unknown = sorted(set(values) - set(SETTINGS))
    if unknown:
        raise ReplayError(f"submitit option {unknown[0][:80]!r} is unknown; use {', '.join(SETTINGS)}")
    fields = {("folder" if key == "executor_folder" else key): value for key, value in values.items()}
    if "slurm" in fields:
        fields["slurm"] = parse_slurm(fields["slurm"] if not isinstance(fields["slurm"], dict)
                                      else [f"{k}={v}" for k, v in fields["slurm"].items()])
    return JobSettings(**fields)


def parse_slurm(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`--slurm qos=high --slurm constraint=a100` -> (("qos", "high"), ("constraint", "a100"))."""
    parsed = []
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip().removeprefix("slurm_")
        if not sep or not key:
            raise ReplayError(f"--slurm {str(item)[:80]!r} is not KEY=VALUE; pass e.g. --slurm qos=high")
        parsed.append((key, value.strip()))
    return tuple(parsed)


def known_clusters() -> tuple[str, ...]:
    try:  # submitit's own registry: its executor plugins count too
        from submitit.core.plugins import get_executors

        return tuple(get_executors())
    except Exception:  # noqa: BLE001 - submitit missing or changed: its built-in executors
        return CLUSTERS


def slurm_parameters() -> set[str]:
    import submitit

    return set(submitit.SlurmExecutor._valid_parameters())


def _number_or_text(value: str):
    try:
        return int(value)
    except ValueError:
        return value


def _check_folder(folder: str) -> None:
    path = Path(folder).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == path else f": {existing}"
        raise ReplayError(f"--executor-folder {folder[:200]}{where} is a file, not a folder; pass a folder for submitit's job files")
    if path.is_dir() and path.stat().st_mode & 0o077:
        raise ReplayError(f"--executor-folder {path} is open to other users; submitit hands each job's result back through "
                          f"a pickle there, which this process loads, and the jobs carry its environment: make it private "
                          f"(chmod 700 {path}) or pass another folder")


def private_folder(folder: str) -> Path:
    """The job folder, made private to this user where it does not exist yet (checked as _check_folder checks it)."""
    path = Path(folder).expanduser().absolute()
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True)
    _check_folder(str(path))
    return path


# ---- a command as a job ---------------------------------------------------------------------------------------
def run_command(argv: list[str], cwd: str, env: dict[str, str]) -> dict:
    """The job itself: `argv` run in `cwd` with `env`, its exit status and output handed back."""
    done = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


class CommandJob:
    """A command running as a submitit job, waited on as a local process is: `communicate()` -> (exit status, stdout,
    stderr). A job that failed outside the command (cancelled, timed out, its node lost) gives JOB_FAILED and the
    scheduler's reason as stderr."""

    def __init__(self, job, cluster: str):
        self.job, self.cluster = job, cluster
        self.job_id = str(job.job_id)

    @property
    def reference(self) -> str:
        """What finds this job again from another process: cluster, folder, id."""
        return f"{self.cluster}:{self.job.paths.folder}:{self.job_id}"

    def state(self) -> str:
        """queued | running | done (submitit's states, in three words)."""
        if self.done():
            return "done"
        raw = str(getattr(self.job, "state", "")).upper()
        return "queued" if raw in ("PENDING", "CONFIGURING", "REQUEUED", "QUEUED", "UNKNOWN") and self.cluster == "slurm" else "running"

    def done(self) -> bool:
        if self.job.paths.result_pickle.exists():
            return True
        if self.cluster != "slurm" and self.job._process is None:  # a local job followed from another process
            return not alive(int(self.job_id))
        return bool(self.job.done())

    def wait(self, timeout: Optional[float] = None, on_poll: Optional[Callable[[], None]] = None) -> bool:
        """Whether the job ended within `timeout` seconds (None: however long it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if on_poll is not None:
                on_poll()
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def communicate(self) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of the command; a job that failed outside it: JOB_FAILED and the reason."""
        self.wait()
        try:
            answer = self.job.result()
        except Exception as error:  # noqa: BLE001 - the job failed outside the command: its reason, one line
            lines = [line for line in str(error).strip().splitlines() if line.strip()]
            return JOB_FAILED, "", f"submitit job {self.job_id} failed: {lines[-1] if lines else type(error).__name__}"
        return int(answer["returncode"]), answer["stdout"], answer["stderr"]

    def cancel(self) -> None:
        if self.done():
            return
        if self.cluster != "slurm" and self.job._process is None:  # as submitit's LocalJob.cancel signals its controller
            try:
                os.kill(int(self.job_id), signal.SIGINT)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
            return
        try:
            self.job.cancel(check=False)
        except Exception:  # noqa: BLE001 - already gone
            pass


def submit_command(settings: JobSettings, name: str, argv: list[str], cwd: str, env: dict[str, str]) -> CommandJob:
    executor = settings.executor(name)
    return CommandJob(executor.submit(run_command, argv, cwd, env), settings.resolved_cluster)


JOB_FAILED = -1000  # CommandJob.communicate's exit status for a job that failed outside its command


def remember(job: CommandJob, settings: JobSettings, name: str) -> None:
    """Note `job` under `name` in the job folder (written whole, readable by this user only), for a successor to
    `recall`: the folder is the watcher's own, never a stored run's word."""
    folder = _notes(settings)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = folder / f"{name}.partial"
    partial.write_text(job.reference, encoding="utf-8")
    partial.replace(folder / name)


def recall(settings: JobSettings, name: str) -> Optional[CommandJob]:
    """The job noted under `name` in the job folder, if it is one of that folder's jobs; None otherwise."""
    note = _notes(settings) / name
    try:
        reference = note.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    cluster, _, rest = reference.partition(":")
    folder, _, job_id = rest.rpartition(":")
    root = Path(settings.folder).expanduser().resolve()
    if cluster not in CLUSTERS or not job_id.isdigit() or int(job_id) <= 1 or Path(folder).resolve().parent != root:
        return None
    import submitit

    if cluster == "slurm":
        job = submitit.SlurmJob(folder=folder, job_id=job_id)
    else:
        from submitit.local.local import LocalJob

        job = LocalJob(folder=folder, job_id=job_id)
    return CommandJob(job, cluster)


def forget(settings: JobSettings, name: str) -> None:
    try:
        (_notes(settings) / name).unlink()
    except OSError:
        pass


def _notes(settings: JobSettings) -> Path:
    return Path(settings.folder).expanduser().resolve() / "running"
