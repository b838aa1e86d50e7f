"""Benchmark `replay bisect` on a 64-commit history: trials and wall time with 1 worker against 3, and a cached rerun.

    python benchmarks/bisect_speed.py [--commits 64] [--mode train|cmd|both] [--cmd-seconds 2]

`train`: each tried commit trains the demo repository's model (examples/bisect_demo, 40 steps, 3 seeds for
the endpoints); `cmd`: the oracle is `--cmd` that sleeps --cmd-seconds and then checks a file, so the number
of rounds, not the CPU, sets the wall time. Every figure comes from one run of this script: the 1- and
3-worker bisects use --no-cache on one store, then the 3-worker bisect runs again with the cache on; in
`train` mode a last 1-worker bisect starts its trials as plain subprocesses (REPLAYBISECT_TRIAL_FORK=0)
instead of forking them from the preloaded server. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPLAY = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))


def _demo():
    spec = importlib.util.spec_from_file_location("make_demo", ROOT / "examples" / "bisect_demo" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bisect(folder: Path, repo: Path, args: list[str], **extra_env: str) -> dict:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'mlflow.db'}", REPLAYBISECT_CACHE=str(folder / "cache"),
               **extra_env)
    started = time.perf_counter()
    done = subprocess.run([REPLAY, "bisect", "--repo", str(repo), "--json", "demo-good", "demo-bad", *args],
                          cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"bisect failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {"wall_s": round(wall, 2), "commits_tried": report["n_trials"], "runs": report["n_runs"],
            "cached_runs": report["n_cached"], "rounds": report["n_rounds"], "first_bad": report["first_bad"][:10]}


def bench(mode: str, commits: int, cmd_seconds: float) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"bisect-bench-{mode}-"))
    regression_at = (commits * 2) // 3
    _, shas = _demo().linear_history(folder / "repo", commits=commits, regression_at=regression_at, kind="clear",
                                     broken_at=None)
    extra = []
    if mode == "cmd":
        extra = ["--cmd", f"sleep {cmd_seconds}; grep -q 'lr: 0.05' conf/config.yaml"]
    # warm the store (its first open migrates the SQLite schema) so no row pays for it
    subprocess.run([sys.executable, "-c", f"from replaybisect.store import open_store; open_store('sqlite:///{folder / 'mlflow.db'}')"],
                   check=True)
    rows = {
        "1 worker": _bisect(folder, folder / "repo", [*extra, "--workers", "1", "--no-cache"]),
        "3 workers": _bisect(folder, folder / "repo", [*extra, "--workers", "3", "--no-cache"]),
        "3 workers, cached rerun": _bisect(folder, folder / "repo", [*extra, "--workers", "3"]),
    }
    if mode == "train":  # what forking trials from the preloaded server saves (trial_process.py)
        rows["1 worker, plain subprocesses"] = _bisect(folder, folder / "repo", ["--workers", "1", "--no-cache"],
                                                       REPLAYBISECT_TRIAL_FORK="0")
    for row in rows.values():
        assert row["first_bad"] == shas[regression_at][:10], row
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "mode": mode, "commits": commits, "rows": rows,
        "wall_ratio_1_over_3": round(rows["1 worker"]["wall_s"] / rows["3 workers"]["wall_s"], 2),
        "rounds_1_vs_3": [rows["1 worker"]["rounds"], rows["3 workers"]["rounds"]],
        "cached_rerun_speedup": round(rows["3 workers"]["wall_s"] / rows["3 workers, cached rerun"]["wall_s"], 2),
        "load_average_1min": round(os.getloadavg()[0], 2),  # other work on the machine inflates every wall time
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=64)
    parser.add_argument("--mode", choices=["train", "cmd", "both"], default="both")
    parser.add_argument("--cmd-seconds", type=float, default=2.0)
    args = parser.parse_args()
    results = [bench(mode, args.commits, args.cmd_seconds) for mode in (["cmd", "train"] if args.mode == "both" else [args.mode])]
    for result in results:
        print(f"\n{result['mode']}: {result['commits']} commits, cpus={os.cpu_count()}, load average {result['load_average_1min']}")
        print(f"{'':26} {'wall s':>8} {'commits':>8} {'runs':>6} {'cached':>7} {'rounds':>7}")
        for name, row in result["rows"].items():
            print(f"{name:26} {row['wall_s']:8.1f} {row['commits_tried']:8d} {row['runs']:6d} {row['cached_runs']:7d} {row['rounds']:7d}")
        print(f"wall 1 worker / 3 workers = {result['wall_ratio_1_over_3']}x; rounds {result['rounds_1_vs_3']}; "
              f"cached rerun {result['cached_rerun_speedup']}x faster than the 3-worker bisect")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
