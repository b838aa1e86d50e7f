"""`replay watch`: the triage service. Polls the tracking server and triages every failed run once."""

from __future__ import annotations

from typing import Optional

import typer

from replaybisect.options import (Account, Cluster, CodeDirs, Cpus, Executor, ExecutorFolder, Gpus, MemGb, Partition, Slurm, TimeMin,
                                  TrackingUri, TrustPrefixes, job_settings)

SIGNAL_EXIT = 143  # as every verb stopped by SIGTERM


def watch_command(
    experiments: Optional[list[str]] = typer.Option(None, "--experiment", help="Watch this experiment (repeatable; default: all)."),
    interval: float = typer.Option(30.0, "--interval", help="Seconds between polls."),
    once: bool = typer.Option(False, "--once", help="Triage what is waiting now, then exit."),
    workers: int = typer.Option(1, "--workers", help="Triages at once (each a child process)."),
    notify_url: Optional[str] = typer.Option(None, "--notify-url", envvar="REPLAYBISECT_NOTIFY_URL",
                                             help="POST each result here (Slack/Mattermost incoming-webhook JSON)."),
    notify_timeout: float = typer.Option(10.0, "--notify-timeout", help="Seconds one notification may take in all; posted "
                                         "off the triage, so a slow webhook never holds a run (on shutdown: at most this long more)."),
    ui_url: Optional[str] = typer.Option(None, "--ui-url", help="The MLflow UI address for links (default: the tracking URI when it is http)."),
    lease: float = typer.Option(120.0, "--lease", help="Seconds a claim lasts unless renewed; a dead watcher's runs are taken over after it."),
    settle: float = typer.Option(2.0, "--settle", help="Seconds between claiming a run and confirming the claim (two watchers racing)."),
    time_limit: float = typer.Option(1800.0, "--time-limit", help="Seconds each triage step (nan, ablate, diagnose) may run."),
    memory_mb: int = typer.Option(8192, "--memory-mb", help="Address-space limit of each triage process in MiB (0: none; use 0 where triage runs on a GPU: CUDA reserves far more than it uses)."),
    horizon: int = typer.Option(200, "--horizon", min=1, max=1_000_000, help="ablate: steps replayed past the failing step."),
    grace: float = typer.Option(20.0, "--grace", help="On SIGTERM: seconds running triages may take to finish before their claims are released."),
    status: bool = typer.Option(False, "--status", help="Print the server's triage state in one line and exit."),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = typer.Option(False, "--json", help="Log JSON lines on stdout (one event each), for log shippers."),
    code_dirs: Optional[list[str]] = CodeDirs,
    trust_prefixes: Optional[list[str]] = TrustPrefixes,
    allow_root: bool = typer.Option(False, "--allow-root", help="Triage as root (refused by default: a stored run's config "
                                    "is untrusted input; run the watcher as an unprivileged user instead)."),
    executor: str = Executor,
    cluster: Optional[str] = Cluster,
    partition: Optional[str] = Partition,
    time_min: int = TimeMin,
    gpus: int = Gpus,
    cpus: Optional[int] = Cpus,
    mem_gb: Optional[float] = MemGb,
    account: Optional[str] = Account,
    slurm: Optional[list[str]] = Slurm,
    executor_folder: str = ExecutorFolder,
):
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
    from replaybisect.verbs.watch.engine import Event, Watcher, WatchOptions, triage_status
    from replaybisect.verbs.watch.report import EventLog, health_line, print_status, publish

    location = locate_store(tracking_uri)
    notify_url = notify_url or None  # REPLAYBISECT_NOTIFY_URL= (empty, as compose passes it unset): no notifications
    options = WatchOptions(tracking_uri=location.uri, experiments=list(experiments or []), interval=interval, workers=workers,
                           lease=lease, settle=settle, time_limit=time_limit, memory_mb=memory_mb, horizon=horizon, grace=grace,
                           code_dirs=list(code_dirs or []), trust_prefixes=list(trust_prefixes or []), ui_url=ui_url,
                           notify_url=notify_url, notify_timeout=notify_timeout, allow_root=allow_root, executor=executor,
                           jobs=job_settings(cluster=cluster, partition=partition, time_min=time_min, gpus=gpus, cpus=cpus,
                                             mem_gb=mem_gb, account=account, slurm=slurm, folder=executor_folder))
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

    log = EventLog(as_json=as_json, notify_url=notify_url, notify_timeout=notify_timeout)
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
    app.command("watch", short_help="The service: triage every new failed run once.")(watch_command)
