"""`replay verify` on a GPU: a `replay train` run of the built-in char transformer (dropout 0.1, so the CUDA RNG
stream matters) recorded on the device for 100 steps with a snapshot every 25, then verified over all its steps, in
fp32, bf16 and fp16, with deterministic algorithms off and on. Each line is one JSON result: the verdict (`exact`
expected: replays are exact on CUDA), the steps compared and the first difference if any.

    python benchmarks/gpu_verify.py [--device cuda] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def check(device: str, steps: int, precision: str, deterministic: bool) -> dict:
    import torch

    from replaybisect.core import config
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train
    from replaybisect.verbs.verify.engine import verify

    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        store = open_store(f"sqlite:///{folder}/mlflow.db")
        cfg = config.compose(None, "config", ["+experiment=char", f"train.precision={precision}", f"train.device={device}",
                                              f"train.steps={steps}", "snapshot.every=25", "train.val_every=0"])
        run_id = train(cfg, store).run_id
        report = verify(store, run_id)
    first = report.differences[0] if report.differences else None
    return {"check": "verify", "device": device, "precision": precision, "deterministic": deterministic,
            "verdict": report.verdict, "exact": report.verdict == "exact", "steps_compared": report.steps_compared,
            "first_difference": None if first is None else {"step": first.step, "metric": first.metric,
                                                            "relative": first.relative}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    for deterministic in (False, True):
        for precision in ("fp32", "bf16", "fp16"):
            print(json.dumps(check(args.device, args.steps, precision, deterministic)), flush=True)


if __name__ == "__main__":
    main()
