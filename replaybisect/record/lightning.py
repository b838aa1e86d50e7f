"""Record a PyTorch Lightning run so `replay nan`, `replay ablate` and `replay check --run-id` can replay it.

    from replaybisect.lightning import ReplayCallback

    trainer = L.Trainer(..., callbacks=[ReplayCallback()])
    trainer.fit(model, data)

The run is a user-loop run (`train.loop: user`, see record/recorder.py): metrics every step, snapshots with the
batches, and a config a replay rebuilds from. A replay needs no Trainer (replay/lightning.py): it makes the
LightningModule from its class and `hparams` (call `self.save_hyperparameters()` in `__init__`). The step's
bookkeeping is record/trainer_steps.py's, shared with the transformers callback; this file adapts it to Lightning's
hooks and reads the Trainer's settings.

A non-finite loss or gradient stops training before the update: `trainer.fit` raises NonFiniteStep, the run
ends FAILED and its last snapshot is the state before the failing step (`replay nan --run-id ...`).
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback

from replaybisect.core import guard, ranks, reentry, user_step
from replaybisect.core.rng import capture_raw
from replaybisect.core.user_step import LIGHTNING_BATCHES, LIGHTNING_POSITIONS
from replaybisect.errors import ConfigError, NonFiniteStep
from replaybisect.record.ranked import RankedSteps, run_of_this_rank
from replaybisect.record.recorder import function_target, one_line_failures, open_session, own_sources, plain_config, replay_config
from replaybisect.record.trainer_steps import RecordingCallback, TrainerRecording
from replaybisect.replay.lightning import lightning_step

STEP_TARGET = ranks.LIGHTNING_STEP
BUILD_TARGET = "replaybisect.lightning.build"
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


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


class ReplayCallback(RecordingCallback, Callback):
    """Records the Trainer's run to MLflow so it can be replayed bit for bit (`replay nan --run-id ...`); its
    arguments are RecordingCallback's (record/trainer_steps.py)."""

    def _constructed(self) -> None:
        self._takes_batch_idx = False
        if reentry.replaying():  # a replay running the script again: its Trainers log and checkpoint nothing
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
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if reentry.replaying():  # a replay ran this script again: it takes the module and its optimizer over here
            _hand_over(trainer, pl_module)
        self.recording = _start_recording(self, trainer, pl_module)
        self._takes_batch_idx = _takes_batch_idx(pl_module)
        one_line_failures()  # (rank 0 has it from open_session; the other ranks end with one line too)
        self.recording.undo.append(register_optimizer_step_post_hook(self._after_update).remove)
        if _clip_follows_moment(trainer, pl_module, self):
            self._clip_with_measured_norm(trainer.precision_plugin)

    def _clip_with_measured_norm(self, plugin) -> None:
        """The Trainer's clip follows the step's gradients moment (on_before_optimizer_step) with nothing of the
        user's in between: it takes the norm the watch took there instead of another pass over every gradient."""
        clip = plugin.clip_grad_by_norm
        own = vars(plugin).get("clip_grad_by_norm")  # (an instance attribute already there is put back at the end)

        def clip_grad_by_norm(optimizer, clip_val):
            if self._step is None:
                return clip(optimizer, clip_val)
            with user_step.reusing_measured_norm(self._step.watch):
                return clip(optimizer, clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm
        self.recording.undo.append(lambda: setattr(plugin, "clip_grad_by_norm", own) if own is not None
                                   else vars(plugin).pop("clip_grad_by_norm", None))

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Ctrl-C: KILLED; anything else FAILED ("crashed"); what was recorded stays. NonFiniteStep ended the run itself."""
        if not isinstance(exception, NonFiniteStep):
            self._fail(exception)

    # ---- one step: the step watch's moments, at Lightning's hooks -------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        """A step begins with the first batch after an optimizer step; accumulated batches join it."""
        if not self._open:
            return
        called = time.perf_counter()
        rng_at_start = capture_raw()  # the batch's, and the step's where it is the step's first (one capture)
        packed = user_step.pack(batch, self.recording.state.device, rng_at_start)  # a copy of the batch, with it
        position = {"batch_idx": int(batch_idx), "takes_batch_idx": self._takes_batch_idx,
                    "accumulate": int(trainer.accumulate_grad_batches), "scheduler_step": _scheduler_steps(trainer, batch_idx)}
        step = self._step or self.recording.begin_step(called, rng_at_start)
        step.add(packed, position)
        step.watch.open_forward()

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
        if self._step is not None and optimizer is self.recording.state.optimizer:
            self._step.watch.updated()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """The loss Lightning logged for this batch (divided by accumulate_grad_batches) joins the step's sum;
        after the optimizer step the step is recorded."""
        step = self._step
        if step is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            step.loss = loss.detach().float() if step.loss is None else step.loss + loss.detach().float()
        if not step.stepped:
            return
        if step.loss is None:
            self.recording.end_step(math.nan)
        else:  # deferred: stays on the device, read with the step's other metrics at the flush
            self.recording.end_step(step.loss.clone() if step.watch.defer_reads else float(step.loss.item()))


def _start_recording(callback: ReplayCallback, trainer, pl_module) -> TrainerRecording:
    """The Trainer's run as a replay rebuilds it (its config and state), opened and recording; in a DDP job, rank 0
    records the run and the other ranks send it their steps."""
    from omegaconf import OmegaConf

    from replaybisect.core.loop import TrainState

    settings = _trainer_settings(trainer, pl_module)
    module, script, folder, name = _how_replayed(type(pl_module))
    user = {"module": module, "hparams": _hparams(pl_module), "trainer": settings}
    where = ranks.world()
    link = ranks.RankLink(*where) if where is not None else None
    precision = PRECISIONS[settings["precision"]]
    steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    cfg = replay_config(step_target=STEP_TARGET, build_target=None if script else BUILD_TARGET, config=user,
                        seed=torch.initial_seed(), precision=precision, snapshot_every=callback.snapshot_every,
                        layer_stats_every=callback.layer_stats_every, on_nonfinite=callback.on_nonfinite, steps=steps,
                        script=script, distributed=ranks.layout(where[1]) if where is not None else None)
    configs = trainer.lr_scheduler_configs
    state = TrainState(cfg=cfg, model=pl_module, optimizer=trainer.optimizers[0],
                       scheduler=configs[0].scheduler if configs else None,
                       scaler=getattr(trainer.precision_plugin, "scaler", None), loss_fn=None,
                       step_fn=lightning_step, device=pl_module.device, precision=precision, clip_grad_norm=None,
                       user_loop=True, user_config=OmegaConf.create(user),
                       ranks_agree=ranks.any_rank_failed(pl_module.device) if link is not None else None)

    def start(session):
        session.write_config(cfg)
        return session.start_recording(cfg, state, {"seed": int(cfg.seed)}, runs_steps=False)

    tags = {"replaybisect.loop": "user", "replaybisect.trainer": "lightning", **own_sources(type(pl_module))}
    session, hooks = run_of_this_rank(
        link, callback.tracking_uri, callback.on_nonfinite,
        lambda: open_session(callback.tracking_uri, callback.experiment, folder, tags,
                             callback.run_name or f"train {name} (lightning)"),
        start)
    ranked = RankedSteps(link, pl_module, callback.snapshot_every) if link is not None else None
    return TrainerRecording(session, cfg, state, hooks, (LIGHTNING_BATCHES, LIGHTNING_POSITIONS), ranked=ranked,
                            defer_reads=getattr(hooks, "defers_reads", False))


def _hand_over(trainer, pl_module) -> None:
    """A replay's re-entered script: the Trainer's module and optimizer are handed to the replay."""
    configs = trainer.lr_scheduler_configs
    parts = {"model": pl_module, "optimizer": trainer.optimizers[0], "scheduler": configs[0].scheduler if configs else None,
             "scaler": getattr(trainer.precision_plugin, "scaler", None), "step_fn": lightning_step}
    pl_module.trainer = None  # the replay runs the module's steps as a replay without a Trainer does
    reentry.hand_over(parts)


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


def _clip_follows_moment(trainer, pl_module, callback: ReplayCallback) -> bool:
    """Whether Lightning's own clip (its precision plugin's) follows this callback's on_before_optimizer_step (the
    gradients moment) with nothing of the user's in between: no later callback's on_before_optimizer_step, nor the
    module's own or its configure_gradient_clipping (any of them could change the gradients, through `.data` too,
    which no version counter sees)."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.model_helpers import is_overridden

    later = trainer.callbacks[trainer.callbacks.index(callback) + 1:]
    return type(trainer.precision_plugin).clip_grad_by_norm is Precision.clip_grad_by_norm and not (
                any(is_overridden("on_before_optimizer_step", other, Callback) for other in later)
                or is_overridden("on_before_optimizer_step", pl_module)
                or is_overridden("configure_gradient_clipping", pl_module))


def _takes_batch_idx(pl_module) -> bool:
    """Lightning passes batch_idx when training_step takes a second argument (loops/training_epoch_loop)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    return bool(is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2))
