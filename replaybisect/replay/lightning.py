"""A recorded Lightning run replayed without a Trainer (record/lightning.py records it): `build` makes the
LightningModule from its class and `hparams` and calls its `configure_optimizers`; `lightning_step` does one optimizer
step the way Lightning's automatic optimization does it numerically (training_step under the Trainer's precision,
backward, gradient clipping, optimizer and scheduler steps). Recorded runs name them `replaybisect.lightning.build`
and `replaybisect.lightning.lightning_step`. The module's class is your code: a replay imports it only from the
folder it runs in or a --code-dir."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional

import torch

from replaybisect.core import ranks
from replaybisect.core.user_step import LIGHTNING_BATCHES, LIGHTNING_POSITIONS, NO_LOSS

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


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
