"""What `replay verify` costs against training, and what the op trace (core/op_trace.py, bisect's numerics) costs a step.

- verify: the same `replay train` run (an MLP, AdamW, batch 64, a snapshot every 50 steps) trained, then verified
  over all its steps, in one process, alternating (train, verify) `--repeats` times; printed: seconds per step of
  each and their ratio verify/train (the median, and each pair's). A verified step restores nothing it does not need:
  one snapshot per interval, then the steps in order, compared at the end.
- op trace: step 0 of that run, restored, run plain and under the op trace (every op's outputs hashed, its caller's
  line read), interleaved ABBA; printed: the ratio traced/plain (median and range).

    python benchmarks/verify_speed.py [--steps 200] [--repeats 3] [--hidden 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    from replaybisect.core import config, loop, op_trace
    from replaybisect.replay import restore as restore_mod
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train
    from replaybisect.verbs.verify.engine import verify

    torch.set_num_threads(args.threads)
    overrides = [f"model.hidden={args.hidden}", "model.depth=3", f"train.steps={args.steps}", "train.batch_size=64",
                 "train.val_every=0", "snapshot.every=50"]
    pairs = []
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        store = open_store(f"sqlite:///{folder}/mlflow.db")
        for _ in range(args.repeats):
            started = time.perf_counter()
            run_id = train(config.compose(None, "config", overrides), store).run_id
            trained = (time.perf_counter() - started) / args.steps
            started = time.perf_counter()
            report = verify(store, run_id)
            verified = (time.perf_counter() - started) / report.steps_compared
            assert report.verdict == "exact", report.sentence
            pairs.append((trained, verified))
        restored = restore_mod.restore(store, run_id, 0)
        batch = loop.to_device(restored.batch(0), restored.state.device)
        target = os.path.join(folder, "ops.json")

        def step(traced: bool) -> float:
            with loop.state_copy(restored.state) as copy:
                started = time.perf_counter()
                with op_trace._written(target) if traced else op_trace._UNTRACED:
                    loop.run_step(copy, 0, batch)
                return time.perf_counter() - started

        step(False), step(True)
        ratios = []
        for index in range(10):
            plain, traced = (step(False), step(True)) if index % 2 == 0 else reversed((step(True), step(False)))
            ratios.append(traced / plain)
    ratio = [v / t for t, v in pairs]
    print(f"{args.steps} steps, MLP hidden {args.hidden}, {args.threads} thread(s), {args.repeats} pairs")
    print(f"train {statistics.median(t for t, _ in pairs) * 1e3:.1f} ms/step, verify {statistics.median(v for _, v in pairs) * 1e3:.1f} "
          f"ms/step: verify/train {statistics.median(ratio):.2f} (pairs {', '.join(f'{r:.2f}' for r in ratio)})")
    print(f"op trace: traced/plain step {statistics.median(ratios):.1f}x (range {min(ratios):.1f}..{max(ratios):.1f}, 10 pairs)")


if __name__ == "__main__":
    sys.exit(main())
