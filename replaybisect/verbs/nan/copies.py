"""Running the failing step on copies: the live state and every RNG stream are left as they were, so each
probe (and the plain step) starts from the same state; a state's fingerprint proves it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional


def fingerprint(state) -> str:
    """sha256 over every tensor a step depends on (bytes, so NaN payloads count too)."""
    import torch

    from replaybisect.core.state import live_tensors

    digest = hashlib.sha256()
    for name, tensor in sorted(live_tensors(state).items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- probing the failing step ------------------------------------------------------------------------------
@dataclass
class StepResults:
    plain: Any  # StepOutcome of the plain step
    batch: list
    state: list
    probe: Any  # StepProbeResult
    anomaly: Any  # AnomalyFinding
    isolation: dict
    isolation_warning: Optional[str] = None  # why the isolation check failed, where that is known (isolation_warning)


def calls_differ(state, step: int) -> Optional[tuple[int, int]]:
    """A loop recorded as written: (training calls made, recorded) of the first replay of `step` whose iteration made
    another number than the recording (core/inline_step.RemoteStep.calls_differ); None: none did, or no such loop."""
    from replaybisect.core.inline_step import RemoteStep

    return state.step_fn.calls_differ.get(step) if isinstance(state.step_fn, RemoteStep) else None


def isolation_warning(isolation: dict, state, step: int, plain_calls: Optional[tuple[int, int]] = None) -> Optional[str]:
    """What a report says of its replays of the failing step: where the plain replay's iteration (`plain_calls`, taken
    after it) made another number of training calls than the recording, that it ran another step; where the
    probes' isolation check failed, that a later repeat did, or else the check's values."""
    from replaybisect.core.inline_step import CALLS_DECIDED

    calls, which = plain_calls, "the replay"
    if calls is None:
        if all(isolation.values()):
            return None
        calls, which = calls_differ(state, step), "a repeat"
    if calls is None:
        return f"probe isolation check failed: {isolation} (please report this)"
    consequence = ("the replay ran another step, and what it found may be that step's (a replay from the run's first "
                   "snapshot runs the loop as recorded)" if plain_calls is not None else
                   "only the first replay of the step is the recorded one, and what the probes after it found may be another step's")
    return (f"{which} of step {step} made {calls[0]} training calls of the model where the recording made {calls[1]}: "
            f"{CALLS_DECIDED}, so {consequence}")


def on_copy(state, rng_at_step, function):
    """Run `function(copy)` on a deep copy of the state with the step's RNG streams, leaving both untouched."""
    from replaybisect.core import loop
    from replaybisect.core.rng import isolated_rng, restore_raw

    with isolated_rng(), loop.state_copy(state) as copy:
        restore_raw(rng_at_step)
        return function(copy)


def plain_run(step, batch):
    """A function of a state copy: the plain step on it -> (outcome, bit signature of loss, grad norm, state, RNG)."""
    from replaybisect.core import loop
    from replaybisect.core.rng import capture_raw, to_json

    def run(copy):
        outcome = loop.run_step(copy, step, batch, halt_on_nonfinite=True)
        return outcome, (bits(outcome.loss), bits(outcome.grad_norm), fingerprint(copy), str(to_json(capture_raw())))

    return run


def bits(value) -> Optional[str]:
    import struct

    return None if value is None else struct.pack("<d", value).hex()
