"""`replay ablate ARMS --run-id X`: which single change makes the failure go away."""

from __future__ import annotations

import os
from typing import Optional

import typer

from replaybisect.options import MAX_STEPS, MAX_WORKERS, CodeDirs, JsonFlag, TrackingUri, TrustPrefixes, print_json


def ablate_command(
    arms: Optional[str] = typer.Argument(None, help="Comma-separated arms, bare or with a value: lr,clip,precision or lr=x0.3,clip=265 (default: all, none with --patch; see --list)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="The failed run to ablate."),
    from_step: Optional[int] = typer.Option(None, "--from-step", help="Apply the changes from this step (default: the snapshot before the failure)."),
    horizon: int = typer.Option(200, "--horizon", max=MAX_STEPS, help="Replay this many steps past the failing step."),
    workers: Optional[int] = typer.Option(None, "--workers", max=MAX_WORKERS, help="Arms run in parallel: local processes, or SLURM array parallelism with submitit (default: auto: one per arm up to the cores, in-process when the replays are short)."),
    executor: str = typer.Option("local", "--executor", help="local (processes here) | submitit (SLURM; local when no sbatch)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="submitit cluster: slurm | local | debug (default: slurm when sbatch exists, else local)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="SLURM partition (submitit)."),
    time_min: int = typer.Option(60, "--time", min=1, help="Job time limit in minutes (submitit)."),
    gpus: int = typer.Option(0, "--gpus", min=0, help="GPUs per job (submitit)."),
    cpus: Optional[int] = typer.Option(None, "--cpus", min=1, help="CPUs per job (submitit)."),
    mem_gb: Optional[float] = typer.Option(None, "--mem-gb", min=0.001, help="Memory per job in GB (submitit)."),
    executor_folder: str = typer.Option(".replaybisect/submitit", "--executor-folder", help="submitit's job folder (shared file system on SLURM)."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="lr | clip: find the largest lr factor (clip threshold) that fixes the failure, by bisection; instead of arms."),
    patch: Optional[str] = typer.Option(None, "--patch", help="Your changed module (fix.py) or a folder of them: replay the failure with it in place of the recorded code."),
    list_arms: bool = typer.Option(False, "--list", help="List the interventions and exit."),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = JsonFlag,
    code_dirs: Optional[list[str]] = CodeDirs,
    trust_prefixes: Optional[list[str]] = TrustPrefixes,
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
    from replaybisect.errors import ReplayError
    from replaybisect.verbs.ablate import interventions

    if list_arms:
        entries = [(name, interventions.get(name).description) for name in interventions.names()]
        if as_json:
            print_json({"interventions": [{"name": n, "description": d} for n, d in entries]})
        else:
            from replaybisect.verbs.ablate.report import print_list

            print_list(entries)
        return
    if not run_id:
        raise ReplayError("pass --run-id ID of the failed run (find it with `replay runs --status nonfinite`)")

    from replaybisect.verbs.ablate.engine import SubmititOptions, ablate, check_options

    # bad options are bad input before anything heavy is imported or any run is read
    check_options(arms, horizon=horizon, workers=workers, executor=executor, from_step=from_step, patch=patch, sweep=sweep)
    _check_submitit(executor, cluster, executor_folder)

    from replaybisect.core.trust import Trust
    from replaybisect.options import run_store

    trust = Trust.from_user(code_dirs or (), trust_prefixes or ())
    store = run_store(tracking_uri, run_id)  # an unknown run is answered before torch is imported
    from replaybisect.core.tags import step_tag

    step_tag(store.tags(run_id), "first_nonfinite_step", run_id)  # a damaged tag too (torch is not imported yet)
    from replaybisect.verbs.ablate.report import ArmProgress, print_result, publish

    options = SubmititOptions(cluster=cluster, folder=executor_folder, partition=partition, timeout_min=time_min,
                              gpus_per_node=gpus, cpus_per_task=cpus, mem_gb=mem_gb)
    with ArmProgress() as bar:
        result = ablate(store, run_id, arms, from_step=from_step, horizon=horizon, workers=workers, executor=executor,
                        submitit_options=options, progress=bar.update, on_plan=bar.plan, trust=trust, patch=patch, sweep=sweep)
    publish(store, result)
    if as_json:
        print_json(result.to_json())
    else:
        print_result(result)


SUBMITIT_CLUSTERS = ("slurm", "local", "debug")  # what submitit.AutoExecutor runs on (without plugins)


def _check_submitit(executor: str, cluster: Optional[str], folder: str) -> None:
    """The submitit options, before any run is read: a cluster submitit knows, a job folder that can be a folder."""
    from pathlib import Path

    from replaybisect.errors import ReplayError

    if cluster is not None:
        try:  # submitit's own registry: its executor plugins count too
            from submitit.core.plugins import get_executors

            known = tuple(get_executors())
        except Exception:  # noqa: BLE001 - submitit missing or changed: its built-in executors
            known = SUBMITIT_CLUSTERS
        if cluster not in known:
            raise ReplayError(f"--cluster {cluster[:80]!r} is not a submitit cluster; use {', '.join(known)} "
                              "(or leave it out: slurm when sbatch exists, else local)")
    if executor != "submitit":
        return
    path = Path(folder).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is None:
        return
    if not existing.is_dir():
        where = "" if existing == path else f": {existing}"
        raise ReplayError(f"--executor-folder {folder[:200]}{where} is a file, not a folder; pass a folder for submitit's job files")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ReplayError(f"--executor-folder {folder[:200]}: {existing} is not writable; pass a folder you can write to")


def register(app: typer.Typer) -> None:
    app.command("ablate", short_help="Which single change makes the failure go away.")(ablate_command)
