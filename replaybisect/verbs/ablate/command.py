"""`replay ablate ARMS --run-id X`: which single change makes the failure go away."""

from __future__ import annotations

from typing import Optional

import typer

from replaybisect.options import (Account, Cluster, CodeDirs, Cpus, Executor, ExecutorFolder, Gpus, JsonFlag, MemGb, Partition, Slurm,
                                  TimeMin, TrackingUri, AllowUnsigned, TrustPrefixes, print_json)
from replaybisect.verbs.ablate.request import DEFAULT_HORIZON, HORIZON, WORKERS, AblateRequest


def ablate_command(
    arms: Optional[str] = typer.Argument(None, help="Comma-separated arms, bare or with a value: lr,clip,precision or lr=x0.3,clip=265 (default: all, none with --patch; see --list)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="The failed run to ablate."),
    from_step: Optional[int] = typer.Option(None, "--from-step", help="Apply the changes from this step (default: the snapshot before the failure)."),
    horizon: int = typer.Option(DEFAULT_HORIZON, "--horizon", **HORIZON.limits, help="Replay this many steps past the failing step."),
    workers: Optional[int] = typer.Option(None, "--workers", **WORKERS.limits, help="Arms run in parallel: local processes, or SLURM array parallelism with submitit (default: auto: one per arm up to the cores, in-process when the replays are short)."),
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
    sweep: Optional[str] = typer.Option(None, "--sweep", help="lr | clip: find the largest lr factor (clip threshold) that fixes the failure, by bisection; instead of arms."),
    patch: Optional[str] = typer.Option(None, "--patch", help="Your changed module (fix.py) or a folder of them: replay the failure with it in place of the recorded code."),
    list_arms: bool = typer.Option(False, "--list", help="List the interventions and exit."),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = JsonFlag,
    code_dirs: Optional[list[str]] = CodeDirs,
    trust_prefixes: Optional[list[str]] = TrustPrefixes,
    allow_unsigned: Optional[str] = AllowUnsigned,
):
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
    from replaybisect.verbs.ablate import interventions

    if list_arms:
        entries = [(name, interventions.get(name).description) for name in interventions.names()]
        if as_json:
            print_json({"interventions": [{"name": n, "description": d} for n, d in entries]})
        else:
            from replaybisect.verbs.ablate.report import print_list

            print_list(entries)
        return
    # bad options are bad input before anything heavy is imported or any run is read
    request = AblateRequest(
        run_id=run_id, arms=arms, from_step=from_step, horizon=horizon, workers=workers, executor=executor, cluster=cluster,
        partition=partition, time_min=time_min, gpus=gpus, cpus=cpus, mem_gb=mem_gb, account=account, slurm=slurm or (),
        executor_folder=executor_folder,
        sweep=sweep, patch=patch, tracking_uri=tracking_uri, code_dirs=code_dirs or (), trust=trust_prefixes or (), allow_unsigned=allow_unsigned,
    )
    from replaybisect.options import run_store

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before torch is imported
    from replaybisect.core.tags import step_tag

    step_tag(store.tags(run_id), "first_nonfinite_step", run_id)  # a damaged tag too (torch is not imported yet)
    from replaybisect.verbs.ablate.engine import ablate_request
    from replaybisect.verbs.ablate.report import ArmProgress, print_result, publish

    with ArmProgress() as bar:
        result = ablate_request(store, request, progress=bar.update, on_plan=bar.plan)
    publish(store, result)
    if as_json:
        print_json(result.to_json())
    else:
        print_result(result)


def register(app: typer.Typer) -> None:
    app.command("ablate", short_help="Which single change makes the failure go away.")(ablate_command)
