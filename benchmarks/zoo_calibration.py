"""Calibration on the test zoo (tests/zoo): every healthy model over 5 seeds must get no finding from `replay diagnose`
and no warning or failure from `replay check --run-id`,
and every plant must get the right answer from `replay nan` / `replay diagnose` on every seed (`replay ablate` on
seed 0). Prints one table (markdown). The test suite runs one seed (tests/test_zoo.py); this runs them all.

    python benchmarks/zoo_calibration.py [--seeds 5] [--no-ablate]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ZOO = Path(__file__).resolve().parents[1] / "tests" / "zoo"

# name: (config, overrides, arms to ablate or None)
RUNS = {
    "gpt (healthy)": ("gpt", (), None),
    "lstm clip 0.25 (healthy)": ("lstm", (), None),
    "cnn + BatchNorm (healthy)": ("cnn", (), None),
    "own-loss model (healthy)": ("ownloss", (), None),
    "gpt: hand-written softmax": ("gpt", ("model.plant=handwritten_softmax", "optim.lr=0.1"), "lr,clip"),
    "gpt: fp16 overflow in attention": ("gpt", ("model.plant=fp16_attention", "train.precision=fp16", "optim.lr=0.1"), "precision,lr"),
    "gpt: LayerNorm overflow (ln_2)": ("gpt", ("model.plant=layernorm_overflow",), "lr,clip"),
    "cnn: NaN row": ("cnn", ("data.nan_row=700",), "skip-batch"),
    "gpt: detached attention": ("gpt", ("model.plant=detached_attention",), None),
    "gpt: softmax into CE": ("gpt", ("model.plant=softmax_output",), None),
    "gpt: LR typo (lr=3)": ("gpt", ("optim.lr=3",), None),
    "lstm: LR typo (lr=2000)": ("lstm", ("optim.lr=2000",), None),
    "cnn: frozen first layer": ("cnn", ("model.plant=frozen_first",), None),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--no-ablate", action="store_true")
    args = parser.parse_args()

    from replaybisect.core import config as config_mod
    from replaybisect.core.trust import Trust
    from replaybisect.store import open_store
    from replaybisect.verbs.ablate.engine import ablate
    from replaybisect.verbs.diagnose.engine import diagnose
    from replaybisect.verbs.nan.engine import find_nan
    from replaybisect.verbs.train.engine import train

    folder = Path(tempfile.mkdtemp(prefix="zoo-calibration-"))
    project = folder / "zoo"
    shutil.copytree(ZOO, project, ignore=shutil.ignore_patterns("__pycache__"))
    store = open_store(f"sqlite:///{folder / 'mlflow.db'}")
    trust = Trust.from_user([project])
    started = time.perf_counter()
    print("| run | seed | status | nan: category / module / op / line | ablate | diagnose | check |")
    print("|---|---|---|---|---|---|---|")
    healthy_alarms = healthy_runs = check_alarms = 0
    for name, (config, overrides, arms) in RUNS.items():
        for seed in range(args.seeds):
            cfg = config_mod.compose(project, config, [*overrides, f"seed={seed}"])
            result = train(cfg, store, code_folder=project)
            nan_cell = ablate_cell = "-"
            if result.status == "nonfinite":
                report = find_nan(store, result.run_id, trust=trust)
                line = (report.source or "").split(": ", 1)[-1].split("#")[0].strip() if report.source else "-"
                nan_cell = f"{report.category} / {report.module} / {report.op} / `{line}` (step {report.failing_step}, {report.reproduced})"
                if arms and seed == 0 and not args.no_ablate:
                    ablation = ablate(store, result.run_id, arms, workers=1, trust=trust)
                    ablate_cell = ", ".join(f"{arm.name}: {arm.verdict}" for arm in ablation.arms)
            diagnosis = diagnose(store, result.run_id)
            findings = ", ".join(f.pattern + (f" ({f.layer})" if f.layer else "") for f in diagnosis.findings) or "no finding"
            check_cell = "-"
            if "healthy" in name:
                healthy_runs += 1
                healthy_alarms += bool(diagnosis.findings)
                flagged = _checks_flagged(result.run_id, project, folder)
                check_alarms += bool(flagged)
                check_cell = ", ".join(flagged) or "pass"
            print(f"| {name} | {seed} | {result.status} | {nan_cell} | {ablate_cell} | {findings} | {check_cell} |", flush=True)
    print(f"\nhealthy runs with a finding (false alarms): diagnose {healthy_alarms} of {healthy_runs}, "
          f"check {check_alarms} of {healthy_runs}; {time.perf_counter() - started:.0f} s")
    shutil.rmtree(folder, ignore_errors=True)


def _checks_flagged(run_id: str, project: Path, folder: Path) -> list[str]:
    """`replay check --run-id`'s warnings and failures on a run, each as name:status."""
    import replaybisect as rb

    here = Path.cwd()
    os.chdir(project)  # the run's code folder: the trusted place its replays read the model from
    try:
        report = rb.check(run_id=run_id, tracking_uri=f"sqlite:///{folder / 'mlflow.db'}", publish=False)
    finally:
        os.chdir(here)
    return [f"{check.name}:{check.status}" for check in report.checks if check.status not in ("pass", "skip")]


if __name__ == "__main__":
    sys.exit(main())
