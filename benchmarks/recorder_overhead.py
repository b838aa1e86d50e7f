"""Recorder overhead: the same training with the recorder off and on, in one run of this script.

A 5.2M-parameter MLP with AdamW, 300 steps; recorder on = snapshot every 100 steps, layer statistics
every 50, per-step metrics. Each configuration runs in its own process (fair peak-memory numbers),
alternating off/on; reported: wall ratio on/off, blocking time per snapshot against its size, and the
peak RSS increase. Target (CheckFreq): ratio <= 1.03.

glibc's malloc returns the top of the heap to the OS whenever it is free, so a loop that frees every batch
pays page faults on the next step's large allocations, and a loop that keeps some small tensors alive
(the recorder keeps the interval's batches) does not: on these machines that alone made "off" ~20% slower
than "on". The headline ratio therefore runs both with trimming off (MALLOC_TRIM_THRESHOLD_ /
MALLOC_MMAP_THRESHOLD_, the same for both); the default allocator's figures are printed too.

    python benchmarks/recorder_overhead.py [--steps 300] [--repeats 2] [--flush 10]   # metrics read every N steps
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model.hidden=1600", "model.depth=3", "model.dropout=0.0"]


def child(mode: str, steps: int, folder: str, flush: int = 10) -> None:
    import torch

    from replaybisect.core import config
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train

    torch.set_num_threads(2)
    overrides = MODEL + [f"train.steps={steps}", "train.batch_size=64", "train.val_every=0", "snapshot.every=100", "snapshot.layer_stats_every=50"]
    overrides.append(f"snapshot.metrics_flush_every={flush}")  # the loss and norm read every `flush` steps
    if mode == "off":
        overrides.append("snapshot.enabled=false")
    cfg = config.compose(None, "config", overrides)
    store = open_store(f"sqlite:///{folder}/mlflow.db")
    recorder_box = {}

    import replaybisect.record.hooks as recorder_module

    original_close = recorder_module.RecordingHooks.close

    def close_and_keep(self):  # keep the recorder's own measurements for the report
        original_close(self)
        recorder_box["blocking"] = self.snapshot_blocking

    recorder_module.RecordingHooks.close = close_and_keep
    params = sum(p.numel() for p in __import__("replaybisect.core.loop", fromlist=["x"]).build_state(cfg).model.parameters())
    started = time.perf_counter()
    result = train(cfg, store)
    seconds = time.perf_counter() - started
    print(json.dumps({
        "mode": mode, "seconds": seconds, "steps": result.steps_completed, "params": params,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "blocking": recorder_box.get("blocking", []),
    }))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["off", "on"])
    parser.add_argument("--folder")
    parser.add_argument("--flush", type=int, default=10, help="snapshot.metrics_flush_every of the recorded runs")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.folder, args.flush)
        return

    pinned = {"MALLOC_TRIM_THRESHOLD_": str(2**28), "MALLOC_MMAP_THRESHOLD_": str(2**28)}
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for allocator, extra_env in (("trimming off", pinned), ("default malloc", {})):
            results = runs[allocator] = {"off": [], "on": []}
            for _ in range(args.repeats):
                for mode in ("off", "on"):
                    done = subprocess.run(
                        [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--folder", folder,
                         "--flush", str(args.flush)],
                        capture_output=True, text=True, check=True, env={**os.environ, **extra_env},
                    )
                    results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = runs["trimming off"]
    print(f"model: {results['on'][0]['params'] / 1e6:.2f}M parameters, AdamW, {args.steps} steps, {args.repeats} runs each, "
          f"metrics read every {args.flush} step(s)")
    for allocator, measured in runs.items():
        off = statistics.median(r["seconds"] for r in measured["off"])
        on = statistics.median(r["seconds"] for r in measured["on"])
        print(f"[{allocator}] recorder off: {off:.2f} s   on: {on:.2f} s   ratio on/off: {on / off:.3f}  (target <= 1.03)")
    blocking = [b for r in results["on"] for b in r["blocking"]]
    for step, seconds, size, _ in blocking[: len(blocking) // args.repeats]:
        print(f"  snapshot at step {step}: blocked the step {seconds * 1e3:.1f} ms for {size / 1e6:.1f} MB ({size / 1e9 / max(seconds, 1e-9):.1f} GB/s)")
    rss_off = max(r["max_rss_mb"] for r in results["off"])
    rss_on = max(r["max_rss_mb"] for r in results["on"])
    print(f"peak RSS off: {rss_off:.0f} MB   on: {rss_on:.0f} MB   increase: {rss_on - rss_off:.0f} MB")


if __name__ == "__main__":
    main()
