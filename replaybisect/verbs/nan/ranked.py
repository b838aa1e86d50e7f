"""`replay nan --run-id X --nproc N`: a distributed run replayed over the real collective, for what one process
cannot reproduce (a step with collectives of its own, ranks that took different paths).

N processes on this machine, started as torchrun starts its workers (core/launch.py), form a gloo group. Each one
is one recorded rank and runs `find_nan` as one process does, with three differences: the user's `build` wraps the
model in DDP over the real group (no stand-in for the all-reduce), each step runs this rank's own recorded batch and
RNG states and is compared with this rank's logged losses (`loss/rankN`), and the ranks halt together as they did
recording (a non-finite loss on one rank stops every rank after its backward). Every probe pass runs to its end on
every rank, so the ranks' collectives stay in step: detect_anomaly records the forward's lines but does not raise.

Each rank writes its report to a file (its stdout is the user's: it goes to our stderr); the launcher merges them:
the worst reproduction, and the verdict of the rank where the failure starts (its batch, forward or loss, which
are its own; the gradients after the all-reduce and the update are the same on every rank, rank 0's report).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

from replaybisect.core import launch
from replaybisect.errors import ConfigError, ReplayError

ENTRY = "replaybisect.verbs.nan.ranked"
WHERE_A_RANK_STARTS_IT = ("data", "forward", "loss")  # categories decided by a rank's own batch and forward
REPRODUCTION_ORDER = ("exact", "close", "unchecked", "diverged")  # best first
STATE_MATCH = "the replayed state "  # engine.find_nan's evidence line: "the replayed state before step N vs the snapshot..."


def check_nproc(cfg, run_id: str, nproc: int, device: Optional[str]) -> None:
    """A replay over the real collective: a distributed run of DDP modules, one process per recorded rank, over gloo
    on this machine's CPU."""
    from replaybisect.core import ranks

    world_size = ranks.recorded_world_size(cfg)
    if world_size < 2:
        raise ConfigError(f"run {run_id} was recorded on one process; --nproc replays a distributed run's ranks: leave "
                          "it out")
    if ranks.recorded_sharded(cfg):
        raise ConfigError(f"run {run_id}'s model was sharded with fully_shard: its replay averages the ranks' gradients on "
                          "one process (its snapshots hold whole tensors); leave --nproc out")
    if not ranks.replays_over_the_collective(cfg):
        raise ConfigError(f"run {run_id} is a Lightning run: its replay averages the ranks' gradients on one process; "
                          "leave --nproc out")
    if nproc != world_size:
        raise ConfigError(f"run {run_id} was recorded with {world_size} ranks; pass --nproc {world_size} (each process "
                          "replays one recorded rank)")
    backend = cfg.train.get("backend") or "gloo"
    if device not in (None, "cpu") or backend != "gloo":
        raise ConfigError(f"--nproc replays the ranks over gloo on this machine's CPU (the run was recorded over {backend}); "
                          "leave --device out, or replay on one process")


def answer(store, request, log: Optional[Callable[[str], None]] = None):
    """`replay nan` for a NanRequest: on this process, or over the real collective (--nproc)."""
    from replaybisect.verbs.nan.engine import find_nan

    if request.nproc is None:
        return find_nan(store, request.run_id, request.step, device=request.torch_device, trust=request.trusted, log=log)
    from replaybisect.replay.restore import run_config

    check_nproc(run_config(store, request.run_id, request.trusted), request.run_id, request.nproc, request.device)
    return find_nan_on_ranks(store, request.run_id, request.step, request.nproc, code_dirs=request.code_dirs,
                             trust=request.trust, allow_unsigned=request.allow_unsigned, log=log)


def find_nan_on_ranks(store, run_id: str, step: Optional[int], nproc: int, *, code_dirs=(), trust=(), allow_unsigned=None,
                      log: Optional[Callable[[str], None]] = None):
    """Start `nproc` rank processes replaying run `run_id`, wait for them, and merge their reports (a NanReport)."""
    from replaybisect.verbs.nan.engine import NanReport

    log = log or (lambda message: None)
    log(f"replaying over the real collective: {nproc} processes (gloo) on this machine")
    with tempfile.TemporaryDirectory(prefix="replaybisect-nan-ranks-") as folder:
        command = [sys.executable, "-m", ENTRY, "--tracking-uri", store.uri, "--run-id", run_id, "--out", folder]
        command += ["--step", str(step)] if step is not None else []
        command += [argument for path in code_dirs for argument in ("--code-dir", str(path))]
        command += [argument for prefix in trust for argument in ("--trust", prefix)]
        command += ["--allow-unsigned", allow_unsigned] if allow_unsigned else []
        codes = launch.wait_ranks(launch.start_ranks(command, nproc, num_threads=1))
        answers = [launch.read_answer(Path(folder) / f"rank{rank}.json") for rank in range(nproc)]
    failed = next((answer for answer in answers if answer is not None and "error" in answer), None)
    if failed is not None:
        launch.raise_failure(failed)
    missing = [rank for rank, answer in enumerate(answers) if answer is None]
    if missing:
        raise ReplayError(f"rank {missing[0]} of the {nproc}-process replay ended with exit status {codes[missing[0]]} "
                          "before its report; its output is above")
    return merge([NanReport.from_json(answer["report"]) for answer in answers])


def merge(reports: list):
    """One report for the job: the worst reproduction over the ranks, and the verdict of the rank where the failure
    starts (the first, in rank order, whose own batch, forward or loss went non-finite), else rank 0's."""
    starts = [rank for rank, report in enumerate(reports) if report.category in WHERE_A_RANK_STARTS_IT]
    chosen_rank = min(starts, key=lambda rank: (WHERE_A_RANK_STARTS_IT.index(reports[rank].category), rank)) if starts else 0
    if reports[chosen_rank].category == "data" and reports[chosen_rank].batch:  # every rank reads the whole global
        # step's batches: the rank whose rows are bad is named there, and its own report follows them through its forward
        chosen_rank = min(finding.get("rank") or 0 for finding in reports[chosen_rank].batch)
    report = reports[chosen_rank]
    worst = max(reports, key=lambda each: REPRODUCTION_ORDER.index(each.reproduced) if each.reproduced in REPRODUCTION_ORDER else 0)
    report.reproduced = worst.reproduced
    mismatches = [{**mismatch, "rank": rank} for rank, each in enumerate(reports) for mismatch in each.replay.get("mismatches", [])]
    report.replay = {**report.replay, "reproduced": worst.reproduced, "ranks_compared": len(reports),
                     "processes": len(reports), "mismatches": mismatches[:20],
                     "max_relative_error": max(float(each.replay.get("max_relative_error", 0.0)) for each in reports),
                     "failure_starts_on_rank": chosen_rank if starts else None}
    _state_match_of_rank_0(report, reports[0])
    if "reproduced_from" not in report.replay:  # (step 0, reproduced from the config: its own sentence stays)
        report.evidence[0] = _job_sentence(reports)
    report.evidence.insert(1, f"the failure starts on rank {chosen_rank}: its {'batch' if report.category == 'data' else report.category} "
                              "went non-finite" if starts else "no rank's own batch, forward or loss went non-finite first: the "
                              "gradients after the all-reduce and the update are the same on every rank (rank 0's report)")
    for rank, each in enumerate(reports):
        if each is not report and each.headline != report.headline:
            report.evidence.append(f"rank {rank}: {each.headline} (its losses {each.reproduced})")
    return report


def _state_match_of_rank_0(report, rank_0) -> None:
    """The snapshot saved at the failing step holds rank 0's RNG streams (Python's, NumPy's): only rank 0's replayed
    state compares with it."""
    said = next((line for line in rank_0.evidence if line.startswith(STATE_MATCH)), None)
    report.state_match = rank_0.state_match
    report.evidence = [line for line in report.evidence if not line.startswith(STATE_MATCH)]
    if said is not None:
        report.evidence.insert(1, said.replace(STATE_MATCH, "rank 0's replayed state ", 1))


def _job_sentence(reports: list) -> str:
    replay = reports[0].replay
    if "end_step" not in replay or replay.get("end_step") == replay.get("start_step"):
        return f"restored the snapshot of step {reports[0].snapshot_step} on each of {len(reports)} processes (no earlier snapshot: reproduction unchecked)"
    reproduced = [each.reproduced for each in reports]
    said = reproduced[0] if len(set(reproduced)) == 1 else ", ".join(f"rank {rank} {how}" for rank, how in enumerate(reproduced))
    return (f"replayed steps {replay['start_step']}..{replay['end_step'] - 1} from the snapshot of step "
            f"{reports[0].snapshot_step} over the real collective ({len(reports)} processes, gloo): the losses of all "
            f"{len(reports)} ranks {said}")


# ---- one rank: python -m replaybisect.verbs.nan.ranked (started by find_nan_on_ranks) ----------------------------
def main(argv: Optional[list[str]] = None) -> int:
    import torch.distributed as dist

    from replaybisect import request as checks
    from replaybisect.core import ranks
    from replaybisect.core.jsonutil import to_jsonable
    from replaybisect.store import open_store
    from replaybisect.verbs.nan.engine import find_nan

    parser = argparse.ArgumentParser(prog=ENTRY, description="one rank of `replay nan --nproc N` (started by it)")
    for name in ("--tracking-uri", "--run-id", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--step", type=int)
    parser.add_argument("--code-dir", action="append", default=[])
    parser.add_argument("--trust", action="append", default=[])
    parser.add_argument("--allow-unsigned")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    answer = Path(args.out) / f"rank{rank}.json"
    dist.init_process_group("gloo", timeout=ranks.PEER_TIMEOUT)  # (a rank that stopped: the others, within this)
    ranks.replay_ranks_here()
    try:
        report = find_nan(open_store(args.tracking_uri), args.run_id, args.step,
                          trust=checks.trust_of(tuple(args.code_dir), tuple(args.trust), args.run_id, args.allow_unsigned),
                          log=(lambda message: print(message, file=sys.stderr, flush=True)) if rank == 0 else None)
    except ReplayError as error:  # the launcher raises the first rank's line
        launch.write_answer(answer, launch.failure(rank, error))
        return error.exit_code
    finally:
        dist.destroy_process_group()
    launch.write_answer(answer, {"report": to_jsonable(report)})  # (whole: to_json shortens the histories)
    return 0


if __name__ == "__main__":
    sys.exit(main())
