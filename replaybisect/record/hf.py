"""Record a Hugging Face `Trainer` run so `replay nan`, `replay ablate` and `replay check --run-id` can replay it.

    from replaybisect.hf import ReplayCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ReplayCallback()])
    trainer.train()

The run is a user-loop run (`train.loop: user`, see record/recorder.py): metrics every optimizer step, snapshots
with the batches, and a config a replay rebuilds from. When the Trainer's own `MLflowCallback` is active, the record
goes into the run it opened (one run); its metrics, averaged over `logging_steps` and with non-finite losses
filtered out, are kept there under `trainer/` (`trainer/loss`), beside the exact per-step `loss`.

A replay needs no Trainer (replay/hf.py builds the model, optimizer and schedule as the Trainer made them, and
repeats its step numerically). The step's bookkeeping is record/trainer_steps.py's, shared with the Lightning
callback; this file adapts it to the Trainer's calls and records the Trainer's settings.

A non-finite loss or gradient stops training before the update: `trainer.train()` raises NonFiniteStep, the run
ends FAILED and its last snapshot is the state before the failing step.
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback

from replaybisect.core import guard, reentry, user_step
from replaybisect.errors import ConfigError
from replaybisect.record.recorder import _watch_unclosed, function_target, one_line_failures, open_session, own_sources, replay_config
from replaybisect.record.trainer_steps import RecordingCallback, TrainerRecording
from replaybisect.replay.hf import HF_BATCHES, HF_POSITIONS, _model_config, hf_step
from replaybisect.store import end_fluent_run

STEP_TARGET = "replaybisect.hf.hf_step"
BUILD_TARGET = "replaybisect.hf.build"
METRIC_PREFIX = "trainer/"


# ---- recording: what the Trainer runs, as the config a replay needs ---------------------------------------
def _the_trainer() -> Trainer:
    """The Trainer whose callback this is: callbacks are handed no Trainer, so it is the `self` of the caller that
    runs the training loop."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise ConfigError("ReplayCallback records a transformers.Trainer's training; call trainer.train() with it in callbacks")


def _trainer_settings(trainer: Trainer, model) -> dict[str, Any]:
    """What the replay repeats; a setup it cannot repeat is a one-line ConfigError before anything is recorded."""
    args = trainer.args
    if args.world_size > 1 or args.n_gpu > 1:
        raise ConfigError(f"ReplayCallback records a Trainer on one process and one device; this one trains on "
                          f"{max(args.world_size, args.n_gpu)} (run it on one device to record it)")
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ConfigError(f"ReplayCallback cannot record a Trainer with {'DeepSpeed' if trainer.is_deepspeed_enabled else 'FSDP'}: "
                          "a replay runs the step on one process without it; record the run without the plugin")
    for method in ("training_step", "compute_loss"):
        if getattr(type(trainer), method) is not getattr(Trainer, method):
            raise ConfigError(f"{type(trainer).__name__} overrides Trainer.{method}, which a replay does not run (it repeats "
                              f"the Trainer's own step); record the run with the Trainer's {method}")
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        raise ConfigError("ReplayCallback records the loss the model returns; this Trainer computes its own "
                          "(compute_loss_func or label_smoothing_factor), which a replay does not repeat")
    if str(args.lr_scheduler_type).rsplit(".", 1)[-1].lower() in ("reduce_lr_on_plateau", "greedy"):
        raise ConfigError(f"ReplayCallback records schedules that follow the step count; {args.lr_scheduler_type} "
                          "follows evaluation metrics")
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return {"precision": precision, "device": str(next(model.parameters()).device),
            "max_grad_norm": float(args.max_grad_norm or 0.0), "accumulate": int(args.gradient_accumulation_steps)}


def _model_target(model) -> tuple[dict, Any, str]:
    """(user.model, the code folder, a name for the run): the model's class as a replay imports it."""
    target, folder = function_target(type(model), "the model's class")
    return {"_target_": _public_path(type(model), target), "_partial_": True}, folder, type(model).__name__


def _public_path(cls: type, target: str) -> str:
    """A transformers class by its public name (`transformers.GPT2LMHeadModel`), which the trust check accepts."""
    import transformers

    if target.startswith("transformers.") and getattr(transformers, cls.__name__, None) is cls:
        return f"transformers.{cls.__name__}"
    return target


def _optimizer_record(optimizer: torch.optim.Optimizer, model) -> dict:
    """The optimizer's class and its parameter groups by parameter name, each group's settings as at the start
    (its base lr, before the schedule's first factor)."""
    names = {id(param): name for name, param in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        settings = {key: _plain(value) for key, value in group.items() if key not in ("params", "initial_lr")}
        settings["lr"] = float(group.get("initial_lr", group["lr"]))
        groups.append({"params": [names[id(param)] for param in group["params"]], "settings": settings})
    cls = type(optimizer)
    return {"class": {"_target_": f"{cls.__module__}.{cls.__qualname__}", "_partial_": True}, "groups": groups}


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def _scheduler_record(trainer: Trainer) -> dict:
    args = trainer.args
    steps = int(trainer.state.max_steps)
    return {"name": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "warmup_steps": int(args.get_warmup_steps(steps)), "training_steps": steps,
            "kwargs": dict(args.lr_scheduler_kwargs or {})}


def _mlflow_run(trainer: Trainer) -> Optional[tuple[str, str, Any]]:
    """(run id, tracking URI, the callback) of the run the Trainer's MLflowCallback opened, when it is active."""
    callback = next((cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "MLflowCallback"), None)
    if callback is None or not getattr(callback, "_initialized", False):
        return None
    from replaybisect.store import active_fluent_run

    active = active_fluent_run()
    return (*active, callback) if active is not None else None


class _PrefixedMetrics:
    """The Trainer's MLflowCallback's view of mlflow, its metrics logged under `trainer/`: the run's own `loss`,
    `grad_norm` and `learning_rate` are the recorder's exact per-step values."""

    def __init__(self, mlflow_module):
        self._mlflow = mlflow_module

    def __getattr__(self, name: str):
        return getattr(self._mlflow, name)

    def log_metrics(self, metrics, *args, **kwargs):
        return self._mlflow.log_metrics({METRIC_PREFIX + key: value for key, value in metrics.items()}, *args, **kwargs)


class ReplayCallback(RecordingCallback, TrainerCallback):
    """Records the Trainer's run to MLflow so it can be replayed bit for bit (`replay nan --run-id ...`); its
    arguments are RecordingCallback's (record/trainer_steps.py). tracking_uri is the store when the Trainer logs to
    no MLflow run of its own."""

    # ---- the run ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if reentry.replaying():
            raise ConfigError("a replay of a Trainer run needs no Trainer: run `replay nan --run-id ...` on the recorded run")
        one_line_failures()  # a refusal below, or the NonFiniteStep later, ends the script with its one line
        self._trainer = _the_trainer()
        self.recording = _start_recording(self, self._trainer, model)
        self._watch(self._trainer, model, self.recording.state.optimizer)
        _watch_unclosed(self)  # a train() that an exception ends: the run FAILED at exit, not left RUNNING

    def _watch(self, trainer: Trainer, model, torch_optimizer) -> None:
        """The step's moments at the Trainer's own calls: the model's training calls (each accumulated batch), the
        accelerator's backward (the loss as backpropagated) and clip (the gradients before any clip), the update."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        accelerator = trainer.accelerator
        backward, clip = accelerator.backward, accelerator.clip_grad_norm_

        def watched_backward(loss, **kwargs):
            self._backward(loss)
            result = backward(loss, **kwargs)
            if self._step is not None:
                self._step.watch.backward_done()
            return result

        def watched_clip(parameters, max_norm, *args, **kwargs):
            if self._step is not None:
                self._step.watch.gradients()  # once per step: before the Trainer's clip (or its norm at max_norm inf)
                if not guard.scaler_enabled(self.recording.state.scaler):  # (accelerate unscales inside its clip)
                    with user_step.reusing_measured_norm(self._step.watch):  # the norm not taken twice
                        return clip(parameters, max_norm, *args, **kwargs)
            return clip(parameters, max_norm, *args, **kwargs)

        accelerator.backward, accelerator.clip_grad_norm_ = watched_backward, watched_clip
        hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                 model.register_forward_hook(self._after_forward),
                 register_optimizer_step_post_hook(lambda opt, *_: self._step.watch.updated()
                                                   if self._step is not None and opt is torch_optimizer else None)]
        self.recording.undo += [hook.remove for hook in hooks]
        self.recording.undo.append(lambda: (vars(accelerator).pop("backward", None), vars(accelerator).pop("clip_grad_norm_", None)))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    # ---- one step --------------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        """An optimizer step begins (the Trainer calls this before its first accumulated batch)."""
        if self._open:
            self.recording.begin_step(time.perf_counter())

    def _before_forward(self, model, args, kwargs):
        """A training call of the model: one accumulated batch, its keyword arguments and the RNG state it starts with."""
        step = self._step
        if step is None or not model.training or not torch.is_grad_enabled():
            return None
        if args:
            self._fail_now(ConfigError("the model was called with positional arguments; the Trainer calls it with keywords "
                                       "(model(**inputs)), which is what ReplayCallback records"))
        step.add(user_step.pack(dict(kwargs), self.recording.state.device), {"divisor": 1})
        step.watch.open_forward()
        return None

    def _after_forward(self, model, args, output):
        if self._step is not None and model.training and torch.is_grad_enabled():
            self._step.loss = output["loss"] if isinstance(output, dict) else output[0]  # the model's, as returned

    def _backward(self, loss: torch.Tensor) -> None:
        """The loss the Trainer backpropagates: the model's, or divided by the accumulation steps."""
        step = self._step
        if step is None or not step.positions:
            return
        step.positions[-1]["divisor"] = _divisor(self._trainer, loss, step.loss, step.batches[-1], self._fail_now)
        step.loss = None
        step.watch.loss(loss)

    def on_step_end(self, args, state, control, **kwargs):
        """After the update and the scheduler: the step is recorded."""
        if self._step is not None:
            self.recording.end_step(self._step.watch.loss_so_far())

    def _fail_now(self, error: BaseException) -> None:
        self._fail(error)
        raise error


def _start_recording(callback: ReplayCallback, trainer: Trainer, model) -> TrainerRecording:
    """The Trainer's run as a replay rebuilds it (its config and state), opened (the MLflowCallback's run when it
    opened one) and recording."""
    from omegaconf import OmegaConf

    from replaybisect.core.loop import TrainState

    settings = _trainer_settings(trainer, model)
    torch_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper's
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    model_target, folder, name = _model_target(model)
    user = {"model": model_target, "model_config": _model_config(OmegaConf.create(model.config.to_dict())),
            "optimizer": _optimizer_record(torch_optimizer, model), "scheduler": _scheduler_record(trainer),
            "trainer": settings}
    cfg = replay_config(step_target=STEP_TARGET, build_target=BUILD_TARGET, config=user, seed=torch.initial_seed(),
                        precision=settings["precision"], snapshot_every=callback.snapshot_every,
                        layer_stats_every=callback.layer_stats_every, on_nonfinite=callback.on_nonfinite,
                        steps=int(trainer.state.max_steps) or None)
    state = TrainState(cfg=cfg, model=model, optimizer=torch_optimizer, scheduler=scheduler,
                       scaler=getattr(trainer.accelerator, "scaler", None), loss_fn=None, step_fn=hf_step,
                       device=next(model.parameters()).device, precision=settings["precision"],
                       clip_grad_norm=None, user_loop=True, user_config=OmegaConf.create(user))
    tags = {"replaybisect.loop": "user", "replaybisect.trainer": "transformers", **own_sources(type(model))}
    session, undo = _open_run(callback, trainer, folder, tags, name)
    with session.failure_ends_run():
        session.write_config(cfg)
        hooks = session.start_recording(cfg, state, {"seed": int(cfg.seed)}, runs_steps=False)
    recording = TrainerRecording(session, cfg, state, hooks, (HF_BATCHES, HF_POSITIONS),
                                 ended=lambda status: end_fluent_run(session.run_id, status))
    recording.undo += undo
    return recording


def _open_run(callback: ReplayCallback, trainer: Trainer, folder, tags: dict, name: str):
    """(session, what to undo at the end): the MLflowCallback's run when it opened one (its metrics moved under
    trainer/), else a run of our own."""
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    opened = _mlflow_run(trainer)
    if opened is None:
        return open_session(callback.tracking_uri, callback.experiment, folder, tags,
                            callback.run_name or f"train {name} (transformers)"), []
    run_id, uri, mlflow_callback = opened
    original = mlflow_callback._ml_flow
    mlflow_callback._ml_flow = _PrefixedMetrics(original)
    session = RunSession.attach(open_store(uri), run_id, code_folder=folder, tags=tags)
    print(f"replaybisect: recording into the Trainer's MLflow run {run_id} at {session.store.uri}", file=sys.stderr)
    one_line_failures()
    return session, [lambda: setattr(mlflow_callback, "_ml_flow", original)]


def _divisor(trainer: Trainer, backpropagated: torch.Tensor, returned: Optional[torch.Tensor], inputs: dict, fail) -> int:
    """What the Trainer divided the model's loss by before its backward: told by the values, and where a non-finite
    loss cannot tell, by the Trainer's own rule (training_step: `loss_is_scaled_for_ga`)."""
    divides = trainer.current_gradient_accumulation_steps
    if returned is not None and bool(torch.isfinite(returned).all()):
        if backpropagated is returned or torch.equal(backpropagated, returned):
            return 1
        if torch.equal(backpropagated, returned / divides):
            return int(divides)
        fail(ConfigError("the Trainer changed the model's loss before its backward in a way ReplayCallback cannot "
                         "repeat (not the model's loss, nor it divided by gradient_accumulation_steps)"))
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = bool(trainer.model_accepts_loss_kwargs and inputs.get("num_items_in_batch") is not None)
    return 1 if scaled else int(divides)
