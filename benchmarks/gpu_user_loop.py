"""A user-loop run replayed on a GPU (or the CPU): a hand-written step (dropout on the CUDA generator, 2 micro-batches, a
GradScaler under fp16, autocast) run through core/user_step.py as `replaybisect.Recorder` runs it; the state
before step S goes through the snapshot format (safetensors + JSON, the stored batches with each step's torch
and CUDA RNG state); the loop draws from the global CUDA and CPU generators between steps, as a loop sampling
its batches does. A fresh state is built, the snapshot applied and S..S+K replayed; losses compared bit for bit.

Core modules only (no MLflow): `python benchmarks/gpu_user_loop.py` on a machine with CUDA (else on the CPU).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from replaybisect.core import loop, rng, snapshot, user_step
from replaybisect.core.state import apply, live_tensors, state_json

START, STEPS = 10, 30
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU run checks the script itself
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build(precision: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(256, 8)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(DEVICE) if precision == "fp16" else None
    return model, optimizer, scaler


def train_step(model, optimizer, batch, scaler, config):
    total = 0.0
    for x, y in batch:
        with torch.autocast(DEVICE, dtype=DTYPES.get(config["precision"], torch.float32), enabled=config["precision"] != "fp32"):
            loss = F.cross_entropy(model(x), y) / len(batch)
        (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return total


def state_for(precision: str) -> loop.TrainState:
    model, optimizer, scaler = build(precision)
    return loop.TrainState(cfg=None, model=model, optimizer=optimizer, scheduler=None, scaler=scaler, loss_fn=None,
                           step_fn=train_step, device=user_step.model_device(model), precision=precision, clip_grad_norm=None,
                           user_loop=True, user_config={"precision": precision})


def next_batch():
    x = torch.randn(32, 64, device=DEVICE)  # the loop draws from the global CUDA generator between steps
    y = torch.randint(0, 8, (32,), device=DEVICE)
    return [(x[:16], y[:16]), (x[16:], y[16:])]


def check(precision: str) -> dict:
    state = state_for(precision)
    for step in range(START):
        loop.run_step(state, step, user_step.pack(next_batch(), state.device))
    records = {step: user_step.pack(next_batch(), state.device) for step in range(START, START + STEPS)}
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / snapshot.folder_name(START)
        folder.mkdir()
        saved = state_json(state, START, rng.capture_raw(), {"seed": 0, "step": START}, "periodic")
        files = {
            snapshot.TENSORS: snapshot.write_tensors_atomic(folder / snapshot.TENSORS, {k: v.detach().cpu() for k, v in live_tensors(state).items()}),
            snapshot.STATE: snapshot.write_atomic(folder / snapshot.STATE, snapshot.encode_json(saved)),
            snapshot.BATCHES: snapshot.write_atomic(folder / snapshot.BATCHES, snapshot.encode_batches(records)),
        }
        snapshot.write_manifest(folder, START, files)
        # recorded as the Recorder's step runs (its reads deferred); replayed as a replay runs it
        original = [loop.run_step(state, step, records[step], defer_reads=True).loss for step in range(START, START + STEPS)]
        loaded = snapshot.load(folder)
    restored = state_for(precision)
    apply(restored, loaded.tensors, loaded.state)
    torch.randn(1000, device=DEVICE)  # the replaying process's CUDA stream is elsewhere: the stored per-step state rules
    replayed = [loop.run_step(restored, step, loop.to_device(loaded.batches[step], restored.device)).loss
                for step in range(START, START + STEPS)]
    return {"precision": precision, "steps": STEPS, "exact": replayed == original,
            "mismatches": sum(a != b for a, b in zip(original, replayed)), "first_loss": original[0], "last_loss": original[-1]}


if __name__ == "__main__":
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch.__version__)
    for precision in ("fp32", "bf16", "fp16"):
        print(json.dumps(check(precision)))
