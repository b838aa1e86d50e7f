"""`replay watch`: poll a tracking server for failed runs and triage each exactly once.

The claim protocol (README, "replay watch: how a run is claimed"), written entirely in the run's tags:

    replaybisect.triage           running | done | failed   (absent: not triaged yet)
    replaybisect.triage.claim     "<watcher id> until <unix time>"   the lease
    replaybisect.triage.attempts  claims taken so far (a run whose watchers keep dying is given up, not retried forever)
    replaybisect.triage.step      the step in progress (nan | ablate | diagnose)
    replaybisect.triage.<step>    a finished step's one-line result: a restarted triage skips finished steps
    replaybisect.triage.summary   the one-line answer (a column in the MLflow run list); .next the next command

MLflow has no compare-and-set, so a claim is a tag write followed by a re-read after `settle` seconds: a watcher
whose claim read-to-write took less than `settle` and whose claim is still there after `settle` owns the run (a
rival that read the run before our write landed wrote within `settle` of its read, so before our re-read).
The owner renews its lease every lease/3 and checks the tag each time; a watcher that finds its claim taken
stops its triage. Wall-clock expiry times assume watchers' clocks agree to well within a lease (NTP).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from replaybisect.core.processes import Forked
from replaybisect.core.jobs import JOB_FAILED
from replaybisect.errors import ReplayError, StoreUnreachable
from replaybisect.verbs.watch.request import CODE_DIR_ENV, WatchOptions  # noqa: F401  (WatchOptions: engine's callers import it from here)
from replaybisect.store import (
    TAG, Store, all_experiment_ids, experiment_ids_named, search_all_runs, search_runs_without_tag,
)
from replaybisect.verbs.watch.answer import (
    TRIAGE, Conclusion, ablate_args, conclude, evidence_of, result_runs, step_lines, tag_line,
)

CLAIM = "triage.claim"
ATTEMPTS = "triage.attempts"
STEP = "triage.step"
SUMMARY = "triage.summary"
NEXT = "triage.next"
REASON = "triage.reason"
JOB = "triage.job"  # triage.job.<step>: the id of the step's job, with --executor submitit (for people; never read back)
FINISHED_STATES = ("done", "failed", "untrusted")  # untrusted: its signature does not verify, so nothing of it was run
MAX_ATTEMPTS = 3  # claims of one run before it is given up (its watchers died mid-triage each time)
FAILED_STATUSES = ("FAILED", "KILLED")
# An outage of the tracking server (restarting, its database down) is waited out, never a verdict on a run:
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0  # seconds between tries of a store call, doubling
STORE_RERUNS = 3  # a step whose child said the store failed while the store answers us: run again this often at most
# SIGTERM: a watcher exits within --grace + --notify-timeout + 1 s of it. After the grace, the claims' releases (and the
# triages ending) get RELEASE_SECONDS at most; EXIT_SECONDS is kept for the process's own end after the log is closed.
RELEASE_SECONDS, EXIT_SECONDS = 1.0, 0.5
# MLflow's error codes for a request that is wrong (not a server in trouble): retrying cannot help
REQUEST_ERRORS = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE",
                  "RESOURCE_ALREADY_EXISTS", "INVALID_REQUEST", "ENDPOINT_NOT_FOUND")
# what a triage child prints when it could not reach the tracking store (replay's own lines, MLflow's client)
STORE_TROUBLE = re.compile(r"cannot open tracking store|tracking server \S+ is unreachable|API request to \S+ failed|"
                           r"Max retries exceeded|TEMPORARILY_UNAVAILABLE")
@dataclass
class Claim:
    watcher_id: str
    expires: float  # unix time

    def render(self) -> str:
        return f"{self.watcher_id} until {self.expires:.1f}"

    @staticmethod
    def parse(value: Optional[str]) -> Optional["Claim"]:
        if not value or " until " not in value:
            return None
        watcher_id, _, expires = value.rpartition(" until ")
        try:
            return Claim(watcher_id, float(expires))
        except ValueError:
            return None

    def live(self, now: Optional[float] = None) -> bool:
        return self.expires > (time.time() if now is None else now)


@dataclass
class TriageStepResult:
    """One triage step's child process: its JSON result or why it failed."""

    name: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0
    detail: str = ""  # the end of the child's stderr (a failure's evidence: was it the tracking server?)


@dataclass
class TriageResult:
    run_id: str
    run_name: str
    experiment_id: str
    failure: str  # nonfinite | failed | killed: why the run was picked
    state: str  # done | failed
    verdict: str  # the nan category or the diagnose verdict ("" when the triage failed)
    summary: str  # the one line tagged on the run
    next_command: str
    reason: str = ""  # a failed triage's one-line reason
    evidence: list[str] = field(default_factory=list)  # a few lines of the verbs' evidence
    fix: str = ""  # the fix the ablation proved, in one line ("" when none did)
    to_prove: str = ""  # none did: the command that proves the op's fix replay nan proposes
    headline: str = ""  # the answer in a few words first: the triage run's name
    links: list[dict[str, Any]] = field(default_factory=list)  # the verbs' result runs: step, name, run_id, url, path
    steps: list[str] = field(default_factory=list)  # the steps run by this watcher (resumed ones are not rerun)
    results: dict[str, Any] = field(default_factory=dict)  # step -> its JSON
    seconds: float = 0.0
    watcher_id: str = ""
    run_url: Optional[str] = None
    triage_run_id: Optional[str] = None  # the triage's own run under the examined one (report.publish)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Event:
    """What the watcher did, for the log (rich lines or JSON lines) and the health line."""

    kind: str  # start | poll | claimed | lost | step | done | failed | released | skipped | outage | error | health | stop
    message: str
    run_id: Optional[str] = None
    data: dict[str, Any] = field(default_factory=dict)
    result: Optional[TriageResult] = None


@dataclass
class _Active:
    """A run this watcher holds a claim on."""

    run_id: str
    claim: Claim
    process: Optional[Forked] = None  # the running step's child (a job is never killed: see _run_step_as_job)
    scratch: Optional[str] = None  # the triage's scratch folder (_scratch_folder)
    lost: bool = False  # another watcher holds the run now: stop
    released: bool = False


def _in_thread(fn: Callable, *args) -> Future:
    """fn(*args) in a daemon thread of its own, its outcome in the Future: a watcher's exit never waits for it (a
    ThreadPoolExecutor's threads are joined at exit, whatever they wait for)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - the future carries it
            future.set_exception(error)

    threading.Thread(target=run, name=f"replay-watch-{fn.__name__.strip('_')}", daemon=True).start()
    return future


def attempts_of(tags: dict[str, str]) -> Optional[int]:
    """The run's count of claims (0 when untagged), None when the tag is not a count: tags are data."""
    from replaybisect.core.tags import step_tag_or_none

    value = tags.get(TAG + ATTEMPTS)
    return 0 if value in (None, "") else step_tag_or_none({"n": value}, "n")


def new_watcher_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def failure_of(run) -> Optional[str]:
    """Why a training run needs triage (nonfinite | failed | killed), or None for a healthy or live run."""
    if run.info.status == "RUNNING":  # still training (on_nonfinite=continue tags early), or SIGKILLed: not ended
        return None
    tags = run.data.tags
    if tags.get(TAG + "status") == "nonfinite" or tags.get(TAG + "first_nonfinite_step"):
        return "nonfinite"
    if run.info.status == "FAILED":
        return "failed"
    if run.info.status == "KILLED":
        return "killed"
    return None


def plan_for(failure: str) -> list[str]:
    return ["nan", "ablate"] if failure == "nonfinite" else ["diagnose"]


def run_url(options: WatchOptions, experiment_id: str, run_id: str) -> Optional[str]:
    """The run's page in the MLflow UI (None when the watcher knows no UI address: a local store)."""
    base = options.ui_url or (options.tracking_uri if options.tracking_uri.startswith(("http://", "https://")) else None)
    if not base:
        return None
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


class _LeftRunning(Exception):
    """A triage job this watcher stopped waiting for: the run is no longer its own (released, lost, shutting down)."""


class _Abandoned(Exception):
    """The grace is over (--grace, or a second signal): a triage waiting out an outage gives its run back."""


class Watcher:
    """Polls, claims, triages in child processes, renews leases; thread-safe event reporting through `on_event`."""

    def __init__(self, store: Store, options: WatchOptions, on_event: Callable[[Event], None],
                 publish: Callable[[TriageResult], None] = lambda result: None):
        self.store = store
        self.options = options
        self.on_event = on_event
        self.publish = publish
        self.watcher_id = new_watcher_id()
        self.stopping = threading.Event()  # SIGTERM/SIGINT: no new claims
        self.abandon = threading.Event()  # grace over: stop children, release claims
        self.stopped_at: Optional[float] = None  # time.monotonic() of the first stop(): the grace counts from it
        self.exit_by: Optional[float] = None  # after a stop(): when the log must be closed to exit within the promise
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        self._unsettled: dict[str, Claim] = {}  # claims written or released during an outage: maybe landed, maybe not
        self._outage_seen = -math.inf  # time.time() of the last store call that failed for the server's reasons
        self._missing_experiments: set[str] = set()
        self.started = time.time()
        self.counts = {"polls": 0, "done": 0, "failed": 0, "untrusted": 0, "lost": 0, "errors": 0}
        self.last_poll: Optional[float] = None

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self, once: bool = False) -> dict[str, int]:
        """Poll until stopped (or, with once, until nothing claimable is left); returns the counts."""
        watched = ", ".join(self.options.experiments) or "all experiments"
        self.on_event(Event("start", f"watching {self.store.uri} ({watched}) as {self.watcher_id}", data=self.health()))
        remove_dead_scratch_folders()  # a watcher killed with SIGKILL could not remove its own
        heartbeat = threading.Thread(target=self._renew_leases, name="replay-watch-leases", daemon=True)
        heartbeat.start()
        futures: set[Future] = set()
        while not self.stopping.is_set():
            claimed = self._poll(futures)
            futures = {f for f in futures if not f.done()}
            if once and not futures and not claimed:
                break
            if once:  # poll again when a triage ends (its slot is free)
                while futures and not self.stopping.is_set() and not wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)[0]:
                    pass
            else:
                self.stopping.wait(self.options.interval)
        self._finish_or_release(futures)
        self.stopping.set()
        return dict(self.counts)

    def stop(self) -> None:
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
            self.exit_by = self.stopped_at + self.options.grace + self.options.notify_timeout + 1.0 - EXIT_SECONDS
        self.stopping.set()

    def _poll(self, futures: set[Future]) -> int:
        """Claim up to the free worker slots; returns how many triages were started."""
        self._settle_claims()
        free = self.options.workers - len([f for f in futures if not f.done()])
        if free <= 0:
            return 0
        try:
            candidates = self.candidates()
        except ReplayError:
            raise
        except Exception as error:  # the server is down or restarting: try again next poll
            self._note(error)
            self.counts["errors"] += 1
            self.on_event(Event("error", f"poll failed: {_one_line(error)}"))
            return 0
        self.counts["polls"] += 1
        self.last_poll = time.time()
        started = 0
        for run in candidates:
            if started >= free or self.stopping.is_set():
                break
            with self._lock:
                if run.info.run_id in self._active:
                    continue
            try:
                active = self._try_claim(run)
            except Exception as error:  # a run deleted meanwhile, the server restarting: the next poll sees
                self._note(error)
                self.counts["errors"] += 1
                self.on_event(Event("error", f"claim failed: {_one_line(error)}", run.info.run_id))
                continue
            if active is None:
                continue
            futures.add(_in_thread(self._triage_guarded, run, active))
            started += 1
        return started

    # ---- the tracking server's outages ----------------------------------------------------------------------
    def _note(self, error: BaseException) -> bool:
        """Remember an outage (for `_may_take_over`); True when `error` is one."""
        if _outage(error):
            self._outage_seen = time.time()
            return True
        return False

    def _may_take_over(self, now: float) -> bool:
        """Another watcher's lapsed claim is taken over only when this watcher has seen the server answer for a whole
        lease: a lease that lapsed during an outage belongs to a live watcher that could not renew it, and that
        watcher renews it as soon as the server is back (a takeover would count an attempt the run never failed)."""
        return now - self._outage_seen >= self.options.lease

    def _call(self, fn: Callable, *args, run_id: Optional[str] = None):
        """A store call of a triage, retried with backoff while the tracking server is unavailable (restarting, its
        database down): an outage is waited out, never a verdict on the run. Raises what is not an outage (the run
        deleted, a bad request), and _Abandoned when the grace is over."""
        delay = BACKOFF_FIRST
        while True:
            if self.abandon.is_set():
                raise _Abandoned()
            try:
                return fn(*args)
            except Exception as error:
                if not self._note(error):
                    raise
                self.on_event(Event("outage", f"tracking server unavailable ({_one_line(_cause(error))}); "
                                              f"trying again in {delay:g} s", run_id))
            if self.abandon.wait(delay):
                raise _Abandoned()
            delay = min(delay * 2, BACKOFF_MAX)

    def _store_answers(self, run_id: str) -> bool:
        try:
            self.store.get_run(run_id)
        except Exception as error:
            return not self._note(error)
        return True

    def _settle_claims(self) -> None:
        """Claims whose write or release failed during an outage may have landed: give each back once the server
        answers (an attempt that never started is not counted)."""
        with self._lock:
            unsettled = list(self._unsettled)
        for run_id in unsettled:
            try:
                self._give_back(run_id)
            except Exception as error:
                if self._note(error):
                    continue  # still down: the next poll tries again
            with self._lock:
                self._unsettled.pop(run_id, None)

    # ---- which runs ---------------------------------------------------------------------------------------
    def experiment_ids(self) -> list[str]:
        if not self.options.experiments:
            return all_experiment_ids(self.store)
        named = experiment_ids_named(self.store, self.options.experiments)
        for name, experiment_id in named.items():
            if experiment_id is None and name not in self._missing_experiments:
                self._missing_experiments.add(name)
                self.on_event(Event("skipped", f"experiment {name!r} does not exist (yet); watching for it"))
        return [experiment_id for experiment_id in named.values() if experiment_id is not None]

    def candidates(self) -> list:
        """Training runs that failed (or went non-finite) with no finished triage and no live claim, oldest first."""
        experiment_ids = self.experiment_ids()
        train = f"tags.`{TAG}kind` = 'train'"
        untriaged = [f"{train} and attributes.status = '{status}'" for status in FAILED_STATUSES]  # no IN for status
        untriaged.append(f"{train} and tags.`{TAG}status` = 'nonfinite'")  # also a run that went on (on_nonfinite=continue)
        found = [run for query in untriaged for run in search_runs_without_tag(self.store, experiment_ids, query, TAG + TRIAGE)]
        found += search_all_runs(self.store, experiment_ids, f"{train} and tags.`{TAG}{TRIAGE}` = 'running'")
        runs = {run.info.run_id: run for run in found}
        now = time.time()
        ready = [run for run in runs.values() if failure_of(run) and self._claimable(run.data.tags, now)]
        return sorted(ready, key=lambda run: run.info.start_time)

    def _claimable(self, tags: dict[str, str], now: float) -> bool:
        return _claimable(tags, now, self.watcher_id, take_over=self._may_take_over(now))

    # ---- claims -----------------------------------------------------------------------------------------
    def _try_claim(self, run) -> Optional[_Active]:
        run_id = run.info.run_id
        read_at = time.monotonic()
        fresh = self.store.get_run(run_id)
        tags = fresh.data.tags
        if not self._claimable(tags, time.time()):
            return None
        attempts = attempts_of(tags)
        if attempts is None or attempts >= MAX_ATTEMPTS:
            shown = repr(str(tags.get(TAG + ATTEMPTS))[:40])
            reason = (f"its tag {TAG}{ATTEMPTS}={shown} is not a count of claims (the watcher writes one): delete the "
                      "tag to triage it again") if attempts is None else \
                f"given up after {attempts} attempts: the watchers triaging it stopped each time (crash, kill or memory)"
            self._record_final(fresh, "failed", summary=f"triage failed: {reason}", next_command="", reason=reason)
            self.on_event(Event("failed", reason, run_id))
            return None
        claim = Claim(self.watcher_id, time.time() + self.options.lease)
        try:
            self.store.set_tags(run_id, {TRIAGE: "running", CLAIM: claim.render(), ATTEMPTS: attempts + 1})
        except Exception:
            with self._lock:
                self._unsettled[run_id] = claim  # it may have landed: given back when the server answers
            raise
        if time.monotonic() - read_at >= self.options.settle:  # too slow to be sure no rival wrote meanwhile
            self._release(_Active(run_id, claim), "claim took longer than --settle; trying again later")
            return None
        active = _Active(run_id, claim)
        with self._lock:
            self._active[run_id] = active
        return active

    def _confirm(self, active: _Active) -> bool:
        """The re-read after `settle`: still ours?"""
        time.sleep(self.options.settle)  # the full settle time, also when stopping: the proof needs it
        current = Claim.parse(self._call(self.store.get_run, active.run_id, run_id=active.run_id).data.tags.get(TAG + CLAIM))
        return current is not None and current.watcher_id == self.watcher_id

    def _renew_leases(self) -> None:
        period = self.options.lease / 3
        delay = period  # after a failed renewal: sooner, doubling (an outage's end is caught within seconds)
        while not (self.stopping.is_set() and not self._active):
            time.sleep(min(delay, 1.0) if self.stopping.is_set() else delay)
            with self._lock:
                holding = [a for a in self._active.values() if not a.lost and not a.released]
            failed = False
            for active in holding:
                try:
                    self._renew(active)
                except Exception as error:
                    failed = True
                    kind = "outage" if self._note(error) else "error"
                    self.on_event(Event(kind, f"lease renewal failed: {_one_line(_cause(error))}", active.run_id))
            if not failed:
                delay = period
            else:  # 1 s, then doubling up to the period
                delay = BACKOFF_FIRST if delay >= period else min(delay * 2, period)

    def _renew(self, active: _Active) -> None:
        current = Claim.parse(self.store.get_run(active.run_id).data.tags.get(TAG + CLAIM))
        if active.released:
            return
        if current is None or current.watcher_id != self.watcher_id:
            active.lost = True
            _kill(active.process)
            return
        active.claim = Claim(self.watcher_id, time.time() + self.options.lease)
        self.store.set_tags(active.run_id, {CLAIM: active.claim.render()})

    def _give_back(self, run_id: str) -> None:
        """Our claim on the run ends now and its attempt is not counted (a release, not a death); once only."""
        tags = self.store.get_run(run_id).data.tags
        current = Claim.parse(tags.get(TAG + CLAIM))
        if current is not None and current.watcher_id == self.watcher_id and current.expires > 0:
            attempts = max(0, (attempts_of(tags) or 1) - 1)
            self.store.set_tags(run_id, {CLAIM: Claim(self.watcher_id, 0.0).render(), ATTEMPTS: attempts})

    def _release(self, active: _Active, why: str) -> None:
        """Give the run back (its lease ends now); finished steps stay recorded, so the next watcher resumes."""
        with self._lock:
            if active.released:  # finished, or released by another thread already
                return
            active.released = True
        _kill(active.process)
        try:
            self._give_back(active.run_id)
        except Exception as error:  # the lease expires on its own; after an outage, the next poll gives it back
            if self._note(error):
                with self._lock:
                    self._unsettled[active.run_id] = active.claim
            why += f" (release not written yet: {_one_line(error)})"
        self.on_event(Event("released", why, active.run_id))

    # ---- the triage -------------------------------------------------------------------------------------
    def _triage_guarded(self, run, active: _Active) -> Optional[TriageResult]:
        try:
            if not self._confirm(active):
                if not self.abandon.is_set():
                    self.on_event(Event("skipped", "claimed by another watcher", active.run_id))
                return None
            self.on_event(Event("claimed", f"{failure_of(run)} run: {' then '.join(plan_for(failure_of(run)))}", active.run_id,
                                data={"run_name": run.info.run_name or "", "failure": failure_of(run)}))
            return self._triage(run, active)
        except _Abandoned:
            self._release(active, "released on shutdown; another watcher resumes it after its finished steps")
            return None
        except Exception as error:
            self.counts["errors"] += 1
            self.on_event(Event("error", f"triage stopped: {_one_line(error)}", active.run_id))
            self._release(active, "released after an error; another poll resumes it")
            return None
        finally:
            with self._lock:
                self._active.pop(active.run_id, None)

    def _triage(self, run, active: _Active) -> Optional[TriageResult]:
        run_id = run.info.run_id
        failure = failure_of(run)
        started = time.monotonic()
        examined = self._call(self.store.get_run, run_id, run_id=run_id).data
        tags = examined.tags
        unverified = self._call(self._unverified, run_id, run_id=run_id)
        if unverified:  # never run: said on the run, once (no --allow-unsigned here: a watcher vouches for no run)
            said = Conclusion("", f"not triaged: {unverified}", "", [], "")
            return self._finish(run, active, self._result(run, failure, "untrusted", said, unverified, [], {}, started, {}))
        lines: dict[str, str] = {}  # the finished steps' results as tags (resumed steps' from the run)
        results: dict[str, Any] = {}
        ran: list[str] = []
        scratch = active.scratch = _scratch_folder()
        try:
            for step in plan_for(failure):
                if TAG + f"{TRIAGE}.{step}" in tags:  # finished before a restart: resume after it
                    lines[f"{TRIAGE}.{step}"] = tags[TAG + f"{TRIAGE}.{step}"]
                    lines.update({k[len(TAG):]: v for k, v in tags.items() if k.startswith(TAG + f"{TRIAGE}.{step}.")})
                    continue
                if active.released or not self._owns(active):
                    return self._stopped(active)
                self._call(self.store.set_tags, run_id, {STEP: step}, run_id=run_id)
                self.on_event(Event("step", f"{step} started", run_id))
                outcome = self._run_step_through_outages(step, run_id, active, scratch, lines)
                if active.released or not self._owns(active):  # every write waits for this check: a lapsed owner writes nothing
                    return self._stopped(active)
                ran.append(step)
                if not outcome.ok:
                    reason = f"{step}: {outcome.reason}"
                    found = "".join(f"; {name} found: {lines[f'{TRIAGE}.{name}']}" for name in plan_for(failure)
                                    if f"{TRIAGE}.{name}" in lines)
                    failed = Conclusion("", f"triage failed: {reason}{found}", "", evidence_of(lines), "")
                    return self._finish(run, active, self._result(run, failure, "failed", failed, reason, ran, results, started, lines))
                results[step] = outcome.result
                finished = step_lines(step, outcome.result)
                self._call(self.store.set_tags, run_id, finished, run_id=run_id)  # progress: a restarted triage skips this step
                lines.update(finished)
                self.on_event(Event("step", f"{step} finished in {outcome.seconds:.1f} s: {finished[f'{TRIAGE}.{step}']}", run_id))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        conclusion = conclude(failure, run_id, lines, run.info.run_name or "", tags, plan_for(failure), examined.params)
        return self._finish(run, active, self._result(run, failure, "done", conclusion, "", ran, results, started, lines))

    def _unverified(self, run_id: str) -> str:
        """Why the run's signature does not verify with this watcher's key (core/provenance.py), or "" when it does
        or the run has no config to replay (its steps say so)."""
        from replaybisect.core import provenance

        if not any(info.path == "config.yaml" for info in self.store.list_artifacts(run_id)):
            return ""  # (a missing file is no outage: asking for it would be retried as one on some servers)
        text = self.store.read_artifact_text(run_id, "config.yaml")
        try:
            provenance.verify(run_id, text, self.store.tags(run_id))
        except provenance.UnsignedRun as error:
            return str(error)
        return ""

    def _run_step_through_outages(self, step: str, run_id: str, active: _Active, scratch: str,
                                  lines: dict[str, str]) -> TriageStepResult:
        """A step that failed because the tracking server did not answer (its child could not open the store, or the
        server is down now) runs again once the server answers: an outage is never the run's verdict."""
        reruns = 0
        while True:
            outcome = self._run_step(step, run_id, active, scratch, lines)
            if outcome.ok or active.released or active.lost or self.abandon.is_set():
                return outcome
            answers = self._store_answers(run_id)
            said = bool(STORE_TROUBLE.search(outcome.detail)) or f"no run {run_id!r}" in outcome.detail
            if answers and (not said or reruns >= STORE_RERUNS):
                return outcome
            if answers:
                reruns += 1
            self.on_event(Event("outage", f"{step} could not reach the tracking server ({outcome.reason}); "
                                          "running it again when the server answers", run_id))
            if answers and self.abandon.wait(BACKOFF_FIRST * 2 ** reruns):
                raise _Abandoned()
            self._call(self.store.get_run, run_id, run_id=run_id)  # waits out the outage

    def _result(self, run, failure: str, state: str, conclusion: Conclusion, reason: str, ran: list[str],
                results: dict[str, Any], started: float, lines: dict[str, str]) -> TriageResult:
        experiment_id = run.info.experiment_id
        return TriageResult(run_id=run.info.run_id, run_name=run.info.run_name or "", experiment_id=experiment_id,
                            failure=failure, state=state, verdict=conclusion.verdict, summary=conclusion.summary,
                            next_command=conclusion.next_command, reason=reason, evidence=conclusion.evidence,
                            fix=conclusion.fix, to_prove=conclusion.to_prove, headline=conclusion.headline or conclusion.summary, links=self._links(experiment_id, lines), steps=ran, results=results,
                            seconds=round(time.monotonic() - started, 2), watcher_id=self.watcher_id,
                            run_url=run_url(self.options, experiment_id, run.info.run_id))

    def _links(self, experiment_id: str, lines: dict[str, str]) -> list[dict[str, Any]]:
        """The verbs' result runs (nan's, the ablation's and its fixing arm, diagnose's) with their names and pages."""
        links = []
        for step, run_id in result_runs(lines):
            try:
                name = self._call(self.store.get_run, run_id, run_id=run_id).info.run_name or ""
            except _Abandoned:
                raise
            except Exception:  # deleted since: still worth its id
                name = ""
            links.append({"step": step, "name": name, "run_id": run_id, "url": run_url(self.options, experiment_id, run_id),
                          "path": f"#/experiments/{experiment_id}/runs/{run_id}"})
        return links

    def _stopped(self, active: _Active) -> None:
        if active.lost:
            self.counts["lost"] += 1
            self.on_event(Event("lost", "another watcher took the run over (our lease had lapsed); stopped", active.run_id))
        return None

    def _owns(self, active: _Active) -> bool:
        """Re-read the claim: still ours? (A watcher that stalled past its lease finds a rival's.)"""
        if not active.lost:
            run = self._call(self.store.get_run, active.run_id, run_id=active.run_id)
            current = Claim.parse(run.data.tags.get(TAG + CLAIM))
            active.lost = current is None or current.watcher_id != self.watcher_id
        return not active.lost

    def _finish(self, run, active: _Active, result: TriageResult) -> Optional[TriageResult]:
        if not self._owns(active):
            return self._stopped(active)
        self._call(self.publish, result, run_id=result.run_id)
        if not self._owns(active):  # publishing may have waited out an outage
            return self._stopped(active)
        self._call(self._record_final, run, result.state, result.summary, result.next_command, result.reason, run_id=result.run_id)
        with self._lock:
            active.released = True
        self.counts[result.state] += 1
        self.on_event(Event(result.state, result.summary, result.run_id, result=result))
        return result

    def _record_final(self, run, state: str, summary: str, next_command: str, reason: str) -> None:
        tags = {TRIAGE: state, SUMMARY: tag_line(summary), NEXT: tag_line(next_command), STEP: "finished"}
        if reason:
            tags[REASON] = tag_line(reason)
        self.store.set_tags(run.info.run_id, tags)

    def _run_step(self, step: str, run_id: str, active: _Active, scratch: str, lines: dict[str, str]) -> TriageStepResult:
        if self.options.executor == "submitit":
            return self._run_step_as_job(step, run_id, active, lines)
        return self._run_step_here(step, run_id, active, scratch, lines)

    def _run_step_as_job(self, step: str, run_id: str, active: _Active, lines: dict[str, str]) -> TriageStepResult:
        """One verb as a job (core/jobs.py). The job is noted in the watcher's private job folder before it is waited
        on (and its id on the run, for people): a watcher that takes the run over after this one stopped or died
        follows that job to its end instead of submitting it again. A job that failed, timed out or was cancelled is
        the step's failure, with the scheduler's reason in one line."""
        from replaybisect.core import jobs

        settings, note = self.options.jobs, f"{run_id}.{step}"
        job = jobs.recall(settings, note)
        if job is not None:
            self.on_event(Event("step", f"{step}: following job {job.job_id} ({job.cluster}), submitted by an earlier watcher", run_id))
        else:
            argv = [sys.executable, "-m", "replaybisect.verbs.watch.child", str(self.options.memory_mb), "--scratch", "--",
                    *self._verb_args(step, run_id, lines)]
            env = dict(os.environ)
            if env.get(CODE_DIR_ENV):
                env[CODE_DIR_ENV] = os.pathsep.join(_absolute(part) for part in env[CODE_DIR_ENV].split(os.pathsep) if part.strip())
            job = jobs.submit_command(settings, f"replay-triage-{step}", argv, tempfile.gettempdir(), env)
            jobs.remember(job, settings, note)
            self.on_event(Event("step", f"{step}: job {job.job_id} submitted ({job.cluster})", run_id))
        self._call(self.store.set_tags, run_id, {f"{JOB}.{step}": job.job_id}, run_id=run_id)
        started = time.monotonic()
        said = None

        def watch_it() -> None:  # the job's state as it changes; a run this watcher no longer holds is left to it
            nonlocal said
            if active.released or active.lost or self.abandon.is_set():
                raise _LeftRunning()
            state = job.state()
            if state != said and state != "done":
                self.on_event(Event("step", f"{step}: job {job.job_id} {state}", run_id))
            said = state

        try:
            if not job.wait(self.options.time_limit, on_poll=watch_it):
                job.cancel()
                jobs.forget(settings, note)
                return TriageStepResult(step, False, reason=f"job {job.job_id} stopped at the time limit ({self.options.time_limit:.0f} s)",
                                        seconds=time.monotonic() - started)
        except _LeftRunning:  # the job runs on: the watcher that holds the run now (or next) follows it
            if self.abandon.is_set():
                raise _Abandoned() from None
            return TriageStepResult(step, False, reason=f"job {job.job_id} left to the next watcher", seconds=time.monotonic() - started)
        returncode, stdout, error_text = job.communicate()
        jobs.forget(settings, note)  # consumed: a rerun submits anew
        return self._step_result(step, returncode, stdout, error_text, time.monotonic() - started, job_id=job.job_id)

    def _run_step_here(self, step: str, run_id: str, active: _Active, scratch: str, lines: dict[str, str]) -> TriageStepResult:
        """One verb in a child process with the memory and time limits (watch/child.py); its JSON comes back in a file
        of ours. It runs in the triage's scratch folder (never the watcher's working folder: nothing there is trusted
        or importable) with its caches and temporary files there too."""
        from replaybisect.verbs.watch.child import start_step

        work = os.path.join(scratch, "work")
        env = dict(os.environ, PWD=work, TMPDIR=os.path.join(scratch, "tmp"), REPLAYBISECT_CACHE=os.path.join(scratch, "cache"))
        if env.get(CODE_DIR_ENV):  # the folders as the watcher reads them, not relative to the child's scratch folder
            env[CODE_DIR_ENV] = os.pathsep.join(_absolute(part) for part in env[CODE_DIR_ENV].split(os.pathsep) if part.strip())
        started = time.monotonic()
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            process = start_step(self.options.memory_mb, self._verb_args(step, run_id, lines), work, env, stdout, stderr)
            active.process = process
            if active.released or active.lost:  # given up while it started, when _release or _renew saw no process yet
                _kill(process)
            try:  # the limit counts from the step's start: the child's own start (a fork, its imports) is the step's too
                process.wait(timeout=max(0.0, self.options.time_limit - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                _kill(process)
                process.wait()
                return TriageStepResult(step, False, reason=f"stopped at the time limit ({self.options.time_limit:.0f} s)",
                                   seconds=time.monotonic() - started)
            finally:
                active.process = None
            stdout.seek(0)
            stderr.seek(0)
            output, error_text = stdout.read(), stderr.read().decode("utf-8", "replace")
        return self._step_result(step, process.returncode, output, error_text, time.monotonic() - started)

    def _step_result(self, step: str, returncode: int, stdout, error_text: str, seconds: float,
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
        reason = _failure_reason(returncode, error_text, self.options.memory_mb)
        return TriageStepResult(step, False, reason=f"job {job_id}: {reason}" if job_id else reason,
                                seconds=seconds, detail="\n".join(error_text.splitlines()[-40:]))

    def _verb_args(self, step: str, run_id: str, lines: dict[str, str]) -> list[str]:
        """The verb's command line; ablate tries the arms nan suggested (from where it said) and the standard ones."""
        common = ["--run-id", run_id, "--json", "--tracking-uri", self.store.uri]
        trust = [arg for folder in self.options.code_dirs for arg in ("--code-dir", _absolute(folder))]
        trust += [arg for prefix in self.options.trust_prefixes for arg in ("--trust", prefix)]
        if step == "nan":
            return ["nan", *common, *trust]
        if step == "ablate":
            return ["ablate", *ablate_args(lines), *common, "--horizon", str(self.options.horizon), *trust]
        return ["diagnose", *common]

    # ---- stopping -------------------------------------------------------------------------------------------
    def _finish_or_release(self, futures: set[Future]) -> None:
        """Running triages get the grace (from the stop) to finish; then their children are killed and their claims
        released, within RELEASE_SECONDS: a triage still starting its child or sleeping out --settle, or a release the
        store does not answer, is not waited for (its lease lapses on its own), so the exit keeps its promise."""
        pending = {f for f in futures if not f.done()}
        if pending:
            self.on_event(Event("stop", f"waiting up to {self.options.grace:.0f} s for {len(pending)} triage(s) to finish"))
            deadline = (self.stopped_at or time.monotonic()) + self.options.grace
            while pending and time.monotonic() < deadline and not self.abandon.is_set():  # a second signal: at once
                pending = wait(pending, timeout=min(1.0, max(0.0, deadline - time.monotonic())))[1]
        self.abandon.set()
        with self._lock:
            leftover = [a for a in self._active.values() if not a.released]
        releases = {_in_thread(self._release, active, "released on shutdown; another watcher resumes it after its finished steps")
                    for active in leftover}
        limit = RELEASE_SECONDS if self.exit_by is None else min(RELEASE_SECONDS, self.exit_by - time.monotonic())
        unreleased = wait(releases | pending, timeout=max(0.0, limit))[1] & releases
        if unreleased:
            self.on_event(Event("error", f"{len(unreleased)} claim(s) not released in time (the store did not answer): "
                                         f"they lapse with their lease ({self.options.lease:g} s)"))
        with self._lock:
            unfinished = list(self._active.values())
        for active in unfinished:  # its thread is left behind: remove what it would have
            if active.scratch:
                shutil.rmtree(active.scratch, ignore_errors=True)

    def health(self) -> dict[str, Any]:
        with self._lock:
            active = sorted(self._active)
        return {"watcher_id": self.watcher_id, "tracking_uri": self.store.uri, "uptime_s": round(time.time() - self.started, 1),
                "last_poll_age_s": None if self.last_poll is None else round(time.time() - self.last_poll, 1),
                "active": active, "workers": self.options.workers, **self.counts}


# ---- the server-wide picture (`replay watch --status`) --------------------------------------------------
def triage_status(store: Store, experiments: list[str]) -> dict[str, Any]:
    """How many runs are waiting, being triaged (by whom, lease live or lapsed), done and failed."""
    probe = Watcher(store, WatchOptions(tracking_uri=store.uri, experiments=experiments), on_event=lambda event: None)
    experiment_ids = probe.experiment_ids()
    train = f"tags.`{TAG}kind` = 'train'"
    waiting = [run for run in probe.candidates() if TAG + TRIAGE not in run.data.tags]
    counts = {state: len(search_all_runs(store, experiment_ids, f"{train} and tags.`{TAG}{TRIAGE}` = '{state}'"))
              for state in FINISHED_STATES}
    claims = []
    now = time.time()
    for run in search_all_runs(store, experiment_ids, f"{train} and tags.`{TAG}{TRIAGE}` = 'running'"):
        claim = Claim.parse(run.data.tags.get(TAG + CLAIM))
        claims.append({"run_id": run.info.run_id, "watcher_id": claim.watcher_id if claim else None,
                       "lease_left_s": round(claim.expires - now, 1) if claim else None,
                       "step": run.data.tags.get(TAG + STEP)})
    return {"tracking_uri": store.uri, "waiting": len(waiting), "running": claims, **counts}


# ---- helpers -------------------------------------------------------------------------------------------------
def _claimable(tags: dict[str, str], now: float, watcher_id: str = "", take_over: bool = True) -> bool:
    """Not finished, and no live claim. A lapsed claim of another watcher is taken over only with `take_over`; one
    given back (expiry 0) or our own is free."""
    if tags.get(TAG + TRIAGE) in FINISHED_STATES:
        return False
    claim = Claim.parse(tags.get(TAG + CLAIM))
    if claim is None or claim.expires <= 0 or claim.watcher_id == watcher_id:
        return claim is None or not claim.live(now)
    return not claim.live(now) and take_over


def _outage(error: BaseException) -> bool:
    """The tracking server failed us, not the request: unreachable, restarting, its database down (MLflow's 5xx,
    connection errors, a store that does not open). A run that does not exist or a bad request is not an outage."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "error_code", None)
        if isinstance(code, str):
            return code not in REQUEST_ERRORS
        if isinstance(error, (OSError, StoreUnreachable)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _cause(error: BaseException) -> BaseException:
    """The server's own error under ours (Store.get_run says RunNotFound for whatever MLflow raised)."""
    if getattr(error, "error_code", None) is None and not isinstance(error, OSError):
        inner = error.__cause__ or error.__context__
        if inner is not None and (getattr(inner, "error_code", None) is not None or isinstance(inner, OSError)):
            return inner
    return error


def _absolute(folder: str) -> str:
    return os.path.abspath(os.path.expanduser(folder))


SCRATCH_PREFIX = "replay-triage-"


def _scratch_folder() -> str:
    """A fresh folder for one triage: work/ (the children's working folder, empty), cache/ (snapshot downloads),
    tmp/ (their temporary files); removed when the triage ends. Its name says whose it is (host and watcher pid),
    so a watcher killed with SIGKILL leaves one that the next watcher on this host removes."""
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{socket.gethostname()}-{os.getpid()}-")
    for name in ("work", "cache", "tmp"):
        os.mkdir(os.path.join(scratch, name))
    return scratch


def remove_dead_scratch_folders() -> list[str]:
    """Scratch folders of watchers of this host (and PID namespace) that are gone; returns the ones removed."""
    removed = []
    prefix = f"{SCRATCH_PREFIX}{socket.gethostname()}-"
    try:
        names = os.listdir(tempfile.gettempdir())
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except OSError:  # another user's: alive, or not ours to remove
            continue
        shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)
        removed.append(name)
    return removed


def _kill(process: Optional[Forked]) -> None:
    """The step's child and its own workers (its session)."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # forked a moment ago: its session is not made yet
        process.kill()
    except PermissionError:
        pass


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__


# how running out of address space (RLIMIT_AS) shows: Python, torch's allocator, the loader mapping a library
OUT_OF_MEMORY = ("MemoryError", "std::bad_alloc", "DefaultCPUAllocator", "failed to map segment", "Cannot allocate memory")


def _failure_reason(returncode: int, stderr: str, memory_mb: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    if any(sign in line for line in lines[-20:] for sign in OUT_OF_MEMORY):
        return f"ran out of memory (limit {memory_mb} MiB, --memory-mb)"
    last = next((line for line in reversed(lines) if line.startswith("replay:")), lines[-1] if lines else "no output")
    return f"exit {returncode}: {last.removeprefix('replay: ').removeprefix('error: ')}"
