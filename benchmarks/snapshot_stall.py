"""Snapshot stall against state size: what a snapshot costs the training step, from 21 MB to 1 GB of state.

A snapshot has two phases (record/hooks.py, CheckFreq's split): the step copies every tensor of the state into
preallocated host buffers (pinned on a GPU) and goes on; one background thread serialises and writes them. The step
pays for the copy, and, while the write runs, for whatever the writer takes from it (CPU time, memory bandwidth).

For each state size (the built-in MLP's parameters with AdamW's two moments: 12 bytes a parameter) the same training
runs twice in one process, without snapshots and with one every `--every` steps, on a real SQLite store:
- wait: the step waits for the previous snapshot's write first (one in flight, its host buffers are reused);
- copy: then copies the state into the host buffers (its bandwidth, against this machine's memcpy: one large
  `copy_`);
- interference: what the background write takes from the steps while it runs (CPU time, memory bandwidth):
  (recorded steps' time - plain steps' time) / snapshots, step time as the run logs it (the copy is not in it);
- the stall, their sum, against the plain step's time and the interval between snapshots.
The first snapshot of a run also allocates the host buffers; its copy is reported apart.

    python benchmarks/snapshot_stall.py [--sizes 21,100,300,1000] [--steps 50] [--every 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time

ADAMW_BYTES_PER_PARAM = 12  # fp32 weight + exp_avg + exp_avg_sq
DEPTH = 3


def memory_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """GB/s of one large tensor copy into a preallocated one (bytes copied per second, as the snapshot's figure)."""
    import torch

    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch of the pages
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return source.numel() * 4 / best / 1e9


def hidden_for(megabytes: float) -> int:
    """The MLP width whose AdamW state is about `megabytes` (DEPTH linear layers: 64 -> hidden, DEPTH - 1 of
    hidden x hidden, hidden -> 10)."""
    return max(16, round(math.sqrt(megabytes * 1e6 / ADAMW_BYTES_PER_PARAM / (DEPTH - 1))))


def child(megabytes: float, steps: int, every: int, threads: int, folder: str) -> None:
    import torch

    from replaybisect.core import config
    from replaybisect.core.state import live_tensors
    from replaybisect.record import hooks as hooks_module
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train

    torch.set_num_threads(threads)
    kept = {}
    original_close = hooks_module.RecordingHooks.close

    def close_and_keep(self):  # the recorder's own copy timings and the state it copied
        original_close(self)
        kept["blocking"] = self.snapshot_blocking
        kept["state_bytes"] = sum(t.numel() * t.element_size() for t in live_tensors(self.state).values())

    hooks_module.RecordingHooks.close = close_and_keep
    model = [f"model.hidden={hidden_for(megabytes)}", f"model.depth={DEPTH}", "model.dropout=0.0"]
    common = model + [f"train.steps={steps}", "train.batch_size=64", "train.val_every=0", "snapshot.layer_stats_every=0"]
    seconds = {}
    for mode in ("plain", "plain", "snapshots"):  # the first plain run warms the allocator and the caches
        store = open_store(f"sqlite:///{folder}/{mode}.db")
        overrides = common + (["snapshot.every=100000"] if mode == "plain" else [f"snapshot.every={every}"])
        cfg = config.compose(None, "config", overrides)
        result = train(cfg, store)
        seconds[mode] = [value for _, value in sorted(store.metric_history(result.run_id, "step_time"))]
    print(json.dumps({"megabytes": megabytes, "state_bytes": kept["state_bytes"], "blocking": kept["blocking"],
                      "plain": seconds["plain"], "snapshots": seconds["snapshots"]}))


def report(measured: dict, every: int, bandwidth: float) -> None:
    plain, recorded, snapshots = measured["plain"], measured["snapshots"], measured["blocking"]
    later = snapshots[1:] or snapshots  # the first also allocates the host buffers
    plain_step = statistics.median(plain)
    interference = max(0.0, (sum(recorded[1:]) - sum(plain[1:])) / max(1, len(later)))  # step 0 left out (warm-up)
    wait = statistics.median(waited for _, _, _, waited in later)
    copy = statistics.median(seconds - waited for _, seconds, _, waited in later)
    first_copy = snapshots[0][1] - snapshots[0][3]
    stall = wait + copy + interference
    size = measured["state_bytes"]
    print(f"{size / 1e6:6.0f} MB | plain step {plain_step * 1e3:6.1f} ms | wait {wait * 1e3:6.1f} ms | copy {copy * 1e3:6.1f} ms "
          f"({size / copy / 1e9:4.1f} GB/s = {size / copy / 1e9 / bandwidth:4.0%} of memcpy; first {first_copy * 1e3:.0f} ms) | "
          f"interference {interference * 1e3:6.1f} ms | stall {stall * 1e3:6.1f} ms = {stall / plain_step:4.2f} plain steps, "
          f"{stall / plain_step / every:5.1%} of {every} steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="21,100,300,1000", help="state sizes in MB")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=16, help="snapshot.every of the recorded run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", type=float)
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.every, args.threads, args.folder)
        return

    bandwidth = memory_bandwidth()
    print(f"memcpy bandwidth of this machine: {bandwidth:.1f} GB/s (one 1 GiB copy_, best of 5)")
    print(f"MLP of depth {DEPTH}, AdamW, batch 64, {args.steps} steps, a snapshot every {args.every}, {args.threads} threads")
    for megabytes in (float(size) for size in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            done = subprocess.run([sys.executable, __file__, "--child", str(megabytes), "--steps", str(args.steps),
                                   "--every", str(args.every), "--threads", str(args.threads), "--folder", folder],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(done.stderr)
            report(json.loads(done.stdout.strip().splitlines()[-1]), args.every, bandwidth)


if __name__ == "__main__":
    main()
