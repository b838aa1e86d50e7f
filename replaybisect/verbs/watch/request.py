"""What `replay watch` is asked: its options, checked before the server is contacted (a watcher's own mistake is never
written on the runs it would touch). Light: no torch, no MLflow."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from replaybisect import request as checks
from replaybisect.core.jobs import JobSettings
from replaybisect.errors import ReplayError
from replaybisect.request import MAX_STEPS, Bound, option, option_group

# bounds of the options: finite, and within what the timers (threading's TIMEOUT_MAX) and setrlimit can take
BOUNDS = {"--interval": (0.1, 86400.0), "--lease": (1.0, 86400.0), "--settle": (0.1, 3600.0),
          "--time-limit": (1.0, 7 * 86400.0), "--grace": (0.0, 3600.0), "--notify-timeout": (1.0, 300.0)}
CODE_DIR_ENV = "REPLAYBISECT_CODE_DIR"  # core/trust.py's: folders of the user's code, os.pathsep-separated
MAX_MEMORY_MB = 1 << 30  # 1 PiB: far above any machine, far below what RLIMIT_AS (a C long of bytes) can hold


@dataclass
class WatchOptions:
    """What `replay watch` is asked: the server and the experiments watched, how triage runs, where results go."""

    tracking_uri: Optional[str] = checks.tracking_uri_option()  # resolved to the store's URI before the watcher starts
    experiments: Sequence[str] = option((), "--experiment", help="Watch this experiment (repeatable; default: all).")
    interval: float = option(30.0, "--interval", help="Seconds between polls.")
    workers: int = option(1, "--workers", help="Triages at once (each a child process).")
    notify_url: Optional[str] = option(None, "--notify-url", envvar="REPLAYBISECT_NOTIFY_URL",
                                       help="POST each result here (Slack/Mattermost incoming-webhook JSON).")
    notify_timeout: float = option(10.0, "--notify-timeout", help="Seconds one notification may take in all; posted off "
                                   "the triage, so a slow webhook never holds a run (on shutdown: at most this long more).")
    ui_url: Optional[str] = option(None, "--ui-url", help="The MLflow UI address for links (default: the tracking URI when it is http).")
    lease: float = option(120.0, "--lease", help="Seconds a claim lasts unless renewed; a dead watcher's runs are taken over after it.")
    settle: float = option(2.0, "--settle", help="Seconds between claiming a run and confirming the claim (two watchers racing).")
    time_limit: float = option(1800.0, "--time-limit", help="Seconds each triage step (nan, ablate, diagnose) may run.")
    memory_mb: int = option(8192, "--memory-mb", help="Address-space limit of each triage process in MiB (0: none; use 0 "
                            "where triage runs on a GPU: CUDA reserves far more than it uses).")
    horizon: int = option(200, bound=Bound("watch", ("--horizon",), low=1, high=MAX_STEPS),
                          help="ablate: steps replayed past the failing step.")
    audit: float = option(0.0, "--audit", metavar="PER_1000", help="Also verify each finished run once: this many of its "
                          "recorded steps per thousand (e.g. 5), replayed and compared bit for bit (replay verify --sample); "
                          "a run a replay does not reproduce is tagged and reported. 0: off.")
    grace: float = option(20.0, "--grace", help="On SIGTERM: seconds running triages may take to finish before their claims are released.")
    code_dirs: Sequence[str] = checks.code_dirs_option()
    trust_prefixes: Sequence[str] = checks.trust_option()
    allow_root: bool = option(False, "--allow-root", help="Triage as root (refused by default: a stored run's config is "
                              "untrusted input; run the watcher as an unprivileged user instead).")
    executor: str = checks.executor_option()  # local: child processes here | submitit: each step a job (core/jobs.py)
    jobs: Any = option_group(JobSettings)  # submitit's JobSettings, with executor submitit

    def check(self) -> None:
        """Bad values are bad input, before the server is contacted: a watcher's own mistake must never be written
        on the runs it would touch as their triage's failure."""
        for name, value in (("--interval", self.interval), ("--lease", self.lease), ("--settle", self.settle),
                            ("--time-limit", self.time_limit), ("--grace", self.grace), ("--notify-timeout", self.notify_timeout)):
            low, high = BOUNDS[name]
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
                raise ReplayError(f"{name} {value} must be a number of seconds from {low:g} to {high:g}")
        if self.settle * 2 >= self.lease:
            raise ReplayError(f"--settle {self.settle} must be under half of --lease {self.lease}")
        if not (isinstance(self.audit, (int, float)) and math.isfinite(self.audit) and 0 <= self.audit <= 1000):
            raise ReplayError(f"--audit {self.audit} must be a number of steps per thousand from 0 (off) to 1000")
        if not 1 <= self.workers <= 64:
            raise ReplayError(f"--workers {self.workers} must be between 1 and 64")
        if self.memory_mb < 0 or 0 < self.memory_mb < 512:
            raise ReplayError(f"--memory-mb {self.memory_mb} is too small for torch: use at least 512 (0: no limit)")
        if self.memory_mb > MAX_MEMORY_MB:
            raise ReplayError(f"--memory-mb {self.memory_mb} is more than {MAX_MEMORY_MB} (1 PiB); pass 0 for no limit")
        for flag, url, example in (("--notify-url (or $REPLAYBISECT_NOTIFY_URL)", self.notify_url, "https://hooks.slack.com/services/..."),
                                     ("--ui-url", self.ui_url, "http://mlflow.example.com:5000")):
            if url is not None:
                check_http_url(flag, url, example)
        self.check_trust()
        self.check_jobs()
        from replaybisect.core import provenance

        provenance.signing_key()  # the key runs are verified with (a team's: $REPLAYBISECT_KEY_FILE): one line if none

    def check_jobs(self) -> None:
        """With --executor submitit: the job settings, and a job folder only this user can write (submitit hands each
        job's result back through a pickle there, which this watcher loads)."""
        from replaybisect.core.jobs import EXECUTORS, JobSettings, private_folder

        if self.executor not in EXECUTORS:
            raise ReplayError(f"--executor {str(self.executor)[:80]!r} is not one of {', '.join(EXECUTORS)}")
        if self.executor != "submitit":
            return
        self.jobs = (self.jobs or JobSettings()).checked("watch")
        private_folder(self.jobs.folder)  # (made here, at the start, where the watcher's jobs will write)

    def check_trust(self) -> None:
        """The folders and prefixes the triage children will be given (options and environment), checked as they
        will check them, and readable here (the children run as this user)."""
        from replaybisect.core.trust import Trust

        Trust.from_user(list(self.code_dirs), list(self.trust_prefixes))  # one line for a missing folder or a bad prefix
        env_dirs = [part for part in os.environ.get(CODE_DIR_ENV, "").split(os.pathsep) if part.strip()]
        for flag, folders in (("--code-dir", self.code_dirs), (f"${CODE_DIR_ENV}", env_dirs)):
            for folder in folders:
                if not os.access(os.path.expanduser(folder), os.R_OK | os.X_OK):
                    raise ReplayError(f"{flag} {folder!r} is not readable by this user (uid {os.geteuid()}), "
                                      "who runs the triage; make it readable or pass another folder")

    def check_user(self) -> None:
        """Triage builds what a stored run's config names, and anyone who can write runs can write that config:
        it never runs as root unless the operator says so."""
        if os.geteuid() == 0 and not self.allow_root:
            raise ReplayError("replay watch will not triage as root (a stored run's config is untrusted input): run it "
                              "as an unprivileged user (deploy/compose.yaml does), or pass --allow-root")


def check_http_url(option: str, url: str, example: str) -> None:
    """An http(s) URL with a host, no spaces or control characters, a valid port: or one line of bad input."""
    from urllib.parse import urlsplit

    problem = f"{option} {url[:200]!r} is not an http(s) URL with a host; pass an address such as {example}"
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise ReplayError(problem)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError:
        raise ReplayError(problem) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplayError(problem)
