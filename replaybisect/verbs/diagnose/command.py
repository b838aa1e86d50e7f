"""`replay diagnose --run-id X`: read the recorded curves and name the pathology."""

from __future__ import annotations

import typer

from replaybisect.options import JSON_OUTPUT, print_json, request_command
from replaybisect.verbs.diagnose.request import DiagnoseRequest


def diagnose(request: DiagnoseRequest, as_json: bool) -> None:
    """Read a run's recorded metrics (no replay) and name what the curves show: NaN at the first step or
    after K steps, flat from the start, spikes, plateau, oscillation, overfitting, train/validation
    mismatch, exploding or vanishing gradients per layer, dead ReLUs, update/weight ratio out of range,
    input-pipeline bound. Each finding comes with its evidence and the next command to run; a healthy
    run gets "no pathology found". diagnosis.md and an annotated loss curve are recorded in a child run
    of the run (`diagnose: <verdict>`), whose description is the verdict.

    Example: replay diagnose --run-id 3f2a9c0d...

    1. dead-relu [net.1]  dead ReLU net.1: 100.0% of its outputs are zero since step 10 ...

    next: replay check --run-id 3f2a9c0d...
    """
    from replaybisect.options import run_store

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before anything heavy is imported
    from replaybisect.verbs.diagnose.engine import analyse, load_curves
    from replaybisect.verbs.diagnose.report import print_diagnosis, publish

    curves = load_curves(store, request.run_id)
    result = analyse(curves)
    report_run_id = publish(store, result, curves) if request.publish else None
    if as_json:
        print_json({**result.to_json(), "report_run_id": report_run_id})
    else:
        print_diagnosis(result, report_run_id=report_run_id)


def register(app: typer.Typer) -> None:
    command = request_command(DiagnoseRequest, diagnose, extras=[JSON_OUTPUT])
    app.command("diagnose", short_help="Read the loss curves: which pathology, what next.")(command)
