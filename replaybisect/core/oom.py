"""An out-of-memory error in a step: told apart from other exceptions, and what the process had when it happened
(the address-space cap a CPU process ran under, its size then, the allocation that failed), kept as the run's tags
so that `replay memory` can run the step again under the same cap (address_space_capped)."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

KIND = "out_of_memory"  # the failure_kind tag of a step that ran out of memory
MESSAGES = ("can't allocate memory", "not enough memory", "out of memory", "cannot allocate memory")
_TRIED = re.compile(r"tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|KB|MB|GB)", re.IGNORECASE)
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def is_out_of_memory(error: BaseException) -> bool:
    """A MemoryError, CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError (`DefaultCPUAllocator: can't
    allocate memory`)."""
    if isinstance(error, MemoryError) or isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error).lower() for text in MESSAGES)


def failed_allocation(error: BaseException) -> Optional[int]:
    """The bytes the failing allocation asked for, as the allocator's message says it."""
    found = _TRIED.search(str(error))
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()]) if found else None


def address_space() -> Optional[int]:
    """This process's virtual size (what RLIMIT_AS caps); None where /proc/self/statm is not."""
    return _statm(0)


def resident() -> Optional[int]:
    """This process's resident set size; None where /proc/self/statm is not."""
    return _statm(1)


def _statm(field: int) -> Optional[int]:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def address_space_cap() -> Optional[int]:
    """The soft RLIMIT_AS this process runs under (`ulimit -v`, resource.setrlimit), None when unlimited."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def failure_tags(error: BaseException, device: torch.device) -> dict[str, object]:
    """The run's tags for a step that ran out of memory: the kind, the allocation that failed, and the cap with what
    the process held when it failed (on CPU: its address space under RLIMIT_AS; on CUDA: the allocator's bytes and
    the device's total)."""
    tags: dict[str, object] = {"failure_kind": KIND}
    asked = failed_allocation(error)
    if asked is not None:
        tags["failed_allocation"] = asked
    if device.type == "cuda":
        tags["memory_at_failure"] = torch.cuda.memory_allocated(device)
        tags["memory_limit"] = torch.cuda.get_device_properties(device).total_memory
        return tags
    cap, size = address_space_cap(), address_space()
    if cap is not None and size is not None:
        tags.update(memory_limit=cap, memory_at_failure=size)
    return tags


@contextmanager
def address_space_capped(limit: int) -> Iterator[None]:
    """This process's soft RLIMIT_AS lowered to `limit` bytes for the block, then set back (an unprivileged process
    may raise its soft limit again up to the hard one)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    hard = before[1]
    if hard != resource.RLIM_INFINITY and limit > hard:
        limit = hard
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)
