"""The device a run trains on, checked to exist on this machine (config validation and replay both ask)."""

from __future__ import annotations

import torch

from replaybisect.errors import ConfigError

DEVICE_TYPES = ("cpu", "cuda", "mps")  # what a run trains and replays on (meta, xla, ... hold no numbers to replay)


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """The device `name` names, checked to exist here: auto | cpu | cuda | cuda:N | mps. `option` is how the
    user gave it (train.device=..., --device ...), for the one-line error."""
    given = f"{option}={name!r}" if option.startswith("train.") else f"{option} {name!r}"
    if not isinstance(name, str):
        raise ConfigError(f"{given} is not a device name; use auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ConfigError(f"{given[:120]} is not a device to train on; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{given} but CUDA is not available here; use cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{given} but this machine has {count} CUDA device{'' if count == 1 else 's'} "
                              f"(cuda:0{'' if count == 1 else f'..cuda:{count - 1}'})")
    if device.type == "mps" and not (torch.backends.mps.is_built() and torch.backends.mps.is_available()):
        raise ConfigError(f"{given} but MPS (Apple's GPU) is not available here; use cpu")
    return device
