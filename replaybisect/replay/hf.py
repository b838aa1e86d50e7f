"""A recorded Hugging Face Trainer run replayed without a Trainer (record/hf.py records it). `build` makes the model
from its class (a `transformers` model class or your own, trusted like any `_target_`) and its config, the optimizer
over the same parameter groups as the Trainer made them, and the schedule with `transformers.get_scheduler` as the
Trainer called it. `hf_step` does one optimizer step as `Trainer.training_step` and its loop do it numerically: each
accumulated batch (the keyword arguments the model was called with, `num_items_in_batch` included) under the mixed
precision's autocast, the loss divided as the Trainer divided it, backward (scaled for fp16), the clip at
`max_grad_norm`, the optimizer and scheduler steps. Recorded runs name them `replaybisect.hf.build` and
`replaybisect.hf.hf_step`."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from replaybisect.errors import ConfigError

HF_BATCHES, HF_POSITIONS = "hf_batches", "hf_positions"  # a step's record: the model's keyword arguments per batch
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = ("eager", "sdpa", None)  # implementations a replay builds (others load kernels from the Hub)


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
