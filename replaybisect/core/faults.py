"""A fault injector for testing `replay verify` (as Megatron-LM's RerunErrorInjector): one bit of a chosen tensor is
flipped at a chosen step, where the step's moments are (core/step_watch.py), whatever the recording path.

    REPLAYBISECT_INJECT_FAULT="step=12,what=loss,bit=3"              the loss's bit 3 at step 12 (its value as logged)
    REPLAYBISECT_INJECT_FAULT="step=12,what=grad,bit=20,device=gpu7"  a gradient's bit 20, only on device gpu7

`what`: loss (the value backpropagated and logged; the gradients are unchanged) or grad (the largest element of the
first parameter's gradient, before the gradient norm and the update: the run goes on from a corrupted update).
`device`: flip only while this process's device label (REPLAYBISECT_DEVICE_LABEL, else the host name) is this one: a
persistent fault of one device. Read when a run starts recording or replaying; unset, a step's only cost is one
check of a module global."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch

from replaybisect.errors import ConfigError

ENV = "REPLAYBISECT_INJECT_FAULT"
LABEL_ENV = "REPLAYBISECT_DEVICE_LABEL"
WHAT = ("loss", "grad")
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Fault:
    step: int
    what: str
    bit: int
    device: Optional[str] = None

    def applies(self, step: int, what: str) -> bool:
        return step == self.step and what == self.what and (self.device is None or self.device == device_label())


def device_label() -> str:
    """What tells this machine's device from another's in `replay verify`'s verdict: $REPLAYBISECT_DEVICE_LABEL, else
    the host name."""
    return os.environ.get(LABEL_ENV) or socket.gethostname()


def _parse(text: str) -> Fault:
    try:
        fields = dict(part.split("=", 1) for part in text.split(",") if part.strip())
        fault = Fault(int(fields["step"]), fields.get("what", "loss"), int(fields.get("bit", "0")), fields.get("device"))
    except (KeyError, ValueError):
        raise ConfigError(f"${ENV}={text!r} is not step=N[,what=loss|grad][,bit=B][,device=LABEL]") from None
    if fault.what not in WHAT or not 0 <= fault.bit < 64:
        raise ConfigError(f"${ENV}={text!r}: what is one of {', '.join(WHAT)}, bit is 0..63")
    return fault


_FAULT: Optional[Fault] = None  # what arm() read: the step's moments look at this global only


def arm() -> None:
    """Read the fault the environment asks for, as a run starts recording or replaying (RunSession.open,
    restore.restore): a test may set it between runs; the training step itself never reads the environment."""
    global _FAULT
    text = os.environ.get(ENV)
    _FAULT = _parse(text) if text else None


def flip(tensor: torch.Tensor, bit: int, largest: bool = False) -> None:
    """Flip one bit of the tensor's first element (its largest in magnitude with `largest`), in place."""
    with torch.no_grad():
        flat = tensor.detach().reshape(-1)
        index = int(flat.abs().argmax()) if largest else 0
        flat = flat[index:index + 1]
        ints = flat.view(INTS[flat.element_size()])
        ints.bitwise_xor_(torch.tensor(1 << (bit % (8 * flat.element_size())), dtype=ints.dtype).to(ints.device))


def at_loss(step: int, loss: torch.Tensor) -> None:
    fault = _FAULT
    if fault is not None and fault.applies(step, "loss"):
        flip(loss, fault.bit)


def at_gradients(step: int, params) -> None:
    fault = _FAULT
    if fault is not None and fault.applies(step, "grad"):
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            flip(grads[0], fault.bit, largest=True)  # (an element that is 0 would barely change)
