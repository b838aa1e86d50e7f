"""The Recorder's part in a distributed data-parallel job (core/ranks.py says how the job is stored and replayed).

Rank 0 records the run as one process does, storing each global step's records of every rank and every rank's loss
and parameter checksum. The other ranks run their steps under the same non-finite guard, send what rank 0 stores,
and own no run: `PeerSession` stands in for theirs, and ends the run itself only when rank 0 is gone.
"""

from __future__ import annotations

import signal

from typing import Any, Callable, Optional

from replaybisect.core import ranks
from replaybisect.core.snapshot import snapshot_due
from replaybisect.errors import ConfigError


def link_for(inline: bool, build, step_fn) -> Optional[ranks.RankLink]:
    """This process's link to the other ranks, when it is one of several; refuses the forms a replay cannot split."""
    from replaybisect.core.user_step import takes_carry

    where = ranks.world()
    if where is None:
        return None
    if step_fn is not None and takes_carry(step_fn):
        raise ConfigError("a distributed job's step takes `carry`: a one-process replay keeps one carry, not one per rank; "
                          "keep per-step state in the batch or the model (a buffer) in a DDP job")
    if inline or build is None:
        raise ConfigError("a distributed job (torchrun, more than one process) records with step_fn= and build=: a replay "
                          "rebuilds the DDP model with your build(config) and runs each rank's batch through your step; "
                          "define both at the top level of your module")
    return ranks.RankLink(*where)


def refuse_sharded(model, snapshot_every: int) -> None:
    """A model sharded in a way a replay cannot rebuild is refused before any run exists. FSDP2's fully_shard over one
    dimension of ranks is recorded (core/ranks.py), in a job of several processes with periodic snapshots: they are
    the only state its replay can start from."""
    why = ranks.unrecordable_sharding(model)
    if why is None and ranks.is_sharded(model):
        if ranks.world() is None:
            why = "fully_shard over one process (shard it under torchrun with several, or leave fully_shard out)"
        elif not snapshot_every:
            why = "snapshot_every=0: a sharded run's replay starts from a periodic snapshot; pass snapshot_every=N"
    if why is None:
        return
    raise ConfigError(f"the Recorder cannot record this sharded model: {why}; record the job with fully_shard over one "
                      "dimension of ranks, DistributedDataParallel, or on one process, to replay it; nothing was recorded")


def run_of_this_rank(link: Optional[ranks.RankLink], tracking_uri: Optional[str], on_nonfinite: str,
                     open_writer: Callable[[], Any], start_recording: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(session, hooks). One process, or rank 0 of a job: the run opened by `open_writer`, its id shared with the
    other ranks, and `start_recording(session)`'s hooks (a store that fails then ends the run FAILED). Another
    rank: rank 0's run joined, and hooks that record nothing (the step's non-finite guard still stops it)."""
    if link is not None and link.rank != 0:
        from replaybisect.record.hooks import NullHooks

        return PeerSession(link, tracking_uri), NullHooks(on_nonfinite == "stop")
    session = open_writer()
    if link is not None:
        link.share_run_id(session.run_id)
    with session.failure_ends_run():
        return session, start_recording(session)


class RankedSteps:
    """Each step of one rank: what rank 0 stores for it, and the ranks' losses and checksums as rank 0's metrics."""

    def __init__(self, link: ranks.RankLink, model, snapshot_every: int):
        self.link, self.model = link, model
        self._checksum = 0.0  # the replica's parameters as the step started
        self.sharded = ranks.is_sharded(model)  # fully_shard: no replicas to compare, and snapshots gather the shards
        self.snapshot_every = snapshot_every

    @property
    def is_writer(self) -> bool:
        return self.link.rank == 0

    def opened(self, step: int, state) -> None:
        """A step starts: the replica's checksum now (replicas that began different show at step 0). A sharded model's
        other ranks join the gather of rank 0's periodic snapshot (made as the step opened): every rank all-gathers
        the same tensors in the same order."""
        if self.sharded:
            if not self.is_writer and snapshot_due(step, self.snapshot_every):
                from replaybisect.core.state import iter_live_tensors

                for _ in iter_live_tensors(state):  # each gathered tensor dropped at once: rank 0 keeps its own
                    pass
            return
        self._checksum = ranks.param_checksum(self.model)

    def stored(self, step: int, record: Any) -> Any:
        """What the run stores for this step: on rank 0 the global record (every rank's); other ranks send theirs."""
        if self.is_writer:
            return self.link.global_record(step, record)
        self.link.send_record(step, record)
        return record

    def finished(self, step: int, loss: float, hooks) -> None:
        """After the step (taken or halted): every rank's loss and checksum go to rank 0's metrics."""
        checksum = self._checksum
        if not self.is_writer:
            self.link.send_outcome(step, loss, checksum)
            return
        points = [] if self.sharded else [("param_checksum/rank0", checksum, step)]
        for peer, (peer_loss, peer_checksum) in self.link.peer_outcomes(step).items():
            points.append((f"loss/rank{peer}", peer_loss, step))
            if not self.sharded:  # shards differ by design: only replicas are compared
                points.append((f"param_checksum/rank{peer}", peer_checksum, step))
        hooks.metrics.extend(points)

    def blamed(self, error: BaseException, store, run_id: str) -> BaseException:
        """Rank 0 ending on an error: the ranks that failed first (they said so, or their process is gone) are tagged
        on the run, which then ends FAILED even when the launcher's SIGTERM is what stopped rank 0."""
        failed = self.link.failed_ranks()
        if not failed:
            return error
        store.set_tags(run_id, failure_tags(failed))
        return RuntimeError(f"rank {min(failed)} failed") if isinstance(error, KeyboardInterrupt) else error


def failure_tags(failed: dict[int, str]) -> dict[str, str]:
    return {"failed_ranks": ",".join(str(rank) for rank in sorted(failed)),
            "failure": "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failed.items()))[:1000]}


class PeerSession:
    """A rank other than 0: the run is rank 0's. Its failure is said to the others; with rank 0 gone it ends the
    run (FAILED, naming rank 0) so the record does not stay RUNNING."""

    def __init__(self, link: ranks.RankLink, tracking_uri: Optional[str]):
        from replaybisect.store import open_store

        self.link = link
        self.run_id = link.joined_run_id()
        self.store = None  # this rank writes nothing while rank 0 lives
        # opened now: ending the run for a dead rank 0 must fit in the launcher's grace period after its SIGTERM
        self._store_if_rank_0_dies = open_store(tracking_uri)
        self.ended = False

    def write_config(self, cfg) -> None:
        pass

    def finish(self) -> str:
        self.ended = True
        return "ok"

    def fail(self, error: BaseException):
        if self.ended:
            return None
        self.ended = True
        # the launcher's SIGTERM (sent as soon as it sees a rank die, rank 0 here) must not cut short what follows, or a
        # dead rank 0's run stays RUNNING (seen on a loaded machine); with rank 0 alive it applies again after
        previous = _ignore_sigterm()
        self.link.say_failed(error)
        failed = self.link.failed_ranks()
        if 0 in failed:
            self._end_for_rank_0(failed, error)
        elif previous is not None:
            signal.signal(signal.SIGTERM, previous)
        return None

    def _end_for_rank_0(self, failed: dict[int, str], error: BaseException) -> None:
        from replaybisect.record.session import mark_ended

        store = self._store_if_rank_0_dies
        try:
            if store.get_run(self.run_id).info.status != "RUNNING":
                return
            store.set_tags(self.run_id, failure_tags(failed))
            mark_ended(store, self.run_id, RuntimeError(f"rank 0 failed: {failed[0]}") if isinstance(error, KeyboardInterrupt) else error)
        except Exception:
            return


def _ignore_sigterm():
    """From here on this process finishes what it does; the launcher's SIGKILL after its grace period still ends it.
    The handler it replaced (None: not the main thread, where it is left as it is)."""
    try:
        return signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        return None
