"""How the checks read a batch: its fields (inputs, targets), its samples, its micro-batches joined."""

from __future__ import annotations

from typing import Any, Optional

import torch

from replaybisect.core import user_step
from replaybisect.core.inline_step import ARGS, KWARGS, OUTSIDE
from replaybisect.core.snapshot import like


# ---- batch structure ---------------------------------------------------------------------------------
def merged_micro_batches(batch):
    """A user loop's list of micro-batches (tuples or dicts of tensors, one structure) as one batch: every field
    concatenated along dim 0. Anything else is returned as it is."""
    batch = user_step.data_of(batch)
    if isinstance(batch, list) and batch and all(isinstance(b, dict) and ARGS in b for b in batch):
        # a loop recorded as written: each training call's inputs, then the targets its loss met outside the model
        batch = [(*b[ARGS], *b[KWARGS].values(), *(b.get(OUTSIDE) or [])) for b in batch]
    if not isinstance(batch, (list, tuple)) or not batch or not all(isinstance(b, (list, tuple, dict)) for b in batch):
        return batch
    first = batch[0]
    try:
        if isinstance(first, dict):
            return {key: torch.cat([b[key] for b in batch]) for key in first if isinstance(first[key], torch.Tensor)}
        return tuple(torch.cat([b[i] for b in batch]) for i in range(len(first)) if isinstance(first[i], torch.Tensor))
    except (KeyError, IndexError, TypeError, RuntimeError):  # micro-batches of different structures or shapes
        return batch


def batch_fields(batch) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of a batch: (inputs, targets) tuples become `input`/`target`, dicts keep their keys."""
    batch = merged_micro_batches(batch)
    if isinstance(batch, torch.Tensor):
        return [("input", batch)]
    if isinstance(batch, dict):
        return [(str(k), v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    if isinstance(batch, (list, tuple)):
        names = ["input", "target"] + [f"field {i}" for i in range(2, len(batch))]
        return [(names[i], v) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)]
    return []


def batch_inputs(batch) -> Optional[torch.Tensor]:
    batch = merged_micro_batches(batch)
    if isinstance(batch, dict):
        return batch.get("input")
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def batch_targets(batch) -> Optional[torch.Tensor]:
    batch = merged_micro_batches(batch)
    if isinstance(batch, dict):
        return batch.get("target")
    if isinstance(batch, (list, tuple)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    return None


def leading_sizes(batch) -> set[int]:
    """The first-dimension sizes of every tensor in a batch (scalars have none)."""
    if isinstance(batch, torch.Tensor):
        return {int(batch.shape[0])} if batch.dim() else set()
    if isinstance(batch, dict):
        return set().union(*(leading_sizes(v) for v in batch.values()))
    if isinstance(batch, (list, tuple)):
        return set().union(*(leading_sizes(v) for v in batch))
    return set()


def samples_of(batch, count: int) -> Optional[Any]:
    """The first `count` samples of a batch when every tensor in it has the same first dimension, else None: then no
    slice is a set of samples (a sequence-first language model gets (T, B) tokens and T*B flattened targets; slicing
    both by 16 feeds its loss 16 targets for T*B outputs). A stored step is sliced as its step reads it: its batch
    (each rank's, for a distributed step), not the RNG states stored beside it."""
    return user_step.map_batch(batch, lambda data: slice_batch(data, count) if len(leading_sizes(data)) == 1 else None)


def slice_batch(batch, count: int):
    """The first `count` samples of a batch (every tensor sliced along dim 0)."""
    if isinstance(batch, torch.Tensor):
        return batch[:count]
    if isinstance(batch, dict):
        return {k: slice_batch(v, count) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return like(batch, [slice_batch(v, count) for v in batch])
    return batch


def batch_size_of(batch) -> int:
    fields = batch_fields(batch)
    return int(fields[0][1].shape[0]) if fields and fields[0][1].dim() else 0


def is_class_labels(targets: Optional[torch.Tensor]) -> bool:
    return targets is not None and not targets.is_floating_point() and not targets.is_complex() and targets.dtype != torch.bool
