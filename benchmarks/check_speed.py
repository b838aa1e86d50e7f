"""How long `replay check` takes on the built-in config.

Times the installed CLI end to end (`replay check --json`, wall clock, median of --repeats) on the built-in
config (MLP on digits) with the default checklist (overfit one batch for 300 steps, LR range test over 100
steps), against a shared SQLite store created beforehand (a fresh store's migrations are a one-off cost).
For scale it also times `replay train` on the same config and the process start-up (`replay check --help`
cannot show it, so: `python -c "import torch, mlflow, matplotlib"`), and reports the time the
checks themselves took (the `seconds` field: building, checking, recording the check run) and each check's
share, measured in process.

    python benchmarks/check_speed.py [--repeats 3] [--threads N] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPLAY = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))


def timed(command: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return elapsed, done.stdout


def per_check_seconds(overrides: list[str]) -> dict[str, float]:
    """Each check's own time, in process (imports and building excluded)."""
    from replaybisect.core import config as config_mod
    from replaybisect.core import loop
    from replaybisect.verbs.check import engine as K

    cfg = config_mod.compose(None, None, overrides)
    if cfg.train.num_threads:
        import torch

        torch.set_num_threads(int(cfg.train.num_threads))
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    ctx = K.CheckContext(state, source.batch, dataset=source.dataset, steps_per_epoch=source.steps_per_epoch, seed=int(cfg.seed))
    times: dict[str, float] = {}
    marks: list = []

    def progress(name: str) -> None:
        now = time.perf_counter()
        if marks:
            times[marks[-1][0]] = now - marks[-1][1]
        marks.append((name, now))

    K.run_checks(ctx, progress=progress)
    times[marks[-1][0]] = time.perf_counter() - marks[-1][1]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="train.num_threads for check and train (default: torch's)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the checked config")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"train.num_threads={args.threads}"] if args.threads else [])

    folder = Path(tempfile.mkdtemp(prefix="check-speed-"))
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'mlflow.db'}", PYTHONUNBUFFERED="1")
    try:
        # the store's one-off migrations, outside the timings
        subprocess.run([sys.executable, "-c", "from replaybisect.store import open_store; open_store()"], cwd=folder, env=env, check=True)

        imports = [timed([sys.executable, "-c", "import torch, mlflow, matplotlib, hydra"], folder, env)[0] for _ in range(args.repeats)]
        checks, inner = [], []
        report = {}
        for _ in range(args.repeats):
            elapsed, stdout = timed([REPLAY, "check", "--json", *overrides], folder, env)
            report = json.loads(stdout)
            checks.append(elapsed)
            inner.append(report["seconds"])
        trains = [timed([REPLAY, "train", "--json", *overrides], folder, env)[0] for _ in range(args.repeats)]
        shares = per_check_seconds(overrides)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    median = statistics.median
    load = os.getloadavg()
    print(f"replay check on the built-in config{' ' + ' '.join(overrides) if overrides else ''} (median of {args.repeats}; load average {load[0]:.1f} on {os.cpu_count()} cores)")
    print(f"  replay check, end to end        {median(checks):7.2f} s   (runs: {', '.join(f'{t:.2f}' for t in checks)})")
    print(f"    of which check() itself       {median(inner):7.2f} s   (build + checks + recording the check run)")
    print(f"  import torch/mlflow/...         {median(imports):7.2f} s")
    print(f"  replay train (same config)      {median(trains):7.2f} s   -> check / train = {median(checks) / median(trains):.2f}")
    print(f"  status {report.get('status')}: {report.get('summary')}")
    print("  per check, in process:")
    for name, seconds in sorted(shares.items(), key=lambda item: -item[1]):
        print(f"    {name:24s} {seconds:6.3f} s")


if __name__ == "__main__":
    main()
