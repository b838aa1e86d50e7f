"""How fast is `replay nan` against the naive way, and what do the probes cost?

1. Time to diagnosis. A run of examples/nan_forward (a wider GatedMLP on digits) trains with snapshots every
   100 steps and fails past step 1000 (mid-interval, so the replay covers ~60 steps). We time
   `nan.engine.find_nan()` + `nan.report.publish()` (restore, replay, probes, detect_anomaly, child run with report and plot) against
   the naive way: rebuild the run from its config and rerun steps 0..t under torch.autograd.detect_anomaly
   until it fails. Target: ratio <= 0.1.
2. The probes' cost for one step: the instrumented pass (forward/gradient/node hooks, op finder, update)
   plus the detect_anomaly pass, each on a state copy, against one plain step on a copy; at the failing
   step (where NaN/Inf/denormal arithmetic is slow in every pass) and at a healthy step.

    python benchmarks/nan_speed.py [--hidden 1024] [--batch-size 256] [--hold-steps 1047] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nan_forward"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hold-steps", type=int, default=1047, help="steps before the gate's temperature starts to fall")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from replaybisect.core import config as config_mod
    from replaybisect.core import loop
    from replaybisect.verbs.nan import engine as nan
    from replaybisect.verbs.nan import anomaly, step_probe
    from replaybisect.verbs.nan.report import publish
    from replaybisect.replay import restore as restore_mod
    from replaybisect.core.rng import capture_raw
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train

    folder = Path(tempfile.mkdtemp(prefix="nan-speed-"))
    os.chdir(folder)  # MLflow's default artifact root (./mlruns) lands in the temp folder too
    os.environ["REPLAYBISECT_CODE_DIR"] = str(EXAMPLE)  # the stored run's model lives there (replaybisect/trust.py)
    store = open_store(f"sqlite:///{folder / 'mlflow.db'}")
    overrides = [
        f"model.hidden={args.hidden}", f"model.hold_steps={args.hold_steps}", f"train.batch_size={args.batch_size}",
        f"train.steps={args.hold_steps + 200}", f"snapshot.every={args.every}", "snapshot.layer_stats_every=100",
    ]
    cfg = config_mod.compose(EXAMPLE, "config", overrides)

    started = time.perf_counter()
    result = train(cfg, store, code_folder=EXAMPLE)
    train_s = time.perf_counter() - started
    t = result.first_nonfinite_step
    assert result.status == "nonfinite" and t is not None and t >= 1000, result
    print(f"trained {t + 1} steps in {train_s:.1f}s; non-finite at step {t}; snapshots every {args.every}", flush=True)

    # 1. time to diagnosis vs the naive way -------------------------------------------------------------------
    started = time.perf_counter()
    report = nan.find_nan(store, result.run_id)
    publish(store, report)  # the child run with report and plot, as `replay nan` makes it
    ours_s = time.perf_counter() - started
    assert report.category == "forward" and report.module == "gate", (report.category, report.module)

    started = time.perf_counter()
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    naive_fail = None
    with torch.autograd.detect_anomaly(check_nan=True):
        for step in range(t + 1):
            try:
                outcome = loop.run_step(state, step, loop.to_device(source.batch(step), state.device))
            except RuntimeError:  # anomaly mode raised in backward
                naive_fail = step
                break
            if outcome.nonfinite:
                naive_fail = step
                break
    naive_s = time.perf_counter() - started
    assert naive_fail == t, (naive_fail, t)

    # 2. the probes' cost for one step --------------------------------------------------------------------------
    restored = restore_mod.restore(store, result.run_id, step=t)  # the snapshot saved at t: state before t
    live = restored.state
    batch = loop.to_device(restored.batch(t), live.device)
    rng_at_step = capture_raw()

    def timed(function) -> float:
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            function()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    plain_s = timed(lambda: nan.on_copy(live, rng_at_step, lambda c: loop.run_step(c, t, batch, halt_on_nonfinite=False)))
    copy_s = timed(lambda: nan.on_copy(live, rng_at_step, lambda c: None))
    probe_s = timed(lambda: nan.on_copy(live, rng_at_step, lambda c: step_probe.StepProbe(c).run(t, batch)))
    anomaly_s = timed(lambda: nan.on_copy(live, rng_at_step, lambda c: anomaly.anomaly_pass(c, t, batch)))

    # the same at a healthy step (the snapshot's own step): no NaN/Inf or denormal arithmetic in the timings
    healthy = restore_mod.restore(store, result.run_id, step=report.snapshot_step)
    h_state, h_step = healthy.state, healthy.step
    h_batch = loop.to_device(healthy.batch(h_step), h_state.device)
    h_rng = capture_raw()
    h_plain_s = timed(lambda: nan.on_copy(h_state, h_rng, lambda c: loop.run_step(c, h_step, h_batch)))
    h_probe_s = timed(lambda: nan.on_copy(h_state, h_rng, lambda c: step_probe.StepProbe(c).run(h_step, h_batch)))
    h_anomaly_s = timed(lambda: nan.on_copy(h_state, h_rng, lambda c: anomaly.anomaly_pass(c, h_step, h_batch)))

    params = sum(p.numel() for p in live.model.parameters())
    results = {
        "failing_step": t,
        "snapshot_step": report.snapshot_step,
        "replayed_steps": t - report.snapshot_step,
        "parameters": params,
        "threads": torch.get_num_threads(),
        "diagnosis_s": round(ours_s, 2),
        "diagnosis_breakdown_s": report.timings,
        "naive_rerun_under_detect_anomaly_s": round(naive_s, 2),
        "ratio_diagnosis_vs_naive": round(ours_s / naive_s, 3),
        "plain_step_on_copy_ms": round(plain_s * 1e3, 2),
        "state_copy_ms": round(copy_s * 1e3, 2),
        "probe_pass_ms": round(probe_s * 1e3, 2),
        "anomaly_pass_ms": round(anomaly_s * 1e3, 2),
        "ratio_probes_vs_plain_step": round((probe_s + anomaly_s) / plain_s, 2),
        "ratio_probes_vs_plain_step_without_copies": round((probe_s + anomaly_s - 2 * copy_s) / max(plain_s - copy_s, 1e-9), 2),
        "healthy_step": h_step,
        "healthy_plain_step_on_copy_ms": round(h_plain_s * 1e3, 2),
        "healthy_probe_pass_ms": round(h_probe_s * 1e3, 2),
        "healthy_anomaly_pass_ms": round(h_anomaly_s * 1e3, 2),
        "healthy_ratio_probes_vs_plain_step": round((h_probe_s + h_anomaly_s) / h_plain_s, 2),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
