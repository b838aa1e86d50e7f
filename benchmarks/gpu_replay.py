"""Replay on a GPU: record the state before step S (through the snapshot format: safetensors + JSON, CUDA RNG
included), train S..S+K, restore into a freshly built state and replay S..S+K; compare losses bit for bit.

Runs the built-in char transformer (dropout 0.1, so the CUDA RNG stream matters) in fp32, bf16 and fp16.
Core modules only (no MLflow): `python benchmarks/gpu_replay.py` on a machine with CUDA.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from replaybisect.core import config as config_mod
from replaybisect.core import loop, rng, snapshot
from replaybisect.core.state import apply, live_tensors, state_json

START, STEPS = 20, 30


def train_steps(state, source, start, stop, recording: bool = False):
    """`recording`: as a recorded step runs (its reads deferred: one guard read, the loss and norm read later)."""
    losses, norms = [], []
    for step in range(start, stop):
        outcome = loop.run_step(state, step, loop.to_device(source.batch(step), state.device), defer_reads=recording)
        losses.append(outcome.loss)
        norms.append(outcome.grad_norm)
    return losses, norms


def check(precision: str, deterministic: bool) -> dict:
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    cfg = config_mod.compose(None, "config", ["+experiment=char", f"train.precision={precision}", "train.device=cuda"])
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    train_steps(state, source, 0, START)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder) / snapshot.folder_name(START)
        folder.mkdir()
        saved = state_json(state, START, rng.capture_raw(), {"seed": cfg.seed, "step": START}, "periodic")
        files = {
            snapshot.TENSORS: snapshot.write_tensors_atomic(folder / snapshot.TENSORS, {k: v.detach().cpu() for k, v in live_tensors(state).items()}),
            snapshot.STATE: snapshot.write_atomic(folder / snapshot.STATE, snapshot.encode_json(saved)),
        }
        snapshot.write_manifest(folder, START, files)
        original, original_norms = train_steps(state, source, START, START + STEPS, recording=True)
        loaded = snapshot.load(folder)
    restored = loop.build_state(cfg)
    apply(restored, {k: v.to(restored.device) for k, v in loaded.tensors.items()}, loaded.state)
    replayed, replayed_norms = train_steps(restored, source, START, START + STEPS)
    mismatches = sum(a != b for a, b in zip(original, replayed))
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(original, replayed))
    worst_norm = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(original_norms, replayed_norms))
    return {"precision": precision, "deterministic_algorithms": deterministic, "steps": STEPS,
            "loss_mismatches": mismatches, "max_rel_loss_error": worst, "max_rel_grad_norm_error": worst_norm}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device here")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", file=sys.stderr)
    results = [check(precision, deterministic) for deterministic in (False, True) for precision in ("fp32", "bf16", "fp16")]
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
