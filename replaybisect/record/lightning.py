"""Record a PyTorch Lightning run so `replay nan`, `replay ablate` and `replay check --run-id` can replay it.

    from replaybisect.lightning import ReplayCallback

    trainer = L.Trainer(..., callbacks=[ReplayCallback()])
    trainer.fit(model, data)

The run is a user-loop run (`train.loop: user`, see record/recorder.py): metrics every step, snapshots with the
batches, and a config a replay rebuilds from. A replay needs no Trainer: `build` makes the LightningModule from
its class and `hparams` (call `self.save_hyperparameters()` in `__init__`) and calls its `configure_optimizers`;
`lightning_step` does one optimizer step the way Lightning's automatic optimization does it numerically
(training_step under the Trainer's precision, backward, gradient clipping, optimizer and scheduler steps).
The module's class is your code: a replay imports it only from the folder it runs in or a --code-dir.

A non-finite loss or gradient stops training before the update: `trainer.fit` raises NonFiniteStep, the run
ends FAILED and its last snapshot is the state before the failing step (`replay nan --run-id ...`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch import Callback

from replaybisect.core import guard, ranks, reentry
from replaybisect.core.step_watch import StepOutcome, StepWatch
from replaybisect.core.user_step import LIGHTNING_BATCHES, LIGHTNING_POSITIONS, NO_LOSS
from replaybisect.core.config import OnNonfinite
from replaybisect.errors import ConfigError, NonFiniteStep
from replaybisect.record.ranked import RankedSteps, run_of_this_rank
from replaybisect.record.recorder import (function_target, loop_data_started, nonfinite_step, one_line_failures, open_session,
                                          own_sources, plain_config, replay_config)

STEP_TARGET = ranks.LIGHTNING_STEP
BUILD_TARGET = "replaybisect.lightning.build"
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


# ---- replay: the objects and the step, without a Trainer ----------------------------------------------------
def build(config) -> dict[str, Any]:
    """The LightningModule from its class and hparams, on the recorded device, and its configure_optimizers."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    from replaybisect.core.config import instantiate

    module_class = instantiate(config.module, "the LightningModule")
    model = module_class(**{key: config.hparams[key] for key in config.hparams})
    model = model.to(torch.device(config.trainer.device))
    with _no_trainer_warnings():
        optimizers, schedulers, _ = _configure_optimizers(model.configure_optimizers())
    scaler = _scaler(config.trainer)
    scheduler = schedulers[0] if schedulers else None
    if isinstance(scheduler, dict):
        scheduler = scheduler["scheduler"]
    return {"model": model, "optimizer": optimizers[0], "scheduler": scheduler, "scaler": scaler}


def _scaler(trainer) -> Optional[torch.amp.GradScaler]:
    """16-mixed's GradScaler, off where the recorded one was (a MixedPrecision plugin given GradScaler(enabled=False);
    runs recorded before this was noted had Lightning's own, enabled)."""
    if trainer.precision != "16-mixed":
        return None
    return torch.amp.GradScaler(torch.device(trainer.device).type, enabled=trainer.get("scaler_enabled", True))


def lightning_step(model, optimizer, scheduler, scaler, batch, config):
    """One step of Lightning's automatic optimization: for each accumulated batch, training_step under the
    precision's autocast, its loss divided by accumulate_grad_batches, backward (scaled for 16-mixed); then
    unscale, the module's configure_gradient_clipping with the Trainer's settings, the optimizer (scaler) step,
    and the scheduler when Lightning stepped it after that batch. Returns the summed loss."""
    from replaybisect.core.rng import restore_stored

    trainer = config.trainer
    device = torch.device(trainer.device)
    dtype = AUTOCAST.get(trainer.precision)
    total, last_loss = None, None
    with _no_trainer_warnings():
        for inner, position in zip(batch[LIGHTNING_BATCHES], batch[LIGHTNING_POSITIONS]):
            if position["rng"] is not None:  # a later accumulated batch: the RNG state it started with
                restore_stored(position["rng"], device)
            with torch.autocast(device.type, dtype=dtype, cache_enabled=False) if dtype else contextlib.nullcontext():
                output = model.training_step(inner, position["batch_idx"]) if position["takes_batch_idx"] else model.training_step(inner)
            loss = last_loss = output.get("loss") if isinstance(output, dict) else output
            if loss is None:  # training_step skipped this batch, as Lightning allows: no backward
                continue
            loss = loss / position["accumulate"]
            model.backward(scaler.scale(loss) if scaler is not None else loss)
            total = loss.detach().float() if total is None else total + loss.detach().float()
        if trainer.get("world_size", 1) > 1:  # a DDP job: the all-reduce the strategy's wrapper did after the backward
            ranks.reduce_gradients(p for group in optimizer.param_groups for p in group["params"])
        # Lightning's AMP plugin skips unscale, step and update when the last batch (the one its optimizer closure
        # runs) had no loss, whatever the earlier accumulated batches backpropagated; without a scaler the optimizer
        # steps (with no gradient, when every batch was skipped, it updates nothing)
        scaling = scaler is not None and last_loss is not None
        if scaling:
            scaler.unscale_(optimizer)
        # clipped in the optimizer's own pre-step hook: the recorder's observers see the gradients before the
        # clip (as a recorded run's on_before_optimizer_step did), an ablation arm's clip then comes first
        clip = optimizer.register_step_pre_hook(lambda *_: _clip(model, optimizer, trainer))
        try:
            if scaling:
                scaler.step(optimizer)
                scaler.update()
            elif scaler is None:
                optimizer.step()
        finally:
            clip.remove()
        if scheduler is not None and batch[LIGHTNING_POSITIONS][-1]["scheduler_step"]:
            model.lr_scheduler_step(scheduler, None)
    return total if total is not None else NO_LOSS


lightning_step.reduces_gradients = True  # a DDP run's replay: no DDP module here (core/ranks.py)


def _clip(model, optimizer, trainer) -> None:
    """The module's configure_gradient_clipping with the Trainer's value and algorithm; its clip_gradients
    (which reads the Trainer) replaced by what Lightning's precision plugin does."""
    def clip_gradients(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        value = trainer.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        algorithm = (trainer.gradient_clip_algorithm if gradient_clip_algorithm is None else gradient_clip_algorithm) or "norm"
        if not value or value <= 0:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if str(algorithm).lower() == "value":
            torch.nn.utils.clip_grad_value_(params, clip_value=value)
        else:
            torch.nn.utils.clip_grad_norm_(params, value)

    model.clip_gradients = clip_gradients
    try:
        model.configure_gradient_clipping(optimizer, gradient_clip_val=trainer.gradient_clip_val,
                                          gradient_clip_algorithm=trainer.gradient_clip_algorithm)
    finally:
        del model.clip_gradients


@contextlib.contextmanager
def _no_trainer_warnings():
    """`self.log(...)` in a replayed training_step has no Trainer to log to: that is expected, not worth a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*not registered on the model.*")
        yield


# ---- recording: what the Trainer runs, as the config a replay needs ---------------------------------------
def _trainer_settings(trainer, pl_module) -> dict[str, Any]:
    """The Trainer's numerics a replay repeats; a setup the replay cannot repeat is a one-line ConfigError."""
    if not pl_module.automatic_optimization:
        raise ConfigError("ReplayCallback records automatic optimization only; this module sets automatic_optimization = False")
    if len(trainer.optimizers) != 1:
        raise ConfigError(f"ReplayCallback records one optimizer; configure_optimizers returned {len(trainer.optimizers)}")
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise ConfigError(f"ReplayCallback records precision 32-true, bf16-mixed or 16-mixed; this Trainer uses {precision}")
    configs = trainer.lr_scheduler_configs
    if len(configs) > 1 or any(c.reduce_on_plateau for c in configs):
        raise ConfigError("ReplayCallback records at most one learning-rate scheduler, not ReduceLROnPlateau")
    if trainer.world_size != 1:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = trainer.strategy
        if type(strategy) is not DDPStrategy or ranks.world() is None or getattr(strategy, "_start_method", "popen") != "popen":
            raise ConfigError(f"ReplayCallback records one process or a DDP job started as a script (strategy=\"ddp\"); "
                              f"this Trainer runs {trainer.world_size} processes with {type(strategy).__name__}"
                              f"{' (' + strategy._start_method + ')' if getattr(strategy, '_start_method', None) else ''}")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ConfigError("ReplayCallback records DDP's own gradient averaging; this Trainer's DDPStrategy has a "
                              "ddp_comm_hook, which a one-process replay would not repeat: leave it out to record the run")
    algorithm = trainer.gradient_clip_algorithm
    return {
        "precision": precision,
        "scaler_enabled": guard.scaler_enabled(getattr(trainer.precision_plugin, "scaler", None)),
        "device": str(pl_module.device),
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": getattr(algorithm, "value", algorithm),
        "scheduler": {"interval": configs[0].interval, "frequency": configs[0].frequency} if configs else None,
        "world_size": int(trainer.world_size),
    }


def _hparams(pl_module) -> dict[str, Any]:
    """The module's hparams, checked to cover every argument its __init__ requires."""
    hparams = plain_config(dict(pl_module.hparams))
    signature = inspect.signature(type(pl_module).__init__)
    missing = [name for name, p in list(signature.parameters.items())[1:]
               if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in hparams]
    if missing:
        raise ConfigError(f"{type(pl_module).__name__}.__init__ takes {', '.join(missing)}, which is not in its hparams; call "
                          "self.save_hyperparameters() in __init__ so a replay can rebuild the module")
    return hparams


def _scheduler_steps(trainer, batch_idx: int) -> bool:
    """Whether Lightning steps the scheduler after this batch (training_epoch_loop.update_lr_schedulers)."""
    if not trainer.lr_scheduler_configs:
        return False
    config = trainer.lr_scheduler_configs[0]
    if config.interval == "step":
        return (batch_idx + 1) % config.frequency == 0
    last_batch = trainer.fit_loop.epoch_loop._num_ready_batches_reached()
    return bool(last_batch) and (trainer.current_epoch + 1) % config.frequency == 0


class ReplayCallback(Callback):
    """Records the Trainer's run to MLflow so it can be replayed bit for bit (`replay nan --run-id ...`).

    tracking_uri: the store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db). snapshot_every: a snapshot (model,
    optimizer, scheduler, scaler, RNG) every N steps, with every batch in between. layer_stats_every: per-layer
    statistics every N steps. on_nonfinite: "stop" (trainer.fit raises NonFiniteStep) or "continue".
    """

    def __init__(self, *, tracking_uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 snapshot_every: int = 100, layer_stats_every: int = 50, on_nonfinite: OnNonfinite = "stop"):
        from replaybisect.core import arguments

        arguments.tracking_uri(tracking_uri)
        arguments.text(experiment, "experiment")
        arguments.text(run_name, "run_name")
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.snapshot_every, self.layer_stats_every, self.on_nonfinite = snapshot_every, layer_stats_every, on_nonfinite
        self.run_id: Optional[str] = None
        self.steps_taken = 0
        self.first_nonfinite_step: Optional[int] = None
        self._session = None  # the run, from on_train_start
        self._ranked: Optional[RankedSteps] = None  # one rank of a DDP job
        self._post_hook = None  # the optimizer post-step hook, while recording
        self._step: Optional[_StepInProgress] = None  # the optimizer step in progress
        if reentry.replaying():
            _quiet_trainers()

    # A strategy that trains in new processes (ddp_spawn, or any spawn/forkserver launcher) pickles the Trainer,
    # callbacks included, in this process before it starts them: the place to refuse it before any process or run
    # exists (in the new processes the refusal would come back as a ProcessRaisedException quoting a traceback).
    # Copies (copy.deepcopy) stay possible.
    def __getstate__(self):
        raise ConfigError("ReplayCallback records in the process that calls trainer.fit, and this Trainer's strategy starts "
                          "the training in new processes (ddp_spawn, or another spawning strategy); train on one device "
                          "with strategy='auto' (devices=1) to record it")

    def __deepcopy__(self, memo):
        import copy

        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    # ---- the run ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        from omegaconf import OmegaConf
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from replaybisect.core.loop import BufferGuard, TrainState

        if reentry.replaying():  # a replay ran this script again: it takes the module and its optimizer over here
            self._hand_over(trainer, pl_module)
        settings = _trainer_settings(trainer, pl_module)
        module, script, folder, name = _how_replayed(type(pl_module))
        user = {"module": module, "hparams": _hparams(pl_module), "trainer": settings}
        where = ranks.world()  # one rank of a DDP job: rank 0 records the run, the others send it their steps
        link = ranks.RankLink(*where) if where is not None else None
        self._ranked = RankedSteps(link, pl_module, self.snapshot_every) if link is not None else None
        precision = PRECISIONS[settings["precision"]]
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self.cfg = replay_config(step_target=STEP_TARGET, build_target=None if script else BUILD_TARGET, config=user,
                                 seed=torch.initial_seed(), precision=precision, snapshot_every=self.snapshot_every,
                                 layer_stats_every=self.layer_stats_every, on_nonfinite=self.on_nonfinite, steps=steps,
                                 script=script, distributed=ranks.layout(where[1]) if where is not None else None)
        configs = trainer.lr_scheduler_configs
        self.state = TrainState(cfg=self.cfg, model=pl_module, optimizer=trainer.optimizers[0],
                                scheduler=configs[0].scheduler if configs else None,
                                scaler=getattr(trainer.precision_plugin, "scaler", None), loss_fn=None,
                                step_fn=lightning_step, device=pl_module.device, precision=precision, clip_grad_norm=None,
                                user_loop=True, user_config=OmegaConf.create(user),
                                ranks_agree=ranks.any_rank_failed(pl_module.device) if link is not None else None)
        self._buffers = BufferGuard(pl_module)
        self._takes_batch_idx = _takes_batch_idx(pl_module)
        self.steps_taken = 0
        self.first_nonfinite_step = None
        self._last_step_end: Optional[float] = None
        def start_recording(session):
            session.write_config(self.cfg)
            return session.start_recording(self.cfg, self.state, {"seed": int(self.cfg.seed)}, runs_steps=False)

        self._session, self._hooks = run_of_this_rank(
            link, self.tracking_uri, self.on_nonfinite,
            lambda: open_session(self.tracking_uri, self.experiment, folder,
                                 {"replaybisect.loop": "user", "replaybisect.trainer": "lightning", **own_sources(type(pl_module))},
                                 self.run_name or f"train {name} (lightning)"),
            start_recording)
        self.run_id = self._session.run_id
        one_line_failures()  # (rank 0 has it from open_session; the other ranks end with one line too)
        self._post_hook = register_optimizer_step_post_hook(self._after_update)

    def _hand_over(self, trainer, pl_module) -> None:
        configs = trainer.lr_scheduler_configs
        parts = {"model": pl_module, "optimizer": trainer.optimizers[0], "scheduler": configs[0].scheduler if configs else None,
                 "scaler": getattr(trainer.precision_plugin, "scaler", None), "step_fn": lightning_step}
        pl_module.trainer = None  # the replay runs the module's steps as a replay without a Trainer does
        reentry.hand_over(parts)

    @property
    def _open(self) -> bool:
        return self._session is not None and not self._session.ended

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Ctrl-C: KILLED; anything else FAILED ("crashed"); what was recorded stays. NonFiniteStep ended the run itself."""
        if isinstance(exception, NonFiniteStep) or not self._open:
            return
        self._stop_watching()
        if self._ranked is not None and self._ranked.is_writer:
            exception = self._ranked.blamed(exception, self._session.store, self.run_id)
        self._session.fail(exception)

    def _finish(self) -> None:
        """Every pending write done; the run FINISHED, or FAILED after a non-finite step (or a write that failed)."""
        if not self._open:
            return
        self._stop_watching()
        self._session.finish()

    def _stop_watching(self) -> None:
        if self._post_hook is not None:
            self._post_hook.remove()
            self._post_hook = None
        if self._step is not None:
            self._step.watch.close_forward()

    # ---- one step: the step watch's moments, at Lightning's hooks -------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        """A step begins with the first batch after an optimizer step; accumulated batches join it."""
        from replaybisect.core import user_step

        if not self._open:
            return
        called = time.perf_counter()
        packed = user_step.pack(batch, self.state.device)  # a copy of the batch, and the RNG states it starts with
        position = {"batch_idx": int(batch_idx), "takes_batch_idx": self._takes_batch_idx, "rng": None,
                    "accumulate": int(trainer.accumulate_grad_batches), "scheduler_step": _scheduler_steps(trainer, batch_idx)}
        if self._step is None:
            self._step = self._begin_step(packed, position, called)
            return
        position["rng"] = packed[user_step.RECORD_RNG]  # a later accumulated batch: the RNG state it starts with
        self._step.batches.append(packed[user_step.RECORD_BATCH])
        self._step.positions.append(position)
        self._step.watch.open_forward()

    def _begin_step(self, packed: dict, position: dict, called: float) -> "_StepInProgress":
        from replaybisect.core import loop, user_step

        step = self.steps_taken
        loop.open_step(step, self.state, self._hooks, self._buffers)
        if self._ranked is not None:
            self._ranked.opened(step, self.state)
        outcome = StepOutcome(step=step, loss=math.nan, lr=float(self.state.optimizer.param_groups[0]["lr"]))
        watch = StepWatch(self.state, outcome, self._hooks.observer(step), on_fault=self._nonfinite,
                          ranks_agree=self.state.ranks_agree, defer_reads=getattr(self._hooks, "defers_reads", False))
        watch.open_forward()
        now = time.perf_counter()
        return _StepInProgress(watch=watch, batches=[packed[user_step.RECORD_BATCH]], positions=[position],
                               rng=packed[user_step.RECORD_RNG], started=now,
                               data_started=loop_data_started(self._last_step_end, called, now))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._step is not None:
            self._step.watch.loss(loss)

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._step is not None:
            self._step.watch.backward_done()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._step is not None:
            self._step.stepped = True
            self._step.watch.gradients()

    def _after_update(self, optimizer, args, kwargs) -> None:
        if self._step is not None and optimizer is self.state.optimizer:
            self._step.watch.updated()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """The loss Lightning logged for this batch (divided by accumulate_grad_batches) joins the step's sum;
        after the optimizer step the step is recorded."""
        if self._step is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            part = loss.detach().float()
            self._step.logged_loss = part if self._step.logged_loss is None else self._step.logged_loss + part
        if not self._step.stepped:
            return
        step, self._step = self._step, None
        outcome = step.watch.outcome
        if step.logged_loss is None:
            outcome.loss = math.nan
        elif step.watch.defer_reads:  # stays on the device, read with the step's other metrics at the flush
            outcome.loss = step.logged_loss.clone()
        else:
            outcome.loss = float(step.logged_loss.item())
        step.watch.settle()
        ended = time.perf_counter()
        stored = self._stored(step)
        self._hooks.after_step(outcome, stored, ended - step.started, step.started - step.data_started)
        if self._ranked is not None:
            self._ranked.finished(outcome.step, outcome.loss, self._hooks)
        self.steps_taken = outcome.step + 1
        self._last_step_end = time.perf_counter()  # after the recorder's own flush of the step

    def _stored(self, step: "_StepInProgress"):
        """What the run stores for the step: its record; in a DDP job, every rank's (rank 0 gathers them)."""
        record = step.record()
        return self._ranked.stored(step.watch.outcome.step, record) if self._ranked is not None else record

    def _nonfinite(self) -> None:
        """The step watch's fault: the state is still the one before this step, and the hooks save it with the
        failing batch. Stop: log the step, end the run FAILED and raise; continue: put the forward's buffer
        updates back and go on."""
        step = self._step
        outcome = step.watch.outcome
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = outcome.step
        stored = self._stored(step)
        if self._buffers.ask_as_before_step(lambda: self._hooks.on_nonfinite(outcome, stored)):
            return
        step.watch.close_forward()
        self._step = None
        self._hooks.after_step(outcome, stored, time.perf_counter() - step.started, 0.0)
        if self._ranked is not None:
            self._ranked.finished(outcome.step, outcome.loss, self._hooks)
        self._finish()
        raise nonfinite_step(outcome, self.run_id)


@dataclass
class _StepInProgress:
    """The optimizer step the Trainer is in: its accumulated batches, where each sat in Lightning's loop, the RNG
    state it started with, and its watch."""

    watch: StepWatch
    batches: list
    positions: list
    rng: dict
    started: float
    data_started: float
    stepped: bool = False  # the optimizer step was reached
    logged_loss: Optional[torch.Tensor] = None  # the sum of what Lightning logged for the step's batches

    def record(self) -> dict:
        """The step's stored batch as user_step.pack shapes it (lists copied: later batches do not change it)."""
        from replaybisect.core import user_step

        return {user_step.RECORD_BATCH: {LIGHTNING_BATCHES: list(self.batches), LIGHTNING_POSITIONS: list(self.positions)},
                user_step.RECORD_RNG: self.rng}


def _quiet_trainers() -> None:
    """In a replay that ran a script again: the Trainers it makes from now on log and checkpoint nothing. Their
    loggers would write into the user's folders as `fit` starts, before the replay takes over (which refuses it),
    and none of the script's own training runs in a replay."""
    import functools

    from lightning.pytorch import Trainer

    if getattr(Trainer.__init__, "replaybisect", False):
        return
    original = Trainer.__init__

    @functools.wraps(original)
    def quiet(self, *args, **kwargs):
        kwargs.update(logger=False, enable_checkpointing=False)
        original(self, *args, **kwargs)

    quiet.replaybisect = True
    Trainer.__init__ = quiet


def _how_replayed(module_class: type) -> tuple[dict, Optional[dict], Any, str]:
    """(user.module, the script entry or None, the code folder, a name for the run): the class a replay imports
    and builds, or, for a class defined in a script that trains when run (a LightningModule and `trainer.fit` at
    the top level), the script a replay runs again. Its class is then named, never a `_target_`: nothing imports it."""
    from pathlib import Path

    try:
        target, folder = function_target(module_class, "the LightningModule")
    except ConfigError:
        if module_class.__module__ != "__main__":
            raise
        script = reentry.script_entry()
        return {"class": module_class.__qualname__}, script, Path(script["path"]).parent, Path(script["path"]).stem
    return {"_target_": target, "_partial_": True}, None, folder, target.rsplit(".", 1)[0]


def _takes_batch_idx(pl_module) -> bool:
    """Lightning passes batch_idx when training_step takes a second argument (loops/training_epoch_loop)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    return bool(is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2))
