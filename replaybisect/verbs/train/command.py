"""`replay train [hydra overrides]`: train with the recorder on."""

from __future__ import annotations

import inspect

import typer

from replaybisect.options import OUR_STDOUT, HYDRA_CONTEXT, JSON_OUTPUT, StepProgress, print_json, request_command
from replaybisect.verbs.train.request import TrainRequest

SHOW_CONFIG = inspect.Parameter("show_config", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                default=typer.Option(False, "--cfg", help="Print the resolved config and exit."))


def train_command(request: TrainRequest, as_json: bool, show_config: bool) -> None:
    """Train a model from a Hydra config, recording metrics and snapshots to MLflow.

    Everything after the options is a Hydra override. Examples:

    \b
        replay train                                     # the built-in MLP on digits, 500 steps
        replay train train.steps=300 optim.lr=3e-3 model=cnn train.precision=bf16
        replay train --config-dir examples/nan_forward   # a run that dies with loss=nan (exit 3)
        replay train --config-dir conf train.steps=5000  # your own project's conf/config.yaml

    Runs are recorded to the nearest mlflow.db in this folder or above (else ./mlflow.db is created), or to
    $MLFLOW_TRACKING_URI / --tracking-uri.

    Exit status: 0 trained, 3 stopped on a non-finite loss or gradient (then run `replay nan --run-id ID`),
    2 bad config or store.
    """
    from replaybisect.core import config as config_mod
    from replaybisect.errors import NonFiniteStep
    from replaybisect.report import print_train_result, run_label

    cfg = config_mod.compose(request.config_dir, request.config_name, list(request.overrides))
    if show_config:
        print(config_mod.to_yaml(cfg), end="", file=OUR_STDOUT)
        return

    from replaybisect.options import recording_store
    from replaybisect.verbs.train import ranks
    from replaybisect.verbs.train.engine import train

    store = recording_store(request.tracking_uri, later=True)  # opened (created) once the config has built: bad input creates nothing
    run_name = request.run_name or run_label(cfg, request.config_dir, request.config_name)
    if ranks.launched_rank() is not None or cfg.train.nproc > 1:  # one DDP job: every rank's batches in one run
        result = _train_ranks(cfg, store, request, run_name)
        if result is None:  # a rank other than 0: rank 0 says how the job ended
            return
    else:
        with StepProgress("training", starting="building the model, data and optimizer") as bar:
            result = train(
                cfg, store, run_name=run_name, parent_run_id=request.parent_run_id, kind=request.kind,
                extra_tags=request.run_tags(), code_folder=request.code_folder, progress=bar.update,
            )
    if as_json:
        print_json(result.to_json())
    else:
        print_train_result(result)
    if result.stopped:
        raise NonFiniteStep.of_command(
            result.first_nonfinite_step, (result.nonfinite_what or "loss").replace("_", " "), result.run_id,
            snapshot_saved=result.first_nonfinite_step in result.snapshot_steps,
        )


def _train_ranks(cfg, store, request: TrainRequest, run_name: str):
    """train.nproc=N starts the job's processes; under torchrun this process is one of them."""
    from replaybisect.errors import ConfigError
    from replaybisect.options import say
    from replaybisect.verbs.train import ranks

    if request.parent_run_id is not None or request.kind != "train":
        raise ConfigError("a bisect trial trains on one process; leave train.nproc out of the bisect's overrides")
    from replaybisect.store import locate_store

    uri = locate_store(request.tracking_uri).uri  # rank 0 opens (creates) it; the others join its run after that
    tags = request.run_tags()
    if ranks.launched_rank() is None:
        say(f"training: starting {cfg.train.nproc} processes (DistributedDataParallel, "
            f"{cfg.train.nproc} x train.batch_size={cfg.train.batch_size} samples a step)")
        return ranks.launch(cfg, tracking_uri=uri, run_name=run_name, tags=tags, code_folder=request.code_folder)
    with StepProgress("training", enabled=None if ranks.launched_rank()[0] == 0 else False) as bar:
        return ranks.train_this_rank(cfg, tracking_uri=uri, run_name=run_name, tags=tags, code_folder=request.code_folder,
                                     progress=bar.update)


def register(app: typer.Typer) -> None:
    command = request_command(TrainRequest, train_command, extras=[JSON_OUTPUT, SHOW_CONFIG])
    app.command("train", context_settings=HYDRA_CONTEXT, short_help="Train from a Hydra config, recording to MLflow.")(command)
