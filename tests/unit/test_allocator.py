"""services/server/allocator.py: the free pages inside glibc's heap go back to the kernel (issue 13's
soak: a service's resident memory crept up while its Python objects stayed flat)."""

from __future__ import annotations

import threading

import pytest

from services.server import allocator


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



_WHERE_A_BLOCK_LIVES = """
import ctypes, os, sys
from services.server import allocator
allocator.exec_with_tunables(int(sys.argv[1]), huge_pages=False)  # a second start where a threshold is asked
def in_heap(block):
    address = ctypes.addressof((ctypes.c_char * len(block)).from_buffer(block))
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return rest[-1] == "[heap]"
    raise AssertionError("no mapping holds the block")
print(os.environ.get("GLIBC_TUNABLES", "-"))
first = bytearray(4 << 20)  # 4 MiB: above glibc's starting threshold, so mapped on its own
print(in_heap(first))
del first                   # glibc's own threshold now rises to 4 MiB
print(in_heap(bytearray(4 << 20)))
"""


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")
def test_a_fixed_mmap_threshold_keeps_large_blocks_out_of_the_heap():
    import os
    import subprocess
    import sys

    def placed(threshold: int) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        run = subprocess.run([sys.executable, "-c", _WHERE_A_BLOCK_LIVES, str(threshold)],
                             capture_output=True, text=True, check=True, env=env)
        return run.stdout.split()

    # glibc's moving threshold: the second block comes from the heap, where it stays when freed
    assert placed(0) == ["-", "False", "True"]
    # fixed at 1 MiB (the process started again with the tunable): both mapped, unmapped when freed
    assert placed(1 << 20) == ["glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=2097152",
                               "False", "False"]
    # fixed at 32 MiB, where the moving one ends: both from the heap from the first
    assert placed(32 << 20) == ["glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864",
                                "True", "True"]


def test_tunables_are_asked_only_for_a_fixed_threshold():
    assert allocator.tunables(0, huge_pages=True) == ""
    assert allocator.tunables(262144, huge_pages=True) == (
        "glibc.malloc.mmap_threshold=262144:glibc.malloc.trim_threshold=524288:glibc.malloc.hugetlb=1")
    assert allocator.tunables(262144, huge_pages=False) == (
        "glibc.malloc.mmap_threshold=262144:glibc.malloc.trim_threshold=524288")


def test_a_preloaded_malloc_is_named_clearly_or_refused():
    assert allocator.preload("") == {}
    with pytest.raises(ValueError, match="malloc_library 'tcmalloc'"):
        allocator.preload("tcmalloc")


_MALLOC_IN_USE = """
import sys
from services.server import allocator
allocator.exec_with_tunables(0, False, sys.argv[1])
print(any("jemalloc" in line for line in open("/proc/self/maps")))
"""


@pytest.mark.skipif(__import__("ctypes.util").util.find_library("jemalloc") is None,
                    reason="jemalloc is not installed (Debian: apt-get install libjemalloc2; .ci/run installs it)")
def test_malloc_library_starts_the_process_again_on_jemalloc():
    import os
    import subprocess
    import sys

    def on_jemalloc(library: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
        run = subprocess.run([sys.executable, "-c", _MALLOC_IN_USE, library], capture_output=True, text=True,
                             check=True, env=env)
        return run.stdout.strip()

    assert on_jemalloc("jemalloc") == "True"
    assert on_jemalloc("auto") == "True"  # installed here, so auto takes it
    assert on_jemalloc("") == "False"


@pytest.mark.skipif(__import__("ctypes.util").util.find_library("jemalloc") is None,
                    reason="jemalloc is not installed (Debian: apt-get install libjemalloc2; .ci/run installs it)")
def test_an_operators_malloc_conf_comes_after_ours(monkeypatch):
    monkeypatch.setenv("MALLOC_CONF", "prof:true")
    assert allocator.preload("jemalloc")["MALLOC_CONF"] == f"{allocator.JEMALLOC_CONF},prof:true"
    monkeypatch.setenv("MALLOC_CONF", f"{allocator.JEMALLOC_CONF},prof:true")  # a child of a preloaded process
    assert allocator.preload("jemalloc")["MALLOC_CONF"] == f"{allocator.JEMALLOC_CONF},prof:true"
    monkeypatch.delenv("MALLOC_CONF")
    assert allocator.preload("jemalloc")["MALLOC_CONF"] == allocator.JEMALLOC_CONF


def test_auto_falls_back_to_glibc_with_a_warning_where_jemalloc_is_missing(monkeypatch, caplog):
    import ctypes.util

    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None if name == "jemalloc" else real(name))
    assert allocator.resolve("auto", "tts") == ""
    assert "tts: malloc_library=auto: libjemalloc is not installed" in caplog.text
    assert allocator.preload("auto") == {}
    with pytest.raises(RuntimeError, match="libjemalloc is not installed"):  # asked by name: an error, not a fallback
        allocator.preload("jemalloc")
