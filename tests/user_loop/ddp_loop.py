"""A distributed data-parallel job as users write one, started with torchrun (2 processes, gloo on CPU): the process
group set up in main, the model wrapped in DDP by build, each rank drawing its own data, the same Recorder lines as
one process. Plants: a NaN row in rank 1's batch at a step (--nan-step), rank asymmetries (--plant seed | hook |
loss-count: a rank-dependent init, rank 1 changing its gradients after the all-reduce, a loss divided by a per-rank
count), a step that returns the ranks' mean loss (--plant mean-loss: a collective of its own in the step), fp16
autocast with a GradScaler (--plant fp16) and an lr that diverges (--plant diverge, or --loss mse --lr 3 --clip 0).
--fsdp shards the model with FSDP2's fully_shard instead of wrapping it in DDP. Several plants record a run each, one
after another: a run that stops at a non-finite step says so in a line and the next starts, except the job's last
run, whose NonFiniteStep ends the job as it ends a user's script (a sharded run's is a line too). A plant may set its
own run's steps, NaN step and sharding (PLANT:steps=N:nan-step=K:fsdp); its lines name it as written.

Run: torchrun --nproc_per_node 2 ddp_loop.py --steps 20 [--nan-step 12] [--lr 0.05] [--plant SPEC,...] [--fsdp]"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import replaybisect


def build(config):
    torch.manual_seed(0 if config["plant"] != "seed" else 1 + dist.get_rank())  # planted: a rank-dependent init...
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    if config.get("fsdp"):  # each Linear its own shard group, then the root: FSDP2 as its docs show it
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9), None, None
    ddp = DDP(model, init_sync=config["plant"] != "seed")  # ...that DDP does not broadcast
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config["lr"], momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if config["fp16"] else None
    return ddp, optimizer, None, scaler


def train_step(model, optimizer, scaler, batch, config):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=config["fp16"]):
        if config["loss"] == "mse":  # a regression: too high an lr diverges geometrically to inf, then NaN
            loss = F.mse_loss(model(x), F.one_hot(y, 4).float())
        else:
            loss = F.cross_entropy(model(x), y, reduction="sum" if config["plant"] == "loss-count" else "mean")
    if config["plant"] == "loss-count":  # planted: each rank divides by its own count of kept rows
        loss = loss / (y >= 0).sum().clamp(min=1) / (1 + dist.get_rank())
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)
    if config["plant"] == "hook" and dist.get_rank() == 1:  # planted: rank 1 scales its gradients after the all-reduce
        for param in model.parameters():
            param.grad.mul_(1.5)
    if config["clip"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip"])
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if config["plant"] == "mean-loss":  # returns the ranks' mean loss: an all-reduce of its own, which one process cannot replay
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        print(f"rank {dist.get_rank()} mean loss {float(mean) / dist.get_world_size():.6f}", flush=True)  # in the step: replays print it too
        return mean / dist.get_world_size()
    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--plant", default="none")  # comma-separated: one run each
    parser.add_argument("--clip", type=float, default=5.0)  # 0: no clipping
    parser.add_argument("--loss", default="ce")  # ce | mse
    parser.add_argument("--sleep", type=float, default=0.0)  # seconds per step (a test kills a rank mid-run)
    parser.add_argument("--fsdp", action="store_true")  # fully_shard instead of DDP
    args = parser.parse_args()
    dist.init_process_group("gloo")
    runs = [run_of(spec, args) for spec in args.plant.split(",")]
    for position, run in enumerate(runs):  # one run per plant, one after another in the same job
        try:
            record(args, run)
        except replaybisect.NonFiniteStep as stop:
            if position == len(runs) - 1 and not run["fsdp"]:
                # every rank is here before any ends the job: a rank leaving while its peer is still in a collective
                # can abort the peer (SIGABRT, seen once in seven whole-suite runs) before the peer prints its line
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
                raise
            print(f"rank {dist.get_rank()} {run['label']}: {stop}", flush=True)
    dist.destroy_process_group()


def run_of(spec: str, args) -> dict:
    """One run of --plant: PLANT[:steps=N][:nan-step=K][:fsdp], the job's --steps, --nan-step and --fsdp otherwise."""
    plant, *options = spec.split(":")
    run = {"label": spec, "plant": plant, "steps": args.steps, "nan_step": args.nan_step, "fsdp": args.fsdp}
    for option in options:
        key, _, value = option.partition("=")
        run[key.replace("-", "_")] = int(value) if value else True
    return run


def record(args, run: dict):
    rank, plant = dist.get_rank(), run["plant"]
    config = {"lr": args.lr, "plant": plant, "clip": args.clip, "loss": args.loss, "fp16": plant == "fp16", "fsdp": run["fsdp"]}
    if plant == "diverge":  # a regression at too high an lr, unclipped
        config.update(lr=3.0, loss="mse", clip=0.0)
    model, optimizer, _, scaler = build(config)
    rec = replaybisect.Recorder(model, optimizer, scaler=scaler, step_fn=train_step, build=build, config=config,
                                snapshot_every=5, layer_stats_every=0)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the data
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    with rec:
        for step in range(run["steps"]):
            x = torch.randn(16, 8, generator=generator)
            y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
            if rank == 1 and step == run["nan_step"] and plant != "diverge":
                x[5, 3] = float("nan")  # planted: one bad row on rank 1
            loss = rec.step((x, y))
            print(f"rank {rank} {run['label']} step {step} loss {loss:.6f}", flush=True)  # user code prints to stdout
            time.sleep(args.sleep)
    if rank == 0:
        print("run", rec.run_id)


if __name__ == "__main__":
    main()
