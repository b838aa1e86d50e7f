"""Recorder overhead on a distributed data-parallel job: examples/own_loop/gpt_loop.py's GPT (causal attention,
4 micro-batches, AdamW, bf16 autocast) wrapped in DDP, trained by torchrun with gloo on CPU, plain and recorded
(`rec.step(batch)`, the same lines as one process), with 1 and 2 processes, each run in its own launch, alternating.
Reported: the in-loop wall-time ratio recorded/plain for 1 and for 2 ranks (median over repeats), and the per-rank
parameter checksum's share of a recorded step (it is taken once per step on every rank).

    python benchmarks/ddp_overhead.py [--steps 100] [--repeats 3] [--width 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_loop"


def build(cfg):
    """gpt_loop's model and optimizer, the model wrapped in DDP (a replay rebuilds it the same way)."""
    import gpt_loop
    from torch.nn.parallel import DistributedDataParallel

    model, _ = gpt_loop.build(cfg)
    wrapped = DistributedDataParallel(model)
    return wrapped, gpt_loop.configure_optimizers(wrapped.module, cfg.lr, cfg.weight_decay)


def train_step(model, optimizer, batch):
    import gpt_loop

    return gpt_loop.train_step(model, optimizer, batch)


def child(mode: str, steps: int, d: int, layers: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    sys.path.insert(0, str(EXAMPLE))
    import gpt_loop

    import replaybisect
    from replaybisect.core.ranks import param_checksum

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = OmegaConf.merge(OmegaConf.load(EXAMPLE / "config.yaml"), {"lr": 1e-3, "d": d, "layers": layers, "heads": 4, "T": 64, "micro_batch": 8})
    model, optimizer = build(cfg)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [gpt_loop.get_batch(cfg, generator) for _ in range(steps)]
    if mode == "recorded":
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/mlflow.db"
        rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config=cfg)
        step = rec.step
    else:
        step = lambda batch: train_step(model, optimizer, batch)  # noqa: E731
    step(batches[0])  # warm-up outside the clock
    started = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    loop_seconds = time.perf_counter() - started
    checksum_started = time.perf_counter()
    for _ in range(20):
        param_checksum(model)
    checksum_seconds = (time.perf_counter() - checksum_started) / 20
    if mode == "recorded":
        rec.close()
    if dist.get_rank() == 0:
        Path(folder, "result.json").write_text(json.dumps({"loop_seconds": loop_seconds, "checksum_seconds": checksum_seconds}))
    dist.destroy_process_group()


def launch(mode: str, ranks: int, args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone",
                        __file__, "--child", mode, "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
                        "--folder", folder], capture_output=True, text=True, check=True, cwd=EXAMPLE,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(Path(folder, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", choices=["plain", "recorded"])
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.width, args.layers, args.folder)
        return
    results: dict[tuple[str, int], list[dict]] = {(mode, ranks): [] for ranks in (1, 2) for mode in ("plain", "recorded")}
    for _ in range(args.repeats):
        for mode, ranks in results:
            results[(mode, ranks)].append(launch(mode, ranks, args))
    print(f"DDP recorder overhead (torchrun, gloo, CPU, 1 thread a rank), {args.steps} steps, width={args.width}, {args.layers} layers")
    for (mode, ranks), values in results.items():
        loops = [v["loop_seconds"] for v in values]
        print(f"  {ranks} rank(s) {mode:9s} loop seconds: median {statistics.median(loops):.2f}  ({', '.join(f'{v:.2f}' for v in loops)})")
    for ranks in (1, 2):
        ratios = [r["loop_seconds"] / p["loop_seconds"] for r, p in zip(results[("recorded", ranks)], results[("plain", ranks)])]
        print(f"  ratio recorded/plain, {ranks} rank(s): median {statistics.median(ratios):.3f}  ({', '.join(f'{r:.3f}' for r in ratios)})")
    step = statistics.median(v["loop_seconds"] for v in results[("recorded", 2)]) / (args.steps - 1)
    checksum = statistics.median(v["checksum_seconds"] for v in results[("recorded", 2)])
    print(f"  parameter checksum: {1000 * checksum:.3f} ms a step, {100 * checksum / step:.2f}% of a recorded 2-rank step ({1000 * step:.1f} ms)")


if __name__ == "__main__":
    main()
