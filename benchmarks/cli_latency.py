"""Wall time of the quick answers: `replay --help`, `replay runs`, and a bad run id (`replay nan --run-id bogus`),
each in an empty folder and beside an existing store. A bad run id should answer in about a second.

    python benchmarks/cli_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPLAY = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))


def _seconds(command: list[str], cwd: Path, repeats: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, env=env, capture_output=True)
        times.append(time.perf_counter() - started)
    return times


def _make_store(folder: Path) -> None:
    """An existing SQLite store (MLflow's own client creates its schema)."""
    code = "import mlflow, sys; mlflow.MlflowClient(sys.argv[1]).search_experiments()"
    subprocess.run([sys.executable, "-c", code, f"sqlite:///{folder / 'mlflow.db'}"], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = [
        ("replay --help", [REPLAY, "--help"], False),
        ("replay runs (empty folder)", [REPLAY, "runs"], False),
        ("replay runs (existing store)", [REPLAY, "runs"], True),
        ("replay nan --run-id bogus (empty folder)", [REPLAY, "nan", "--run-id", "bogus"], False),
        ("replay nan --run-id bogus (existing store)", [REPLAY, "nan", "--run-id", "bogus"], True),
        ("replay diagnose --run-id bogus (existing store)", [REPLAY, "diagnose", "--run-id", "bogus"], True),
    ]
    print(f"{'command':<50} {'median s':>9} {'min s':>7}  ({args.repeats} runs each, 2-core machine)")
    for label, command, with_store in cases:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            if with_store:
                _make_store(folder)
            times = _seconds(command, folder, args.repeats)
            created = "" if with_store or not (folder / "mlflow.db").exists() else "   (created mlflow.db)"
        print(f"{label:<50} {statistics.median(times):>9.2f} {min(times):>7.2f}{created}")


if __name__ == "__main__":
    main()
