"""Rank asymmetries of a distributed data-parallel run, measured on the curves each rank logged through rank 0
(`loss/rankN`, `param_checksum/rankN`, record/ranked.py): replicas that are not identical, and one rank's loss on
another scale than rank 0's. A one-process replay assumes neither (DDP keeps replicas identical): these are the
"distributed bugs" that are not single-process bugs at scale. The detectors that report them are in engine.py."""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

RANK_METRIC = re.compile(r"^(loss|param_checksum)/rank(\d+)$")
LOSS_SCALE_RATIO = 1.25  # a rank whose loss sits this far from rank 0's...
LOSS_SCALE_AGREEMENT = 0.9  # ...on this share of the steps (different data alone scatters both ways)
MIN_STEPS = 10
SOURCE = ("PyTorch DDP notes (replicas stay identical: the same initial state, the same averaged gradients); "
          "\"reproduce on one GPU first\" (most distributed bugs are single-process bugs; the rest are rank asymmetries)")


def ranks_logged(metric_keys: list[str], metric: str) -> list[int]:
    return sorted(int(match.group(2)) for key in metric_keys if (match := RANK_METRIC.match(key)) and match.group(1) == metric)


def replica_drift(checksums: dict[int, dict[int, float]]) -> Optional[dict]:
    """The first step (of those every rank logged) where a rank's checksum differs from rank 0's, with the ranks
    that differ and whether it is the first step (the replicas began different)."""
    steps = sorted(set.intersection(*(set(values) for values in checksums.values())))
    ranks = sorted(checksums)
    for step in steps:
        reference = checksums[ranks[0]][step]
        if not np.isfinite(reference):  # a run that went on past a non-finite update: NaN on every replica
            break
        differing = [rank for rank in ranks[1:] if checksums[rank][step] != reference]
        if differing:
            return {"step": step, "ranks": differing, "at_start": step == steps[0],
                    "checksums": {f"rank{rank}": checksums[rank][step] for rank in ranks}}
    return None


def loss_scale(base: tuple[np.ndarray, np.ndarray], other: tuple[np.ndarray, np.ndarray]) -> Optional[dict]:
    """One rank's loss against rank 0's, step by step ((steps, values) each, finite): the median ratio when it is
    x1.25 away from 1 or more on 90% of the steps or more, else None."""
    common, mine, theirs = np.intersect1d(base[0], other[0], return_indices=True)
    ratios = other[1][theirs] / np.maximum(base[1][mine], 1e-30)
    keep = ratios > 0
    if keep.sum() < MIN_STEPS:
        return None
    log_ratios = np.log(ratios[keep])
    median = float(np.exp(np.median(log_ratios)))
    one_sided = max(float(np.mean(log_ratios > 0)), float(np.mean(log_ratios < 0)))
    if max(median, 1 / median) < LOSS_SCALE_RATIO or one_sided < LOSS_SCALE_AGREEMENT:
        return None
    return {"median_ratio": median, "one_sided_share": one_sided, "steps": int(keep.sum()), "first_step": int(common[0])}
