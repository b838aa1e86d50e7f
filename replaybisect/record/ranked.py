"""The Recorder's part in a distributed data-parallel job (core/ranks.py says how the job is stored and replayed).

Rank 0 records the run as one process does, storing each global step's records of every rank and every rank's loss
and parameter checksum. The other ranks run their steps under the same non-finite guard, send what rank 0 stores,
and own no run: `PeerSession` stands in for theirs, and ends the run itself only when rank 0 is gone.
"""

from __future__ import annotations

from typing import Any, Optional

from replaybisect.core import ranks
from replaybisect.errors import ConfigError


def link_for(inline: bool, build) -> Optional[ranks.RankLink]:
    """This process's link to the other ranks, when it is one of several; refuses the forms a replay cannot split."""
    where = ranks.world()
    if where is None:
        return None
    if inline or build is None:
        raise ConfigError("a distributed job (torchrun, more than one process) records with step_fn= and build=: a replay "
                          "rebuilds the DDP model with your build(config) and runs each rank's batch through your step; "
                          "define both at the top level of your module")
    return ranks.RankLink(*where)


class RankedSteps:
    """Each step of one rank: what rank 0 stores for it, and the ranks' losses and checksums as rank 0's metrics."""

    def __init__(self, link: ranks.RankLink, model):
        self.link, self.model = link, model
        self._checksum = 0.0  # the replica's parameters as the step started

    @property
    def is_writer(self) -> bool:
        return self.link.rank == 0

    def stored(self, step: int, record: Any) -> Any:
        """What the run stores for this step: on rank 0 the global record (every rank's); other ranks send theirs."""
        self._checksum = ranks.param_checksum(self.model)  # before the step: replicas that began different show at step 0
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
        points = [("param_checksum/rank0", checksum, step)]
        for peer, (peer_loss, peer_checksum) in self.link.peer_outcomes(step).items():
            points.append((f"loss/rank{peer}", peer_loss, step))
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
        self.link, self.tracking_uri = link, tracking_uri
        self.run_id = link.joined_run_id()
        self.store = None
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
        self.link.say_failed(error)
        failed = self.link.failed_ranks()
        if 0 in failed:
            self._end_for_rank_0(failed, error)
        return None

    def _end_for_rank_0(self, failed: dict[int, str], error: BaseException) -> None:
        from replaybisect.record.session import mark_ended
        from replaybisect.store import open_store

        try:
            store = open_store(self.tracking_uri)
            if store.get_run(self.run_id).info.status != "RUNNING":
                return
            store.set_tags(self.run_id, failure_tags(failed))
            mark_ended(store, self.run_id, RuntimeError(f"rank 0 failed: {failed[0]}") if isinstance(error, KeyboardInterrupt) else error)
        except Exception:
            return
