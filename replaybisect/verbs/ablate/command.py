"""`replay ablate ARMS --run-id X`: which single change makes the failure go away."""

from __future__ import annotations

import inspect

import typer

from replaybisect.options import JSON_OUTPUT, print_json, request_command
from replaybisect.verbs.ablate.request import AblateRequest

LIST_ARMS = inspect.Parameter("list_arms", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                              default=typer.Option(False, "--list", help="List the interventions and exit."))


def ablate(request: AblateRequest, as_json: bool, list_arms: bool = False) -> None:
    """Replay the failure once unchanged (the baseline) and once per single change, from the snapshot before
    it over the same batches; say which change fixes, delays, does nothing or makes it worse. Examples:

    \b
        replay ablate --list                                   # the arms: lr, clip, precision, warmup, ...
        replay ablate lr,clip,precision --run-id 3f2a... --horizon 40
        replay ablate lr=x0.3,clip=265 --run-id 3f2a...        # arms with values
        replay ablate --sweep lr --run-id 3f2a...              # how far must the lr come down?
        replay ablate --patch fix.py --run-id 3f2a...          # does my code change fix it?
        replay ablate lr --run-id 3f2a... --workers 2 --from-step 100

    prints a table (arm, change, verdict, first non-finite step, final loss) and a conclusion such as
    "fixed by: lr=x0.1, clip=1"; a clip arm adds one at the run's own 95th-percentile norm, so the threshold it
    suggests is printed with its verdict. Each ablation is one MLflow run (`✓ lr=x0.1 · ablate @ step 47 (lr)`)
    under the failed run, holding one child run per arm (`✓ lr=x0.1: fixes · ablate @ step 47`), with ablation.md,
    ablation.json and ablation.png.
    """
    from replaybisect.options import run_store

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before torch is imported
    from replaybisect.verbs.ablate.request import checked_failing_step

    checked_failing_step(store, request.run_id, request.from_step)  # a run that never failed, a damaged tag: before torch
    from replaybisect.verbs.ablate.engine import ablate_request
    from replaybisect.verbs.ablate.report import ArmProgress, print_result, publish

    with ArmProgress() as bar:
        result = ablate_request(store, request, progress=bar.update, on_plan=bar.plan)
    publish(store, result)
    if as_json:
        print_json(result.to_json())
    else:
        print_result(result)


def listed(as_json: bool, list_arms: bool) -> bool:
    """--list: the interventions, and nothing else (no run is needed)."""
    if not list_arms:
        return False
    from replaybisect.verbs.ablate import interventions

    entries = [(name, interventions.get(name).description) for name in interventions.names()]
    if as_json:
        print_json({"interventions": [{"name": n, "description": d} for n, d in entries]})
    else:
        from replaybisect.verbs.ablate.report import print_list

        print_list(entries)
    return True


def register(app: typer.Typer) -> None:
    # bad options are bad input (the request refuses them) before anything heavy is imported or any run is read
    command = request_command(AblateRequest, ablate, extras=[JSON_OUTPUT, LIST_ARMS], answered=listed)
    app.command("ablate", short_help="Which single change makes the failure go away.")(command)
