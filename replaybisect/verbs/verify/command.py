"""`replay verify --run-id X [--steps A:B]`: is the recording what this code computes here?"""

from __future__ import annotations

import typer

from replaybisect.options import JSON_OUTPUT, finish, request_command, stderr_console
from replaybisect.verbs.verify.request import VerifyRequest


def verify(request: VerifyRequest, as_json: bool) -> None:
    """Replay recorded steps from their snapshots and compare every logged loss and gradient norm bit for bit. The
    verdict: exact (a failure in the run is the code's or the data's) | transient (the machine that recorded the run
    does not reproduce a step from its own state and batch: a fault while recording) | device (this machine
    reproducibly computes a step differently from the one that recorded it: verify there too) | hardware and recorder
    (--cross-check: another machine, a submitit job, reproduces the recording, or agrees with this one) | code (the
    run's code changed since) | nondeterministic (two replays here differ) | loop (a loop recorded as written made another
    number of training calls in the step's replay than recorded: that replay ran another step). A differing interval is replayed twice to
    tell them apart. Exit status 0 with a verdict, whichever; 2 for bad input.

    \b
        replay verify --run-id 3f2a...                   # every recorded step
        replay verify --run-id 3f2a... --steps 4000:4200
        replay verify --run-id 3f2a... --cross-check --partition gpu   # whose hardware: another node's replay
    """
    from replaybisect.options import run_store
    from replaybisect.verbs.nan.command import progress_log

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before torch is imported
    from replaybisect.verbs.verify.engine import verify as run_verify
    from replaybisect.verbs.verify.report import print_report, publish

    report = run_verify(store, request.run_id, request.start, request.end, device=request.torch_device,
                        trust=request.trusted, sample=request.sample, cross_check=request.jobs if request.cross_check else None,
                        log=progress_log(stderr_console()))
    finish(report, store=store, publishing=request.publish, publish=publish, render=print_report, as_json=as_json)


def register(app: typer.Typer) -> None:
    command = request_command(VerifyRequest, verify, extras=[JSON_OUTPUT])
    app.command("verify", short_help="Is the recording what this code computes here? Replayed bit for bit.")(command)
