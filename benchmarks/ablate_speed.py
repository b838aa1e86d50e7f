"""Benchmark: `replay ablate` wall time, 3 arms on 2 workers vs 1 worker, and vs re-running the three variants
from step 0.

    python benchmarks/ablate_speed.py [--steps-scale 1.0] [--horizon 50]

A planted LR explosion (examples/ablate_lr_explosion widened, fp32, its LR jumping 10x at step 500 so it
fails after a long healthy stretch; 1 torch thread recorded so two workers fit on two cores) is trained once into a temporary SQLite store.
Then, measured in this one run:
  ablate-1   `ablate(lr,clip,warmup)` with --workers 1 (in-process, sequential; baseline + 3 arms)
  ablate-2   the same with --workers 2 (spawned worker processes; includes their start-up)
  scratch-1  the three variants re-run from step 0 to the same end step, one after another
  scratch-2  the same on 2 worker processes
Each timing is the best of --repeats runs. Prints one JSON object with the times and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["lr", "clip", "warmup"]


def _import_worker_modules(_index: int = 0) -> float:
    """What a spawned worker imports before its first arm (torch, MLflow, the library)."""
    started = time.perf_counter()
    import mlflow  # noqa: F401
    import torch  # noqa: F401

    import replaybisect.core.loop  # noqa: F401
    import replaybisect.replay.restore  # noqa: F401

    return time.perf_counter() - started


def worker_startup_seconds(workers: int) -> float:
    """Wall time to spawn `workers` fresh interpreters that import what an arm needs: the fixed cost that
    --workers N pays before its first step (--workers 1 runs in-process and pays none)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_import_worker_modules, range(workers)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--milestone", type=int, default=500, help="the step where the planted LR jumps 10x")
    parser.add_argument("--repeats", type=int, default=2, help="each timing is the best of this many runs")
    args = parser.parse_args()

    from replaybisect.core import config as config_mod
    from replaybisect.verbs.ablate import engine as ablate_mod
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train

    folder = Path(tempfile.mkdtemp(prefix="ablate-bench-"))
    os.chdir(folder)
    store = open_store(f"sqlite:///{folder / 'mlflow.db'}")
    example = ROOT / "examples" / "ablate_lr_explosion"
    # Wider than the example (256 features, 1024 hidden, batch 128) so the steps, not process start-up, carry
    # weight; and the classic schedule bug instead of the example's warmup: MultiStepLR with gamma=10 instead
    # of 0.1, so the LR jumps 10x at the milestone after a long healthy stretch and the run explodes soon after.
    cfg = config_mod.compose(example, "config", [
        "train.precision=fp32", f"train.steps={args.milestone + 200}", "model.n_features=256", "data.n_features=256",
        "model.hidden=1024", "train.batch_size=128", "optim.lr=0.015", "snapshot.every=50", "train.num_threads=1",
    ])
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.scheduler = {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "_partial_": True,
                         "milestones": [args.milestone], "gamma": 10.0}
    started = time.perf_counter()
    run = train(cfg, store, code_folder=example)
    train_seconds = time.perf_counter() - started
    if run.status != "nonfinite":
        sys.exit(f"the planted run did not fail in {cfg.train.steps} steps")
    print(f"trained {run.run_id}: non-finite at step {run.first_nonfinite_step} in {train_seconds:.1f}s", file=sys.stderr)

    def timed(label, function):
        best, value = float("inf"), None
        for _ in range(args.repeats):
            started = time.perf_counter()
            value = function()
            best = min(best, time.perf_counter() - started)
        print(f"{label}: {best:.1f}s (best of {args.repeats})", file=sys.stderr)
        return best, value

    one, result_one = timed("ablate, 1 worker", lambda: ablate_mod.ablate(store, run.run_id, ARMS, horizon=args.horizon, workers=1))
    two, result_two = timed("ablate, 2 workers", lambda: ablate_mod.ablate(store, run.run_id, ARMS, horizon=args.horizon, workers=2))
    assert result_one.verdicts() == result_two.verdicts(), (result_one.verdicts(), result_two.verdicts())

    # The naive alternative: each variant trained again from step 0 to the same end step (no baseline).
    scratch_specs = [
        {"tracking_uri": store.uri, "run_id": run.run_id, "arm": arm, "snapshot_step": 0, "start_step": 0,
         "end_step": result_one.end_step, "failing_step": run.first_nonfinite_step}
        for arm in ARMS
    ]
    scratch_one, raw_one = timed("from step 0, 1 worker", lambda: ablate_mod._run_here(scratch_specs, None))
    scratch_two, raw_two = timed("from step 0, 2 workers", lambda: ablate_mod._run_local(scratch_specs, 2, None))
    for raw in (raw_one, raw_two):
        errors = [r["error"] for r in raw.values() if "error" in r]
        assert not errors, errors

    startup = min(worker_startup_seconds(2) for _ in range(args.repeats))
    print(f"spawning 2 workers that import torch + MLflow: {startup:.1f}s (best of {args.repeats})", file=sys.stderr)

    print(json.dumps({
        "failing_step": run.first_nonfinite_step,
        "arms_start_step": result_one.start_step,
        "end_step": result_one.end_step,
        "steps_per_arm": result_one.end_step - result_one.start_step,
        "steps_per_variant_from_0": result_one.end_step,
        "verdicts": result_one.verdicts(),
        "seconds": {"ablate_1_worker": round(one, 2), "ablate_2_workers": round(two, 2),
                    "from_step_0_1_worker": round(scratch_one, 2), "from_step_0_2_workers": round(scratch_two, 2)},
        "worker_startup_2_processes": round(startup, 2),
        "ratio_2_workers_over_1": round(two / one, 3),
        "ratio_2_workers_over_1_excluding_startup": round((two - startup) / one, 3),
        "ratio_ablate_over_from_step_0_1_worker": round(one / scratch_one, 3),
        "ratio_ablate_over_from_step_0_2_workers": round(two / scratch_two, 3),
        "note": "ablate times include the baseline arm (4 replays); from-step-0 times run the 3 variants only",
        "train_seconds_to_failure": round(train_seconds, 2),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }, indent=2))


if __name__ == "__main__":
    main()
