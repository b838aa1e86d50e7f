"""Telling an out-of-memory error from other exceptions, and reading the allocation that failed from the message,
in the CPU allocator's words and CUDA's."""

from __future__ import annotations

import pytest
import torch

from replaybisect.core import oom

CPU = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
       "134217728 bytes. Error code 12 (Cannot allocate memory)")
CUDA = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.02 GiB is "
        "free.")


@pytest.mark.parametrize(("error", "asked"), [(RuntimeError(CPU), 134217728), (torch.OutOfMemoryError(CUDA), 2 * 2**30),
                                              (MemoryError(), None)])
def test_out_of_memory_errors_and_what_they_asked_for(error, asked):
    assert oom.is_out_of_memory(error) and oom.failed_allocation(error) == asked


@pytest.mark.parametrize("error", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("out of range")])
def test_other_errors_are_not(error):
    assert not oom.is_out_of_memory(error)


def test_the_cap_is_set_for_the_block_and_put_back():
    before = oom.address_space_cap()
    size = oom.address_space()
    with oom.address_space_capped(size + 2**30):
        assert oom.address_space_cap() == size + 2**30
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            torch.empty(2**31, dtype=torch.uint8)
    assert oom.address_space_cap() == before
