"""Host syncs per recorded step: how often the built-in step and a user's step (as `Recorder` runs them) make the
host wait for the device. Counted two ways on the same steps:
- `aten::_local_scalar_dense` calls (`.item()`, `float(t)`, `bool(t)`) seen by a TorchDispatchMode, on any device;
- on CUDA, the warnings of `torch.cuda.set_sync_debug_mode("warn")` (every synchronizing call PyTorch knows of).

Each path is run plain, with its reads deferred as a recorded step defers them (one guard read a
step, the loss and norm read at each metrics flush: `deferred_reads`), and with the
per-layer statistics observer (what a statistics step of the recorder adds).
Core modules only (no MLflow): `python benchmarks/gpu_syncs.py` (CUDA when present, else the CPU).
"""

from __future__ import annotations

import json
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replaybisect.core import config as config_mod
from replaybisect.core import loop, user_step
from replaybisect.core.layer_stats import LayerStats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WARMUP, STEPS = 3, 10
FLUSH_EVERY = 10  # the recorder's default snapshot.metrics_flush_every


class ScalarReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host."""

    READS = {torch.ops.aten._local_scalar_dense.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def builtin_state(precision: str):
    cfg = config_mod.compose(None, "config", ["+experiment=char", f"train.precision={precision}", f"train.device={DEVICE}"])
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    return state, lambda step: loop.to_device(source.batch(step), state.device)


def user_state(precision: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(DEVICE) if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)

    def train_step(model, optimizer, batch, scaler, config):
        total = 0.0
        for x, y in batch:
            with torch.autocast(DEVICE, dtype=dtype, enabled=precision != "fp32"):
                loss = torch.nn.functional.cross_entropy(model(x), y) / len(batch)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        (scaler.step(optimizer), scaler.update()) if scaler else optimizer.step()
        return total

    state = loop.TrainState(cfg=None, model=model, optimizer=optimizer, scheduler=None, scaler=scaler, loss_fn=None,
                            step_fn=train_step, device=user_step.model_device(model), precision=precision,
                            clip_grad_norm=None, user_loop=True, user_config={"precision": precision})

    def batch(step):
        x, y = torch.randn(32, 64, device=DEVICE), torch.randint(0, 8, (32,), device=DEVICE)
        return user_step.pack([(x[:16], y[:16]), (x[16:], y[16:])], state.device)

    return state, batch


def count(path: str, precision: str, with_stats: bool, deferred: bool = False) -> dict:
    state, batch_of = (builtin_state if path == "builtin" else user_state)(precision)
    for step in range(WARMUP):
        loop.run_step(state, step, batch_of(step))
    batches = [batch_of(step) for step in range(WARMUP, WARMUP + STEPS)]
    reads, cuda_syncs = ScalarReads(), 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with reads:
                for step, batch in zip(range(WARMUP, WARMUP + STEPS), batches):
                    observer = LayerStats(state.model) if with_stats else None
                    outcome = loop.run_step(state, step, batch, observer=observer, defer_reads=deferred)
                    if deferred and step % FLUSH_EVERY == FLUSH_EVERY - 1:  # what the recorder's metrics flush reads
                        torch.stack([torch.as_tensor(v, device=DEVICE).float() for v in (outcome.loss_value, outcome.grad_norm_value)]).tolist()
                    if observer is not None:
                        observer.finish()  # (their values stay on the device: the recorder reads them at its metrics flush)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"device": DEVICE, "path": path, "precision": precision, "layer_stats": with_stats, "deferred_reads": deferred,
            "scalar_reads_per_step": reads.count / STEPS,
            "cuda_syncs_per_step": cuda_syncs / STEPS if DEVICE == "cuda" else None}


if __name__ == "__main__":
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch.__version__)
    for path in ("builtin", "user"):
        for precision in ("fp32", "bf16", "fp16"):
            for with_stats, deferred in ((False, False), (False, True), (True, False)):
                print(json.dumps(count(path, precision, with_stats, deferred)))
