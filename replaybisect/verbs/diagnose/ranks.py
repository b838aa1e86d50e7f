"""Rank asymmetries of a distributed data-parallel run, read from the curves each rank logged through rank 0
(`loss/rankN`, `param_checksum/rankN`, record/ranked.py): replicas that are not identical, and one rank's loss
on another scale than the others'. A one-process replay assumes neither (DDP keeps replicas identical), so these
are the "distributed bugs" that are not single-process bugs at scale."""

from __future__ import annotations

import re

import numpy as np

from replaybisect.verbs.diagnose.engine import Curves, Finding, _round, detector

RANK_KEY = re.compile(r"^(loss|param_checksum)/rank(\d+)$")
LOSS_SCALE_RATIO = 1.25  # a rank whose loss sits this far from rank 0's...
LOSS_SCALE_AGREEMENT = 0.9  # ...on this share of the steps (different data alone scatters both ways)
MIN_STEPS = 10
SOURCE = "PyTorch DDP notes (replicas stay identical: the same initial state, the same averaged gradients); " \
         "\"reproduce on one GPU first\" (most distributed bugs are single-process bugs; the rest are rank asymmetries)"


def ranks_logged(curves: Curves, metric: str) -> list[int]:
    return sorted(int(match.group(2)) for key in curves.metric_keys
                  if (match := RANK_KEY.match(key)) and match.group(1) == metric)


@detector("replicas-drifted")
def detect_replica_drift(curves: Curves) -> list[Finding]:
    """The ranks' parameter checksums (taken as each step starts) differ: at the first step, the replicas began
    different; later, an update differed between ranks after the all-reduce."""
    ranks = ranks_logged(curves, "param_checksum")
    if len(ranks) < 2:  # one process: nothing to compare (not a skipped check)
        return []
    series = {rank: dict(zip(s.steps.tolist(), s.values.tolist())) for rank in ranks if len(s := curves.get(f"param_checksum/rank{rank}"))}
    steps = sorted(set.intersection(*(set(values) for values in series.values())))
    for step in steps:
        differing = [rank for rank in ranks[1:] if series[rank][step] != series[ranks[0]][step]]
        if not differing:
            continue
        at_start = step == steps[0]
        names = ", ".join(str(rank) for rank in differing)
        if at_start:
            summary = (f"the replicas differ from the first step (rank {names} vs rank 0 at step {step}): their initial "
                       "parameters were not the same; a rank-dependent seed with DDP's init sync off, or parameters changed "
                       "after wrapping the model in DDP")
        else:
            summary = (f"the replicas drifted apart at step {step} (rank {names} vs rank 0): an update differed between ranks "
                       "after the all-reduce; a gradient hook or in-place change on one rank, the model used outside its DDP "
                       "wrapper, or no_sync misuse")
        return [Finding(
            "replicas-drifted", summary,
            {"step": step, "ranks": differing, "at_start": at_start,
             "checksums": {f"rank{rank}": series[rank][step] for rank in ranks}},
            "grep -nE 'manual_seed|init_sync|register_.*hook|no_sync|\\.module\\(' <your script>   # what runs on one rank only",
            step=step, source=SOURCE)]
    return []


@detector("rank-loss-scale")
def detect_rank_loss_scale(curves: Curves) -> list[Finding]:
    """One rank's loss sits on another scale than rank 0's at nearly every step: each rank normalises its loss
    differently (a per-rank count or weight), so DDP's average weights the ranks' gradients unequally."""
    ranks = ranks_logged(curves, "loss")
    if not ranks:
        return []
    base = curves.get("loss").before(curves.failing_step).finite()
    findings = []
    for rank in ranks:
        other = curves.get(f"loss/rank{rank}").before(curves.failing_step).finite()
        common, mine, theirs = np.intersect1d(base.steps, other.steps, return_indices=True)
        ratios = other.values[theirs] / np.maximum(base.values[mine], 1e-30)
        keep = ratios > 0
        if keep.sum() < MIN_STEPS:
            continue
        log_ratios = np.log(ratios[keep])
        median = float(np.exp(np.median(log_ratios)))
        one_sided = max(float(np.mean(log_ratios > 0)), float(np.mean(log_ratios < 0)))
        if max(median, 1 / median) < LOSS_SCALE_RATIO or one_sided < LOSS_SCALE_AGREEMENT:
            continue
        findings.append(Finding(
            "rank-loss-scale",
            f"rank {rank}'s loss is x{median:.3g} of rank 0's on {100 * one_sided:.0f}% of {int(keep.sum())} steps: more than "
            "different data explains; each rank normalises its loss differently (a per-rank count or weight), so the "
            "averaged gradient weights the ranks unequally",
            {"rank": rank, "median_ratio": _round(median), "one_sided_share": _round(one_sided), "steps": int(keep.sum())},
            "grep -nE 'get_rank|world_size|/ *len\\(|\\.sum\\(\\) */' <your script>   # how each rank divides its loss",
            step=int(common[0]), source=SOURCE))
    return findings
