"""How long `replay diagnose` takes on a 10,000-step run.

Logs a realistic 10,000-step metric history into a fresh SQLite store (per step: loss, grad_norm, lr,
step_time, data_time; val_loss every 100 steps; every 50 steps param_norm, update_ratio and, for each of
`--layers` modules, grad_norm/ weight_norm/ act_zero_frac/ act_sat_frac), exactly the keys `replay train`
records, then times the installed CLI end to end (`replay diagnose --run-id X --json`, wall clock, median
of --repeats, with its CPU seconds, which a busy machine does not inflate) and, in process, loading
the histories vs. the analysis vs. writing the artifacts.

    python benchmarks/diagnose_speed.py [--steps 10000] [--layers 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def synthetic_history(steps: int, layers: int, seed: int = 0):
    """A healthy-looking run: exponential loss decay with SGD noise, slowly shrinking gradients."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    loss = (2.3 * np.exp(-t / (steps / 5)) + 0.15) * np.exp(0.08 * rng.standard_normal(steps))
    grad_norm = (0.3 + 1.5 * np.exp(-t / (steps / 3))) * np.exp(0.2 * rng.standard_normal(steps))
    lr = 1e-3 * np.minimum(1.0, (t + 1) / 200) * (0.5 * (1 + np.cos(math.pi * t / steps)))
    step_time = 0.02 * np.exp(0.1 * rng.standard_normal(steps))
    data_time = 0.002 * np.exp(0.2 * rng.standard_normal(steps))
    points = []
    for step in range(steps):
        points += [
            ("loss", loss[step], step), ("grad_norm", grad_norm[step], step), ("lr", lr[step], step),
            ("step_time", step_time[step], step), ("data_time", data_time[step], step),
        ]
        if (step + 1) % 100 == 0:
            points.append(("val_loss", float(np.median(loss[max(0, step - 99) : step + 1])) * 1.05, step))
        if step % 50 == 0:
            points += [("param_norm", 40 + step / steps, step), ("update_ratio", 1e-3 * math.exp(0.2 * rng.standard_normal()), step)]
            for index in range(layers):
                name = f"blocks.{index}.linear"
                scale = 0.5 * (1.3 ** -(layers - index))  # deeper layers a little smaller, never vanishing
                points += [
                    (f"grad_norm/{name}", scale * grad_norm[step], step),
                    (f"weight_norm/{name}", 10 + index, step),
                    (f"act_zero_frac/blocks.{index}.relu", 0.5 + 0.05 * rng.standard_normal(), step),
                    (f"act_sat_frac/blocks.{index}.gelu", 0.01, step),
                ]
    return points


def _children_cpu() -> float:
    """CPU seconds (user + system) used by finished child processes: a figure the machine's load does not inflate."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from replaybisect.verbs.diagnose.engine import analyse, load_curves
    from replaybisect.verbs.diagnose.report import publish
    from replaybisect.store import open_store

    folder = Path(tempfile.mkdtemp(prefix="diagnose-bench-"))
    previous = Path.cwd()
    os.chdir(folder)  # the store's artifact root (./mlruns) goes in the temporary folder, not here
    try:
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        store = open_store(uri)
        run_id = store.create_run("train", run_name="bench-10k")
        points = synthetic_history(args.steps, args.layers)
        started = time.perf_counter()
        store.log_metrics(run_id, points)
        log_seconds = time.perf_counter() - started
        store.finish_run(run_id, "ok")
        keys = {key for key, _, _ in points}
        print(f"logged {len(points)} points, {len(keys)} keys, {args.steps} steps in {log_seconds:.1f} s", file=sys.stderr)

        # In process: where the time goes.
        t0 = time.perf_counter()
        curves = load_curves(store, run_id)
        t1 = time.perf_counter()
        result = analyse(curves)
        t2 = time.perf_counter()
        publish(store, result, curves)
        t3 = time.perf_counter()

        # End to end, as a user runs it.
        replay = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))
        env = dict(os.environ, MLFLOW_TRACKING_URI=uri)
        walls, cpus = [], []
        for _ in range(args.repeats):
            begin, cpu_begin = time.perf_counter(), _children_cpu()
            done = subprocess.run([replay, "diagnose", "--run-id", run_id, "--json"], env=env, capture_output=True, text=True, cwd=folder)
            walls.append(time.perf_counter() - begin)
            cpus.append(_children_cpu() - cpu_begin)
            if done.returncode != 0:
                raise SystemExit(f"replay diagnose failed ({done.returncode}): {done.stderr}")
        verdict = json.loads(done.stdout)["verdict"]
        help_begin, help_cpu = time.perf_counter(), _children_cpu()
        subprocess.run([replay, "--help"], env=env, capture_output=True)
        help_seconds, help_cpu = time.perf_counter() - help_begin, _children_cpu() - help_cpu
        import_cpu = _children_cpu()
        subprocess.run([sys.executable, "-c", "import mlflow, matplotlib.pyplot"], capture_output=True)
        import_cpu = _children_cpu() - import_cpu
        report = {
            "steps": args.steps,
            "metric_keys": len(keys),
            "points": len(points),
            "cli_wall_s_median": round(statistics.median(walls), 3),
            "cli_wall_s_all": [round(w, 3) for w in walls],
            "cli_cpu_s_median": round(statistics.median(cpus), 3),
            "cli_startup_s (replay --help)": round(help_seconds, 3),
            "cli_startup_cpu_s": round(help_cpu, 3),
            "import_mlflow_matplotlib_cpu_s": round(import_cpu, 3),
            "load_average_1min": round(os.getloadavg()[0], 2),
            "in_process_load_s": round(t1 - t0, 3),
            "in_process_analyse_s": round(t2 - t1, 3),
            "in_process_artifacts_s": round(t3 - t2, 3),
            "verdict": verdict,
        }
        print(json.dumps(report, indent=2))
    finally:
        os.chdir(previous)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
