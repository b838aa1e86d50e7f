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

import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Optional

from replaybisect.errors import ReplayError
from replaybisect.verbs.watch.claims import (  # noqa: F401  (Claim, outage: the tests' names for them)
    BACKOFF_FIRST, CLAIM, FINISHED_STATES, Active, Claim, Claims, one_line, outage,
)
from replaybisect.verbs.watch.events import Event, TriageResult
from replaybisect.verbs.watch.request import WatchOptions  # noqa: F401  (engine's callers import it from here)
from replaybisect.verbs.watch.steps import (
    Abandoned, TriageSteps, TriageStepResult,
)
from replaybisect.store import (
    TAG, Store, all_experiment_ids, experiment_ids_named, search_all_runs, search_runs_without_tag,
)
from replaybisect.verbs.watch.answer import (
    TRIAGE, Conclusion, conclude, evidence_of, result_runs, step_lines, tag_line,
)

STEP = "triage.step"
SUMMARY = "triage.summary"
NEXT = "triage.next"
REASON = "triage.reason"
FAILED_STATUSES = ("FAILED", "KILLED")
STORE_RERUNS = 3  # a step whose child said the store failed while the store answers us: run again this often at most
# SIGTERM: a watcher exits within --grace + --notify-timeout + 1 s of it. After the grace, the claims' releases (and the
# triages ending) get RELEASE_SECONDS at most; EXIT_SECONDS is kept for the process's own end after the log is closed.
RELEASE_SECONDS, EXIT_SECONDS = 1.0, 0.5
# what a triage child prints when it could not reach the tracking store (replay's own lines, MLflow's client)
STORE_TROUBLE = re.compile(r"cannot open tracking store|tracking server \S+ is unreachable|API request to \S+ failed|"
                           r"Max retries exceeded|TEMPORARILY_UNAVAILABLE")
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
    return "audit" if run.info.status == "FINISHED" else None  # (found only with --audit: a sample replayed)


def plan_for(failure: str) -> list[str]:
    return {"nonfinite": ["nan", "ablate"], "audit": ["verify"]}.get(failure, ["diagnose"])


def run_url(options: WatchOptions, experiment_id: str, run_id: str) -> Optional[str]:
    """The run's page in the MLflow UI (None when the watcher knows no UI address: a local store)."""
    base = options.ui_url or (options.tracking_uri if options.tracking_uri.startswith(("http://", "https://")) else None)
    if not base:
        return None
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


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
        self.claims = Claims(store, options, self.watcher_id, on_event, self.stopping, self.abandon, self._record_final)
        self._missing_experiments: set[str] = set()
        self.started = time.time()
        self.counts = {"polls": 0, "done": 0, "failed": 0, "untrusted": 0, "lost": 0, "errors": 0}
        self.last_poll: Optional[float] = None
        self.steps = TriageSteps(store, options, self.claims.call, lambda kind, text, run_id: self.on_event(Event(kind, text, run_id)),
                                 self.abandon)

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self, once: bool = False) -> dict[str, int]:
        """Poll until stopped (or, with once, until nothing claimable is left); returns the counts."""
        watched = ", ".join(self.options.experiments) or "all experiments"
        self.on_event(Event("start", f"watching {self.store.uri} ({watched}) as {self.watcher_id}", data=self.health()))
        remove_dead_scratch_folders()  # a watcher killed with SIGKILL could not remove its own
        heartbeat = threading.Thread(target=self.claims.renew_leases, name="replay-watch-leases", daemon=True)
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
        self.claims.settle()
        free = self.options.workers - len([f for f in futures if not f.done()])
        if free <= 0:
            return 0
        try:
            candidates = self.candidates()
        except ReplayError:
            raise
        except Exception as error:  # the server is down or restarting: try again next poll
            self.claims.note(error)
            self.counts["errors"] += 1
            self.on_event(Event("error", f"poll failed: {one_line(error)}"))
            return 0
        self.counts["polls"] += 1
        self.last_poll = time.time()
        started = 0
        for run in candidates:
            if started >= free or self.stopping.is_set():
                break
            with self.claims.lock:
                if run.info.run_id in self.claims.active:
                    continue
            try:
                active = self.claims.try_claim(run)
            except Exception as error:  # a run deleted meanwhile, the server restarting: the next poll sees
                self.claims.note(error)
                self.counts["errors"] += 1
                self.on_event(Event("error", f"claim failed: {one_line(error)}", run.info.run_id))
                continue
            if active is None:
                continue
            futures.add(_in_thread(self._triage_guarded, run, active))
            started += 1
        return started

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
        if self.options.audit:  # and every finished run, once: a sample of its steps verified
            untriaged.append(f"{train} and attributes.status = 'FINISHED'")
        found = [run for query in untriaged for run in search_runs_without_tag(self.store, experiment_ids, query, TAG + TRIAGE)]
        found += search_all_runs(self.store, experiment_ids, f"{train} and tags.`{TAG}{TRIAGE}` = 'running'")
        runs = {run.info.run_id: run for run in found}
        now = time.time()
        ready = [run for run in runs.values() if failure_of(run) and self.claims.claimable(run.data.tags, now)]
        return sorted(ready, key=lambda run: run.info.start_time)

    # ---- the triage -------------------------------------------------------------------------------------
    def _triage_guarded(self, run, active: Active) -> Optional[TriageResult]:
        try:
            if not self.claims.confirm(active):
                if not self.abandon.is_set():
                    self.on_event(Event("skipped", "claimed by another watcher", active.run_id))
                return None
            self.on_event(Event("claimed", f"{failure_of(run)} run: {' then '.join(plan_for(failure_of(run)))}", active.run_id,
                                data={"run_name": run.info.run_name or "", "failure": failure_of(run)}))
            return self._triage(run, active)
        except Abandoned:
            self.claims.release(active, "released on shutdown; another watcher resumes it after its finished steps")
            return None
        except Exception as error:
            self.counts["errors"] += 1
            self.on_event(Event("error", f"triage stopped: {one_line(error)}", active.run_id))
            self.claims.release(active, "released after an error; another poll resumes it")
            return None
        finally:
            with self.claims.lock:
                self.claims.active.pop(active.run_id, None)

    def _triage(self, run, active: Active) -> Optional[TriageResult]:
        run_id = run.info.run_id
        failure = failure_of(run)
        started = time.monotonic()
        examined = self.claims.call(self.store.get_run, run_id, run_id=run_id).data
        tags = examined.tags
        unverified = self.claims.call(self._unverified, run_id, run_id=run_id)
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
                self.claims.call(self.store.set_tags, run_id, {STEP: step}, run_id=run_id)
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
                self.claims.call(self.store.set_tags, run_id, finished, run_id=run_id)  # progress: a restarted triage skips this step
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

    def _run_step_through_outages(self, step: str, run_id: str, active: Active, scratch: str,
                                  lines: dict[str, str]) -> TriageStepResult:
        """A step that failed because the tracking server did not answer (its child could not open the store, or the
        server is down now) runs again once the server answers: an outage is never the run's verdict."""
        reruns = 0
        while True:
            outcome = self.steps.run(step, run_id, active, scratch, lines)
            if outcome.ok or active.released or active.lost or self.abandon.is_set():
                return outcome
            answers = self.claims.store_answers(run_id)
            said = bool(STORE_TROUBLE.search(outcome.detail)) or f"no run {run_id!r}" in outcome.detail
            if answers and (not said or reruns >= STORE_RERUNS):
                return outcome
            if answers:
                reruns += 1
            self.on_event(Event("outage", f"{step} could not reach the tracking server ({outcome.reason}); "
                                          "running it again when the server answers", run_id))
            if answers and self.abandon.wait(BACKOFF_FIRST * 2 ** reruns):
                raise Abandoned()
            self.claims.call(self.store.get_run, run_id, run_id=run_id)  # waits out the outage

    def _result(self, run, failure: str, state: str, conclusion: Conclusion, reason: str, ran: list[str],
                results: dict[str, Any], started: float, lines: dict[str, str]) -> TriageResult:
        experiment_id = run.info.experiment_id
        return TriageResult(run_id=run.info.run_id, run_name=run.info.run_name or "", experiment_id=experiment_id,
                            failure=failure, state=state, verdict=conclusion.verdict, summary=conclusion.summary,
                            next_command=conclusion.next_command, reason=reason, evidence=conclusion.evidence,
                            fix=conclusion.fix, to_prove=conclusion.to_prove, headline=conclusion.headline or conclusion.summary, links=result_links(self.claims, self.options, experiment_id, lines), steps=ran, results=results,
                            seconds=round(time.monotonic() - started, 2), watcher_id=self.watcher_id,
                            run_url=run_url(self.options, experiment_id, run.info.run_id))

    def _stopped(self, active: Active) -> None:
        if active.lost:
            self.counts["lost"] += 1
            self.on_event(Event("lost", "another watcher took the run over (our lease had lapsed); stopped", active.run_id))
        return None

    def _owns(self, active: Active) -> bool:
        """Re-read the claim: still ours? (A watcher that stalled past its lease finds a rival's.)"""
        if not active.lost:
            run = self.claims.call(self.store.get_run, active.run_id, run_id=active.run_id)
            current = Claim.parse(run.data.tags.get(TAG + CLAIM))
            active.lost = current is None or current.watcher_id != self.watcher_id
        return not active.lost

    def _finish(self, run, active: Active, result: TriageResult) -> Optional[TriageResult]:
        if not self._owns(active):
            return self._stopped(active)
        self.claims.call(self.publish, result, run_id=result.run_id)
        if not self._owns(active):  # publishing may have waited out an outage
            return self._stopped(active)
        self.claims.call(self._record_final, run, result.state, result.summary, result.next_command, result.reason, run_id=result.run_id)
        with self.claims.lock:
            active.released = True
        self.counts[result.state] += 1
        self.on_event(Event(result.state, result.summary, result.run_id, result=result))
        return result

    def _record_final(self, run, state: str, summary: str, next_command: str, reason: str) -> None:
        tags = {TRIAGE: state, SUMMARY: tag_line(summary), NEXT: tag_line(next_command), STEP: "finished"}
        if reason:
            tags[REASON] = tag_line(reason)
        self.store.set_tags(run.info.run_id, tags)

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
        with self.claims.lock:
            leftover = [a for a in self.claims.active.values() if not a.released]
        releases = {_in_thread(self.claims.release, active, "released on shutdown; another watcher resumes it after its finished steps")
                    for active in leftover}
        limit = RELEASE_SECONDS if self.exit_by is None else min(RELEASE_SECONDS, self.exit_by - time.monotonic())
        unreleased = wait(releases | pending, timeout=max(0.0, limit))[1] & releases
        if unreleased:
            self.on_event(Event("error", f"{len(unreleased)} claim(s) not released in time (the store did not answer): "
                                         f"they lapse with their lease ({self.options.lease:g} s)"))
        with self.claims.lock:
            unfinished = list(self.claims.active.values())
        for active in unfinished:  # its thread is left behind: remove what it would have
            if active.scratch:
                shutil.rmtree(active.scratch, ignore_errors=True)

    def health(self) -> dict[str, Any]:
        with self.claims.lock:
            active = sorted(self.claims.active)
        return {"watcher_id": self.watcher_id, "tracking_uri": self.store.uri, "uptime_s": round(time.time() - self.started, 1),
                "last_poll_age_s": None if self.last_poll is None else round(time.time() - self.last_poll, 1),
                "active": active, "workers": self.options.workers, **self.counts}


def result_links(claims: Claims, options: WatchOptions, experiment_id: str, lines: dict[str, str]) -> list[dict[str, Any]]:
    """The verbs' result runs (nan's, the ablation's and its fixing arm, diagnose's) with their names and pages."""
    links = []
    for step, run_id in result_runs(lines):
        try:
            name = claims.call(claims.store.get_run, run_id, run_id=run_id).info.run_name or ""
        except Abandoned:
            raise
        except Exception:  # deleted since: still worth its id
            name = ""
        links.append({"step": step, "name": name, "run_id": run_id, "url": run_url(options, experiment_id, run_id),
                      "path": f"#/experiments/{experiment_id}/runs/{run_id}"})
    return links


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





