"""What recording memory costs a step: the recorder samples the process's memory once per metrics flush
(`memory_points`: /proc/self/statm on CPU, the CUDA allocator's host-side counters on a GPU; no device sync) and
times each step's wait for data with two clock reads. This measures both against the recorded step of
benchmarks/overhead.py's `recorder` path (examples/own_loop/gpt_loop.py's GPT, one thread) and prints the ratio they
add to a step: (step + their share) / step. Target (issue 50): <= 1.01.

    python benchmarks/memory_recording.py [--calls 20000] [--flush 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def per_call(function, calls: int) -> float:
    """Seconds a call, the median of 5 rounds."""
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        rounds.append((time.perf_counter() - started) / calls)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--flush", type=int, default=50, help="steps between metrics flushes (the recorder's default)")
    args = parser.parse_args()
    import tempfile

    import torch

    sys.path.insert(0, str(HERE))
    import overhead

    from replaybisect.record.hooks import memory_points

    torch.set_num_threads(1)
    sample = per_call(lambda: memory_points(torch.device("cpu")), args.calls)
    clock = per_call(time.perf_counter, args.calls) * 2
    with tempfile.TemporaryDirectory() as folder:
        plain, recorded, close = overhead.path_recorder(folder, 20)
        recorded()
        step = statistics.median(recorded() for _ in range(3)) / 20
        close()
    added = sample / args.flush + clock
    print(f"memory sample: {sample * 1e6:.1f} us a flush (every {args.flush} steps); data-wait clock: {clock * 1e6:.2f} us a step")
    print(f"recorded step: {step * 1e3:.1f} ms; memory recording adds {added * 1e6:.2f} us a step: ratio {(step + added) / step:.5f} "
          "(target <= 1.01)")


if __name__ == "__main__":
    main()
