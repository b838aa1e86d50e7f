"""`replay train` as a DistributedDataParallel job: `train.nproc=N` starts N processes on this machine (each with
the environment torchrun gives its workers), or `torchrun --nproc-per-node N $(which replay) train ...` starts them.

Each rank builds the config's model, wraps it in DDP and trains on its share of each step's batch: the step's
`nproc * train.batch_size` samples in data order, rank r taking the r-th slice. The job is recorded as any DDP job
recorded with the Recorder (record/ranked.py): one run, every rank's batches, RNG states, losses and parameter
checksums. Its `build` and `train_step` are this module's own (registered in core/trust.py) and its `user` config
is the composed config, so `replay nan`, `ablate` and `check --run-id` rebuild it on one process like any DDP run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from replaybisect.core import launch as launch_mod
from replaybisect.errors import ConfigError, ReplayError
from replaybisect.record.recorder import Recorder

ENTRY = "replaybisect.verbs.train.ranks"
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---- the run's build and step: what a replay rebuilds on one process ------------------------------------------
def builtin_config(config) -> Any:
    """The composed config a rank trained (the run's `user` config), checked as `replay train` checks it."""
    from omegaconf import OmegaConf

    from replaybisect.core.config import ReplayConfig, validate

    cfg = OmegaConf.merge(OmegaConf.structured(ReplayConfig), OmegaConf.to_container(config, resolve=True))
    validate(cfg)
    return cfg


def build(config) -> dict:
    """The config's model (wrapped in DDP while a process group is up), optimizer, scheduler and scaler."""
    from torch.nn.parallel import DistributedDataParallel

    from replaybisect.core import loop

    state = loop.build_state(builtin_config(config))
    model = state.model
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        model = DistributedDataParallel(model, device_ids=[state.device.index] if state.device.type == "cuda" else None)
    return {"model": model, "optimizer": state.optimizer, "scheduler": state.scheduler, "scaler": state.scaler}


@dataclass
class StepSettings:
    """What the built-in step reads from the config: built once per config object."""

    step_fn: Callable
    loss_fn: Callable
    precision: str
    accumulate: int


_SETTINGS: dict[int, tuple[Any, StepSettings]] = {}  # id(config) -> (config, its settings); a few configs at most


def step_settings(config) -> StepSettings:
    kept = _SETTINGS.get(id(config))
    if kept is not None and kept[0] is config:
        return kept[1]
    from replaybisect.core.config import instantiate

    cfg = builtin_config(config)
    settings = StepSettings(step_fn=instantiate(cfg.train.step_fn, "train.step_fn"), loss_fn=instantiate(cfg.loss, "loss"),
                            precision=cfg.train.precision, accumulate=cfg.train.accumulate)
    if len(_SETTINGS) >= 8:
        _SETTINGS.clear()
    _SETTINGS[id(config)] = (config, settings)
    return settings


def train_step(model, optimizer, scaler, batch, config) -> None:
    """The built-in step (core/loop.py) on one rank: forward under autocast and backward per micro-batch (fp16
    scaled), then the update. The recorder sees the gradients before it (their norm, the config's clip) and steps
    the scheduler after it; returning nothing logs the sum of the micro-batch losses."""
    from replaybisect.core import loop

    settings = step_settings(config)
    loop.forward_backward(model, loop.split_batch(batch, settings.accumulate), settings.step_fn, settings.loss_fn,
                          device_type=next(model.parameters()).device.type, precision=settings.precision, scaler=scaler)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


# ---- one rank ---------------------------------------------------------------------------------------------------
def launched_rank() -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) when a launcher (torchrun, or train.nproc) started this process as one of
    several; None otherwise."""
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE")):
        return None
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ConfigError("RANK and WORLD_SIZE must be whole numbers (torchrun sets them); unset them to train on one process") from None
    return (rank, world_size, local_rank) if world_size > 1 else None


def _rank_config(cfg, world_size: int, local_rank: int):
    """This rank's copy of the config: nproc is the job's size; on CUDA each rank trains on its own device."""
    from omegaconf import OmegaConf

    from replaybisect.core.device import resolve_device

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if cfg.train.get("nproc", 1) not in (1, world_size):
        raise ConfigError(f"train.nproc={cfg.train.nproc} but the launcher started {world_size} processes; leave "
                          "train.nproc out under torchrun")
    cfg.train.nproc = world_size
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"rank {local_rank} of {world_size} has no GPU of its own ({torch.cuda.device_count()} here); "
                              f"set train.nproc to at most {torch.cuda.device_count()}, or train.device=cpu")
        cfg.train.device = f"cuda:{local_rank}"
    return cfg, device.type


def _process_group(device_type: str, rank: int, world_size: int) -> None:
    import datetime

    if torch.distributed.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.distributed.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(minutes=10))


def train_this_rank(cfg, *, tracking_uri: Optional[str], run_name: Optional[str], tags: dict[str, str],
                    code_folder: Path, progress: Optional[Callable[[int, int], None]] = None):
    """Train this process's rank of the job (the launcher set its environment). Rank 0 returns the TrainResult;
    the other ranks return None. A non-finite step stops every rank before its update (exit 3 on rank 0)."""
    from replaybisect.core import loop
    from replaybisect.core.config import needs_closure
    from replaybisect.errors import NonFiniteStep
    from replaybisect.verbs.train.engine import TrainResult, completed_steps

    rank, world_size, local_rank = launched_rank()
    cfg, device_type = _rank_config(cfg, world_size, local_rank)
    _process_group(device_type, rank, world_size)
    parts = build(cfg)
    if needs_closure(parts["optimizer"]):
        raise ConfigError(f"{type(parts['optimizer']).__name__} evaluates the loss again inside its step; a distributed "
                          "job trains with an optimizer that does not (SGD, Adam, AdamW, ...)")
    source, val_dataset = loop.build_data(cfg)
    source = loop.BatchSource(source.dataset, cfg.train.batch_size * world_size, cfg.seed)  # the step's batch, every rank's
    recorder = BuiltinRecorder(parts, cfg, tracking_uri=tracking_uri, run_name=run_name, tags=tags, code_folder=code_folder)
    validation = _validation(recorder, parts["model"], cfg, val_dataset) if rank == 0 else None
    stopped = None
    try:
        with loop.read_ahead(source, cfg.train.num_workers) as batches:
            for step in range(cfg.train.steps):
                recorder.step(loop.split_batch(batches(step), world_size)[rank])
                if progress is not None:
                    progress(step + 1, cfg.train.steps)
                if validation is not None:
                    validation(step)
        recorder.close()
    except NonFiniteStep as stop:
        stopped = stop
    if rank != 0:
        return None
    hooks = recorder._hooks
    return TrainResult(
        run_id=recorder.run_id, status="nonfinite" if recorder.first_nonfinite_step is not None else "ok",
        steps_completed=completed_steps(recorder.steps_taken, recorder.first_nonfinite_step, stopped is not None),
        first_nonfinite_step=recorder.first_nonfinite_step,
        nonfinite_what=stopped.what if stopped is not None else hooks.nonfinite_what, final_loss=recorder.last_loss,
        stopped=stopped is not None, snapshot_steps=sorted(set(hooks.snapshot_steps)), tracking_uri=recorder.store.uri,
    )


class BuiltinRecorder(Recorder):
    """The Recorder of this module's build and step: the run's code folder is the config's (its targets import
    from there), its tags `replay train`'s, and the config's gradient clip is applied where the recorder sees the
    gradients, as the built-in step does (the pre-clip norm logged)."""

    def __init__(self, parts: dict, cfg, *, tracking_uri: Optional[str], run_name: Optional[str], tags: dict[str, str],
                 code_folder: Path):
        from omegaconf import OmegaConf

        self.clip_grad_norm, self.run_tags, self._code_folder = cfg.train.clip_grad_norm, tags, code_folder
        super().__init__(
            parts["model"], parts["optimizer"], scheduler=parts["scheduler"], scaler=parts["scaler"], step_fn=train_step,
            build=build, config=OmegaConf.to_container(cfg, resolve=True), seed=int(cfg.seed), precision=cfg.train.precision,
            tracking_uri=tracking_uri, run_name=run_name, snapshot_every=cfg.snapshot.every,
            layer_stats_every=cfg.snapshot.layer_stats_every, on_nonfinite=cfg.snapshot.on_nonfinite, steps=cfg.train.steps)

    def _how_replayed(self, step_fn, build_fn):
        step_target, build_target, script, _, _ = super()._how_replayed(step_fn, build_fn)
        return step_target, build_target, script, self._code_folder, "replay train"


def _validation(recorder: Recorder, model, cfg, val_dataset) -> Optional[Callable[[int], None]]:
    """Rank 0's validation every train.val_every steps, on the model inside its DDP wrapper (no collective: the
    other ranks go on to the next step's all-reduce and wait there)."""
    from replaybisect.core import loop

    if val_dataset is None or not cfg.train.val_every:
        return None
    settings = step_settings(cfg)
    inner = getattr(model, "module", model)
    state = loop.TrainState(cfg=cfg, model=inner, optimizer=recorder.state.optimizer, scheduler=None, scaler=None,
                            loss_fn=settings.loss_fn, step_fn=settings.step_fn, device=recorder.state.device,
                            precision=cfg.train.precision, clip_grad_norm=None)

    def validate(step: int) -> None:
        if (step + 1) % cfg.train.val_every == 0:
            recorder._hooks.after_validation(step, loop.validation_loss(state, val_dataset, cfg.train.val_batches))

    return validate


# ---- train.nproc: the launcher ------------------------------------------------------------------------------------
def launch(cfg, *, tracking_uri: str, run_name: Optional[str], tags: dict[str, str], code_folder: Path):
    """Start train.nproc processes of this module, each with the environment torchrun gives its workers (rank,
    world size, a free port on 127.0.0.1), and wait for them. Their output goes to stderr (stdout is replay's own).
    Returns rank 0's TrainResult; a rank that failed ends the others and raises its one line."""
    from omegaconf import OmegaConf

    from replaybisect.verbs.train.engine import TrainResult

    nproc = int(cfg.train.nproc)
    with tempfile.TemporaryDirectory(prefix="replaybisect-ranks-") as folder:
        config_file, result_file = Path(folder) / "config.yaml", Path(folder) / "result.json"
        config_file.write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
        command = [sys.executable, "-m", ENTRY, "--config", str(config_file), "--result", str(result_file),
                   "--tracking-uri", tracking_uri, "--code-folder", str(code_folder), "--tags", json.dumps(tags)]
        if run_name:
            command += ["--run-name", run_name]
        processes = launch_mod.start_ranks(command, nproc, cfg.train.num_threads)
        codes = launch_mod.wait_ranks(processes)
        answer = launch_mod.read_answer(result_file)
    if answer is not None and "result" in answer:
        return TrainResult(**answer["result"])
    if answer is not None and "error" in answer:
        launch_mod.raise_failure(answer)
    failed = next((rank for rank, code in enumerate(codes) if code not in (0, None)), 0)
    raise ReplayError(f"rank {failed} of the {nproc}-process job ended with exit status {codes[failed]} before its run was "
                      "recorded; its output is above")


# ---- one launched rank: python -m replaybisect.verbs.train.ranks ----------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    from omegaconf import OmegaConf

    from replaybisect.core.config import add_code_paths
    from replaybisect.options import StepProgress

    parser = argparse.ArgumentParser(prog=ENTRY, description="one rank of `replay train train.nproc=N` (started by it)")
    for name in ("--config", "--result", "--tracking-uri", "--code-folder", "--tags"):
        parser.add_argument(name, required=True)
    parser.add_argument("--run-name")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    result_file = Path(args.result)
    try:
        add_code_paths(args.code_folder)  # the config's own modules, as `replay train` imports them from its folder
        cfg = OmegaConf.load(args.config)
        with StepProgress("training", enabled=None if rank == 0 else False) as bar:
            result = train_this_rank(cfg, tracking_uri=args.tracking_uri, run_name=args.run_name, tags=json.loads(args.tags),
                                     code_folder=Path(args.code_folder), progress=bar.update if rank == 0 else None)
    except (ReplayError, KeyboardInterrupt) as error:  # the launcher prints the line (rank 0's, or the first one's)
        if rank == 0 or not result_file.exists():
            launch_mod.write_answer(result_file, launch_mod.failure(rank, error))
        return getattr(error, "exit_code", 1)
    if result is not None:
        launch_mod.write_answer(result_file, {"result": result.to_json()})
    return 0


if __name__ == "__main__":  # run from the module by its name, so the run names its build and step by their import path
    from replaybisect.verbs.train import ranks as _imported

    sys.exit(_imported.main())
