"""glibc's allocator, set for a process that serves for days: few arenas, freed memory given back.

glibc gives each thread that meets contention an arena of its own (up to 8 per core), and a
freed chunk inside an arena's heap stays in the process until the whole top of that heap is
free. A service's threads (grpc's pollers, the model worker, onnxruntime's and torch's pools)
allocate and free in turn, so the resident memory of a long soak crept up while Python's own
objects stayed flat (tracemalloc over the gateway: 93.2 → 93.4 MB in 9 minutes while its USS
rose). Two settings bound that: `malloc_arena_max` caps the arenas (`mallopt(M_ARENA_MAX)`,
what `MALLOC_ARENA_MAX` does, set before the models load and their threads start), and
`malloc_trim_interval_s` has a thread call `malloc_trim(0)` that often, which hands the free
pages inside every arena back to the kernel. Elsewhere than glibc (musl, macOS) both do nothing.

A third lever is for the tts: glibc maps a block of 128 KiB or more on its own, but raises that
threshold to the size of every such block freed (up to 32 MiB), so its heap steps up each time a
longer phrase than any before is freed: an hour's soak held 385 MB for half an hour, then 460.
A fixed threshold (`malloc_mmap_threshold`, per service) stops the moving. At 32 MiB, where glibc's
own ends, the tts's buffers come from the heap from the first phrase: the same speed and level as
glibc once it has moved, reached in the warm-up; that is the default. A small one (256 KiB) keeps
them mapped and unmaps each when freed: ~70 MB less, but so many page faults that synthesis ran
at 0.65x (0.86x in transparent huge pages, `malloc_huge_pages`); `bench tts-allocator` measures it.
Huge pages for malloc can only be asked for before the process starts (the GLIBC_TUNABLES
environment variable, glibc 2.35+), so `exec_with_tunables` starts the service again with them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both exist only in glibc)
    except (OSError, AttributeError):
        return None
    return libc


def tune(arena_max: int, trim_interval_s: float, stop: threading.Event | None = None) -> threading.Thread | None:
    """Cap the arenas at `arena_max` (0: glibc's default) and start a daemon thread trimming
    every `trim_interval_s` (0: none) until `stop` is set; returns that thread."""
    libc = _glibc()
    if libc is None:
        log.debug("not glibc: the allocator is left as it is")
        return None
    if arena_max > 0 and not libc.mallopt(M_ARENA_MAX, arena_max):
        log.warning("mallopt(M_ARENA_MAX, %d) refused", arena_max)
    if trim_interval_s <= 0:
        return None
    stop = stop or threading.Event()

    def trim() -> None:
        while not stop.wait(trim_interval_s):
            libc.malloc_trim(0)

    thread = threading.Thread(target=trim, name="malloc-trim", daemon=True)
    thread.start()
    return thread


def trim_now() -> bool:
    """One `malloc_trim(0)`: whether glibc gave memory back (False also where it is not glibc)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def tunables(mmap_threshold: int, huge_pages: bool) -> str:
    """The GLIBC_TUNABLES entries for a fixed mmap threshold of `mmap_threshold` bytes (0: glibc's
    moving one, and nothing to set), its blocks in transparent huge pages if `huge_pages`."""
    if mmap_threshold <= 0:
        return ""
    # A threshold set by hand also stops glibc's moving trim threshold (twice the mmap threshold, where
    # the heap's free top is handed back on free); keep that pairing, or a heap that serves large
    # buffers would shrink and fault its pages in again at every one.
    entries = [f"glibc.malloc.mmap_threshold={mmap_threshold}", f"glibc.malloc.trim_threshold={2 * mmap_threshold}"]
    if huge_pages:
        entries.append("glibc.malloc.hugetlb=1")  # madvise(MADV_HUGEPAGE) on what malloc maps
    return ":".join(entries)


JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"  # freed pages back after ~1 s
# malloc_library: glibc's own, jemalloc preloaded (an error where it is not installed), or "auto":
# jemalloc where it is installed, else glibc's with a warning (the default's choice, so that a
# machine with only Python and pip still runs).
LIBRARIES = ("", "jemalloc", "auto")


def resolve(library: str, service: str = "") -> str:
    """The library `library` names here: "auto" becomes "jemalloc" where it is installed, else ""."""
    if library not in LIBRARIES:
        raise ValueError(f"malloc_library {library!r}: choose one of {', '.join(repr(n) for n in LIBRARIES)}")
    if library != "auto":
        return library
    if ctypes.util.find_library("jemalloc") is not None:
        return "jemalloc"
    log.warning("%smalloc_library=auto: libjemalloc is not installed, so glibc's malloc serves (its heap "
                "grows slowly over hours; Debian and Ubuntu: apt-get install libjemalloc2)",
                f"{service}: " if service else "")
    return ""


def preload(library: str) -> dict[str, str]:
    """The environment that starts a process on `library`'s malloc ("": glibc's, nothing to set).
    A MALLOC_CONF already in the environment comes after ours, so its options win (jemalloc reads
    the pairs in order): an operator can tune or profile (`prof:true`) without a code change."""
    library = resolve(library)
    if not library:
        return {}
    path = ctypes.util.find_library(library)
    if path is None:
        raise RuntimeError(f"malloc_library={library}: lib{library} is not installed "
                           f"(Debian and Ubuntu: apt-get install lib{library}2), or set malloc_library to \"auto\" "
                           f"or \"\"")
    present, conf = os.environ.get("LD_PRELOAD", ""), os.environ.get("MALLOC_CONF", "")
    if conf.startswith(JEMALLOC_CONF):  # ours already (a process started by one that was preloaded)
        conf = conf[len(JEMALLOC_CONF):].lstrip(",")
    return {"LD_PRELOAD": f"{path}:{present}" if present else path,
            "MALLOC_CONF": f"{JEMALLOC_CONF},{conf}" if conf else JEMALLOC_CONF}


def exec_with_tunables(mmap_threshold: int, huge_pages: bool, library: str = "", service: str = "") -> None:
    """Start this process again, the same command, with the tunables (or `library`'s malloc
    preloaded, where glibc's tunables do not apply) in its environment, unless it already has them
    (then, and where nothing is asked or it is not glibc, return at once). Call it first thing:
    nothing done before it survives the exec. `service` names the process in a warning."""
    library = resolve(library, service)
    if library:
        preloaded = preload(library)
        if os.path.basename(preloaded["LD_PRELOAD"].split(":")[0]) in os.environ.get("LD_PRELOAD", ""):
            return
        env = dict(os.environ, **preloaded)
    else:
        wanted = tunables(mmap_threshold, huge_pages)
        present = os.environ.get("GLIBC_TUNABLES", "")
        if not wanted or _glibc() is None or "glibc.malloc.mmap_threshold=" in present:
            return
        env = dict(os.environ, GLIBC_TUNABLES=f"{present}:{wanted}" if present else wanted)
    log.debug("restarting with LD_PRELOAD=%s GLIBC_TUNABLES=%s", env.get("LD_PRELOAD"), env.get("GLIBC_TUNABLES"))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
