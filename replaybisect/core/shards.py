"""Sharded tensors (DTensors: FSDP2's fully_shard parameters and their optimizer moments) as a snapshot needs them:
whole when written, placed as the live shards when restored. Plain tensors pass through unchanged."""

from __future__ import annotations

import torch


def is_shard(tensor: torch.Tensor) -> bool:
    """A DTensor: one rank's part of a sharded tensor (fully_shard's parameters and their optimizer moments)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a shard (an all-gather: every rank calls it at the same point); a plain tensor as it is."""
    return tensor.full_tensor() if is_shard(tensor) else tensor


def shard_like(value: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a snapshot, placed as the live sharded tensor `live` is (a plain tensor as it is)."""
    if not is_shard(live) or is_shard(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(live.device), live.device_mesh, live.placements)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a shard's local tensor; a plain tensor is all of it)."""
    return tensor.to_local() if is_shard(tensor) else tensor
