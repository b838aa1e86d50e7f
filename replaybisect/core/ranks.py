"""Distributed data-parallel runs (torchrun + DistributedDataParallel): recorded per rank, replayed on one process.

Recording. Every rank runs the same script with the same Recorder lines. Rank 0 owns the MLflow run; the other
ranks join it by id. At each step every rank sends rank 0 its stored step (the batch and the RNG states it starts
with, `user_step.pack`) and, after the step, its loss and a parameter checksum, through the process group's own
key-value store (never a collective: a rank that died makes the others wait on nothing but a timeout). Rank 0 stores
the global step as one record, `{"ranks": [record of rank 0, record of rank 1, ...]}`; the model and optimizer
state once (DDP keeps the replicas identical), and every rank's loss (`loss/rank1`) and checksum
(`param_checksum/rank1`) as metrics.

Replay on one process. The step function runs once per rank's record, as DDP runs it on each rank. A one-process
gloo group lets the user's `build` wrap the model in DDP as it did, and a communication hook on each DDP module
stands in for the all-reduce: the passes of ranks 1..W-1 keep their local gradient buckets (then the state is put
back), and the pass of rank 0 gets, for each bucket, the sum over ranks of bucket / W in rank order, which is what
DDP's default reduction computes (exact for two ranks; with more, gloo's summation order may differ in the last bit).
That pass goes on to the update, with the averaged gradients a clip sees and the RNG states rank 0 leaves.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from replaybisect.core.processes import alive
from replaybisect.core.shards import local
from replaybisect.errors import ConfigError, ReplayError

RECORD_RANKS = "ranks"
LIGHTNING_STEP = "replaybisect.lightning.lightning_step"  # the step a Lightning run replays: it averages the ranks itself
_LINKS = itertools.count()  # this process's links so far
KEY_PREFIX = "replaybisect/"
PEER_TIMEOUT = datetime.timedelta(minutes=10)  # a peer this late is gone (the job's own collectives time out sooner)
WAIT_SLICE = datetime.timedelta(seconds=1)


# ---- where this process stands ------------------------------------------------------------------------------
def world() -> Optional[tuple[int, int]]:
    """(rank, world size) of this process's default process group, when it has more than one process."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    size = torch.distributed.get_world_size()
    return (torch.distributed.get_rank(), size) if size > 1 else None


def is_sharded(model: torch.nn.Module) -> bool:
    """Parameters that are shards (DTensors: FSDP's fully_shard, tensor parallel), or a FullyShardedDataParallel
    module (its flat parameters). Only a process with a process group can hold either."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters()) or \
        any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def unrecordable_sharding(model: torch.nn.Module) -> Optional[str]:
    """Why a sharded model cannot be recorded (None: it is not sharded, or FSDP2's `fully_shard` over one dimension
    of ranks, each parameter split along its first dimension, which is recorded)."""
    if not is_sharded(model):
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor, Shard

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return "FullyShardedDataParallel (FSDP1): its flat parameters are not the model's own; wrap with fully_shard (FSDP2)"
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return "parameters sharded without fully_shard (tensor parallel)"
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and (param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),)):
            return f"{name} is placed as {tuple(param.placements)} on a {param.device_mesh.ndim}-D mesh (HSDP or tensor parallel)"
    return None


def recorded_world_size(cfg) -> int:
    """How many ranks the run was recorded with (1: one process)."""
    return int(cfg.train.get("world_size") or 1)


def replays_over_the_collective(cfg) -> bool:
    """Whether `replay nan --nproc` can replay the run: a distributed run whose step goes through DDP's own all-reduce
    (not a Lightning run, whose replayed step averages the ranks' gradients itself, nor a sharded one, whose
    snapshot holds whole tensors that its ranks would have to shard again)."""
    from omegaconf import OmegaConf

    return recorded_world_size(cfg) > 1 and OmegaConf.select(cfg, "train.step_fn._target_", default=None) != LIGHTNING_STEP \
        and not recorded_sharded(cfg)


def collective_offer(run_id: str, cfg, reproduced: str) -> list[str]:
    """A distributed run that one process did not reproduce: the replay over the real collective, offered."""
    if reproduced != "diverged" or not replays_over_the_collective(cfg) or replaying_rank() is not None:
        return []
    world_size = recorded_world_size(cfg)
    return [f"one process did not reproduce this {world_size}-rank run (the step may use collectives of its own, or the "
            f"ranks took different paths): replay it over the real collective on this machine with `replay nan --run-id "
            f"{run_id} --nproc {world_size}`"]


# ---- this process as one recorded rank of `replay nan --nproc` (verbs/nan/ranked.py) -------------------------------
_REPLAYING_RANKS = False  # set by that launcher's rank processes only, not by a user's own torchrun job


def replay_ranks_here() -> None:
    """This process replays one recorded rank over a real process group (set before anything is restored)."""
    global _REPLAYING_RANKS
    _REPLAYING_RANKS = True


def replaying_rank() -> Optional[tuple[int, int]]:
    """(rank, world size) when this process is one rank of `replay nan --nproc`; None otherwise (a one-process
    replay, or a replay called from inside a user's own distributed job)."""
    return world() if _REPLAYING_RANKS else None


def agreed(failed_here: bool) -> bool:
    """Whether any rank of `replay nan --nproc` says yes (one all-reduce); this process's answer elsewhere. Every rank
    asks at the same point, before a decision that leads to collectives (a replay, a rebuilt DDP module)."""
    if replaying_rank() is None:
        return failed_here
    return any_rank_failed(torch.device("cpu"))(failed_here)


def is_ranks_record(record: Any) -> bool:
    return isinstance(record, dict) and set(record) == {RECORD_RANKS} and isinstance(record[RECORD_RANKS], (list, tuple))


def rank_records(record: dict) -> list:
    records = list(record[RECORD_RANKS])
    if not records:
        from replaybisect.errors import SnapshotError

        raise SnapshotError("a stored distributed step holds no rank's batch: the snapshot was changed after recording; "
                            "re-record the run or examine another step (--step)")
    return records


def param_checksum(model: torch.nn.Module) -> float:
    """A cheap fingerprint of the replica's parameters (float64 sum of every element), summed where the parameters
    live and read once: replicas that drifted apart show different values at the same step."""
    with torch.no_grad():
        sums = [local(param.detach()).sum(dtype=torch.float64) for param in model.parameters()]
        return float(torch.stack(sums).sum()) if sums else 0.0


def any_rank_failed(device: torch.device) -> Callable[[bool], bool]:
    """Asked by every rank after each backward: did any rank's loss go non-finite? (One small all-reduce.)"""
    def agree(failed_here: bool) -> bool:
        flag = torch.tensor([1 if failed_here else 0], dtype=torch.int32,
                            device=device if torch.distributed.get_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    return agree


def layout(world_size: int, sharded: bool = False) -> dict[str, Any]:
    """The job's shape as the run's config stores it (`sharding: fsdp` for a model sharded with fully_shard)."""
    backend = torch.distributed.get_backend()
    return {"world_size": world_size, "backend": str(backend), **({"sharding": "fsdp"} if sharded else {})}


def recorded_sharded(cfg) -> bool:
    """Whether the run's model was sharded with fully_shard while recording."""
    return cfg.train.get("sharding") == "fsdp"


# ---- the link between ranks while recording ------------------------------------------------------------------
class RankLink:
    """What one rank tells rank 0 (and rank 0 reads), through the process group's key-value store. Each link (one
    recorded run) has keys of its own: every rank makes its links in the same order, so the n-th link of each rank
    is the same run's."""

    def __init__(self, rank: int, world_size: int):
        from torch.distributed import PrefixStore
        from torch.distributed.distributed_c10d import _get_default_store

        self.rank, self.world_size = rank, world_size
        self._store = PrefixStore(f"{KEY_PREFIX}{next(_LINKS)}/", _get_default_store())
        self._store.set(f"pid/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))

    # the run every rank records into
    def share_run_id(self, run_id: str) -> None:
        self._store.set("run_id", run_id)

    def joined_run_id(self) -> str:
        return self._get("run_id").decode()

    # each step: what rank 0 stores for it
    def send_record(self, step: int, record: Any) -> None:
        from replaybisect.core import snapshot as fmt

        self._store.set(f"record/{step}/{self.rank}", fmt.encode_batches({step: record}))

    def global_record(self, step: int, own: Any) -> dict:
        """Rank 0: the step's records of every rank, rank 0's first."""
        from replaybisect.core import snapshot as fmt

        records = [own]
        for peer in range(1, self.world_size):
            key = f"record/{step}/{peer}"
            records.append(fmt.decode_batches(self._get(key), f"rank {peer}'s step {step}")[step])
            self._store.delete_key(key)
        return {RECORD_RANKS: records}

    def send_outcome(self, step: int, loss: float, checksum: float) -> None:
        self._store.set(f"outcome/{step}/{self.rank}", json.dumps([loss, checksum]))

    def peer_outcomes(self, step: int) -> dict[int, tuple[float, float]]:
        """Rank 0: each other rank's (loss, checksum) of `step`."""
        outcomes = {}
        for peer in range(1, self.world_size):
            key = f"outcome/{step}/{peer}"
            loss, checksum = json.loads(self._get(key))
            outcomes[peer] = (float(loss), float(checksum))
            self._store.delete_key(key)
        return outcomes

    # a rank that failed
    def say_failed(self, error: BaseException) -> None:
        """This rank failed on its own (not a Ctrl-C or the launcher's SIGTERM, which stop every rank when one fails)."""
        if isinstance(error, KeyboardInterrupt):
            return
        with contextlib.suppress(Exception):
            self._store.set(f"failed/{self.rank}", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300])

    def failed_ranks(self) -> dict[int, str]:
        """The other ranks that said they failed, or whose process (on this host) is gone: rank -> why."""
        failed = {}
        host = socket.gethostname()
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            with contextlib.suppress(Exception):
                if self._store.check([f"failed/{peer}"]):
                    failed[peer] = self._store.get(f"failed/{peer}").decode()
                    continue
                if not self._store.check([f"pid/{peer}"]):  # not started yet: get would wait for it
                    continue
                where = json.loads(self._store.get(f"pid/{peer}"))
                if where["host"] == host and not alive(int(where["pid"])):
                    failed[peer] = f"process {where['pid']} is gone (killed)"
        return failed

    def _get(self, key: str) -> bytes:
        """The value another rank sets under `key`, polled (a wait inside the store would hold off the launcher's
        SIGTERM, and each timed-out wait logs a warning): between polls this process's signal handlers run, and
        about every WAIT_SLICE a rank that died is looked for."""
        import time

        started = time.monotonic()
        next_look, pause = started + WAIT_SLICE.total_seconds(), 0.0005
        while not self._has(key):
            now = time.monotonic()
            if now >= next_look:
                failed = self.failed_ranks()
                if failed:
                    raise ReplayError(f"rank {self.rank} stopped: " + "; ".join(f"rank {rank} {why}" for rank, why in sorted(failed.items())))
                if now - started > PEER_TIMEOUT.total_seconds():
                    raise ReplayError(f"rank {self.rank} waited {PEER_TIMEOUT} for {key} from another rank; a rank stopped: "
                                      "see its own output")
                next_look = now + WAIT_SLICE.total_seconds()
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # answers that come at once are read at once; a long wait polls 50 times a second
        return self._store.get(key)

    def _has(self, key: str) -> bool:
        """Whether `key` is set; a store that is gone (rank 0 hosts it, and died) is said in one line."""
        try:
            return self._store.check([key])
        except Exception as error:  # noqa: BLE001 - DistNetworkError and kin: the store's host is gone
            failed = self.failed_ranks()
            who = "; ".join(f"rank {rank} {why}" for rank, why in sorted(failed.items())) or "rank 0, which holds the job's store, is gone"
            raise ReplayError(f"rank {self.rank} stopped: {who} ({str(error).splitlines()[0][:120] if str(error) else type(error).__name__})") from None


# ---- replay on one process ----------------------------------------------------------------------------------
def one_process_group() -> None:
    """A process group of one (gloo, in memory) so the user's build can wrap the model in DDP as it did."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def attach_reduction(model: torch.nn.Module) -> None:
    """The all-reduce of every DDP module in `model` goes through REDUCTION (replaces DDP's own). A step function
    marked `reduces_gradients` calls reduce_gradients itself instead."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = [module for module in model.modules() if isinstance(module, DistributedDataParallel)]
    if not wrapped:
        raise ConfigError("the run was recorded with DistributedDataParallel, but build(config) returned a model without "
                          "it; wrap the model in DDP in build, as the recorded job did")
    for module in wrapped:
        try:
            module.register_comm_hook(REDUCTION, _reduce_bucket)
        except RuntimeError as error:  # build registered a hook of its own: a replay cannot stand in for it
            raise ConfigError(f"build(config) registers a DDP communication hook ({str(error).splitlines()[0][:120]}); a "
                              "one-process replay averages the ranks' gradients as DDP's default does: leave the hook out "
                              "of build to replay the run") from None


def attach_sharded_reduction(model: torch.nn.Module) -> None:
    """FSDP's reduce-scatter of every fully_shard module of `model` goes through REDUCTION: over a one-process group
    it only copies the gradients, and its all-reduce hook then gets the module's flat gradient, which it keeps (ranks
    1..W-1) or replaces by the ranks' average (rank 0), as for a DDP bucket."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not wrapped:
        raise ConfigError("the run was recorded with a model sharded by fully_shard, but build(config) returned one without "
                          "it; shard the model in build, as the recorded job did")
    for module in wrapped:  # the module's flat gradient, reduced in place as a DDP bucket's gradients are
        module.set_all_reduce_hook(functools.partial(_reduce, REDUCTION, module, through_ddp=False))


@dataclass
class Reduction:
    """Which rank's pass is running, and the gradients the passes before it reduced: (parameter, call) -> tensors.
    Kept per parameter, not per bucket: DDP lays its buckets out again after the first backward, so a flat bucket of
    one pass need not line up with the next pass's."""

    world_size: int = 1
    rank: Optional[int] = None  # None: outside a recorded global step (a probe's plain backward keeps its gradients)
    kept: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)  # parameter -> its reductions so far in this rank's pass


REDUCTION = Reduction()


def _reduce_bucket(reduction: Reduction, bucket):  # no return annotation: DDP checks it, and this module postpones them
    """DDP's communication hook, standing in for the all-reduce of one bucket (it holds this pass's local gradients,
    undivided: with a hook, DDP leaves the division to it)."""
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        _reduce(reduction, param, grad)  # in place: each gradient is a view into the bucket
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def reduces_itself(step_fn) -> bool:
    """A step function (or the partial a config makes of it) that calls reduce_gradients itself."""
    return bool(getattr(getattr(step_fn, "func", step_fn), "reduces_gradients", False))


def reduce_gradients(params) -> None:
    """The all-reduce of a step that does not run through a DDP module (a Lightning replay: the strategy wrapped the
    module while recording), at the moment DDP's would have finished: after the step's last backward."""
    for param in params:
        if param.grad is not None:
            _reduce(REDUCTION, param, param.grad, through_ddp=False)


def _reduce(reduction: Reduction, param: torch.Tensor, grad: torch.Tensor, through_ddp: bool = True) -> None:
    """One parameter's gradient in a rank's pass: kept (ranks 1..W-1), or replaced in place by the reduction (rank 0)."""
    if reduction.rank is None:
        return
    call = reduction.calls.get(id(param), 0)
    reduction.calls[id(param)] = call + 1
    key = (id(param), call)
    if reduction.rank != 0:
        reduction.kept.setdefault(key, []).append(grad.detach().clone())
        return
    peers = reduction.kept.get(key, [])
    if len(peers) != reduction.world_size - 1:
        over_the_collective = (": replay it over the real collective with `replay nan --run-id RUN_ID --nproc "
                               f"{reduction.world_size}`") if through_ddp else ""
        raise ReplayError("the ranks' recorded steps reduced their gradients a different number of times: they took "
                          f"different paths; this step cannot be replayed on one process{over_the_collective}")
    share = 1.0 / reduction.world_size  # DDP's reducer multiplies each rank's gradient by 1/W (exact for W = 2, 4, ...)
    reduced = grad.mul(share)
    for peer in peers:  # the sum in rank order, as gloo adds the ranks' shares
        reduced = reduced + peer.mul(share)
    grad.copy_(reduced)


def run_global_step(state, watch, record: dict, run_one: Callable[[Any, Any, Any], None]) -> None:
    """One recorded global step on one process: ranks 1..W-1 first (their gradients kept, the state put back),
    then rank 0 with the reduced gradients, through the update. `watch.outcome` is rank 0's; its `rank_losses`
    holds every rank's loss."""
    from replaybisect.core.state import copy_state
    from replaybisect.core.step_watch import StepOutcome, StepWatch

    records = rank_records(record)
    REDUCTION.world_size, REDUCTION.kept, REDUCTION.calls = len(records), {}, {}
    saved = copy_state(state)
    buffers = {name: buffer.detach().clone() for name, buffer in state.model.named_buffers()}
    losses: list[Optional[float]] = [None] * len(records)
    try:
        for rank in range(1, len(records)):
            REDUCTION.rank, REDUCTION.calls = rank, {}
            side = StepOutcome(step=watch.outcome.step, loss=float("nan"), lr=watch.outcome.lr)
            try:
                run_one(state, StepWatch(state, side, watch.observer, on_fault=None), records[rank])
            finally:  # the next pass, or whoever handles an error, starts from the state before the step
                _put_back(state, saved, buffers)
            losses[rank] = side.loss
        REDUCTION.rank, REDUCTION.calls = 0, {}
        run_one(state, watch, records[0])
        losses[0] = watch.outcome.loss
    finally:
        REDUCTION.rank, REDUCTION.kept, REDUCTION.calls = None, {}, {}
    watch.outcome.rank_losses = losses


def _put_back(state, saved, buffers: dict[str, torch.Tensor]) -> None:
    from replaybisect.core.state import load_state

    load_state(state, saved)
    with torch.no_grad():
        for name, buffer in state.model.named_buffers():
            buffer.copy_(buffers[name])
    state.optimizer.zero_grad(set_to_none=True)
