"""Recorder overhead on the user-loop API path: examples/own_loop/gpt_loop.py's hand-written GPT loop (causal
attention, 4 micro-batches, AdamW, bf16 autocast) trained plain (`train_step(model, optimizer, batch)` called
directly), recorded (`rec.step(batch)`: metrics every step, snapshots every 100 steps with every batch in
between, layer statistics every 50) and recorded inline (the same loop calling train_step itself, the Recorder
given no step_fn: it watches the model's calls and the optimizer), each in its own process, alternating.
Reported: the wall-time ratios recorded/plain and inline/plain of the training loop (median over repeats). Target (CheckFreq): <= 1.03; the user-loop path also
pays a Tensor.backward patch and two global optimizer hooks per step.

    python benchmarks/user_loop_overhead.py [--steps 200] [--repeats 3] [--d 128] [--layers 4] [--flush 50]

`--flush N`: the recorded runs' metrics (the loss and gradient norm kept on the device) are read every N steps
(the Recorder's default: 50 steps or 5 seconds, whichever comes first; here by step count only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_loop"


def child(mode: str, steps: int, d: int, layers: int, folder: str, flush: int) -> None:
    import torch
    from omegaconf import OmegaConf

    sys.path.insert(0, str(EXAMPLE))
    import gpt_loop

    import replaybisect

    torch.set_num_threads(1)
    cfg = OmegaConf.merge(OmegaConf.load(EXAMPLE / "config.yaml"), {"lr": 1e-3, "d": d, "layers": layers, "heads": 4, "T": 64, "micro_batch": 8})
    model, optimizer = gpt_loop.build(cfg)
    generator = torch.Generator().manual_seed(0)
    batches = [gpt_loop.get_batch(cfg, generator) for _ in range(steps)]
    if mode != "plain":
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/mlflow.db"
    if mode == "recorded":
        rec = replaybisect.Recorder(model, optimizer, step_fn=gpt_loop.train_step, build=gpt_loop.build, config=cfg)
        step = rec.step
    elif mode == "inline":  # the loop as written: train_step called by the loop, the Recorder watching
        rec = replaybisect.Recorder(model, optimizer, config=cfg)
        step = lambda batch: gpt_loop.train_step(model, optimizer, batch)  # noqa: E731
    else:
        step = lambda batch: gpt_loop.train_step(model, optimizer, batch)  # noqa: E731
    if mode != "plain":  # the metrics flush by step count only (no public knob on the Recorder: its hooks' settings)
        rec._hooks.flush_every, rec._hooks.flush_seconds = flush, float("inf")
    step(batches[0])  # warm-up outside the clock (first-call allocations; the recorder's step-0 snapshot is kept)
    started = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    loop_seconds = time.perf_counter() - started
    if mode != "plain":
        closing = time.perf_counter()
        rec.close()
        close_seconds = time.perf_counter() - closing
    else:
        close_seconds = 0.0
    print(json.dumps({"mode": mode, "loop_seconds": loop_seconds, "close_seconds": close_seconds}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", choices=["plain", "recorded", "inline"])
    parser.add_argument("--folder")
    parser.add_argument("--flush", type=int, default=50, help="steps between the recorded runs' metric reads")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.d, args.layers, args.folder, args.flush)
        return
    times: dict[str, list[float]] = {"plain": [], "recorded": [], "inline": []}
    for _ in range(args.repeats):
        for mode in times:
            with tempfile.TemporaryDirectory() as folder:
                done = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--d", str(args.d),
                                       "--layers", str(args.layers), "--folder", folder, "--flush", str(args.flush)],
                                      capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                result = json.loads(done.stdout.strip().splitlines()[-1])
                times[mode].append(result["loop_seconds"])
    print(f"user-loop recorder overhead, {args.steps} steps, d={args.d}, {args.layers} layers, 4 micro-batches, bf16 autocast, "
          f"metrics read every {args.flush} steps")
    for mode, values in times.items():
        print(f"  {mode:9s} loop seconds: median {statistics.median(values):.2f}  ({', '.join(f'{v:.2f}' for v in values)})")
    for mode in ("recorded", "inline"):
        ratios = [r / p for r, p in zip(times[mode], times["plain"])]
        print(f"  ratio {mode}/plain: median {statistics.median(ratios):.3f}  ({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
