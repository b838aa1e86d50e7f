"""What a snapshot costs the training steps, from 21 MB to 1 GB of state, measured interleaved.

A snapshot has two phases (record/hooks.py, CheckFreq's split): the step copies every tensor of the state into one
preallocated host image of the file (pinned on a GPU) and goes on; one background thread hashes the image and writes
it (O_DIRECT where the file system takes it, so the kernel does not copy it through the page cache). The steps pay
for the copy and for whatever the writer takes from them while it runs (CPU time, memory bandwidth).

For each state size (`replay train`'s MLP with AdamW's two moments: 12 bytes a parameter) one recorded run trains in
one process, on a real SQLite store, in blocks of `--every` steps. Blocks with a snapshot at their first step and
blocks without one alternate (ABBA: the order flips every pair), on the same model and data, so that drift in the
machine's speed lands on both sides of each pair. A block's time includes waiting, at its end, for the writes it
started. The stall of a snapshot is (block with - block without); its share of the interval is that over the block
without, printed as the median over pairs with a 95% bootstrap interval (benchmarks/overhead.py's). Also printed:
the copy (the recorder's own timing), its bandwidth against this machine's memcpy, and the wait for a previous write.

The measured stall moves with the machine's speed (on a shared 2-core VM, blocks of the same steps vary by 20%).
What moves with it as the step does: the writer thread's CPU time per snapshot (its schedstat, a block with a snapshot
against the one beside it without). With the training threads on every core, a snapshot takes about that time from
them, so its stall is about its copy plus the writer's CPU time: printed in steps and as a share of the interval. An
estimate, not a bound: it leaves out the kernel's work in other threads (writeback of what went through the page
cache, the disk's interrupts) and the memory bandwidth the hash takes. A stall of at most the copy plus one step
(the target docs/performance.md measures against) holds by it where the writer's CPU time is at most one step.

    python benchmarks/snapshot_stall.py [--sizes 21,100,300,1000] [--every 100] [--pairs 8] [--threads 2] [--dir FOLDER]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


def child(megabytes: float, every: int, pairs: int, threads: int, folder: str) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from overhead import interleaved, recorded_train, writes_done
    from replaybisect.core import loop

    torch.set_num_threads(threads)
    overrides = [f"model.hidden={hidden_for(megabytes)}", f"model.depth={DEPTH}", "model.dropout=0.0", "train.steps=10000000",
                 "train.batch_size=64", "train.val_every=0", f"snapshot.every={every}", "snapshot.layer_stats_every=0"]
    _, state, batches, hooks, close = recorded_train(folder, overrides)
    drain = writes_done(hooks)
    writer = Path(f"/proc/self/task/{hooks._worker.submit(threading.get_native_id).result()}/schedstat")
    done = [0]
    writer_cpu: dict[bool, list[float]] = {False: [], True: []}

    def block(snapshot: bool):
        def run() -> float:
            hooks.snapshot_every = every if snapshot else 0  # a snapshot as the block's first step opens, or none
            cpu = cpu_seconds(writer)
            started = time.perf_counter()
            loop.train_loop(state, batches, done[0], done[0] + every, hooks)
            drain()
            done[0] += every
            writer_cpu[snapshot].append(cpu_seconds(writer) - cpu)
            return time.perf_counter() - started
        return run

    measured = interleaved(block(False), block(True), pairs)
    blocking = hooks.snapshot_blocking[1:]  # the first (warm-up) also allocated the host image
    state_bytes = blocking[0][2]
    close()
    print("RESULT " + json.dumps({"megabytes": megabytes, "state_bytes": state_bytes, "pairs": measured,
                                  "copy": [seconds - waited for _, seconds, _, waited in blocking],
                                  "wait": [waited for _, _, _, waited in blocking],
                                  "writer_cpu": [with_one - without for with_one, without in
                                                 zip(writer_cpu[True][1:], writer_cpu[False][1:])]}))


def cpu_seconds(schedstat: Path) -> float:
    """A thread's time on a CPU so far (its schedstat's first field, in ns): nan where the file is not there."""
    try:
        return int(schedstat.read_text().split()[0]) / 1e9
    except OSError:
        return math.nan


def report(measured: dict, every: int, bandwidth: float) -> None:
    from overhead import median_interval

    without = [a for a, _ in measured["pairs"]]
    shares = [(b - a) / a for a, b in measured["pairs"]]
    median, low, high = median_interval(shares)
    stall = statistics.median(b - a for a, b in measured["pairs"])
    step = statistics.median(without) / every
    copy, wait, size = statistics.median(measured["copy"]), statistics.median(measured["wait"]), measured["state_bytes"]
    writer = statistics.median(measured["writer_cpu"])
    print(f"{size / 1e6:6.0f} MB | step {step * 1e3:6.1f} ms | copy {copy * 1e3:6.1f} ms ({size / copy / 1e9:4.1f} GB/s, "
          f"{size / copy / 1e9 / bandwidth:3.0%} of memcpy) | wait {wait * 1e3:5.1f} ms | stall {stall * 1e3:6.1f} ms = "
          f"{stall / step:4.2f} steps = {median:5.1%} of {every} steps [{low:5.1%}, {high:5.1%}] | writer's CPU "
          f"{writer * 1e3:5.1f} ms = {writer / step:4.2f} steps: stall about {(copy + writer) / step:4.2f} steps = "
          f"{(copy + writer) / (step * every):4.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="21,100,300,1000", help="state sizes in MB")
    parser.add_argument("--every", type=int, default=100, help="snapshot.every: the block length")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", help="where the runs' store is made (default: the system's temp folder)")
    parser.add_argument("--child", type=float)
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.every, args.pairs, args.threads, args.folder)
        return

    sys.path.insert(0, str(HERE))
    from overhead import PINNED

    bandwidth = memory_bandwidth()
    print(f"memcpy bandwidth of this machine: {bandwidth:.1f} GB/s (one 1 GiB copy_, best of 5)")
    print(f"MLP of depth {DEPTH}, AdamW, batch 64, {args.threads} threads; {args.pairs} pairs of {args.every}-step blocks, "
          f"with and without a snapshot, interleaved ABBA")
    for megabytes in (float(size) for size in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            done = subprocess.run([sys.executable, __file__, "--child", str(megabytes), "--every", str(args.every),
                                   "--pairs", str(args.pairs), "--threads", str(args.threads), "--folder", folder],
                                  capture_output=True, text=True, env={**os.environ, **PINNED, "OMP_NUM_THREADS": str(args.threads)})
            line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                sys.exit(done.stderr)
            report(json.loads(line[len("RESULT "):]), args.every, bandwidth)


if __name__ == "__main__":
    main()
