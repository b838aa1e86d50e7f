"""`replay profile --run-id X [--step N]`: the recorded step replayed under torch.profiler."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from replaybisect.options import JSON_OUTPUT, finish, request_command, stderr_console
from replaybisect.verbs.profile.request import ProfileRequest


def profile(request: ProfileRequest, as_json: bool) -> None:
    """Replay a recorded step (by default the run's slowest) under torch.profiler: the run is restored at the snapshot
    before it and replayed up to it (compared with the logged losses), then --steps recorded steps run under the
    profiler with each module's forward marked by name. Prints the top ops by time and memory, the modules by
    forward time, each step's time against the time the run logged, and the share of the run's steps spent waiting
    for data; the trace (trace.json: Perfetto or chrome://tracing), profile.md and profile.json are recorded in a
    child run of the run.

    \b
        replay profile --run-id 3f2a...              # the slowest recorded step and the two after it
        replay profile --run-id 3f2a... --step 200 --steps 1
    """
    from replaybisect.options import run_store
    from replaybisect.verbs.nan.command import progress_log

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before torch is imported
    from replaybisect.verbs.profile.engine import profile as run_profile
    from replaybisect.verbs.profile.report import print_report, publish

    with tempfile.TemporaryDirectory(prefix="replaybisect-profile-") as folder:
        report = run_profile(store, request.run_id, request.step, steps=request.steps, device=request.torch_device,
                             trust=request.trusted, trace_folder=Path(folder), log=progress_log(stderr_console()))
        finish(report, store=store, publishing=request.publish, publish=publish, render=print_report, as_json=as_json)


def register(app: typer.Typer) -> None:
    command = request_command(ProfileRequest, profile, extras=[JSON_OUTPUT])
    app.command("profile", short_help="A recorded step replayed under torch.profiler.")(command)
