"""This watcher's claims on runs: taking one (a claim tag with a lease, re-read after --settle), keeping it (the lease
renewed every third of it), giving it back (its attempt not counted); and the tracking server's outages, waited out
with backoff, never a verdict on a run (a lease that lapsed during one is not taken over)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from replaybisect.core.processes import Forked
from replaybisect.errors import StoreUnreachable
from replaybisect.store import TAG, Store
from replaybisect.verbs.watch.answer import TRIAGE
from replaybisect.verbs.watch.events import Event
from replaybisect.verbs.watch.request import WatchOptions
from replaybisect.verbs.watch.steps import Abandoned, kill

CLAIM = "triage.claim"
ATTEMPTS = "triage.attempts"
MAX_ATTEMPTS = 3  # claims of one run before it is given up (its watchers died mid-triage each time)
FINISHED_STATES = ("done", "failed", "untrusted")  # untrusted: its signature does not verify, so nothing of it was run
# An outage of the tracking server (restarting, its database down) is waited out, never a verdict on a run:
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0  # seconds between tries of a store call, doubling
# MLflow's error codes for a request that is wrong (not a server in trouble): retrying cannot help
REQUEST_ERRORS = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE",
                  "RESOURCE_ALREADY_EXISTS", "INVALID_REQUEST", "ENDPOINT_NOT_FOUND")


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
class Active:
    """A run this watcher holds a claim on."""

    run_id: str
    claim: Claim
    process: Optional[Forked] = None  # the running step's child (a job is never killed: see steps.TriageSteps)
    scratch: Optional[str] = None  # the triage's scratch folder (_scratch_folder)
    lost: bool = False  # another watcher holds the run now: stop
    released: bool = False


class Claims:
    """The runs this watcher holds (`active`, under `lock`) and the store calls that take, keep and give them back.
    `record_final(run, state, summary, next_command, reason)` writes a run's final triage tags (a run given up)."""

    def __init__(self, store: Store, options: WatchOptions, watcher_id: str, on_event: Callable[[Event], None],
                 stopping: threading.Event, abandon: threading.Event, record_final: Callable[..., None]):
        self.store, self.options, self.watcher_id, self.on_event = store, options, watcher_id, on_event
        self.stopping, self.abandon, self.record_final = stopping, abandon, record_final
        self.lock = threading.Lock()
        self.active: dict[str, Active] = {}
        self.unsettled: dict[str, Claim] = {}  # claims written or released during an outage: maybe landed, maybe not
        self.outage_seen = -math.inf  # time.time() of the last store call that failed for the server's reasons

    def note(self, error: BaseException) -> bool:
        """Remember an outage (for `_may_take_over`); True when `error` is one."""
        if outage(error):
            self.outage_seen = time.time()
            return True
        return False

    def may_take_over(self, now: float) -> bool:
        """Another watcher's lapsed claim is taken over only when this watcher has seen the server answer for a whole
        lease: a lease that lapsed during an outage belongs to a live watcher that could not renew it, and that
        watcher renews it as soon as the server is back (a takeover would count an attempt the run never failed)."""
        return now - self.outage_seen >= self.options.lease

    def call(self, fn: Callable, *args, run_id: Optional[str] = None):
        """A store call of a triage, retried with backoff while the tracking server is unavailable (restarting, its
        database down): an outage is waited out, never a verdict on the run. Raises what is not an outage (the run
        deleted, a bad request), and Abandoned when the grace is over."""
        delay = BACKOFF_FIRST
        while True:
            if self.abandon.is_set():
                raise Abandoned()
            try:
                return fn(*args)
            except Exception as error:
                if not self.note(error):
                    raise
                self.on_event(Event("outage", f"tracking server unavailable ({one_line(cause(error))}); "
                                              f"trying again in {delay:g} s", run_id))
            if self.abandon.wait(delay):
                raise Abandoned()
            delay = min(delay * 2, BACKOFF_MAX)

    def store_answers(self, run_id: str) -> bool:
        try:
            self.store.get_run(run_id)
        except Exception as error:
            return not self.note(error)
        return True

    def settle(self) -> None:
        """Claims whose write or release failed during an outage may have landed: give each back once the server
        answers (an attempt that never started is not counted)."""
        with self.lock:
            unsettled = list(self.unsettled)
        for run_id in unsettled:
            try:
                self.give_back(run_id)
            except Exception as error:
                if self.note(error):
                    continue  # still down: the next poll tries again
            with self.lock:
                self.unsettled.pop(run_id, None)

    def claimable(self, tags: dict[str, str], now: float) -> bool:
        return claimable_by(tags, now, self.watcher_id, take_over=self.may_take_over(now))

    def try_claim(self, run) -> Optional[Active]:
        run_id = run.info.run_id
        read_at = time.monotonic()
        fresh = self.store.get_run(run_id)
        tags = fresh.data.tags
        if not self.claimable(tags, time.time()):
            return None
        attempts = attempts_of(tags)
        if attempts is None or attempts >= MAX_ATTEMPTS:
            shown = repr(str(tags.get(TAG + ATTEMPTS))[:40])
            reason = (f"its tag {TAG}{ATTEMPTS}={shown} is not a count of claims (the watcher writes one): delete the "
                      "tag to triage it again") if attempts is None else \
                f"given up after {attempts} attempts: the watchers triaging it stopped each time (crash, kill or memory)"
            self.record_final(fresh, "failed", summary=f"triage failed: {reason}", next_command="", reason=reason)
            self.on_event(Event("failed", reason, run_id))
            return None
        claim = Claim(self.watcher_id, time.time() + self.options.lease)
        try:
            self.store.set_tags(run_id, {TRIAGE: "running", CLAIM: claim.render(), ATTEMPTS: attempts + 1})
        except Exception:
            with self.lock:
                self.unsettled[run_id] = claim  # it may have landed: given back when the server answers
            raise
        if time.monotonic() - read_at >= self.options.settle:  # too slow to be sure no rival wrote meanwhile
            self.release(Active(run_id, claim), "claim took longer than --settle; trying again later")
            return None
        active = Active(run_id, claim)
        with self.lock:
            self.active[run_id] = active
        return active

    def confirm(self, active: Active) -> bool:
        """The re-read after `settle`: still ours?"""
        time.sleep(self.options.settle)  # the full settle time, also when stopping: the proof needs it
        current = Claim.parse(self.call(self.store.get_run, active.run_id, run_id=active.run_id).data.tags.get(TAG + CLAIM))
        return current is not None and current.watcher_id == self.watcher_id

    def renew_leases(self) -> None:
        period = self.options.lease / 3
        delay = period  # after a failed renewal: sooner, doubling (an outage's end is caught within seconds)
        while not (self.stopping.is_set() and not self.active):
            time.sleep(min(delay, 1.0) if self.stopping.is_set() else delay)
            with self.lock:
                holding = [a for a in self.active.values() if not a.lost and not a.released]
            failed = False
            for active in holding:
                try:
                    self.renew(active)
                except Exception as error:
                    failed = True
                    kind = "outage" if self.note(error) else "error"
                    self.on_event(Event(kind, f"lease renewal failed: {one_line(cause(error))}", active.run_id))
            if not failed:
                delay = period
            else:  # 1 s, then doubling up to the period
                delay = BACKOFF_FIRST if delay >= period else min(delay * 2, period)

    def renew(self, active: Active) -> None:
        current = Claim.parse(self.store.get_run(active.run_id).data.tags.get(TAG + CLAIM))
        if active.released:
            return
        if current is None or current.watcher_id != self.watcher_id:
            active.lost = True
            kill(active.process)
            return
        active.claim = Claim(self.watcher_id, time.time() + self.options.lease)
        self.store.set_tags(active.run_id, {CLAIM: active.claim.render()})

    def give_back(self, run_id: str) -> None:
        """Our claim on the run ends now and its attempt is not counted (a release, not a death); once only."""
        tags = self.store.get_run(run_id).data.tags
        current = Claim.parse(tags.get(TAG + CLAIM))
        if current is not None and current.watcher_id == self.watcher_id and current.expires > 0:
            attempts = max(0, (attempts_of(tags) or 1) - 1)
            self.store.set_tags(run_id, {CLAIM: Claim(self.watcher_id, 0.0).render(), ATTEMPTS: attempts})

    def release(self, active: Active, why: str) -> None:
        """Give the run back (its lease ends now); finished steps stay recorded, so the next watcher resumes."""
        with self.lock:
            if active.released:  # finished, or released by another thread already
                return
            active.released = True
        kill(active.process)
        try:
            self.give_back(active.run_id)
        except Exception as error:  # the lease expires on its own; after an outage, the next poll gives it back
            if self.note(error):
                with self.lock:
                    self.unsettled[active.run_id] = active.claim
            why += f" (release not written yet: {one_line(error)})"
        self.on_event(Event("released", why, active.run_id))


def attempts_of(tags: dict[str, str]) -> Optional[int]:
    """The run's count of claims (0 when untagged), None when the tag is not a count: tags are data."""
    from replaybisect.core.tags import step_tag_or_none

    value = tags.get(TAG + ATTEMPTS)
    return 0 if value in (None, "") else step_tag_or_none({"n": value}, "n")


def claimable_by(tags: dict[str, str], now: float, watcher_id: str = "", take_over: bool = True) -> bool:
    """Not finished, and no live claim. A lapsed claim of another watcher is taken over only with `take_over`; one
    given back (expiry 0) or our own is free."""
    if tags.get(TAG + TRIAGE) in FINISHED_STATES:
        return False
    claim = Claim.parse(tags.get(TAG + CLAIM))
    if claim is None or claim.expires <= 0 or claim.watcher_id == watcher_id:
        return claim is None or not claim.live(now)
    return not claim.live(now) and take_over


def outage(error: BaseException) -> bool:
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


def cause(error: BaseException) -> BaseException:
    """The server's own error under ours (Store.get_run says RunNotFound for whatever MLflow raised)."""
    if getattr(error, "error_code", None) is None and not isinstance(error, OSError):
        inner = error.__cause__ or error.__context__
        if inner is not None and (getattr(inner, "error_code", None) is not None or isinstance(inner, OSError)):
            return inner
    return error


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__
