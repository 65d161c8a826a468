"""services/allocator.py: the free pages inside glibc's heap go back to the kernel (issue 13's
soak: a service's resident memory crept up while its Python objects stayed flat)."""

from __future__ import annotations

import threading

import pytest

from services import allocator


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")
def test_trimming_hands_back_the_free_pages_a_fragmented_heap_keeps():
    blocks = [bytearray(4096) for _ in range(40_000)]  # ~160 MB through malloc (not Python's small-object arenas)
    for block in blocks:
        block[::512] = b"\x01" * 8  # touch every page
    keep = blocks[::64]  # one block in 64 stays: the heap cannot shrink from its top
    del blocks
    before = _rss_mb()
    assert allocator.trim_now()
    after = _rss_mb()
    assert before - after > 80, (before, after)  # most of the ~157 MB freed inside the heap is given back
    assert all(block[0] == 1 for block in keep)  # what is still held is untouched


def test_the_trimming_thread_runs_until_told_to_stop():
    stop = threading.Event()
    thread = allocator.tune(arena_max=2, trim_interval_s=0.01, stop=stop)
    if allocator._glibc() is None:
        assert thread is None
        return
    assert thread is not None and thread.daemon and thread.is_alive()
    stop.set()
    thread.join(2)
    assert not thread.is_alive()
    assert allocator.tune(arena_max=0, trim_interval_s=0) is None  # both off: nothing started
