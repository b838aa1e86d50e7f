"""ReplayCallback overhead on a Hugging Face Trainer: a GPT-2 built from GPT2Config (width 128, 4 layers, context
64, batch 8, gradient accumulation 2, bf16, max_grad_norm 1.0, AdamW, CPU), trained by `Trainer.train()` with and
without `callbacks=[ReplayCallback()]` (snapshot every 100 steps, layer statistics every 50, as its defaults), each
run in its own process, alternating. Reported: the in-loop time per optimizer step (the median gap between the
Trainer's step ends, after the first 10 steps) and its ratio recorded/plain (median over repeats, and each pair's);
and the one-off cost at train() start (opening the store and the run: the Trainer's train_runtime minus its steps).

    python benchmarks/hf_overhead.py [--steps 100] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def child(mode: str, steps: int, threads: int, folder: str) -> None:
    import time

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    torch.set_num_threads(threads)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 512, (4096, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = TrainingArguments(output_dir=f"{folder}/out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=1e-3, bf16=True, max_grad_norm=1.0, use_cpu=True, seed=0,
                             logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True)
    ends = StepEnds()
    callbacks = [ends]
    if mode == "recorded":
        from replaybisect.hf import ReplayCallback

        callbacks.insert(0, ReplayCallback(tracking_uri=f"sqlite:///{folder}/mlflow.db"))
    result = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=callbacks).train()
    gaps = [later - earlier for earlier, later in zip(ends.times[10:], ends.times[11:])]
    step = statistics.median(gaps)
    print(json.dumps({"step": step, "start": result.metrics["train_runtime"] - sum(gaps) - step * 11}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=["plain", "recorded"])
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.threads, args.folder)
        return
    measured: dict[str, list[dict]] = {"plain": [], "recorded": []}
    for _ in range(args.repeats):
        for mode in ("plain", "recorded"):
            with tempfile.TemporaryDirectory() as folder:
                done = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--threads",
                                       str(args.threads), "--folder", folder], capture_output=True, text=True, check=True)
            measured[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    steps = {mode: [run["step"] for run in runs] for mode, runs in measured.items()}
    ratios = [recorded / plain for plain, recorded in zip(steps["plain"], steps["recorded"])]
    starts = [recorded["start"] - plain["start"] for plain, recorded in zip(measured["plain"], measured["recorded"])]
    print(f"ms per optimizer step ({args.steps} steps, {args.threads} thread(s)): plain "
          f"{', '.join(f'{1000 * s:.1f}' for s in steps['plain'])}; recorded {', '.join(f'{1000 * s:.1f}' for s in steps['recorded'])}")
    print(f"recorded/plain per step: median {statistics.median(ratios):.3f} (pairs {', '.join(f'{r:.3f}' for r in ratios)}); "
          f"one-off cost at train() start: {statistics.median(starts):.2f} s (opening the store and the run)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
