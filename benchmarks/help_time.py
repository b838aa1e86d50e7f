"""`replay --help` wall time (target < 0.3 s): it must not import torch or mlflow.

    python benchmarks/help_time.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    replay = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        subprocess.run([replay, "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    print(f"replay --help: median {statistics.median(times) * 1e3:.0f} ms, min {min(times) * 1e3:.0f} ms over {args.repeats} runs (target < 300 ms)")


if __name__ == "__main__":
    main()
