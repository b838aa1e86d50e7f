"""`replay watch`: the triage service. Polls the tracking server and triages every failed run once."""

from __future__ import annotations

import inspect

import typer

from replaybisect.options import request_command
from replaybisect.verbs.watch.request import WatchOptions

SIGNAL_EXIT = 143  # as every verb stopped by SIGTERM


def watch(options: WatchOptions, once: bool, status: bool, as_json: bool) -> None:
    """Watch a tracking server and triage every training run that failed or went non-finite, once: `replay nan`
    then `replay ablate` (the arms nan suggests, and lr, clip, precision) for a non-finite run, `replay diagnose`
    for the rest, each in a child process with --time-limit and --memory-mb. Results are the verbs' child runs, a
    triage run named with the answer first, triage/triage.md on the run (a short report) and the tags
    replaybisect.triage (done | failed), replaybisect.triage.summary (one line) and replaybisect.triage.next (the
    proven fix as a `replay train` command, or the change to make; never a verb the triage ran).

    \b
        replay watch --tracking-uri http://mlflow:5000 --workers 2 --notify-url https://hooks.slack.com/...
        12:00:01 claimed  3f2a...  nonfinite run: nan then ablate
        12:00:40 done     3f2a...  divergence at step 47; ablate: fixed by lr=x0.1
                  next: replay train --config-dir /src/examples/ablate_lr_explosion optim.lr=0.06

    Watchers may run side by side: a run is claimed with a lease tag (--lease) and re-checked after --settle
    seconds. SIGTERM finishes running triages within --grace seconds or releases them; SIGUSR1 logs a health line.
    An outage of the tracking server is waited out (retried with backoff), never a verdict on a run. Triage runs as
    the watcher's user (never root without --allow-root) in a fresh scratch folder: pass your code with --code-dir.
    """
    import signal
    import threading

    from replaybisect.errors import ReplayError
    from replaybisect.options import announce_store
    from replaybisect.store import locate_store, open_store
    from replaybisect.verbs.watch.engine import Event, Watcher, triage_status
    from replaybisect.verbs.watch.report import EventLog, health_line, print_status, publish

    location = locate_store(options.tracking_uri)
    options.tracking_uri = location.uri
    options.notify_url = options.notify_url or None  # REPLAYBISECT_NOTIFY_URL= (empty, as compose passes it unset): no notifications
    options.check()  # every option, before the server is contacted: a watcher's own mistake never fails a run
    if not status:
        options.check_user()
    if not location.exists:
        raise ReplayError(f"no tracking store at {location.shown} yet; pass --tracking-uri (e.g. http://mlflow:5000)")
    store = open_store(location.uri)
    if status:
        announce_store(location)
        print_status(triage_status(store, options.experiments), as_json)
        return

    log = EventLog(as_json=as_json, notify_url=options.notify_url, notify_timeout=options.notify_timeout)
    watcher = Watcher(store, options, on_event=log, publish=lambda result: publish(store, result))
    received: list[str] = []

    def on_stop(signum, frame):
        received.append(signal.Signals(signum).name)
        if len(received) > 1:
            watcher.abandon.set()  # a second signal: release at once
        watcher.stop()

    def log_health() -> None:
        health = watcher.health()
        log(Event("health", health_line(health), data=health))

    def on_health(signum, frame):  # off the signal handler: the main thread may hold the locks the log takes
        threading.Thread(target=log_health, daemon=True).start()

    previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_health)
    try:
        counts = watcher.run(once=once)
        log.close(until=watcher.exit_by)  # the notifications still queued: at most --notify-timeout more
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log(Event("stop", f"stopped{' (' + received[0] + ')' if received else ''}: done {counts['done']}, failed {counts['failed']}, "
                      f"untrusted {counts['untrusted']}, lost {counts['lost']}, errors {counts['errors']}", data=counts))
    if received:
        raise typer.Exit(SIGNAL_EXIT if received[0] == "SIGTERM" else 130)
    if once and counts["errors"] and not counts["done"] + counts["failed"] + counts["untrusted"]:
        raise typer.Exit(1)  # nothing triaged and the server or a triage failed: say so to the script that ran --once


def register(app: typer.Typer) -> None:
    once = inspect.Parameter("once", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, "--once", help="Triage what is waiting now, then exit."))
    status = inspect.Parameter("status", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, "--status", help="Print the server's triage state in one line and exit."))
    as_json = inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, "--json", help="Log JSON lines on stdout (one event each), for log shippers."))
    command = request_command(WatchOptions, watch, extras=[once, status, as_json])
    app.command("watch", short_help="The service: triage every new failed run once.")(command)
