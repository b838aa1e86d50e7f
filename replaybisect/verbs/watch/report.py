"""`replay watch` output: the log (rich lines on stderr, or JSON lines on stdout for log shippers), the triage
report attached to the run (triage.md, triage.json), and the webhook notification (Slack/Mattermost shape)."""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
import urllib.request
from typing import Any, Optional

from replaybisect.core.jsonutil import strict_json
from replaybisect.options import OUR_STDOUT
from replaybisect.store import Store
from replaybisect.verbs.watch.events import Event, TriageResult

REPORT_MD = "triage/triage.md"
REPORT_JSON = "triage/triage.json"
NOTIFY_TIMEOUT = 10.0  # seconds one notification may take in all (--notify-timeout)
STYLE = {"done": "green", "failed": "red", "untrusted": "red", "lost": "yellow", "released": "yellow", "outage": "yellow", "error": "red",
         "claimed": "cyan", "health": "blue"}


class EventLog:
    """Called by the watcher's threads for each event: one log line each, and a notification for each finished triage.
    Notifications are posted by a thread of their own, each within a total deadline (`notify_timeout`), so a slow or
    trickling webhook never holds a triage slot; close() gives the queued ones at most `notify_timeout` more."""

    def __init__(self, as_json: bool = False, notify_url: Optional[str] = None, notify_timeout: float = NOTIFY_TIMEOUT):
        self.as_json = as_json
        self.notify_url = notify_url
        self.notify_timeout = notify_timeout
        self._lock = threading.Lock()
        self._console = None
        self._queue: "queue.Queue[Optional[TriageResult]]" = queue.Queue()
        self._sender: Optional[threading.Thread] = None
        if not as_json:
            from rich.console import Console

            self._console = Console(stderr=True, log_path=False, soft_wrap=True)

    def __call__(self, event: Event) -> None:
        self.write(event)
        quiet = event.result is not None and event.result.failure == "audit" and event.result.verdict == "exact"
        if event.result is not None and self.notify_url and not quiet:  # (an audit that found nothing is no news)
            with self._lock:
                if self._sender is None:
                    self._sender = threading.Thread(target=self._send_queued, name="replay-watch-notify", daemon=True)
                    self._sender.start()
            self._queue.put(event.result)

    def write(self, event: Event) -> None:
        with self._lock:
            if self.as_json:
                OUR_STDOUT.write(strict_json(event_json(event)) + "\n")
                OUR_STDOUT.flush()
            else:
                self._console.print(_rich_line(event), highlight=False)

    def close(self, until: Optional[float] = None) -> None:
        """Wait for the queued notifications, `notify_timeout` seconds at most in all (and no later than `until`, a
        time.monotonic(): a stopped watcher's exit has a deadline); say what was not sent."""
        if self._sender is None:
            return
        self._queue.put(None)
        wait = self.notify_timeout + 1.0  # the one in flight is cut at its own deadline before this
        self._sender.join(wait if until is None else max(0.0, min(wait, until - time.monotonic())))
        unsent = [item for item in _drain(self._queue) if item is not None]
        if self._sender.is_alive():
            unsent.append(None)  # the one in flight
        if unsent:
            self.write(Event("error", f"{len(unsent)} notification(s) to {_host(self.notify_url)} not sent: "
                                      f"the webhook did not answer within {self.notify_timeout:g} s before shutdown"))

    def _send_queued(self) -> None:
        while True:
            result = self._queue.get()
            if result is None:
                return
            self._notify(result)

    def _notify(self, result: TriageResult) -> None:
        try:
            post_json(self.notify_url, notification(result), self.notify_timeout)
            self.write(Event("notified", f"notification sent to {_host(self.notify_url)}", result.run_id))
        except Exception as error:  # whatever it was, one line: this thread posts the next one
            reason = getattr(error, "reason", None) or _one_line_error(error)
            self.write(Event("error", f"notification to {_host(self.notify_url)} failed: {reason}", result.run_id))


def _drain(items: queue.Queue) -> list:
    drained = []
    while True:
        try:
            drained.append(items.get_nowait())
        except queue.Empty:
            return drained


def _one_line_error(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


def event_json(event: Event) -> dict[str, Any]:
    data = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"), "event": event.kind,
            "run_id": event.run_id, "message": event.message, **event.data}
    if event.result is not None:
        result = event.result.to_json()
        result.pop("results")  # the verbs' full JSON is in triage.json on the run
        data["result"] = result
    return data


def _rich_line(event: Event) -> str:
    from replaybisect.report import plain

    style = STYLE.get(event.kind, "white")
    clock = datetime.datetime.now().strftime("%H:%M:%S")
    run = f" [bold]{plain(event.run_id)}[/bold]" if event.run_id else ""
    text = f"[dim]{clock}[/dim] [{style}]{event.kind:<8}[/{style}]{run}  {plain(event.message)}"
    indent = " " * 18
    if event.result is not None and event.result.next_command:
        text += f"\n{indent}next: {plain(event.result.next_command)}"
    if event.result is not None and event.result.run_url:
        text += f"\n{indent}{plain(event.result.run_url)}"
    return text


# ---- the notification --------------------------------------------------------------------------------
def notification(result: TriageResult) -> dict[str, Any]:
    """Slack and Mattermost incoming webhooks show `text`; the other fields are for machines reading the hook."""
    name = f"{result.run_name} ({result.run_id})" if result.run_name else result.run_id
    lines = [f"replay watch: {result.failure} run {name}: {result.summary}" if result.failure != "audit" else
             f"replay watch: {result.summary.replace('audit: ', 'audit of run ' + name + ': ', 1)}"]
    if result.next_command:
        lines.append(f"next: `{result.next_command}`")
    if result.run_url:
        lines.append(result.run_url)
    return {
        "text": "\n".join(lines),
        "username": "replay watch",
        "run_id": result.run_id,
        "run_name": result.run_name,
        "experiment_id": result.experiment_id,
        "failure": result.failure,
        "triage": result.state,
        "verdict": result.verdict,
        "summary": result.summary,
        "next_command": result.next_command,
        "reason": result.reason,
        "run_url": result.run_url,
        "watcher_id": result.watcher_id,
    }


class NotifyDeadline(OSError):
    """The webhook did not answer within the total deadline."""


class _Watched:
    """A urllib handler mixin that keeps the connections it opens, so a deadline can cut them (urllib's own timeout
    is per socket operation: a server trickling a byte at a time never reaches it). Proxies work as with urlopen."""

    def __init__(self, connections: list, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._connections = connections

    def do_open(self, http_class, request, **kwargs):
        def opened(*args, **kw):
            connection = http_class(*args, **kw)
            self._connections.append(connection)
            return connection

        return super().do_open(opened, request, **kwargs)


class _HTTPHandler(_Watched, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_Watched, urllib.request.HTTPSHandler):
    pass


def post_json(url: str, payload: dict[str, Any], timeout: float = NOTIFY_TIMEOUT) -> None:
    """POST `payload` as JSON and read the answer, all within `timeout` seconds (connect, send, answer, body)."""
    connections: list = []
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        for connection in list(connections):
            sock = getattr(connection, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns at once
                except OSError:
                    pass

    opener = urllib.request.build_opener(_HTTPHandler(connections), _HTTPSHandler(connections))
    request = urllib.request.Request(url, data=strict_json(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    started = time.monotonic()
    timer.start()
    try:
        with opener.open(request, timeout=timeout) as response:
            response.read()
    except Exception:
        if expired.is_set() or time.monotonic() - started >= timeout:
            raise NotifyDeadline(f"no answer within {timeout:g} s") from None
        raise
    finally:
        timer.cancel()
        for connection in connections:
            connection.close()
    if expired.is_set():
        raise NotifyDeadline(f"no answer within {timeout:g} s")


def _host(url: str) -> str:
    from urllib.parse import urlparse

    return urlparse(url).netloc or url


# ---- the report on the run ------------------------------------------------------------------------------
def publish(store: Store, result: TriageResult) -> None:
    """triage.md and triage.json on the triaged run, and the triage's own run under it (kind=triage) named with the
    answer first (`lr=x0.1 fixes · triage: ...`): the run name is what MLflow's default runs view always shows. Its
    description is the report. Published again after an outage, it reuses that run."""
    report = markdown(result)
    if result.triage_run_id is None:
        result.triage_run_id = store.create_run("triage", run_name=result.headline[:250], parent_run_id=result.run_id)
    store.log_text(result.run_id, report, REPORT_MD)
    store.log_dict(result.run_id, result.to_json(), REPORT_JSON)
    store.finish_run(result.triage_run_id, "ok")
    store.record_answer(result.run_id, "triage", result.summary, result.triage_run_id, report=report)


def markdown(result: TriageResult) -> str:
    """A short report a person reads: the answer, the evidence, the proven fix, the next step and the result runs.
    The verbs' full JSON is in triage.json beside it (and in their own runs' reports)."""
    name = f"{result.run_name} ({result.run_id})" if result.run_name else result.run_id
    lines = [f"# Triage of {result.failure} run {name}", "", f"**{result.summary}**", ""]
    if result.next_command:
        command = result.next_command.startswith("replay ")
        lines += [f"Next: `{result.next_command}`" if command else f"Next: {result.next_command}", ""]
    if result.reason:
        lines += [f"Why the triage failed: {result.reason}", ""]
    if result.evidence:
        lines += ["## Evidence", "", *(f"- {line}" for line in result.evidence), ""]
    if result.failure == "nonfinite" and result.state == "done":
        proof = f"; prove the change to the op on this failure with `{result.to_prove}`" if result.to_prove else ""
        lines += ["## Proven fix", "", result.fix or f"none: no single change the ablation tried fixes the failure{proof}", ""]
    if result.links:
        lines += ["## Result runs", "", *(_link_line(link) for link in result.links), ""]
    lines.append(f"The verbs' full results: triage/triage.json. Triaged by watcher {result.watcher_id} in {result.seconds:.0f} s "
                 f"(steps run: {', '.join(result.steps) or 'none, all resumed'}).")
    return "\n".join(lines) + "\n"


LINK_LABEL = {"nan": "replay nan", "ablate": "replay ablate", "fix": "the fixing arm", "diagnose": "replay diagnose"}


def _link_line(link: dict[str, Any]) -> str:
    parts = [f"`{link['name']}`"] if link.get("name") else []
    parts += [f"run {link['run_id']}", link.get("url") or f"MLflow UI {link['path']}"]
    return f"- {LINK_LABEL.get(link['step'], link['step'])}: " + ", ".join(parts)


# ---- health -----------------------------------------------------------------------------------------------
def health_line(health: dict[str, Any]) -> str:
    age = health.get("last_poll_age_s")
    return (f"watcher {health['watcher_id']} up {health['uptime_s']:.0f} s, {health['polls']} polls"
            f" (last {'never' if age is None else f'{age:.0f} s ago'}), triaging {len(health['active'])}/{health['workers']}"
            f" {' '.join(health['active'])}".rstrip()
            + f", done {health['done']}, failed {health['failed']}, lost {health['lost']}, errors {health['errors']}")


def print_status(status: dict[str, Any], as_json: bool) -> None:
    """`replay watch --status`: the server's triage state in one line (JSON: one object)."""
    if as_json:
        OUR_STDOUT.write(strict_json(status) + "\n")
        OUR_STDOUT.flush()
        return
    running = ", ".join(f"{c['run_id']} by {c['watcher_id']} ({c['step'] or 'claimed'}, lease "
                        f"{'lapsed' if (c['lease_left_s'] or 0) <= 0 else str(c['lease_left_s']) + ' s left'})"
                        for c in status["running"])
    OUR_STDOUT.write(f"triage on {status['tracking_uri']}: {status['waiting']} waiting, {len(status['running'])} running"
                     f"{': ' + running if running else ''}, {status['done']} done, {status['failed']} failed\n")
    OUR_STDOUT.flush()
