"""The real tts service under run_service with one probe background worker beside its own, for
tests/e2e/test_supervisor.py: `python -m tests.service_probe`.

SPECVOX_PROBE=drain (default): the probe waits for the drain Event, prints "probe: drain seen"
and returns, as a work-queue worker stops claiming and hands back. SPECVOX_PROBE=fail: it raises
once the service serves, which must take the process down (exit 1) with the reason logged.
"""

from __future__ import annotations

import asyncio
import os

from services.server.runtime import Service, service_main
from services.stages import tts as tts_service


async def probe(draining: asyncio.Event) -> None:
    if os.environ.get("SPECVOX_PROBE") == "fail":
        raise RuntimeError("the probe worker failed on purpose")
    await draining.wait()
    print("probe: drain seen", flush=True)


async def build(settings) -> Service:
    service = await tts_service.build(settings)
    service.workers.append(probe)
    return service


if __name__ == "__main__":
    service_main(build)
