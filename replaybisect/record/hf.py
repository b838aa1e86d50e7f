"""Record a Hugging Face `Trainer` run so `replay nan`, `replay ablate` and `replay check --run-id` can replay it.

    from replaybisect.hf import ReplayCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ReplayCallback()])
    trainer.train()

The run is a user-loop run (`train.loop: user`, see record/recorder.py): metrics every optimizer step, snapshots
with the batches, and a config a replay rebuilds from. When the Trainer's own `MLflowCallback` is active, the record
goes into the run it opened (one run); its metrics, averaged over `logging_steps` and with non-finite losses
filtered out, are kept there under `trainer/` (`trainer/loss`), beside the exact per-step `loss`.

A replay needs no Trainer. `build` makes the model from its class (a `transformers` model class or your own, trusted
like any `_target_`) and its config, the optimizer over the same parameter groups as the Trainer made them, and the
schedule with `transformers.get_scheduler` as the Trainer called it. `hf_step` does one optimizer step as
`Trainer.training_step` and its loop do it numerically: each accumulated batch (the keyword arguments the model was
called with, `num_items_in_batch` included) under the mixed precision's autocast, the loss divided as the Trainer
divided it, backward (scaled for fp16), the clip at `max_grad_norm`, the optimizer and scheduler steps.

A non-finite loss or gradient stops training before the update: `trainer.train()` raises NonFiniteStep, the run
ends FAILED and its last snapshot is the state before the failing step.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback

from replaybisect.core import reentry
from replaybisect.core.config import OnNonfinite
from replaybisect.core.step_watch import StepOutcome, StepWatch
from replaybisect.errors import ConfigError
from replaybisect.store import end_fluent_run
from replaybisect.record.recorder import (_checked_arguments, _watch_unclosed, function_target, loop_data_started, nonfinite_step,
                                          one_line_failures, open_session, own_sources, replay_config)

STEP_TARGET = "replaybisect.hf.hf_step"
BUILD_TARGET = "replaybisect.hf.build"
HF_BATCHES, HF_POSITIONS = "hf_batches", "hf_positions"  # a step's record: the model's keyword arguments per batch
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = ("eager", "sdpa", None)  # implementations a replay builds (others load kernels from the Hub)
METRIC_PREFIX = "trainer/"


# ---- replay: the objects and the step, without a Trainer ----------------------------------------------------
def build(config) -> dict[str, Any]:
    """The model from its class and config on the recorded device, the optimizer over the recorded parameter
    groups, the Trainer's schedule, and fp16's GradScaler."""
    from omegaconf import OmegaConf
    from transformers import get_scheduler

    from replaybisect.core.config import instantiate

    model_class = instantiate(config.model, "the model")
    model_class = getattr(model_class, "func", model_class)  # a partial of the class
    model_config = model_class.config_class.from_dict(_model_config(config.model_config))
    device = torch.device(config.trainer.device)
    model = model_class(model_config).to(device)
    named = dict(model.named_parameters())
    optimizer_class = getattr(instantiate(config.optimizer["class"], "the optimizer"), "func", None)
    groups = [{**OmegaConf.to_container(group.settings), "params": [named[name] for name in group.params]}
              for group in config.optimizer.groups]
    optimizer = optimizer_class(groups)
    schedule = config.scheduler
    scheduler = get_scheduler(schedule.name, optimizer, num_warmup_steps=schedule.warmup_steps,
                              num_training_steps=schedule.training_steps,
                              scheduler_specific_kwargs=OmegaConf.to_container(schedule.kwargs) if schedule.kwargs else None)
    scaler = torch.amp.GradScaler(device.type) if config.trainer.precision == "fp16" else None
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}


def _model_config(stored) -> dict:
    """The model's config as plain data, with attention implementations this replay builds itself (at any depth:
    a composite model's sub-configs name their own)."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(stored, resolve=True)
    _check_attention(values)
    return values


def _check_attention(node) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("attn_implementation", "_attn_implementation") and value not in ATTENTION:
                raise ConfigError(f"the model's config asks for attention {value!r}; a replay builds eager or sdpa attention "
                                  "only (others load code from the Hub)")
            _check_attention(value)
    elif isinstance(node, list):
        for value in node:
            _check_attention(value)


def hf_step(model, optimizer, scheduler, scaler, batch, config):
    """One optimizer step of the Trainer: each accumulated batch through the model under the precision's autocast,
    its loss divided as the Trainer divided it, backward; then the clip at max_grad_norm, the update, and the
    scheduler unless fp16 skipped the update.
    Returns the sum of the backpropagated losses, which is what the Trainer adds up for its logged loss."""
    from replaybisect.core.rng import restore_stored

    settings = config.trainer
    device = torch.device(settings.device)
    dtype = AUTOCAST.get(settings.precision)
    total = None
    for inputs, position in zip(batch[HF_BATCHES], batch[HF_POSITIONS]):
        if position["rng"] is not None:  # a later accumulated batch: the RNG state it started with
            restore_stored(position["rng"], device)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if position["divisor"] != 1:
            loss = loss / position["divisor"]
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if settings.max_grad_norm > 0:  # (the recorder sees the gradients as this clip starts, as it did in the Trainer)
        # model.parameters(), as the Trainer passes them: the total norm sums the parameters' norms in this order
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    skipped = False
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
    else:
        optimizer.step()
    if scheduler is not None and not skipped:
        scheduler.step()
    return total


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


class ReplayCallback(TrainerCallback):
    """Records the Trainer's run to MLflow so it can be replayed bit for bit (`replay nan --run-id ...`).

    tracking_uri: the store when the Trainer logs to no MLflow run of its own (default: $MLFLOW_TRACKING_URI, else
    ./mlflow.db). snapshot_every: a snapshot (model, optimizer, scheduler, scaler, RNG) every N optimizer steps, with
    every batch in between. layer_stats_every: per-layer statistics every N steps. on_nonfinite: "stop"
    (trainer.train raises NonFiniteStep) or "continue".
    """

    def __init__(self, *, tracking_uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 snapshot_every: int = 100, layer_stats_every: int = 50, on_nonfinite: OnNonfinite = "stop"):
        _checked_arguments(tracking_uri, experiment, run_name, None, snapshot_every, layer_stats_every, None, on_nonfinite)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.snapshot_every, self.layer_stats_every, self.on_nonfinite = snapshot_every, layer_stats_every, on_nonfinite
        self.run_id: Optional[str] = None
        self.steps_taken = 0
        self.first_nonfinite_step: Optional[int] = None
        self._session = None
        self._step: Optional[_StepInProgress] = None
        self._undo: list = []  # what on_train_begin installed, undone at the end

    # ---- the run ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        from omegaconf import OmegaConf

        from replaybisect.core.loop import BufferGuard, TrainState

        if reentry.replaying():
            raise ConfigError("a replay of a Trainer run needs no Trainer: run `replay nan --run-id ...` on the recorded run")
        one_line_failures()  # a refusal below, or the NonFiniteStep later, ends the script with its one line
        trainer = _the_trainer()
        settings = _trainer_settings(trainer, model)
        torch_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper's
        scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
        model_target, folder, name = _model_target(model)
        user = {"model": model_target, "model_config": _model_config(OmegaConf.create(model.config.to_dict())),
                "optimizer": _optimizer_record(torch_optimizer, model), "scheduler": _scheduler_record(trainer),
                "trainer": settings}
        self.cfg = replay_config(step_target=STEP_TARGET, build_target=BUILD_TARGET, config=user, seed=torch.initial_seed(),
                                 precision=settings["precision"], snapshot_every=self.snapshot_every,
                                 layer_stats_every=self.layer_stats_every, on_nonfinite=self.on_nonfinite,
                                 steps=int(trainer.state.max_steps) or None)
        self.state = TrainState(cfg=self.cfg, model=model, optimizer=torch_optimizer, scheduler=scheduler,
                                scaler=getattr(trainer.accelerator, "scaler", None), loss_fn=None, step_fn=hf_step,
                                device=next(model.parameters()).device, precision=settings["precision"],
                                clip_grad_norm=None, user_loop=True, user_config=OmegaConf.create(user))
        self._buffers = BufferGuard(model)
        self.steps_taken, self.first_nonfinite_step, self._last_step_end = 0, None, None
        tags = {"replaybisect.loop": "user", "replaybisect.trainer": "transformers", **own_sources(type(model))}
        self._session = self._open_run(trainer, folder, tags, name)
        self.run_id = self._session.run_id
        with self._session.failure_ends_run():
            self._session.write_config(self.cfg)
            self._hooks = self._session.start_recording(self.cfg, self.state, {"seed": int(self.cfg.seed)}, runs_steps=False)
        self._trainer = trainer
        self._watch(trainer, model, torch_optimizer)
        _watch_unclosed(self)  # a train() that an exception ends: the run FAILED at exit, not left RUNNING

    def _open_run(self, trainer: Trainer, folder, tags: dict, name: str):
        """The MLflowCallback's run when it opened one (its metrics moved under trainer/), else a run of our own."""
        from replaybisect.record.session import RunSession
        from replaybisect.store import open_store

        opened = _mlflow_run(trainer)
        if opened is None:
            return open_session(self.tracking_uri, self.experiment, folder, tags, self.run_name or f"train {name} (transformers)")
        run_id, uri, callback = opened
        original = callback._ml_flow
        callback._ml_flow = _PrefixedMetrics(original)
        self._undo.append(lambda: setattr(callback, "_ml_flow", original))
        session = RunSession.attach(open_store(uri), run_id, code_folder=folder, tags=tags)
        print(f"replaybisect: recording into the Trainer's MLflow run {run_id} at {session.store.uri}", file=sys.stderr)
        one_line_failures()
        return session

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
            return clip(parameters, max_norm, *args, **kwargs)

        accelerator.backward, accelerator.clip_grad_norm_ = watched_backward, watched_clip
        hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                 model.register_forward_hook(self._after_forward),
                 register_optimizer_step_post_hook(lambda opt, *_: self._step.watch.updated()
                                                   if self._step is not None and opt is torch_optimizer else None)]
        self._undo += [hook.remove for hook in hooks]
        self._undo.append(lambda: (vars(accelerator).pop("backward", None), vars(accelerator).pop("clip_grad_norm_", None)))

    @property
    def _open(self) -> bool:
        return self._session is not None and not self._session.ended

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Every pending write done, the run FINISHED (or FAILED after a non-finite step)."""
        if self._open:
            self._unwatch()
            self._session.finish()

    def _fail(self, error: BaseException) -> None:
        """An exception ended train() (Ctrl-C: KILLED, else FAILED); what was recorded stays."""
        if self._open:
            self._unwatch()
            self._session.fail(error)
            end_fluent_run(self.run_id, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")

    def _unwatch(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self._step is not None:
            self._step.watch.close_forward()
            self._step = None

    # ---- one step --------------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        """An optimizer step begins (the Trainer calls this before its first accumulated batch)."""
        from replaybisect.core import loop

        if not self._open:
            return
        step = self.steps_taken
        called = time.perf_counter()
        loop.open_step(step, self.state, self._hooks, self._buffers)
        outcome = StepOutcome(step=step, loss=math.nan, lr=float(self.state.optimizer.param_groups[0]["lr"]))
        watch = StepWatch(self.state, outcome, self._hooks.observer(step), on_fault=self._nonfinite)
        now = time.perf_counter()
        self._step = _StepInProgress(watch=watch, started=now, data_started=loop_data_started(self._last_step_end, called, now))

    def _before_forward(self, model, args, kwargs):
        """A training call of the model: one accumulated batch, its keyword arguments and the RNG state it starts with."""
        from replaybisect.core import user_step

        step = self._step
        if step is None or not model.training or not torch.is_grad_enabled():
            return None
        if args:
            self._fail_now(ConfigError("the model was called with positional arguments; the Trainer calls it with keywords "
                                       "(model(**inputs)), which is what ReplayCallback records"))
        packed = user_step.pack(dict(kwargs), self.state.device)
        if step.rng is None:
            step.rng = packed[user_step.RECORD_RNG]
        step.batches.append(packed[user_step.RECORD_BATCH])
        step.positions.append({"rng": packed[user_step.RECORD_RNG] if len(step.batches) > 1 else None, "divisor": 1})
        step.watch.open_forward()
        return None

    def _after_forward(self, model, args, output):
        if self._step is not None and model.training and torch.is_grad_enabled():
            loss = output["loss"] if isinstance(output, dict) else output[0]
            self._step.forward_loss = loss

    def _backward(self, loss: torch.Tensor) -> None:
        """The loss the Trainer backpropagates: the model's, or divided by the accumulation steps."""
        step = self._step
        if step is None or not step.positions:
            return
        step.positions[-1]["divisor"] = self._divisor(loss, step.forward_loss, step.batches[-1])
        step.forward_loss = None
        step.watch.loss(loss)

    def _divisor(self, backpropagated: torch.Tensor, returned: Optional[torch.Tensor], inputs: dict) -> int:
        """What the Trainer divided the model's loss by before its backward: told by the values, and where a
        non-finite loss cannot tell, by the Trainer's own rule (training_step: `loss_is_scaled_for_ga`)."""
        trainer = self._trainer
        divides = trainer.current_gradient_accumulation_steps
        if returned is not None and bool(torch.isfinite(returned).all()):
            if backpropagated is returned or torch.equal(backpropagated, returned):
                return 1
            if torch.equal(backpropagated, returned / divides):
                return int(divides)
            self._fail_now(ConfigError("the Trainer changed the model's loss before its backward in a way ReplayCallback "
                                       "cannot repeat (not the model's loss, nor it divided by gradient_accumulation_steps)"))
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = bool(trainer.model_accepts_loss_kwargs and inputs.get("num_items_in_batch") is not None)
        return 1 if scaled else int(divides)

    def on_step_end(self, args, state, control, **kwargs):
        """After the update and the scheduler: the step is recorded."""
        step, self._step = self._step, None
        if step is None:
            return
        outcome = step.watch.outcome
        outcome.loss = step.watch.loss_so_far()
        step.watch.settle()
        ended = time.perf_counter()
        self._hooks.after_step(outcome, step.record(), ended - step.started, step.started - step.data_started)
        self.steps_taken = outcome.step + 1
        self._last_step_end = time.perf_counter()  # after the recorder's own flush of the step

    def _nonfinite(self) -> None:
        """The step watch's fault: the state is still the one before this step. Stop: record it, end the run FAILED
        and raise; continue: go on as the Trainer goes on."""
        step = self._step
        outcome = step.watch.outcome
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = outcome.step
        if self._buffers.ask_as_before_step(lambda: self._hooks.on_nonfinite(outcome, step.record())):
            return
        self._step = None
        step.watch.close_forward()
        self._hooks.after_step(outcome, step.record(), time.perf_counter() - step.started, 0.0)
        self._unwatch()
        self._session.finish()
        end_fluent_run(self.run_id, "FAILED")
        raise nonfinite_step(outcome, self.run_id)

    def _fail_now(self, error: BaseException) -> None:
        self._fail(error)
        raise error


@dataclass
class _StepInProgress:
    """The optimizer step the Trainer is in: its accumulated batches and their positions, the RNG state it started
    with, its watch."""

    watch: StepWatch
    started: float
    data_started: float
    batches: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    rng: Optional[dict] = None
    forward_loss: Optional[torch.Tensor] = None

    def record(self) -> dict:
        from replaybisect.core import user_step

        return {user_step.RECORD_BATCH: {HF_BATCHES: list(self.batches), HF_POSITIONS: list(self.positions)},
                user_step.RECORD_RNG: self.rng}
