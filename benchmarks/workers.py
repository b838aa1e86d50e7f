"""DataLoader workers on a data-bound run: `replay train` with train.num_workers=0 and 2, steps/s and the ratio.

The dataset does real CPU work per item, as an image pipeline does: each read decodes a 512x512 JPEG (Pillow, ~2 ms on these machines), takes
a random crop resized to 32x32 and a random flip (torch.randint / torch.rand: per-sample randomness). With
`--work sleep` each read instead sleeps `--sleep-ms` (a disk or network read that leaves the CPU free) and returns
a stored 32x32 image with the random flip. The model is a small CNN, so the step waits for data.

Each configuration trains through the real `train()` (recorder on: metrics, snapshots every 50 steps) in its own
process, alternating 0 and 2 workers. Reported: steps/s over the wall time of `train()` (run creation, snapshots and
worker start-up included), the headline, and in the loop alone (1 / (mean data wait + mean step time), from the
logged data_time and step_time: no run creation, start-up or recorder work).
The load average is printed: on a shared machine, decoding in workers only helps when cores are free.
The two worker counts must log identical losses (the same batches), which this script checks.

    python benchmarks/workers.py [--work decode|sleep] [--steps 200] [--batch-size 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

PROJECT = '''
import io
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset


class JpegImages(Dataset):
    """n JPEG images (size x size), decoded on every read with a random crop to 32x32 and a random flip."""

    def __init__(self, n=256, size=512, work="decode", sleep_ms=3.0):
        rng = np.random.default_rng(0)
        self.blobs, self.small = [], []
        for _ in range(n):
            coarse = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
            image = Image.fromarray(coarse).resize((size, size), Image.BICUBIC)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=90)
            self.blobs.append(buffer.getvalue())
            self.small.append(torch.from_numpy(np.array(image.resize((32, 32), Image.BILINEAR))).permute(2, 0, 1))
        self.targets = torch.from_numpy(rng.integers(0, 10, n))
        self.size, self.work, self.sleep_ms = size, work, sleep_ms

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, index):
        if self.work == "sleep":
            time.sleep(self.sleep_ms / 1000)
            pixels = self.small[index]
        else:
            side = int(torch.randint(self.size // 2, self.size + 1, ()))
            left, top = (int(v) for v in torch.randint(0, self.size - side + 1, (2,)))
            image = Image.open(io.BytesIO(self.blobs[index])).convert("RGB")
            image = image.resize((32, 32), Image.BILINEAR, box=(left, top, left + side, top + side))
            pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        if torch.rand(()) < 0.5:
            pixels = pixels.flip(-1)
        return pixels.float() / 255.0, self.targets[index]


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(32, 10),
        )

    def forward(self, x):
        return self.net(x)
'''

CONFIG = '''
model: {_target_: bench_images.SmallCNN}
data: {_target_: bench_images.JpegImages, work: decode, sleep_ms: 3.0}
loss: {_target_: torch.nn.CrossEntropyLoss}
optim: {_target_: torch.optim.AdamW, _partial_: true, lr: 0.001}
train: {val_every: 0, device: cpu, num_threads: 1}
snapshot: {every: 50, layer_stats_every: 50}
'''


def child(folder: str, workers: int, work: str, steps: int, batch_size: int, sleep_ms: float) -> None:
    from replaybisect.core import config
    from replaybisect.replay.restore import logged_losses
    from replaybisect.store import open_store
    from replaybisect.verbs.train.engine import train

    project = Path(folder) / "project"
    overrides = [f"train.num_workers={workers}", f"train.steps={steps}", f"train.batch_size={batch_size}",
                 f"data.work={work}", f"data.sleep_ms={sleep_ms}"]
    cfg = config.compose(project, "config", overrides)
    store = open_store(f"sqlite:///{folder}/mlflow.db")
    started = time.perf_counter()
    result = train(cfg, store, code_folder=project)
    seconds = time.perf_counter() - started
    data_time = [value for _, value in store.metric_history(result.run_id, "data_time")]
    step_time = [value for _, value in store.metric_history(result.run_id, "step_time")]
    losses = logged_losses(store, result.run_id)
    print(json.dumps({"workers": workers, "seconds": seconds, "steps": result.steps_completed,
                      "data_time": statistics.mean(data_time), "step_time": statistics.mean(step_time),
                      "losses": [losses[step] for step in sorted(losses)]}))


def item_time(folder: str, work: str, sleep_ms: float) -> float:
    """Seconds per read of one item in this process."""
    sys.path.insert(0, str(Path(folder) / "project"))
    import bench_images

    dataset = bench_images.JpegImages(n=16, work=work, sleep_ms=sleep_ms)
    started = time.perf_counter()
    for _ in range(5):
        for index in range(len(dataset)):
            dataset[index]
    return (time.perf_counter() - started) / (5 * len(dataset))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", choices=["decode", "sleep"], default="decode")
    parser.add_argument("--sleep-ms", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", type=int)
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child is not None:
        child(args.folder, args.child, args.work, args.steps, args.batch_size, args.sleep_ms)
        return

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        project = Path(folder) / "project"
        project.mkdir()
        (project / "bench_images.py").write_text(PROJECT)
        (project / "config.yaml").write_text(textwrap.dedent(CONFIG))
        per_item = item_time(folder, args.work, args.sleep_ms)
        runs: dict[int, list[dict]] = {0: [], 2: []}
        for _ in range(args.repeats):
            for workers in (0, 2):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(workers), "--folder", folder, "--work", args.work,
                     "--sleep-ms", str(args.sleep_ms), "--steps", str(args.steps), "--batch-size", str(args.batch_size)],
                    capture_output=True, text=True, env=env,
                )
                if done.returncode != 0:
                    sys.exit(f"the run with {workers} workers failed:\n{done.stderr[-3000:]}")
                runs[workers].append(json.loads(done.stdout.strip().splitlines()[-1]))
    same = all(run["losses"] == runs[0][0]["losses"] for measured in runs.values() for run in measured)
    rate = {workers: statistics.median(run["steps"] / run["seconds"] for run in measured) for workers, measured in runs.items()}
    what = "decode a 512x512 JPEG + random crop/flip" if args.work == "decode" else f"sleep {args.sleep_ms:g} ms + random flip"
    print(f"data-bound run: per item {what} ({per_item * 1e3:.2f} ms in-process), batch {args.batch_size}, "
          f"small CNN, {args.steps} steps, {args.repeats} runs each, {os.cpu_count()} CPU cores")
    steady = {}
    for workers, measured in runs.items():
        data = statistics.median(run["data_time"] for run in measured)
        step = statistics.median(run["step_time"] for run in measured)
        steady[workers] = 1 / (data + step)
        print(f"  num_workers={workers}: {rate[workers]:.2f} steps/s wall, {steady[workers]:.1f} steps/s in the loop "
              f"(mean data wait {data * 1e3:.1f} ms, step {step * 1e3:.1f} ms)")
    print(f"ratio 2 workers / 0 workers: {rate[2] / rate[0]:.2f}x wall, {steady[2] / steady[0]:.2f}x in the loop   "
          f"identical losses: {same}   load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
