"""Python allocation tracing for a memory investigation: `SPECVOX_TRACEMALLOC=gateway` (or
`gateway:25,tts`: services, each with the frames to keep, 10 by default) starts `tracemalloc` in
those services, and SIGUSR2 then writes a snapshot of what is live, in a file named for the worker,
its pid and the time, to `SPECVOX_TRACEMALLOC_DIR` (the temporary directory by default).

Two snapshots of a soak, minutes apart, compared by traceback name the Python code whose memory
grew (docs/reliability.md, "The gateway's first half-hour"). Python's own PYTHONTRACEMALLOC would
trace every child of `specvox up`, the llm's decoding loop too; and a debugger's call into a live
process to take the snapshot can deadlock on the GIL, which this signal handler cannot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import time
import tracemalloc
from pathlib import Path

log = logging.getLogger(__name__)

ENV, DIR_ENV = "SPECVOX_TRACEMALLOC", "SPECVOX_TRACEMALLOC_DIR"
DEFAULT_FRAMES = 10


def frames_for(service: str, spec: str) -> int:
    """The frames `spec` ("gateway:25,tts") asks `service` to keep; 0: not traced."""
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, frames = item.partition(":")
        if name == service:
            try:
                return max(1, int(frames)) if frames else DEFAULT_FRAMES
            except ValueError:
                raise ValueError(f"{ENV}={spec!r}: {item!r} is not service[:frames]") from None
    return 0


def install(service: str, worker_name: str, loop: asyncio.AbstractEventLoop) -> bool:
    """Start tracing and take snapshots on SIGUSR2, where `SPECVOX_TRACEMALLOC` names `service`."""
    frames = frames_for(service, os.environ.get(ENV, ""))
    if not frames:
        return False
    tracemalloc.start(frames)
    folder = Path(os.environ.get(DIR_ENV) or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)

    def snapshot() -> None:
        path = folder / f"{worker_name}-{os.getpid()}-{int(time.time())}.tracemalloc"
        tracemalloc.take_snapshot().dump(str(path))
        current, peak = tracemalloc.get_traced_memory()
        log.warning("%s: tracemalloc snapshot %s (%.1f MB traced, %.1f MB peak)", worker_name, path,
                    current / 2**20, peak / 2**20)

    loop.add_signal_handler(signal.SIGUSR2, snapshot)
    log.warning("%s: tracing Python allocations (%d frames); SIGUSR2 writes a snapshot to %s", worker_name,
                frames, folder)
    return True
